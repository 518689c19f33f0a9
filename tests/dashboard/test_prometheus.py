"""The Prometheus signal source against a REAL Prometheus (Debian's ``prometheus``) that scrapes
a real HTTP server serving the proxy's counters and runs ``rules/retrywatch.rules.yml``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dashboard.app import create_app
from dashboard.context import DashboardConfig
from dashboard.data import DetectorUnavailable
from dashboard.pages import live
from dashboard.prometheus import PrometheusSignals
from foundation import metricnames as mn
from foundation.processes import ManagedProcess, free_port
from foundation.timeseries import format_sample
from tests.dashboard.staticapi import StaticDetectorAPI
from tests.detector.conftest import trickling_server
from tests.systemtools import require

pytestmark = pytest.mark.promtool

RULES = Path(__file__).resolve().parents[2] / "rules" / "retrywatch.rules.yml"
CAPACITY = 2.0


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # Prometheus closing a scrape connection at shutdown is not an error here


class CounterServer:
    """Serves a proxy's /metrics (plain text) whose counters grow at fixed rates: first attempts
    at 1/s, retries at 2/s, executions at ``creation_rate``; vLLM's series carry ``engine="0"``,
    as every vLLM's do."""

    def __init__(self, creation_rate: float, waiting: float, model: str) -> None:
        self.creation_rate, self.waiting, self.model = creation_rate, waiting, model
        self.t0 = time.time()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = server.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def exposition(self) -> str:
        dt = time.time() - self.t0
        vllm = {"engine": "0", "model_name": self.model}
        samples = [
            (mn.ATTEMPTS, {"kind": "first"}, 1.0 * dt),
            (mn.ATTEMPTS, {"kind": "retry"}, 2.0 * dt),
            (mn.EXECUTIONS_CREATED, {}, self.creation_rate * dt),
            (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, 0.5 * dt),
            (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, 1.5 * dt),
            (mn.EXECUTIONS_QUEUED, {}, 0.0),
            (mn.CAPACITY, {}, CAPACITY),
            (mn.CLIENT_DEADLINE, {}, 120.0),
            (mn.VLLM_NUM_WAITING, vllm, self.waiting),
            (mn.VLLM_NUM_RUNNING, vllm, 20.0),
        ]
        lines = []
        for name in dict.fromkeys(n for n, _, _ in samples):
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# TYPE {name.removesuffix('_total') if kind == 'counter' else name} {kind}")
            lines.extend(format_sample(n, lb, v) for n, lb, v in samples if n == name)
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# A fleet of two proxies, each before its own vLLM: (creation rate /s, vLLM waiting, model).
FLEET = ((3.0, 50.0, "qwen"), (1.0, 10.0, "llama"))


@pytest.fixture
def fleet() -> Iterator[list[CounterServer]]:
    servers = [CounterServer(rate, waiting, model) for rate, waiting, model in FLEET]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def prometheus(tmp_path: Path, fleet: list[CounterServer]) -> Iterator[str]:
    binary = require("prometheus")
    targets = ", ".join(f"'127.0.0.1:{t.port}'" for t in fleet)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n"
        "  - job_name: retrywatch\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n"
    )
    argv = [
        binary,
        f"--config.file={config}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
    ]
    with ManagedProcess(argv, log_path=tmp_path / "prometheus.log", bound_s=None, name="Prometheus") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(url + "/-/ready", timeout_s=30, poll_s=0.2)
        yield url


def test_prometheus_signals_feed_the_live_page(prometheus: str, fleet: list[CounterServer]) -> None:
    """Two engines whose vLLM ``engine`` label is "0" on both stay two engines, keyed by instance."""
    source = PrometheusSignals(prometheus)
    instances = [f"127.0.0.1:{t.port}" for t in fleet]
    deadline = time.monotonic() + 40
    series: list[Any] = []
    while time.monotonic() < deadline:
        series = source.signal("execution_creation_rate", since=time.time() - 120)
        if len(series) == len(fleet) and all(np.isfinite(s.points[-1, 1]) for s in series):
            break
        time.sleep(0.5)
    assert len(series) == len(fleet), "the recording rules produced no execution_creation_rate per engine"
    assert sorted(s.labels["instance"] for s in series) == sorted(instances)
    assert {s.labels["engine"] for s in series} == {"0"}  # vLLM's label tells engines apart nowhere
    assert source.signal_index().engines == sorted(instances)
    for target, instance in zip(fleet, instances, strict=True):
        own = source.signal("execution_creation_rate", since=time.time() - 120, engine=instance)
        assert [(s.labels["instance"], s.labels["model"]) for s in own] == [(instance, target.model)]
        # rate() over 1 m is extrapolated from the few seconds scraped so far: compare rates with
        # each other (same window, same samples) rather than with their final values.
        first = source.signal("attempt_rate_first", since=time.time() - 120, engine=instance)[0].points
        retry = source.signal("attempt_rate_retry", since=time.time() - 120, engine=instance)[0].points
        assert retry[-1, 1] / first[-1, 1] == pytest.approx(2.0, rel=0.05)
        assert source.signal("vllm_waiting", engine=instance)[0].points[-1, 1] == pytest.approx(
            target.waiting
        )
        assert source.signal("capacity", engine=instance)[0].points[-1, 1] == pytest.approx(CAPACITY)
    assert source.signal("vllm_waiting", engine="0") == []  # vLLM's engine label selects nothing
    # any label value is a selector, never a PromQL error or a refusal (a stale page may send one)
    for odd in ('a"} or vector(1) or {x="', "back\\slash", "new\nline", "x" * 512):
        assert source.signal("vllm_waiting", engine=odd) == []

    # The live page reads each engine's panels from Prometheus (alerts, episodes: the detector API).
    with StaticDetectorAPI() as api:
        app = create_app(DashboardConfig(detector_url=api.url, prometheus_url=prometheus))
        ctx = app.server.config["RETRYWATCH_CONTEXT"]
        for target, instance in zip(fleet, instances, strict=True):
            view = live.live_view(ctx, instance, 900, now=time.time())
            assert view.error is None
            created, first_rate = view.signals["execution_creation_rate"], view.signals["attempt_rate_first"]
            # its own rate, not the fleet's sum (4/2 = 2 for both when engines merge)
            assert created[-1, 1] / first_rate[-1, 1] == pytest.approx(target.creation_rate, rel=0.05)
            assert view.signals["vllm_waiting"][-1, 1] == pytest.approx(target.waiting)
            assert view.signals["capacity"][-1, 1] == pytest.approx(CAPACITY)
            figs = view.figures()
            trace = next(t for t in figs[0].data if t.name == "executions created")
            assert len(trace.x) >= 1


def test_a_prometheus_that_trickles_its_answer_is_no_data_after_the_timeout() -> None:
    # A Prometheus sending its answer a byte at a time held a dashboard worker (one of 8) for as
    # long as it did: requests' timeout bounds each read, not the answer.
    answer = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
    with trickling_server(answer) as url:
        signals = PrometheusSignals(url, timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(DetectorUnavailable, match="not complete after 1 s"):
            signals.signal_index()
        took = time.monotonic() - started
    assert took < 5, f"the query took {took:.1f} s"
