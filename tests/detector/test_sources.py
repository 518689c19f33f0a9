"""Sources: direct scrape of a real HTTP /metrics, and a real Prometheus scraping it."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from detector.service import Detector
from detector.signals import WINDOWS, SignalConfig, SignalEngine
from detector.sources.prometheus import SERIES_PER_ENGINE, PrometheusSource
from detector.sources.scrape import ScrapeSource
from detector.store import EpisodeStore
from detector.thresholds import tier_rules
from foundation import metricnames as mn
from foundation.timeseries import Snapshot
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
    engine = SignalEngine(SignalConfig(windows=WINDOWS.scaled(60.0)))  # the 5-min lookback in 5 s

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
    # a queue at +Inf: Prometheus stores and answers it as it is; the detector reads no value
    # (as for NaN), where a rule on it fired with a value reported as null
    http_server.body = exposition(snapshot(0.0, first=10.0, waiting=math.inf).samples)

    def infinite() -> bool:
        result = source.fetch(time.time())
        for snap in result.snapshots:
            engine.add(snap)
        last = result.snapshots[-1:]
        return any(math.isinf(v) for snap in last for n, _, v in snap.samples if n == mn.VLLM_NUM_WAITING)

    wait_until(infinite, 30, "Prometheus to answer the queue at +Inf")
    (frame,) = engine.compute(time.time())
    assert frame.values["vllm_waiting"] is None and mn.VLLM_NUM_WAITING in frame.missing
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


# --- what a scrape refuses, and what it reads as no value ----------------------------------

_VLLM = {"engine": "0", "model_name": "m"}


def _vllm_exposition(t: float, *, waiting: str, twice: str | None = None, extra: int = 0) -> str:
    """vLLM's own /metrics at ``t`` s of a steady 1 finish/s, each in 1 s and unqueued, with
    ``waiting`` requests waiting (text: "+Inf" is a value); ``twice``: one more line of the
    exposition repeated; ``extra``: that many more series (a label that churns)."""
    lb = 'engine="0",model_name="m"'
    lines = [
        f"{mn.VLLM_NUM_WAITING}{{{lb}}} {waiting}",
        f"{mn.VLLM_NUM_RUNNING}{{{lb}}} 1",
        f'{mn.VLLM_REQUEST_SUCCESS}{{{lb},finished_reason="stop"}} {t}',
        f"{mn.VLLM_PROMPT_TOKENS}{{{lb}}} {100 * t}",
        f"{mn.VLLM_PREFIX_CACHE_QUERIES}{{{lb}}} {100 * t}",
        f"# TYPE {mn.VLLM_E2E_LATENCY} histogram",
        *(f'{mn.VLLM_E2E_LATENCY}_bucket{{{lb},le="{le}"}} {t}' for le in ("1.0", "120.0", "+Inf")),
        f"{mn.VLLM_E2E_LATENCY}_count{{{lb}}} {t}",
        f"{mn.VLLM_E2E_LATENCY}_sum{{{lb}}} {t}",
        f"# TYPE {mn.VLLM_QUEUE_TIME} histogram",
        f'{mn.VLLM_QUEUE_TIME}_bucket{{{lb},le="+Inf"}} {t}',
        f"{mn.VLLM_QUEUE_TIME}_count{{{lb}}} {t}",
        f"{mn.VLLM_QUEUE_TIME}_sum{{{lb}}} 0",
        f"# TYPE {mn.VLLM_REQUEST_PROMPT_TOKENS} histogram",
        f'{mn.VLLM_REQUEST_PROMPT_TOKENS}_bucket{{{lb},le="+Inf"}} {t}',
        f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_count{{{lb}}} {t}",
        f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum{{{lb}}} {100 * t}",
        *(f'{mn.VLLM_NUM_PREEMPTIONS}{{engine="0",model_name="m{t:g}-{i}"}} 0' for i in range(extra)),
    ]
    if twice is not None:
        lines += [line for line in lines if line.startswith(twice + "{")][:1]
    return "\n".join(lines) + "\n"


def _vllm_detector(tmp_path: Path, source: ScrapeSource) -> Detector:
    """The vLLM tier's detector on ``source``: Ĉ 2 calls/s, a 120-s deadline."""
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    return Detector(
        source, store, config=SignalConfig(capacity=2.0, deadline=120.0), rules=tier_rules("vllm")
    )


