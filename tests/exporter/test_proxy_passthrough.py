"""A real proxy process in front of engines that misbehave (``tests.exporter.oddengine``): one that
accepts and never answers (requests passed through end when their client leaves, a read-only one
waits at most ``--passthrough-read-timeout``, a drain cuts a pending one cleanly), one whose
``/metrics`` is huge (the event loop stays responsive) or carries ``retrywatch_`` families of its
own (not passed through beside the proxy's)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.exporter.oddengine import HungEngine, heavy_engine
from tests.exporter.support import errors_logged, proxy_process

WAIT_S = 10.0
FAST_START = ("--metrics-timeout", "0.2")  # the hung engine never answers the proxy's refresh


def _fds(pid: int | None) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until(check: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


async def _probes(url: str, paths: list[str], timeout_s: float) -> list[BaseException | httpx.Response]:
    """One request per path at once, each on a connection of its own, given up after ``timeout_s``."""

    async def probe(path: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await client.get(url + path)

    return await asyncio.gather(*(probe(p) for p in paths), return_exceptions=True)


def test_probes_of_a_hung_engine_leave_no_connection_or_descriptor_behind() -> None:
    """A kubelet probing a wedged engine with a 1-s timeout: each probe the client gives up on
    ends the proxy's request to the engine, long before the read timeout."""
    with HungEngine() as engine, proxy_process(engine.url, *FAST_START) as p:
        time.sleep(0.5)
        engine_before, fds_before = engine.open_connections(), _fds(p.proc.pid)
        paths = ["/health", "/v1/models", "/version", "/load"] * 10
        results = asyncio.run(_probes(p.url, paths, timeout_s=0.5))
        assert all(isinstance(r, httpx.TimeoutException) for r in results), results
        _until(lambda: engine.accepted >= len(paths), "the probes reached the engine")
        # The refresh of the engine's /metrics holds one connection at most.
        _until(lambda: engine.open_connections() <= max(engine_before, 1), "connections to the engine closed")
        _until(lambda: _fds(p.proc.pid) <= fds_before + 1, "descriptors back to the baseline")


def test_a_read_only_request_the_engine_never_answers_gets_504_after_the_read_timeout() -> None:
    with (
        HungEngine() as engine,
        proxy_process(engine.url, *FAST_START, "--passthrough-read-timeout", "0.5") as p,
    ):
        time.sleep(0.5)
        before = engine.open_connections()
        for path in ("/health", "/v1/models"):
            started = time.monotonic()
            r = httpx.get(p.url + path, timeout=WAIT_S)
            assert r.status_code == 504, r.text
            error = r.json()["error"]
            assert error["code"] == "upstream_timeout" and "--passthrough-read-timeout" in error["message"]
            assert 0.4 < time.monotonic() - started < 5.0
        _until(
            lambda: engine.open_connections() <= max(before, 1), "the timed-out requests' connections closed"
        )


def test_an_answer_the_engine_falls_silent_in_is_cut_short_at_the_read_timeout(tmp_path: Path) -> None:
    """Mid-answer, past the read timeout, the client's connection is closed (its answer must not
    look whole), one line is logged, no traceback, and the engine connection is closed."""
    log = tmp_path / "proxy.log"
    head = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"status"'
    with (
        HungEngine(reply=head) as engine,
        proxy_process(engine.url, *FAST_START, "--passthrough-read-timeout", "0.5", log=log) as p,
    ):
        time.sleep(0.5)
        before = engine.open_connections()
        with httpx.Client(timeout=WAIT_S) as client, client.stream("GET", p.url + "/v1/models") as r:
            assert r.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                r.read()
        _until(lambda: engine.open_connections() <= max(before, 1), "the engine connection closed")
    assert errors_logged(log) == []
    lines = [line for line in log.read_text().splitlines() if "ended mid-answer" in line]
    assert len(lines) == 1 and "/v1/models" in lines[0] and "ReadTimeout" in lines[0], lines


def test_a_client_leaving_mid_answer_ends_the_request_to_the_engine() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\npartial"
    with HungEngine(reply=head) as engine, proxy_process(engine.url, *FAST_START) as p:
        time.sleep(0.5)
        before = engine.open_connections()
        for _ in range(5):
            with httpx.Client(timeout=WAIT_S) as client, client.stream("GET", p.url + "/v1/models") as r:
                assert r.status_code == 200
                assert next(r.iter_raw()) == b"partial"
        _until(lambda: engine.accepted >= 5, "the requests reached the engine")
        _until(lambda: engine.open_connections() <= max(before, 1), "the engine connections closed")


