"""What reading the upstream's ``/metrics`` costs the proxy: prometheus_client's parser over a
whole vLLM-shaped exposition against ``exporter.upstreamtext.scan_vllm``, which reads only the
lines of the three families the proxy reads, each by one regular expression.

The proxy scans the upstream's exposition every second, in slices between which its event loop
runs (``bench/bench_big_metrics.py`` measures a huge one's effect on the time to first token).
The exposition is built like vLLM 0.32's: its histograms (about 20 buckets each) and counters
and gauges, for one model.

    .venv/bin/python bench/bench_scan.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from exporter.upstreamtext import scan_vllm
from foundation.timeseries import parse_exposition

HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_n",
    "iteration_tokens_total",
)
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
BUCKETS = tuple(float(2**i) / 100 for i in range(20))


def vllm_like_exposition() -> str:
    registry = CollectorRegistry()
    labels = {"model_name": "Qwen/Qwen2.5-7B-Instruct", "engine": "0"}
    for name in HISTOGRAMS:
        h = Histogram(f"vllm:{name}", name, list(labels), buckets=BUCKETS, registry=registry)
        h.labels(**labels).observe(1.0)
    for name in COUNTERS:
        Counter(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).inc(1000)
    success = Counter("vllm:request_success", "finished", [*labels, "finished_reason"], registry=registry)
    for reason in ("stop", "length", "abort"):
        success.labels(**labels, finished_reason=reason).inc(10)
    for name in GAUGES:
        Gauge(f"vllm:{name}", name, list(labels), registry=registry).labels(**labels).set(3)
    return generate_latest(registry).decode()


def per_call_ms(fn: object, text: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(text)  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    text = vllm_like_exposition()
    assert scan_vllm(text)["vllm:num_requests_waiting"] == 3.0
    lines = text.count("\n")
    whole = per_call_ms(lambda t: parse_exposition(t, keep_histograms=True), text, args.repeat)
    scan = per_call_ms(scan_vllm, text, args.repeat)
    print(f"exposition: {lines} lines, {len(text) / 1024:.1f} KiB (vLLM-shaped)")
    print(f"prometheus_client parser, whole text:        median {whole:.3f} ms")
    print(f"scan_vllm (the wanted lines, a regular expression): median {scan:.3f} ms")
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