def _refused(detector: Detector, reason: str) -> float:
    value = detector.metrics.registry.get_sample_value(
        "retrywatch_detector_scrapes_refused_total", {"reason": reason}
    )
    return -1.0 if value is None else value


def test_the_vllm_tier_reads_the_histograms_off_a_direct_scrape(http_server: TestServer) -> None:
    """The direct scrape keeps vLLM's histograms that the vLLM tier reads: without them its
    NoData fired on a healthy engine and every finish counted as late."""
    clock = [0.0]
    http_server.body_fn = lambda: _vllm_exposition(clock[0], waiting="0")
    source = ScrapeSource([http_server.url + "/metrics"])
    engine = SignalEngine(SignalConfig(capacity=2.0, deadline=120.0))
    for t in range(0, 121, 5):
        clock[0] = float(t)
        (snap,) = source.fetch(float(t)).snapshots
        engine.add(snap)
    source.close()
    (frame,) = engine.compute(120.0)
    assert frame.missing_for("vllm") == ()
    assert frame.values["vllm_finish_rate"] == pytest.approx(1.0)
    assert frame.values["vllm_in_time_rate"] == pytest.approx(1.0)
    assert frame.values["vllm_late_fraction"] == 0.0
    assert frame.values["vllm_queue_time_deadline_ratio"] == 0.0
    assert frame.values["vllm_unfinished_fraction"] == pytest.approx(0.0)


