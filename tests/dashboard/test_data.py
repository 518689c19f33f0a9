"""The detector API client against a real HTTP server in the API's shapes, and its errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from dashboard import data
from dashboard.data import (
    DetectorClient,
    DetectorUnavailable,
    ShapeError,
    SignalSeries,
    engine_name,
    engine_of,
    signals_for_engine,
)
from foundation.processes import free_port
from tests.dashboard.staticapi import StaticDetectorAPI

from .conftest import ENGINE_A, ENGINE_B, NOW


def test_client_reads_every_endpoint(api: StaticDetectorAPI) -> None:
    client = DetectorClient(api.url)
    try:
        alerts = client.alerts()
        assert [(a.alertname, a.severity, a.engine, a.engine_name) for a in alerts] == [
            ("VLLMMetastableRetryLoop", "critical", ENGINE_A, "10.0.0.1:8100 (qwen)"),
            ("VLLMPromptTokensUncounted", "warning", ENGINE_B, "10.0.0.2:8100 (llama)"),
        ]
        index = client.signal_index()
        assert index.engines == [ENGINE_A, ENGINE_B]
        assert "execution_creation_rate" in index.names
        series = client.signal("execution_creation_rate", since=NOW - 600, engine=ENGINE_A)
        assert len(series) == 1 and series[0].labels == {"engine": "0", "model": "qwen", "instance": ENGINE_A}
        assert series[0].points.shape == (121, 2)
        assert series[0].points[0, 0] >= NOW - 600
        open_eps = [e for e in client.episodes(since=NOW - 3600) if e.resolved_at is None]
        assert [(e.alertname, e.engine) for e in open_eps] == [
            ("VLLMMetastableRetryLoop", ENGINE_A),
            ("VLLMPromptTokensUncounted", ENGINE_B),
        ]
        assert [e.alertname for e in client.episodes(engine=ENGINE_B)] == [
            "VLLMOrphanedExecutions",
            "VLLMPromptTokensUncounted",
        ]
        health = client.health()
        assert health.status == "ok" and health.source_up and health.last_scrape_at == NOW
    finally:
        client.close()


def test_signals_for_engine_sums_rates_and_averages_levels() -> None:
    server = StaticDetectorAPI().start()
    try:
        pts = [[NOW, 2.0], [NOW + 5, 4.0]]
        server.set_signals("e", {"execution_creation_rate": pts, "capacity": pts})
        client = DetectorClient(server.url)

        class TwoProxies:
            """Two series for one engine, as two proxies in front of one engine give."""

            def signal_index(self):  # type: ignore[no-untyped-def]
                return client.signal_index()

            def signal(self, name, *, since=None, engine=None):  # type: ignore[no-untyped-def]
                return client.signal(name, since=since, engine=engine) * 2

        out = signals_for_engine(
            TwoProxies(), ["execution_creation_rate", "capacity"], engine="e", since=None
        )
        assert out["execution_creation_rate"][:, 1].tolist() == [4.0, 8.0]
        assert out["capacity"][:, 1].tolist() == [2.0, 4.0]
        client.close()
    finally:
        server.stop()


def test_engines_are_keyed_by_instance_not_vllms_engine_label() -> None:
    assert engine_of({"engine": "0", "model": "qwen", "instance": ENGINE_A}) == ENGINE_A
    assert engine_of({"engine": "0"}) == "0"  # no instance: the engine label stands in
    assert engine_name({"engine": "0", "model": "qwen", "instance": ENGINE_A}) == "10.0.0.1:8100 (qwen)"
    assert engine_name({"engine": "0", "instance": ENGINE_B}) == "10.0.0.2:8100"
    # a Prometheus target or a replayed run's slug is already readable; a URL's credentials never shown
    assert engine_name({"instance": "vllm-0:8100", "model": "m"}) == "vllm-0:8100 (m)"
    assert engine_name({"instance": "https://u:secret@10.0.0.3:8100/metrics"}) == "10.0.0.3:8100"
    assert engine_name({}) == ""


def test_signals_for_engine_keeps_only_the_selected_instance(api: StaticDetectorAPI) -> None:
    """A source that answers every engine's series (engine label "0" on all of them): the
    selected engine's signals are its own, never summed with the fleet's."""
    client = DetectorClient(api.url)

    class WholeFleet:
        def signal_index(self):  # type: ignore[no-untyped-def]
            return client.signal_index()

        def signal(self, name, *, since=None, engine=None) -> list[SignalSeries]:  # type: ignore[no-untyped-def]
            return client.signal(name, since=since)  # ignores ``engine``

    try:
        both = client.signal("execution_creation_rate", since=NOW - 600)
        assert [s.labels["engine"] for s in both] == ["0", "0"]
        own = {s.labels["instance"]: s.points for s in both}
        for key in (ENGINE_A, ENGINE_B):
            got = signals_for_engine(WholeFleet(), ["execution_creation_rate"], engine=key, since=NOW - 600)
            np.testing.assert_array_equal(got["execution_creation_rate"], own[key])
        assert signals_for_engine(WholeFleet(), ["execution_creation_rate"], engine="0", since=None) == {}
    finally:
        client.close()


def test_unreachable_detector_is_a_clear_error_without_its_credentials() -> None:
    client = DetectorClient(f"http://ops:s3cretpw@127.0.0.1:{free_port()}", timeout_s=1.0)
    with pytest.raises(DetectorUnavailable, match="did not answer /alerts") as err:
        client.alerts()
    assert "ops:***@127.0.0.1" in str(err.value) and "s3cretpw" not in str(err.value)
    with pytest.raises(ValueError, match="http") as bad:
        DetectorClient("ops:s3cretpw@detector:8200")
    assert "s3cretpw" not in str(bad.value)


def test_wrong_shapes_name_the_field() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/alerts":
            return httpx.Response(200, json={"alerts": [{"severity": "critical"}]})
        if request.url.path == "/signals":
            return httpx.Response(200, json={"name": "x", "series": [{"labels": {}, "points": [[1, "a"]]}]})
        return httpx.Response(200, text="not json")

    client = DetectorClient("http://detector", transport=httpx.MockTransport(handler))
    with pytest.raises(ShapeError, match="missing field 'alertname'"):
        client.alerts()
    with pytest.raises(ShapeError, match=r"\[t, v\]"):
        client.signal("x")
    with pytest.raises(ShapeError, match="not JSON"):
        client.health()


def test_null_values_become_nan() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, json={"name": "x", "unit": "1/s", "series": [{"labels": {}, "points": [[1, None]]}]}
        )

    client = DetectorClient("http://detector", transport=httpx.MockTransport(handler))
    assert np.isnan(client.signal("x")[0].points[0, 1])


def test_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="http://"):
        DetectorClient("localhost:8200")


def test_static_api_advances_like_a_new_scrape(api: StaticDetectorAPI) -> None:
    client = DetectorClient(api.url)
    before = client.health().last_scrape_at
    api.advance(5.0)
    assert client.health().last_scrape_at == before + 5.0
    assert client.alerts()[0].started_at == NOW - 1100.0 + 5.0
    client.close()


def test_a_detector_that_trickles_its_answer_is_cut_off_at_the_timeout() -> None:
    """httpx's timeout bounds each read: one byte every 0.2 s would hold a worker for a minute."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            body = b'{"alerts": []}' + b" " * 300
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for byte in body:
                if stop.wait(0.2):
                    return
                conn.sendall(bytes([byte]))

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    client = DetectorClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(DetectorUnavailable, match="not complete after 1 s"):
            client.alerts()
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        client.close()
        thread.join(timeout=5)
        listener.close()


