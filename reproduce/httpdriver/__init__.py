"""The HTTP drivers of the reproduce harness: real sockets, the real proxy, a real or emulated engine.

``attempt`` sends one attempt and classifies its end, ``openloop`` replays a trace with the
client model's retries, ``scrape`` turns the proxy's ``/metrics`` into a metrics series,
``proxyproc`` starts ``retrywatch proxy`` with a condition's flags, ``protocol`` holds the
study's protocol and its scaled copy for a CPU engine, ``calibration`` measures Ĉ over HTTP, and
``backend`` registers the ``vllm``, ``emulated`` and ``external`` backends of ``reproduce run``.
"""
