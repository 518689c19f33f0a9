"""Benchmark a fleet's monitoring: series per replica, rule evaluation in Prometheus, the detector's tick.

Run: ``python bench/bench_fleet.py [--replicas 1 10 100] [--settle 75]``. Prints figures; asserts
nothing. Needs Debian's ``prometheus``.

1. Series per replica: a real emulated engine (``retrywatch emulate``) and its proxy, a few calls
   through it, then the proxy's ``/metrics`` counted by family prefix (``retrywatch_``, ``vllm:``,
   the rest).
2. Rule evaluation: a real Prometheus scraping N synthetic replicas every 5 s, with
   ``rules/retrywatch.rules.yml`` loaded. Every replica serves that proxy's ``/metrics`` text (one
   local server, N targets that differ by their ``instance`` label), its counters rising by one
   per second so every rate is defined. After ``--settle`` seconds (the rules' 1-minute windows
   filled), the rule group's ``evaluationTime`` (the rules API) is read at each evaluation for 30 s.
3. The detector at the largest N: ``detector.service.Detector`` over ``PrometheusSource`` (the
   first tick backfills 10 minutes with a range query; later ticks one instant query each), with
   SQLite episodes, ticked 10 times.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml

from detector.service import Detector
from detector.sources.prometheus import PrometheusSource
from detector.store import EpisodeStore
from exporter.settings import ProxySettings
from foundation.processes import ManagedProcess, free_port
from rules.generate import RULES_PATH

PRESET = "qwen2.5-7b-h100"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{.*\})?\s+(?P<value>\S+)$")
_COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def proxy_metrics(workdir: Path) -> str:
    """A real proxy's /metrics text after a few calls through it to its emulated engine."""
    engine_port, proxy_port = free_port(), free_port()
    exe = [sys.executable, "-m", "retrywatch"]
    engine = ManagedProcess(
        [*exe, "emulate", "--model", PRESET, "--time-scale", "4", "--port", str(engine_port)],
        log_path=workdir / "engine.log", bound_s=300, name="emulated engine",
    )  # fmt: skip
    settings = ProxySettings(
        upstream=f"http://127.0.0.1:{engine_port}", port=proxy_port, capacity=11.12, deadline_s=30.0
    )
    proxy = ManagedProcess(
        [*exe, "proxy", *settings.to_argv()], log_path=workdir / "proxy.log", bound_s=300, name="proxy"
    )
    with engine, proxy:
        engine.wait_ready(f"http://127.0.0.1:{engine_port}/health", timeout_s=60)
        url = f"http://127.0.0.1:{proxy_port}"
        proxy.wait_ready(url + "/metrics", timeout_s=60)
        with httpx.Client(timeout=60) as client:
            for i in range(5):
                body = {"model": PRESET, "prompt": list(range(1, 200)), "max_tokens": 8, "stream": i % 2 == 0}
                client.post(url + "/v1/completions", json=body, headers={"X-Call-Id": f"bench-{i}"})
            time.sleep(2)  # one upstream /metrics scan after the calls
            return client.get(url + "/metrics").text


def count_series(text: str) -> dict[str, int]:
    counts = {"retrywatch_*": 0, "vllm:*": 0, "other": 0}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match["name"]
        key = (
            "retrywatch_*"
            if name.startswith("retrywatch_")
            else "vllm:*"
            if name.startswith("vllm:")
            else "other"
        )
        counts[key] += 1
    return counts