def test_an_answer_over_the_bound_is_refused_without_reading_it_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "MAX_ANSWER_BYTES", 1000)
    sent: list[int] = []

    class Endless(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            while len(sent) < 10_000:  # 10 MB if read to the end
                sent.append(1)
                yield b" " * 1000

    client = DetectorClient(
        "http://d", transport=httpx.MockTransport(lambda r: httpx.Response(200, stream=Endless()))
    )
    with pytest.raises(ShapeError, match="exceeds 1000 bytes"):
        client.alerts()
    assert len(sent) <= 2


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/healthz", '{"status": "ok", "source": "up"}', "source must be an object"),
        ("/healthz", '{"status": "ok", "source": {"up": true, "last_scrape_at": NaN}}', "not a Unix time"),
        ("/alerts", '{"alerts": 5}', "'alerts' must be a list"),
        ("/alerts", '{"alerts": [{"alertname": "A", "started_at": 1e300}]}', "not a Unix time"),
        ("/alerts", '{"alerts": [{"alertname": "A", "started_at": Infinity}]}', "not a Unix time"),
        ("/episodes", '{"episodes": [{"alertname": "A", "started_at": NaN}]}', "not a Unix time"),
        ("/signals", '{"signals": 5, "engines": []}', "'signals' must be a list"),
        ("/signals?name=x", '{"series": [{"labels": {}, "points": [[1e300, 1]]}]}', "not a Unix time"),
    ],
)
def test_answers_the_pages_cannot_show_are_shape_errors(path: str, body: str, match: str) -> None:
    """Each used to raise AttributeError, TypeError, ValueError or OverflowError in a page: a 500."""
    client = DetectorClient(
        "http://d", transport=httpx.MockTransport(lambda r: httpx.Response(200, text=body))
    )
    call = {
        "/healthz": client.health,
        "/alerts": client.alerts,
        "/episodes": client.episodes,
        "/signals": client.signal_index,
        "/signals?name=x": lambda: client.signal("x"),
    }[path]
    with pytest.raises(ShapeError, match=match):
        call()


def test_series_of_one_engine_over_different_spans_are_combined_on_their_union() -> None:
    """An engine's series before and after its model changed (Prometheus: a new label set) are
    both shown; neither is stretched over the other's times."""

    class ModelChanged:
        def signal_index(self):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def signal(self, name, *, since=None, engine=None):  # type: ignore[no-untyped-def]
            before = np.array([[NOW, 1.0], [NOW + 5, 1.0], [NOW + 10, 1.0]])
            after = np.array([[NOW + 15, 3.0], [NOW + 20, np.nan], [NOW + 25, 3.0]])
            return [
                SignalSeries({"instance": "e", "model": "a"}, before),
                SignalSeries({"instance": "e", "model": "b"}, after),
            ]

    out = signals_for_engine(ModelChanged(), ["execution_creation_rate", "capacity"], engine="e", since=None)
    for name in ("execution_creation_rate", "capacity"):
        assert out[name][:, 0].tolist() == [NOW + dt for dt in (0, 5, 10, 15, 20, 25)]
        values = out[name][:, 1]
        assert values[[0, 1, 2, 3, 5]].tolist() == [1.0, 1.0, 1.0, 3.0, 3.0] and np.isnan(values[4])
