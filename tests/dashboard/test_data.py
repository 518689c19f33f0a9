"""The detector API client against a real HTTP server in the API's shapes, and its errors."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dashboard.data import (
    DetectorClient,
    DetectorUnavailable,
    ShapeError,
    SignalSeries,
    engine_name,
    engine_of,
    signals_for_engine,
)
from exporter.processes import free_port
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