def test_a_post_passed_through_is_bounded_by_its_client_not_the_read_timeout() -> None:
    """Engine work (a POST passed through, a generation request) may wait in the engine's queue
    for minutes: no read timeout; it ends when its client leaves."""
    with (
        HungEngine() as engine,
        # (cancellation at once: the generation request's execution is not kept for a retry)
        proxy_process(
            engine.url, *FAST_START, "--passthrough-read-timeout", "0.2", "--cancellation", "on"
        ) as p,
    ):
        time.sleep(0.5)
        before = engine.open_connections()
        for path, body in (
            ("/tokenize", {"prompt": "x"}),
            ("/v1/completions", {"model": "m", "prompt": "x"}),
        ):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(p.url + path, json=body, timeout=1.2)  # no 504 after 0.2 s
        _until(lambda: engine.accepted >= 2, "both reached the engine")
        _until(lambda: engine.open_connections() <= max(before, 1), "their connections closed")


def test_a_drain_cutting_a_pending_pass_through_answers_503_and_logs_one_line(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    out: dict[str, httpx.Response | BaseException] = {}

    def probe(url: str) -> None:
        try:
            out["r"] = httpx.get(url + "/health", timeout=WAIT_S)
        except httpx.HTTPError as exc:
            out["r"] = exc

    with (
        HungEngine() as engine,
        proxy_process(engine.url, *FAST_START, "--drain-timeout", "0.3", log=log) as p,
    ):
        time.sleep(0.5)
        accepted = engine.accepted
        thread = threading.Thread(target=probe, args=(p.url,))
        thread.start()
        _until(lambda: engine.accepted > accepted, "the probe reached the engine")
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(timeout=WAIT_S) == 0
        thread.join(timeout=WAIT_S)
    r = out["r"]
    assert isinstance(r, httpx.Response) and r.status_code == 503, r
    assert r.json()["error"]["code"] == "proxy_shutting_down"
    assert errors_logged(log) == []
    lines = [line for line in log.read_text().splitlines() if "passed through" in line]
    assert len(lines) == 1 and "/health" in lines[0] and "503" in lines[0], lines


def test_a_huge_upstream_metrics_leaves_the_event_loop_responsive(tmp_path: Path) -> None:
    """150k series of the families the proxy reads, fetched every second: a request the proxy
    answers itself is not held behind the reading of them (it was, for seconds)."""
    series = 150_000
    with (
        heavy_engine(tmp_path, series) as engine,
        proxy_process(engine) as p,
        httpx.Client(timeout=WAIT_S) as client,
    ):
        client.get(p.url + "/retrywatch/executions").raise_for_status()
        worst = 0.0
        until = time.monotonic() + 3.5  # three refreshes at least
        while time.monotonic() < until:
            started = time.monotonic()
            client.get(p.url + "/retrywatch/executions").raise_for_status()
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.02)
        text = client.get(p.url + "/metrics").text
    assert worst < 1.0, f"a request waited {worst:.2f} s behind the reading of the upstream's /metrics"
    assert text.count("vllm:num_requests_waiting{") == series // 2 + 1
    assert "retrywatch_upstream_up 1.0" in text


def test_an_upstreams_own_retrywatch_families_are_not_passed_through(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    with heavy_engine(tmp_path, 1_000, own_families=True) as engine, proxy_process(engine, log=log) as p:
        for _ in range(2):
            text = httpx.get(p.url + "/metrics", timeout=WAIT_S).text
            time.sleep(1.1)
    # Each of the proxy's own series once, with its own value; the engine's vLLM families kept.
    assert text.count('retrywatch_attempts_total{kind="first"}') == 1
    assert 'retrywatch_attempts_total{kind="first"} 0.0' in text
    assert text.count("# TYPE retrywatch_attempts_total counter") == 1
    assert "retrywatch_executions_live 0.0" in text and "retrywatch_executions_live 2.0" not in text
    assert text.count("vllm:prompt_tokens_total{") == 500
    for family in ("retrywatch_attempts_total", "retrywatch_executions_live"):
        assert text.count(f"# HELP {family} ") == 1 and text.count(f"# TYPE {family} ") == 1
    warned = [line for line in log.read_text().splitlines() if "retrywatch_ families of its own" in line]
    assert len(warned) == 1, warned
    assert errors_logged(log) == []