class _Replicas(ThreadingHTTPServer):
    """Serves one proxy's /metrics text to every target, counters rising by one per second."""

    daemon_threads = True

    def __init__(self, template: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.started = time.monotonic()
        self.lines: list[tuple[str, float | None]] = []
        for line in template.splitlines():
            match = _SAMPLE.match(line)
            counter = (
                match is not None and not line.startswith("#") and match["name"].endswith(_COUNTER_SUFFIXES)
            )
            if match is not None and counter:
                self.lines.append((line[: match.start("value")], float(match["value"])))
            else:
                self.lines.append((line, None))

    def body(self) -> bytes:
        elapsed = time.monotonic() - self.started
        out = [head if value is None else f"{head}{value + elapsed:.3f}" for head, value in self.lines]
        return ("\n".join(out) + "\n").encode()


class _Handler(BaseHTTPRequestHandler):
    server: _Replicas

    def do_GET(self) -> None:
        body = self.server.body()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def rule_evaluation(
    template: str, replicas: int, settle_s: float, workdir: Path, detector_ticks: int
) -> None:
    server = _Replicas(template)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = free_port()
    target = f"127.0.0.1:{server.server_address[1]}"
    config = {
        "global": {"scrape_interval": "5s", "scrape_timeout": "4s", "evaluation_interval": "5s"},
        "rule_files": [str(RULES_PATH)],
        "scrape_configs": [
            {
                "job_name": "retrywatch",
                "static_configs": [
                    {"targets": [target], "labels": {"instance": f"replica-{i}"}}
                    for i in range(1, replicas + 1)
                ],
            }
        ],
    }
    cfg = workdir / f"prometheus-{replicas}.yml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    argv = ["prometheus", f"--config.file={cfg}", f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={workdir / f'tsdb-{replicas}'}"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with ManagedProcess(
        argv, log_path=workdir / f"prometheus-{replicas}.log", bound_s=900, name="prometheus"
    ) as prom:
        prom.wait_ready(url + "/-/ready", timeout_s=30)
        time.sleep(settle_s)
        seen: dict[str, float] = {}
        end = time.monotonic() + 30
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < end:
                (group,) = client.get(url + "/api/v1/rules").json()["data"]["groups"]
                seen[group["lastEvaluation"]] = float(group["evaluationTime"])
                time.sleep(1)
            head = client.get(url + "/api/v1/status/tsdb").json()["data"]["headStats"]["numSeries"]
            recorded = client.get(
                url + "/api/v1/query", params={"query": 'count({__name__=~"instance:retrywatch_.+"})'}
            ).json()["data"]["result"]
        times = sorted(seen.values())
        n_rules = len(yaml.safe_load(RULES_PATH.read_text())["groups"][0]["rules"])
        print(
            f"rules at {replicas:>3} replicas: {n_rules} rules, group evaluation median "
            f"{statistics.median(times) * 1000:.1f} ms, max {times[-1] * 1000:.1f} ms over {len(times)} "
            f"evaluations; {head} head series, {recorded[0]['value'][1] if recorded else 0} recorded "
            f"instance:retrywatch_* series"
        )
        if detector_ticks:
            store = EpisodeStore(f"sqlite:///{workdir / f'detector-{replicas}.db'}")
            detector = Detector(PrometheusSource(url), store)
            ticks = []
            for _ in range(detector_ticks):
                t0 = time.perf_counter()
                detector.tick()
                ticks.append(time.perf_counter() - t0)
                time.sleep(1)
            engines = len(detector.signals.compute(time.time()))
            kept = len(detector.history.engines())
            print(
                f"detector tick reading Prometheus at {replicas} replicas ({engines} engines evaluated, "
                f"history kept for {kept}): first "
                f"(10-min backfill) {ticks[0] * 1000:.0f} ms, then median "
                f"{statistics.median(ticks[1:]) * 1000:.0f} ms, max {max(ticks[1:]) * 1000:.0f} ms "
                f"over {len(ticks) - 1} ticks"
            )
            store.close()
    server.shutdown()
    server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument(
        "--settle", type=float, default=75.0, help="seconds before reading the rules' timings"
    )
    parser.add_argument("--ticks", type=int, default=10, help="detector ticks at the largest fleet")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        workdir = Path(tmp)
        template = proxy_metrics(workdir)
        counts = count_series(template)
        print(
            f"series one proxy exports (one replica): {sum(counts.values())} samples: "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
        )
        largest = max(args.replicas)
        for n in sorted(args.replicas):
            rule_evaluation(template, n, args.settle, workdir, args.ticks if n == largest else 0)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
