"""retrywatch: execution-aware monitoring, alerting and overload control for vLLM."""

__version__ = "0.1.0"
