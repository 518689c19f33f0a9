"""The detector API client against a real HTTP server in the API's shapes, and its errors."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import pytest

from dashboard.data import (
    DetectorClient,
    DetectorUnavailable,
    ShapeError,
    signals_for_engine,
)
from dashboard.staticapi import StaticDetectorAPI

from .conftest import NOW


def test_client_reads_every_endpoint(api: StaticDetectorAPI) -> None:
    client = DetectorClient(api.url)
    try:
        alerts = client.alerts()
        assert [(a.alertname, a.severity, a.engine) for a in alerts] == [
            ("VLLMMetastableRetryLoop", "critical", "engine-0")
        ]
        index = client.signal_index()
        assert index.engines == ["engine-0", "engine-1"]
        assert "execution_creation_rate" in index.names
        series = client.signal("execution_creation_rate", since=NOW - 600, engine="engine-0")
        assert len(series) == 1 and series[0].labels["engine"] == "engine-0"
        assert series[0].points.shape == (121, 2)
        assert series[0].points[0, 0] >= NOW - 600
        open_eps = [e for e in client.episodes(since=NOW - 3600) if e.resolved_at is None]
        assert [e.alertname for e in open_eps] == ["VLLMMetastableRetryLoop"]
        assert [e.alertname for e in client.episodes(engine="engine-1")] == ["VLLMOrphanedExecutions"]
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_detector_is_a_clear_error() -> None:
    client = DetectorClient(f"http://127.0.0.1:{_free_port()}", timeout_s=1.0)
    with pytest.raises(DetectorUnavailable, match="did not answer /alerts"):
        client.alerts()


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
