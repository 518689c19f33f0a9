"""vLLM's histogram families that the series format keeps, with vLLM 0.32's bucket boundaries.

Copied from ``vllm/v1/metrics/buckets.py`` (``REQUEST_LATENCY_BUCKETS``,
``TIME_TO_FIRST_TOKEN_BUCKETS``, ``INTER_TOKEN_LATENCY_BUCKETS``, and
``build_1_2_5_buckets(max_model_len)`` for the ``request_tokens`` family), and from which family
each histogram of ``vllm/v1/metrics/loggers.py``'s ``PrometheusStatLogger`` draws. Every family
here is labelled ``engine`` and ``model_name``, as vLLM labels them. ``le`` label values are written as
prometheus_client writes them (``floatToGoString``: ``0.3``, ``1.0``, ``+Inf``), so a scraped
and a simulated series carry the same strings.
"""

from __future__ import annotations

from typing import Final

from prometheus_client.utils import floatToGoString

from foundation import metricnames as mn

__all__ = [
    "INTER_TOKEN_LATENCY_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "SERIES_HISTOGRAMS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "bucket_bounds",
    "le_label",
    "request_tokens_buckets",
]

REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to the context."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        scale *= 10


#: Bucket family of each histogram (``None``: the token-count family, sized by max_model_len).
_FAMILY_BOUNDS: Final[dict[str, tuple[float, ...] | None]] = {
    mn.VLLM_QUEUE_TIME: REQUEST_LATENCY_BUCKETS,
    mn.VLLM_TTFT: TIME_TO_FIRST_TOKEN_BUCKETS,
    mn.VLLM_E2E_LATENCY: REQUEST_LATENCY_BUCKETS,
    mn.VLLM_PREFILL_TIME: REQUEST_LATENCY_BUCKETS,
    mn.VLLM_DECODE_TIME: REQUEST_LATENCY_BUCKETS,
    mn.VLLM_INTER_TOKEN_LATENCY: INTER_TOKEN_LATENCY_BUCKETS,
    mn.VLLM_REQUEST_PROMPT_TOKENS: None,
    mn.VLLM_REQUEST_GENERATION_TOKENS: None,
}

#: The histogram families a metrics series keeps (``_bucket``, ``_sum``, ``_count``); vLLM's
#: other histograms (inference time, time per output token, preemptions per request, iteration
#: tokens, request parameters, KV residency) are dropped: every family kept costs the simulator
#: (``bench/bench_simulator.py``) and every series file about 25 samples per scrape.
SERIES_HISTOGRAMS: Final = frozenset(_FAMILY_BOUNDS)


def bucket_bounds(family: str, max_model_len: int) -> tuple[float, ...]:
    """The finite upper bounds of ``family``'s buckets (vLLM adds ``+Inf``)."""
    bounds = _FAMILY_BOUNDS[family]
    return request_tokens_buckets(max_model_len) if bounds is None else bounds


def le_label(bound: float) -> str:
    """A bucket's ``le`` value as prometheus_client (and so vLLM) writes it."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]
