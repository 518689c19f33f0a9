"""``/metrics`` of the emulated engine: the engine model's vLLM samples with vLLM's HELP/TYPE.

A custom prometheus_client collector re-exports ``engine.metrics_samples(labels)`` fresh on
every scrape (no state between scrapes), in a registry of its own, rendered as the plain
text format so the colons of vLLM's names survive (OpenMetrics would rewrite them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE_LATEST", "VLLM_HELP", "EngineCollector", "render"]

#: vLLM 0.3x's documentation strings (vllm/v1/metrics/loggers.py), by exported name.
VLLM_HELP: dict[str, str] = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
    "vllm:request_success_total": "Count of successfully processed requests.",
    "vllm:admission_rejections_total": "Number of admission attempts rejected by a queue limit, by reason.",
}

Sample = tuple[str, dict[str, str], float]


def _family(name: str, samples: Sequence[Sample]) -> Metric:
    help_text = VLLM_HELP.get(name, f"{name} (emulated engine).")
    label_names = sorted({key for _, labels, _ in samples for key in labels})
    family: CounterMetricFamily | GaugeMetricFamily
    if name.endswith("_total"):
        family = CounterMetricFamily(name, help_text, labels=label_names)
    else:
        family = GaugeMetricFamily(name, help_text, labels=label_names)
    for _, labels, value in samples:
        family.add_metric([labels.get(key, "") for key in label_names], float(value))
    return family


class EngineCollector(Collector):
    """Yields the engine's vLLM metric families, grouped by name, on every scrape."""

    def __init__(self, samples: Callable[[], Iterable[Any]]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        by_name: dict[str, list[Sample]] = {}
        for sample in self._samples():
            name, labels, value = sample[0], sample[1], sample[2]
            by_name.setdefault(str(name), []).append((str(name), dict(labels), float(value)))
        for name, samples in by_name.items():
            yield _family(name, samples)


def render(samples: Callable[[], Iterable[Any]]) -> bytes:
    """The plain text exposition of ``samples()`` (a fresh registry each call)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(samples))
    return generate_latest(registry)
