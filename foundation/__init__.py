"""The contracts every retrywatch package shares, and nothing of the proxy's.

Metric names and label vocabularies (``metricnames``, ``vllmbuckets``), the series format
(``timeseries``), the derived ratios (``ratios``), OpenAI-style error bodies (``errors``), the
bounds and URL rules of every HTTP server and client (``bounds``), the bounded HTTP server
(``server``), settings declared once (``knobs``), logging and redaction (``logs``, ``redact``),
command-line option types (``options``) and child processes (``processes``). The proxy
(``exporter``), the detector, the dashboard and the experiments build on it; it imports none
of them, so a tier that reads only vLLM's series never loads the proxy.
"""
