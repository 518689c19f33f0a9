"""How long the proxy's per-second work holds its event loop, by the size of the engine's /metrics.

Run: ``python bench/bench_sampling.py`` (about half a minute). Once a second the proxy fetches the
upstream's ``/metrics`` (``UpstreamPool.get_text``) and takes a window sample
(``ProxyMetrics.sample``: the derived gauges, which scan the fetched text for a few vLLM
families); a scrape of the proxy's own ``/metrics`` (``ProxyMetrics.exposition``) serves that
text again. The test upstream's ``/metrics`` is a few lines; a real vLLM's is hundreds (sixteen
histograms of about twenty buckets per engine), more with several engines behind one server.

This times, in one process on uvloop, the proxy's own objects against a uvicorn process serving
a synthetic vLLM exposition of 1, 4 and 16 engines (vLLM v1's families and bucket counts): the
fetch's wall time and CPU time, the longest the event loop went without running a 1-ms heartbeat
during the fetch, and the synchronous sample and exposition. It asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvloop

from exporter.metrics import ProxyMetrics
from exporter.policy import Policy
from exporter.upstream import UpstreamPool
from foundation.processes import ManagedProcess, free_port

MODEL = "Qwen/Qwen2.5-7B-Instruct"
# vLLM v1's histograms (name, number of buckets), from vllm/v1/metrics/loggers.py.
HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", 23),
    ("vllm:inter_token_latency_seconds", 21),
    ("vllm:request_time_per_output_token_seconds", 21),
    ("vllm:e2e_request_latency_seconds", 22),
    ("vllm:request_queue_time_seconds", 22),
    ("vllm:request_inference_time_seconds", 22),
    ("vllm:request_prefill_time_seconds", 22),
    ("vllm:request_decode_time_seconds", 22),
    ("vllm:request_num_preemptions", 8),
    ("vllm:request_prefill_kv_computed_tokens", 16),
    ("vllm:request_prompt_tokens", 16),
    ("vllm:request_generation_tokens", 16),
    ("vllm:iteration_tokens_total", 12),
    ("vllm:request_max_num_generation_tokens", 16),
    ("vllm:request_params_n", 6),
    ("vllm:request_params_max_tokens", 16),
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
FINISH_REASONS = ("stop", "length", "abort", "error")


def exposition(engines: int) -> str:
    """A vLLM-like exposition: its families for ``engines`` engines, values made up."""
    lines: list[str] = []
    for name in GAUGES:
        lines += [f"# HELP {name} A gauge.", f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="{e}",model_name="{MODEL}"}} {e * 3.0}' for e in range(engines)]
    for name in COUNTERS:
        base = name.removesuffix("_total")
        lines += [f"# HELP {base} A counter.", f"# TYPE {base} counter"]
        for e in range(engines):
            lines.append(f'{name}{{engine="{e}",model_name="{MODEL}"}} {1234567.0 + e}')
            lines.append(f'{base}_created{{engine="{e}",model_name="{MODEL}"}} 1.7963e+09')
    lines += ["# HELP vllm:request_success_total Requests.", "# TYPE vllm:request_success_total counter"]
    for e in range(engines):
        for reason in FINISH_REASONS:
            labels = f'engine="{e}",finished_reason="{reason}",model_name="{MODEL}"'
            lines.append(f"vllm:request_success_total{{{labels}}} 4242.0")
    for name, buckets in HISTOGRAMS:
        lines += [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
        for e in range(engines):
            labels = f'engine="{e}",model_name="{MODEL}"'
            for b in range(buckets):
                lines.append(f'{name}_bucket{{{labels},le="{0.001 * 2**b:g}"}} {100.0 * b}')
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} 2500.0')
            lines.append(f"{name}_count{{{labels}}} 2500.0")
            lines.append(f"{name}_sum{{{labels}}} 1234.5")
            lines.append(f"{name}_created{{{labels}}} 1.7963e+09")
    return "\n".join(lines) + "\n"


def serve(path: str, port: int) -> None:
    """The engine's stand-in: uvicorn serving the exposition in ``path`` on ``GET /metrics``."""
    import uvicorn

    with open(path, "rb") as f:
        body = f.read()

    async def app(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")


class Heartbeat:
    """The longest the event loop went without running a 1-ms ``call_later``, since ``reset``."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.longest = 0.0
        self.running = True
        asyncio.get_running_loop().call_later(0.001, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.longest = max(self.longest, now - self.last)
        self.last = now
        if self.running:
            asyncio.get_running_loop().call_later(0.001, self._tick)

    def reset(self) -> None:
        self.last, self.longest = time.perf_counter(), 0.0


async def measure(url: str, fetches: int) -> dict[str, list[float]]:
    client = UpstreamPool(url)
    metrics = ProxyMetrics(Policy(), 60.0, None)
    beat = Heartbeat()
    out: dict[str, list[float]] = {"wall": [], "cpu": [], "stall": [], "sample": [], "exposition": []}
    try:
        for _ in range(fetches):
            await asyncio.sleep(0.05)
            beat.reset()
            t0, c0 = time.perf_counter(), time.thread_time()
            text = await client.get_text("/metrics", 5.0)
            t1, c1 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.002)  # let the heartbeat see the end of the fetch
            out["wall"].append(t1 - t0)
            out["cpu"].append(c1 - c0)
            out["stall"].append(beat.longest - 0.001)
            s0 = time.perf_counter()
            metrics.upstream_fetched(time.monotonic(), text)
            metrics.sample(time.monotonic())
            s1 = time.perf_counter()
            metrics.exposition(True, time.monotonic())
            out["sample"].append(s1 - s0)
            out["exposition"].append(time.perf_counter() - s1)
    finally:
        beat.running = False
        client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetches", type=int, default=40, help="fetches timed per size")
    parser.add_argument("--serve", nargs=2, metavar=("FILE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    with open("/proc/loadavg") as f:
        print(f"machine: {os.cpu_count()} cores; load average {f.read().split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        for engines in (1, 4, 16):
            text = exposition(engines)
            path = os.path.join(tmp, f"metrics-{engines}.txt")
            with open(path, "w") as f:
                f.write(text)
            port = free_port()
            argv = [sys.executable, os.path.abspath(__file__), "--serve", path, str(port)]
            log = Path(tmp) / f"server-{engines}.log"
            with ManagedProcess(argv, log_path=log, bound_s=None, name="metrics server") as server:
                server.wait_ready(f"http://127.0.0.1:{port}/metrics", timeout_s=30.0)
                figures = uvloop.run(measure(f"http://127.0.0.1:{port}", args.fetches))

            def ms(name: str, figures: dict[str, list[float]] = figures) -> str:
                xs = figures[name]
                return f"{statistics.median(xs) * 1e3:.2f} / {max(xs) * 1e3:.2f}"

            print(
                f"{engines:>2} engine(s), {text.count(chr(10))} lines, {len(text) / 1024:.0f} KiB"
                f" (median / max ms): fetch wall {ms('wall')}, CPU {ms('cpu')}, longest loop stall"
                f" {ms('stall')}; sample {ms('sample')}; exposition {ms('exposition')}"
            )


if __name__ == "__main__":
    main()
