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

from exporter import metricnames as mn
from exporter.timeseries import Sample

__all__ = ["CONTENT_TYPE_LATEST", "VLLM_HELP", "EngineCollector", "render"]

#: vLLM 0.3x's documentation strings (vllm/v1/metrics/loggers.py), by exported name.
VLLM_HELP: dict[str, str] = {
    mn.VLLM_NUM_RUNNING: "Number of requests in model execution batches.",
    mn.VLLM_NUM_WAITING: "Number of requests waiting to be processed.",
    mn.VLLM_KV_CACHE_USAGE: "KV-cache usage. 1 means 100 percent usage.",
    mn.VLLM_PREFIX_CACHE_QUERIES: "Prefix cache queries, in terms of number of queried tokens.",
    mn.VLLM_PREFIX_CACHE_HITS: "Prefix cache hits, in terms of number of cached tokens.",
    mn.VLLM_NUM_PREEMPTIONS: "Cumulative number of preemption from the engine.",
    mn.VLLM_PROMPT_TOKENS: "Number of prefill tokens processed.",
    mn.VLLM_GENERATION_TOKENS: "Number of generation tokens processed.",
    mn.VLLM_REQUEST_SUCCESS: "Count of successfully processed requests.",
    mn.VLLM_ADMISSION_REJECTIONS: "Number of admission attempts rejected by a queue limit, by reason.",
}


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
