"""A fleet: several proxies scraped together, every vLLM with the engine label "0". Engines are
keyed by ``instance`` (the scraped URL), so their signals, alerts and episodes stay apart."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from detector.api import create_app
from detector.service import Detector
from detector.sources.scrape import ScrapeSource
from detector.store import EpisodeStore
from foundation.processes import free_port
from tests.detector.conftest import TestServer, exposition, wait_until
from tests.detector.factories import snapshot

T0 = 1_800_000_000.0
STEP = 5.0


@pytest.fixture
def two_servers() -> Iterator[tuple[TestServer, TestServer]]:
    a, b = TestServer(), TestServer()
    yield a, b
    a.close()
    b.close()


def _serve_api(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the detector API")
    return server, thread, f"http://127.0.0.1:{port}"


def _dashboard_sees_two_engines(api_url: str, sick: str, well: str, now: float) -> None:
    """The dashboard's live page, on the real detector API: one engine per instance."""
    from dashboard.context import Context, DashboardConfig
    from dashboard.pages import live

    ctx = Context(DashboardConfig(detector_url=api_url))
    try:
        assert ctx.signals.signal_index().engines == sorted([sick, well])
        view_sick = live.live_view(ctx, sick, 900, now=now)
        view_well = live.live_view(ctx, well, 900, now=now)
        assert view_sick.error is None and view_well.error is None
        # each engine's own rate: not the two added together
        assert view_sick.signals["execution_creation_rate"][-1, 1] == pytest.approx(6.0)
        assert view_well.signals["execution_creation_rate"][-1, 1] == pytest.approx(1.0)
        assert "VLLMMetastableRetryLoop" in {a.alertname for a in view_sick.engine_alerts}
        assert view_well.engine_alerts == [] and view_well.episodes == []
        chips = str(live.render_engine_states(view_sick, [sick, well]))
        # named host:port (and model), not by the scraped /metrics URL
        sick_name = next(a.engine_name for a in view_sick.engine_alerts)
        assert sick_name.startswith(sick.removeprefix("http://").removesuffix("/metrics"))
        assert f"{sick_name}: VLLMMetastableRetryLoop (critical)" in chips
        assert f"{well.removeprefix('http://').removesuffix('/metrics')}: ok" in chips
    finally:
        ctx.detector.close()


def _serve(server: TestServer, elapsed: float, *, collapsed: bool) -> None:
    """Counters after ``elapsed`` s: a collapsed engine (attempts at 3 Ĉ, nothing completes, a
    backlog of 3 deadlines) or a healthy one (0.5 Ĉ, every call delivered in time)."""
    if collapsed:
        snap = snapshot(0.0, first=2.0 * elapsed, retry=4.0 * elapsed, cancelled=6.0 * elapsed,
                        waiting=60.0, capacity=2.0, deadline=10.0)  # fmt: skip
    else:
        snap = snapshot(0.0, first=1.0 * elapsed, completed=1.0 * elapsed, within=1.0 * elapsed,
                        running=1.0, capacity=2.0, deadline=10.0)  # fmt: skip
    server.body = exposition(snap.samples)


def test_two_proxies_with_engine_label_0_are_two_engines(
    tmp_path: Path, two_servers: tuple[TestServer, TestServer]
) -> None:
    sick, well = two_servers
    url_sick, url_well = f"{sick.url}/metrics", f"{well.url}/metrics"
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(ScrapeSource([url_sick, url_well]), store)
    for i in range(13):  # one minute of scrapes
        _serve(sick, STEP * i, collapsed=True)
        _serve(well, STEP * i, collapsed=False)
        det.tick(T0 + STEP * i)
    client = TestClient(create_app(det))

    listing = client.get("/signals").json()
    assert listing["engines"] == sorted([url_sick, url_well])

    def latest(name: str, engine: str) -> tuple[dict[str, str], float]:
        doc = client.get("/signals", params={"name": name, "engine": engine}).json()
        (series,) = doc["series"]  # one engine's series, not every engine labelled "0"
        return series["labels"], series["points"][-1][1]

    labels, rate = latest("execution_creation_rate", url_sick)
    assert labels == {"engine": "0", "model": "m", "instance": url_sick}
    assert rate == pytest.approx(6.0)
    labels, rate = latest("execution_creation_rate", url_well)
    assert labels == {"engine": "0", "model": "m", "instance": url_well}
    assert rate == pytest.approx(1.0)
    assert latest("vllm_waiting", url_sick)[1] == 60.0 and latest("vllm_waiting", url_well)[1] == 0.0
    every = client.get("/signals", params={"name": "vllm_waiting"}).json()["series"]
    assert sorted((s["labels"]["instance"], s["points"][-1][1]) for s in every) == sorted(
        [(url_sick, 60.0), (url_well, 0.0)]
    )
    # vLLM's engine label selects nothing: it does not tell engines apart
    assert client.get("/signals", params={"name": "vllm_waiting", "engine": "0"}).json()["series"] == []

    alerts = client.get("/alerts").json()["alerts"]
    assert {a["alertname"] for a in alerts} >= {"VLLMMetastableRetryLoop", "VLLMBacklogBeyondDeadline"}
    assert {a["labels"]["instance"] for a in alerts} == {url_sick}
    assert all(a["labels"]["engine"] == "0" for a in alerts)

    sick_eps = client.get("/episodes", params={"engine": url_sick}).json()["episodes"]
    assert {e["alertname"] for e in sick_eps} == {a["alertname"] for a in alerts}
    assert client.get("/episodes", params={"engine": url_well}).json()["episodes"] == []

    api, thread, api_url = _serve_api(create_app(det))
    try:
        _dashboard_sees_two_engines(api_url, url_sick, url_well, T0 + STEP * 12)
    finally:
        api.should_exit = True
        thread.join(10)

    # the healthy proxy collapses too: its own alert fires, the first one's stays as it was
    fired_sick = {a["alertname"]: a["started_at"] for a in alerts}
    for i in range(13, 20):
        _serve(sick, STEP * i, collapsed=True)
        _serve(well, STEP * (i - 13), collapsed=True)  # its counters restart (a proxy restart)
        det.tick(T0 + STEP * i)
    alerts = client.get("/alerts").json()["alerts"]
    loops = {a["labels"]["instance"]: a for a in alerts if a["alertname"] == "VLLMMetastableRetryLoop"}
    assert set(loops) == {url_sick, url_well}
    assert loops[url_sick]["started_at"] == fired_sick["VLLMMetastableRetryLoop"]
    assert loops[url_well]["started_at"] > loops[url_sick]["started_at"]
    well_eps = client.get("/episodes", params={"engine": url_well}).json()["episodes"]
    assert "VLLMMetastableRetryLoop" in {e["alertname"] for e in well_eps}
    store.close()
