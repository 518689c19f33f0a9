"""Sources: direct scrape of a real HTTP /metrics, and a real Prometheus scraping it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from detector.signals import SignalConfig, SignalEngine
from detector.sources.prometheus import SERIES_PER_ENGINE, PrometheusSource
from detector.sources.scrape import ScrapeSource
from foundation import metricnames as mn
from tests.detector.conftest import TestServer, exposition, trickling_server, wait_until
from tests.detector.factories import snapshot


def test_scrape_source_labels_the_instance_and_reports_a_down_target(http_server: TestServer) -> None:
    http_server.body = exposition(snapshot(0.0, first=10.0, waiting=7.0, model="qwen").samples)
    url = http_server.url + "/metrics"
    source = ScrapeSource([url, "http://127.0.0.1:9/metrics"], timeout_s=1.0)
    result = source.fetch(1000.0)
    assert result.down == ["http://127.0.0.1:9/metrics"] and result.error
    (snap,) = result.snapshots
    assert snap.t == 1000.0
    assert snap.value("vllm:num_requests_waiting", instance=url) == 7.0
    assert snap.value("retrywatch_attempts_total", kind="first") == 10.0
    engine = SignalEngine()
    engine.add(snap)
    for instance in result.down:
        engine.mark_down(instance, 1000.0)
    frames = {f.labels.instance: f for f in engine.compute(1000.0)}
    assert frames[url].labels.model == "qwen" and frames[url].values["data_missing"] == 0.0
    assert "source" in frames["http://127.0.0.1:9/metrics"].missing
    http_server.status = 503
    assert source.fetch(1005.0).down == [url, "http://127.0.0.1:9/metrics"]
    source.close()
    with pytest.raises(ValueError, match="http"):
        ScrapeSource(["127.0.0.1:8000"])


@pytest.mark.promtool  # needs Debian's prometheus package (promtool's package)
def test_prometheus_source_reads_windows_through_the_http_api(
    http_server: TestServer, prometheus_factory: Callable[[str | Path], str]
) -> None:
    t0 = time.time()

    def body() -> str:
        el = time.time() - t0
        return exposition(snapshot(el, first=2.0 * el, retry=6.0 * el, waiting=50.0, model="qwen").samples)

    http_server.body_fn = body
    prom = prometheus_factory(f"127.0.0.1:{http_server.port}")
    source = PrometheusSource(prom, backfill_s=60.0, step_s=1.0)

    def enough_points() -> bool:
        res = PrometheusSource(prom, backfill_s=60.0, step_s=1.0).fetch(time.time())
        return len(res.snapshots) >= 5

    wait_until(enough_points, 30, "five scrapes in Prometheus")
    engine = SignalEngine()
    now = time.time()
    result = source.fetch(now)  # the first fetch backfills with a range query
    assert result.down == [] and result.error is None and len(result.snapshots) >= 5
    for snap in result.snapshots:
        engine.add(snap)
    (frame,) = engine.compute(now)
    assert frame.labels.instance == f"127.0.0.1:{http_server.port}" and frame.labels.model == "qwen"
    assert frame.values["attempt_rate_first"] == pytest.approx(2.0, rel=0.15)
    assert frame.values["executions_per_first_attempt"] == pytest.approx(4.0, rel=0.15)
    assert frame.values["vllm_waiting"] == 50.0 and frame.values["data_missing"] == 0.0
    # later fetches are instant queries
    time.sleep(1.1)
    later = source.fetch(time.time())
    assert len(later.snapshots) == 1
    # an answer beyond the series bound is refused as a failed fetch (the bound follows --max-engines)
    bounded = PrometheusSource(prom, step_s=1.0, max_engines=1)
    assert bounded.max_series == SERIES_PER_ENGINE
    bounded.max_series = 3
    refused = bounded.fetch(time.time())
    assert refused.error and "series match; at most 3" in refused.error and not refused.snapshots
    # the target goes down: Prometheus' up == 0 marks the instance down
    http_server.status = 500
    wait_until(lambda: bool(source.fetch(time.time()).down), 15, "Prometheus to see the target down")
    # Prometheus itself unreachable: every known instance is down, with the error
    gone = PrometheusSource("http://127.0.0.1:9", timeout_s=1.0)
    res = gone.fetch(time.time())
    assert res.down == ["http://127.0.0.1:9"] and res.error


@pytest.mark.promtool  # needs Debian's prometheus package (promtool's package)
def test_a_target_service_discovery_drops_is_forgotten_and_the_one_that_stays_is_not(
    tmp_path: Path, prometheus_factory: Callable[[str | Path], str]
) -> None:
    stays, leaves = TestServer(), TestServer()
    for server in (stays, leaves):
        server.body = exposition(snapshot(0.0, first=1.0, model="qwen").samples)
    sd = tmp_path / "targets.json"
    both = [f"127.0.0.1:{s.port}" for s in (stays, leaves)]
    sd.write_text(json.dumps([{"targets": both}]))
    source = PrometheusSource(prometheus_factory(sd), backfill_s=10.0, step_s=1.0)
    engine = SignalEngine(SignalConfig(time_scale=60.0))  # the 5-min lookback in 5 s

    def named() -> set[str]:
        result = source.fetch(time.time())
        for snap in result.snapshots:
            engine.add(snap)
        return {labels["instance"] for s in result.snapshots for _, labels, _ in s.samples} | set(result.down)

    wait_until(lambda: named() == set(both), 30, "Prometheus to scrape both targets")
    assert sorted(f.labels.instance for f in engine.compute(time.time())) == sorted(both)
    sd.write_text(json.dumps([{"targets": both[:1]}]))  # a rollout replaced the second replica
    wait_until(lambda: named() == set(both[:1]), 30, "the dropped target's series to go stale")
    dropped_at = time.time()
    wait_until(lambda: named() and [f.labels.instance for f in engine.compute(time.time())] == both[:1],
               30, "the detector to forget the dropped target")  # fmt: skip
    assert time.time() - dropped_at >= engine.windows.gauge_lookback_s - 1.0
    # should Prometheus stop answering, what it named last is down, not every target it ever named
    assert source.known == set(both[:1])
    stays.close()
    leaves.close()


def test_a_target_that_drips_its_answer_is_down_after_the_timeout(http_server: TestServer) -> None:
    # A proxy that sends its headers and then a byte now and then (each within the read
    # timeout) would hold the evaluation, and every other target's, for as long as it drips.
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000000\r\n\r\n")
            while not stop.wait(0.2):  # well within the 1-s read timeout, for up to 20 s
                conn.sendall(b"\n")
                if stop.wait(0) or time.monotonic() - started > 20:
                    return

    started = time.monotonic()
    threading.Thread(target=drip, daemon=True).start()
    http_server.body = exposition(snapshot(0.0, first=10.0).samples)
    slow = f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    source = ScrapeSource([slow, http_server.url + "/metrics"], timeout_s=1.0)
    try:
        result = source.fetch(1000.0)
        took = time.monotonic() - started
    finally:
        stop.set()
        listener.close()
        source.close()
    assert took < 5, f"the fetch took {took:.1f} s"
    assert result.down == [slow] and "1 s" in str(result.error)
    assert [s.value("retrywatch_attempts_total", kind="first") for s in result.snapshots] == [10.0]


def test_targets_that_do_not_answer_cost_one_timeout_not_one_each(http_server: TestServer) -> None:
    # Three proxies whose connections are taken and never answered (a hung process, a full
    # backlog): read one after another, they held the evaluation for three timeouts.
    import socket

    hung = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    http_server.body = exposition(snapshot(0.0, first=10.0).samples)
    silent = [f"http://127.0.0.1:{s.getsockname()[1]}/metrics" for s in hung]
    source = ScrapeSource([*silent, http_server.url + "/metrics"], timeout_s=1.0)
    try:
        started = time.monotonic()
        result = source.fetch(1000.0)
        took = time.monotonic() - started
    finally:
        source.close()
        for s in hung:
            s.close()
    assert result.down == silent  # in the order given
    assert [s.value("retrywatch_attempts_total", kind="first") for s in result.snapshots] == [10.0]
    assert took < 2.5, f"the fetch took {took:.1f} s"


def test_a_prometheus_that_trickles_its_answer_is_down_after_the_timeout() -> None:
    # requests' timeout bounds each read, not the answer: a Prometheus (or a proxy before it)
    # sending its answer a byte at a time held the detector's evaluation for as long as it did.
    answer = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
    with trickling_server(answer) as url:
        source = PrometheusSource(url, timeout_s=1.0)
        started = time.monotonic()
        result = source.fetch(time.time())
        took = time.monotonic() - started
    assert result.down and "not complete after 1 s" in str(result.error)
    assert took < 5, f"the fetch took {took:.1f} s"


def test_a_target_that_answers_without_the_series_is_missing_data_not_gone(http_server: TestServer) -> None:
    """A target that answers 200 with an empty body (or without the retrywatch and vLLM series)
    was reached: its series are stale at once, as in Prometheus, and it reports missing data
    (NoData) for as long as it answers so; it has not left the fleet."""
    other = TestServer()
    try:
        other.body = http_server.body = exposition(snapshot(0.0, first=10.0, waiting=7.0).samples)
        urls = [http_server.url + "/metrics", other.url + "/metrics"]
        source = ScrapeSource(urls)
        engine = SignalEngine()
        for t in range(0, 601, 5):
            if t == 100:
                other.body = ""
            result = source.fetch(float(t))
            for snap in result.snapshots:
                engine.add(snap)
            for instance in result.down:
                engine.mark_down(instance, float(t))
            frames = {f.labels.instance: f for f in engine.compute(float(t))}
            assert sorted(frames) == sorted(source.instances.values()), t
            emptied = frames[source.instances[urls[1]]]
            assert emptied.values["data_missing"] == (1.0 if t >= 100 else 0.0), t
            assert frames[source.instances[urls[0]]].values["data_missing"] == 0.0
        source.close()
    finally:
        other.close()


@pytest.mark.promtool  # needs Debian's prometheus package (promtool's package)
def test_a_target_prometheus_scrapes_without_the_series_is_missing_data(
    http_server: TestServer, prometheus_factory: Callable[[str | Path], str]
) -> None:
    """Prometheus scrapes the target (``up`` 1), which answers without the series: they go stale
    at once, and the detector says missing data at once, as the recording rule does."""
    http_server.body = exposition(snapshot(0.0, first=10.0, waiting=7.0).samples)
    source = PrometheusSource(
        prometheus_factory(f"127.0.0.1:{http_server.port}"), backfill_s=10.0, step_s=1.0
    )
    engine = SignalEngine()

    def feed() -> set[str]:
        now = time.time()
        result = source.fetch(now)
        for snap in result.snapshots:
            engine.add(snap)
        return {name for snap in result.snapshots[-1:] for name, _, _ in snap.samples}

    wait_until(lambda: mn.VLLM_NUM_WAITING in feed(), 30, "Prometheus to scrape the series")
    (frame,) = engine.compute(time.time())
    assert frame.values["data_missing"] == 0.0
    http_server.body = ""
    wait_until(lambda: mn.VLLM_NUM_WAITING not in feed(), 30, "the series to go stale")
    (frame,) = engine.compute(time.time())
    assert frame.labels.instance == f"127.0.0.1:{http_server.port}"
    assert frame.values["data_missing"] == 1.0 and frame.values["vllm_waiting"] is None


@pytest.mark.parametrize("suffix", ["/v1", "/v1/?x=1", "/v1#models"])
def test_an_openai_base_url_is_refused_naming_the_metrics_url(suffix: str) -> None:
    with pytest.raises(ValueError) as refused:
        ScrapeSource(["http://127.0.0.1:8100" + suffix])
    assert f"give http://127.0.0.1:8100/metrics, not http://127.0.0.1:8100{suffix}" in str(refused.value)
