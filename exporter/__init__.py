"""exporter: the execution-aware proxy beside vLLM, its policy core and its metrics."""