def test_a_series_twice_refuses_the_targets_scrape_naming_it(
    tmp_path: Path, http_server: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiting queue exposed twice was summed: 150 read as 300, 1.25 deadlines of work at Ĉ
    2/s, and VLLMQueueBeyondDeadline fired on a queue of 0.6. The scrape is refused instead (the
    target down, its NoData), logged once as an error naming the series, and counted; the other
    target is read as ever."""
    clock = [0.0]
    doubled = [True]
    well = TestServer()
    well.body_fn = lambda: _vllm_exposition(clock[0], waiting="0")
    http_server.body_fn = lambda: _vllm_exposition(
        clock[0], waiting="150", twice=mn.VLLM_NUM_WAITING if doubled[0] else None
    )
    url = http_server.url + "/metrics"
    detector = _vllm_detector(tmp_path, ScrapeSource([url, well.url + "/metrics"]))
    fired: list[tuple[str, str, float | None]] = []
    try:
        for t in range(0, 121, 5):
            clock[0] = float(t)
            fired += [(tr.alertname, tr.labels.instance, tr.value) for tr in detector.tick(float(t))]
        assert fired == [("VLLMTierNoData", url, 1.0)]
        (alert,) = detector.firing_alerts()
        assert "missing source" in str(alert["description"])
        assert detector.status.last_error == (
            f"{url}: scrape refused: the series "
            f'{mn.VLLM_NUM_WAITING}{{engine="0",model_name="m"}} appears twice'
        )
        assert _refused(detector, "duplicate_series") == 25 and _refused(detector, "series_limit") == 0
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        assert len(errors) == 1 and f"the scrape of {url} is refused" in errors[0].getMessage()
        assert f'{mn.VLLM_NUM_WAITING}{{engine="0",model_name="m"}} appears twice' in errors[0].getMessage()
        doubled[0] = False  # the exporter is fixed: its queue of 150 is read once, 0.6 deadlines
        for t in range(125, 241, 5):
            clock[0] = float(t)
            fired += [(tr.alertname, tr.labels.instance, tr.value) for tr in detector.tick(float(t))]
        assert [name for name, _, _ in fired] == ["VLLMTierNoData", "VLLMTierNoData"]  # fired, resolved
        assert f"the scrape of {url} is taken again" in caplog.text
    finally:
        detector.stop()
        well.close()


def test_a_target_past_the_series_limit_is_refused_and_counted(
    tmp_path: Path, http_server: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A label that churns (a new model_name on every scrape) once grew the detector to 1.1 GB
    for one engine; past the series limit (every sample of the answer counts, as in Prometheus'
    sample_limit) the scrape is refused, logged once and counted; under it, it is read."""
    clock = [0.0]
    churn = [104]  # 16 vLLM series and 104 more: 120, at the limit
    http_server.body_fn = lambda: _vllm_exposition(clock[0], waiting="0", extra=churn[0])
    url = http_server.url + "/metrics"
    detector = _vllm_detector(tmp_path, ScrapeSource([url], series_limit=120))
    try:
        for t in (0.0, 5.0, 10.0):
            clock[0] = t
            detector.tick(t)
        assert detector.status.up and _refused(detector, "series_limit") == 0
        churn[0] = 105  # one past it
        for t in (15.0, 20.0):
            clock[0] = t
            detector.tick(t)
        assert not detector.status.up and _refused(detector, "series_limit") == 2
        assert detector.status.last_error == f"{url}: scrape refused: more than 120 series (the series limit)"
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert errors == [
            f"the scrape of {url} is refused, its series unread (the target counts as down):"
            " more than 120 series (the series limit)"
        ]
    finally:
        detector.stop()
    with pytest.raises(ValueError, match="at least 1"):
        ScrapeSource([url], series_limit=0)


def test_counter_series_whose_labels_churn_are_bounded_and_the_steady_ones_rated() -> None:
    """Every scrape names 1,000 new counter series (a model_name that churns, each under the
    series limit): the engine's memory stays flat once its bound of remembered series is
    reached, and the series that stays is rated as ever."""
    import tracemalloc

    engine = SignalEngine(SignalConfig(capacity=2.0, deadline=120.0))

    def scrape(t: float) -> Snapshot:
        churned = [
            (mn.VLLM_REQUEST_SUCCESS, {**_VLLM, "model_name": f"m{t:g}-{i}"}, 1.0) for i in range(1_000)
        ]
        steady = [(mn.VLLM_REQUEST_SUCCESS, {**_VLLM, "finished_reason": "stop"}, 2.0 * t)]
        return Snapshot(t, [*steady, *churned, (mn.VLLM_NUM_WAITING, _VLLM, 0.0)])

    tracemalloc.start()
    try:
        for i in range(10):
            engine.add(scrape(5.0 * i))
        settled = tracemalloc.get_traced_memory()[0]
        for i in range(10, 40):  # 30,000 more series
            engine.add(scrape(5.0 * i))
        grown = tracemalloc.get_traced_memory()[0] - settled
    finally:
        tracemalloc.stop()
    assert grown < 1_000_000, f"{grown} bytes more for 30,000 series gone"
    (frame,) = engine.compute(195.0)
    assert frame.values["vllm_finish_rate"] == pytest.approx(2.0)


def test_an_infinite_queue_is_missing_data_not_a_page_with_no_value(
    tmp_path: Path, http_server: TestServer
) -> None:
    """vLLM's waiting queue at +Inf fired VLLMQueueBeyondDeadline with its value reported as
    null. A value that is not finite is no reading, as NaN (Prometheus' own no-value) is: the
    queue is missing, and the tier's NoData says so with a value of its own."""
    from fastapi.testclient import TestClient

    from detector.api import create_app

    clock = [0.0]
    http_server.body_fn = lambda: _vllm_exposition(clock[0], waiting="+Inf")
    url = http_server.url + "/metrics"
    detector = _vllm_detector(tmp_path, ScrapeSource([url]))
    try:
        fired = []
        for t in range(0, 61, 5):
            clock[0] = float(t)
            fired += [(tr.alertname, tr.value) for tr in detector.tick(float(t))]
        assert fired == [("VLLMTierNoData", 1.0)]
        assert detector.status.up  # the answer was taken: only its queue is no value
        (alert,) = TestClient(create_app(detector)).get("/alerts").json()["alerts"]
        assert alert["value"] == 1.0
        assert f"missing {mn.VLLM_NUM_WAITING}" in alert["description"]
    finally:
        detector.stop()
