"""``/metrics`` of the emulated engine: the engine model's vLLM samples with vLLM's HELP/TYPE.

Histograms (``foundation.vllmbuckets``' families, flat ``_bucket``/``_count``/``_sum`` samples in
the model) are served as histogram families, as vLLM serves them.

A custom prometheus_client collector re-exports ``engine.metrics_samples(labels)`` fresh on
every scrape (no state between scrapes), in a registry of its own, rendered as the plain
text format so the colons of vLLM's names survive (OpenMetrics would rewrite them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from foundation import metricnames as mn
from foundation.timeseries import Sample
from foundation.vllmbuckets import SERIES_HISTOGRAMS

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
    mn.VLLM_QUEUE_TIME: "Histogram of time spent in WAITING phase for request.",
    mn.VLLM_TTFT: "Histogram of time to first token in seconds.",
    mn.VLLM_E2E_LATENCY: "Histogram of e2e request latency in seconds.",
    mn.VLLM_PREFILL_TIME: "Histogram of time spent in PREFILL phase for request.",
    mn.VLLM_DECODE_TIME: "Histogram of time spent in DECODE phase for request.",
    mn.VLLM_INTER_TOKEN_LATENCY: "Histogram of inter-token latency in seconds.",
    mn.VLLM_REQUEST_PROMPT_TOKENS: "Number of prefill tokens processed.",
    mn.VLLM_REQUEST_GENERATION_TOKENS: "Number of generation tokens processed.",
}

_SUFFIXES = ("_bucket", "_count", "_sum")


def _histogram_family(name: str) -> str | None:
    """The histogram family a sample name belongs to, or None for a counter or gauge."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and (base := name[: -len(suffix)]) in SERIES_HISTOGRAMS:
            return base
    return None


def _histogram(name: str, samples: Sequence[Sample]) -> Metric:
    """One histogram family from its flat samples (cumulative buckets in order, then the sum)."""
    series: dict[tuple[tuple[str, str], ...], tuple[list[tuple[str, float]], list[float]]] = {}
    for sample_name, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        buckets, total = series.setdefault(key, ([], []))
        if sample_name.endswith("_bucket"):
            buckets.append((labels["le"], float(value)))
        elif sample_name.endswith("_sum"):
            total.append(float(value))
    label_names = sorted({k for key in series for k, _ in key})
    family = HistogramMetricFamily(
        name, VLLM_HELP.get(name, f"{name} (emulated engine)."), labels=label_names
    )
    for key, (buckets, total) in series.items():
        labels = dict(key)
        family.add_metric([labels.get(k, "") for k in label_names], buckets, total[0] if total else None)
    return family


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
        histograms: dict[str, list[Sample]] = {}
        for sample in self._samples():
            name, labels, value = str(sample[0]), sample[1], sample[2]
            family = _histogram_family(name)
            target = by_name if family is None else histograms
            target.setdefault(family or name, []).append((name, dict(labels), float(value)))
        for name, samples in by_name.items():
            yield _family(name, samples)
        for name, samples in histograms.items():
            yield _histogram(name, samples)


def render(samples: Callable[[], Iterable[Any]]) -> bytes:
    """The plain text exposition of ``samples()`` (a fresh registry each call)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(samples))
    return generate_latest(registry)
