"""reproduce: the study's experiments, simulated and real.

``engine`` models vLLM's V1 scheduler, ``sim`` simulates a run, ``emulate`` serves the engine
model over HTTP, ``harness`` runs on real engines over HTTP, ``workloads`` is what a run sends,
``judge`` what it did, ``planner`` the what-if; ``cli`` and ``options`` are the commands,
``conditions`` the study's blocks and conditions, ``registry`` and ``runner`` run them.
"""
