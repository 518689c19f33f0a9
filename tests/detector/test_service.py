"""The running detector and its API: a replayed collapse through ticks, episodes in SQL,
notifications once across a restart, and the JSON shapes of docs/architecture.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from detector.api import create_app
from detector.evaluator import Transition
from detector.notify import WebhookNotifier
from detector.service import Detector, SignalHistory
from detector.signals import EngineLabels, SignalFrame
from detector.sources import FetchResult
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from foundation.timeseries import Snapshot, write_series
from tests.detector.conftest import TestServer, wait_until
from tests.detector.factories import snapshot
from tests.detector.minisim import MiniSim

T0 = 1_800_000_000.0  # the replayed run is shifted to Unix time


def _series(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.jsonl"
    write_series(path, MiniSim(seed=3, cancellation=False).run())
    return path


def test_detector_ticks_records_serves_and_notifies_once_across_a_restart(
    tmp_path: Path, http_server: TestServer
) -> None:
    series = _series(tmp_path)
    db = f"sqlite:///{tmp_path / 'd.db'}"
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    times = [s.t for s in source.snapshots]
    store = EpisodeStore(db)
    det = Detector(source, store, notifiers=[WebhookNotifier(http_server.url, name="webhook0")])
    det.dispatcher.start()
    fired_at = None
    for t in times:
        det.tick(t)
        if fired_at is None and any(a["alertname"] == "VLLMMetastableRetryLoop" for a in det.firing_alerts()):
            fired_at = t
            break
    assert fired_at is not None
    assert det.dispatcher.wait_idle(10)
    loop_posts = [p for p in http_server.posts if p["alert"]["alertname"] == "VLLMMetastableRetryLoop"]  # type: ignore[index]
    assert [p["status"] for p in loop_posts] == ["firing"]  # type: ignore[index]

    # the API while it fires
    client = TestClient(create_app(det))
    alerts = client.get("/alerts").json()["alerts"]
    loop = next(a for a in alerts if a["alertname"] == "VLLMMetastableRetryLoop")
    assert set(loop) == {
        "alertname",
        "severity",
        "labels",
        "state",
        "resolving_since",
        "resolves_at",
        "started_at",
        "value",
        "summary",
        "description",
        "runbook_url",
    }
    assert loop["runbook_url"] == "http://127.0.0.1:8200/runbook#VLLMMetastableRetryLoop"
    assert loop["labels"] == {"engine": "0", "model": "mini-model", "instance": "proxy-a"}
    assert loop["state"] == "firing" and loop["started_at"] == fired_at
    assert loop["resolving_since"] is None and loop["resolves_at"] is None
    eps = client.get("/episodes", params={"since": T0}).json()["episodes"]
    assert {e["alertname"] for e in eps} >= {"VLLMMetastableRetryLoop", "VLLMBacklogBeyondDeadline"}
    assert all(e["resolved_at"] is None or e["resolved_at"] >= e["started_at"] for e in eps)
    assert all(e["runbook_url"].endswith(f"/runbook#{e['alertname']}") for e in eps)
    assert client.get("/episodes", params={"alertname": "Nope"}).json() == {"episodes": []}
    listing = client.get("/signals").json()
    assert "creation_capacity_ratio" in listing["signals"] and listing["engines"] == ["proxy-a"]
    sig = client.get("/signals", params={"name": "creation_capacity_ratio", "since": fired_at - 30}).json()
    assert sig["name"] == "creation_capacity_ratio" and sig["unit"] == "ratio"
    (series_doc,) = sig["series"]
    assert [p[0] for p in series_doc["points"]] == [t for t in times if fired_at - 30 <= t <= fired_at]
    assert series_doc["points"][-1][1] >= 1.0
    assert client.get("/signals", params={"name": "bogus"}).status_code == 404
    # a time that is not a finite number is refused, not read as "every episode" or "none"
    for route, param in (("/episodes", "since"), ("/episodes", "until"), ("/signals", "since")):
        for bad in ("nan", "inf", "-inf", "1e400"):
            got = client.get(route, params={"name": "creation_capacity_ratio", param: bad})
            assert got.status_code == 422 and "finite" in got.text, (route, param, bad)
    assert client.get("/healthz").json() == {
        "status": "ok",
        "source": {"up": True, "last_scrape_at": fired_at},
    }
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'retrywatch_detector_alerts_firing{alertname="VLLMMetastableRetryLoop"} 1.0' in metrics.text

    # a crash (no clean stop) and a restart on the same database: no second "firing"
    det.lease.release()  # the crash: the kernel releases the dead process's lock
    store2 = EpisodeStore(db)
    source2 = ReplaySource(series, instance="proxy-a", offset=T0)
    source2.fetch(fired_at)  # the new process starts where the old one stopped
    det2 = Detector(source2, store2, notifiers=[WebhookNotifier(http_server.url, name="webhook0")])
    det2.signals = det.signals  # same raw history (a real restart re-reads its windows from the source)
    det2.dispatcher.start()
    det2.dispatcher.requeue_unsent()
    for t in times:
        if t > fired_at:
            det2.tick(t)
    assert det2.dispatcher.wait_idle(10)
    loop_posts = [p for p in http_server.posts if p["alert"]["alertname"] == "VLLMMetastableRetryLoop"]  # type: ignore[index]
    assert [p["status"] for p in loop_posts] == ["firing", "resolved"]  # type: ignore[index]
    loop_eps = store2.episodes(alertname="VLLMMetastableRetryLoop")
    assert len(loop_eps) == 1 and loop_eps[0].resolved_at is not None
    det.dispatcher.close()
    det2.dispatcher.close()
    store.close()
    store2.close()


def test_a_source_that_is_down_never_reports_healthy(tmp_path: Path) -> None:
    class Down:
        name = "exporter"

        def fetch(self, now: float):  # type: ignore[no-untyped-def]
            from detector.sources import FetchResult

            return FetchResult(down=["http://proxy/metrics"], error="connection refused")

        def close(self) -> None:
            return None

    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(Down(), store)
    for i in range(5):
        det.tick(T0 + 5 * i)
    alerts = det.firing_alerts()
    assert [a["alertname"] for a in alerts] == ["VLLMRetrywatchNoData"]
    assert "source" in str(alerts[0]["description"])
    client = TestClient(create_app(det))
    assert client.get("/healthz").json()["status"] == "degraded"
    store.close()


def test_signal_history_is_a_bounded_ring() -> None:
    hist = SignalHistory(points=10, max_engines=1)
    labels = EngineLabels("0", "m", "a")
    for i in range(25):
        hist.add_evaluation([SignalFrame(float(i), labels, {"capacity": float(i), "vllm_waiting": None})])
    # over the bound, and "a" is not older: "b" is not kept, and the evaluation says so
    assert hist.add_evaluation([SignalFrame(24.0, EngineLabels("1", "m", "b"), {"capacity": 1.0})]) == ["b"]
    ((key, pts),) = hist.series("capacity")
    assert key == labels and [p[0] for p in pts] == [float(i) for i in range(15, 25)]
    points = hist.series("vllm_waiting", since=20.0)[0][1]
    assert points[:, 0].tolist() == [float(i) for i in range(20, 25)] and np.isnan(points[:, 1]).all()
    # an engine whose newest point is older than a newcomer's has left: the newcomer takes its place
    hist.add_evaluation([SignalFrame(25.0, EngineLabels("1", "m", "b"), {"capacity": 1.0})])
    assert [e.instance for e in hist.engines()] == ["b"]


def test_signal_history_makes_room_only_from_engines_an_evaluation_does_not_name() -> None:
    hist = SignalHistory(points=10, max_engines=2)

    def evaluation(t: float, *instances: str) -> list[str]:
        hist.add_evaluation([SignalFrame(t, EngineLabels("0", "m", i), {"capacity": 1.0}) for i in instances])
        return sorted(e.instance for e in hist.engines())

    assert evaluation(0.0, "a", "b") == ["a", "b"]
    # a newcomer listed before the engines it would displace: they are live, it waits
    assert evaluation(5.0, "c", "a", "b") == ["a", "b"]
    assert evaluation(10.0, "a", "c") == ["a", "c"]  # "b" has left: "c" takes its place


class ScriptedFleet:
    """A source naming, at each fetch, the instances ``names(now)`` gives."""

    name = "prometheus"

    def __init__(self, names: Callable[[float], list[str]], omit: tuple[str, ...] = ()) -> None:
        self.names, self.omit = names, omit

    def fetch(self, now: float) -> FetchResult:
        samples = [
            s for i in self.names(now) for s in snapshot(now, first=now, instance=i, omit=self.omit).samples
        ]
        return FetchResult(snapshots=[Snapshot(t=now, samples=samples)])

    def close(self) -> None:
        return None


def test_a_replica_that_leaves_the_fleet_is_forgotten_and_its_alerts_resolve(tmp_path: Path) -> None:
    # a rollout replaces "a" with "c" at T0 + 600; "a" and "c" miss a series vLLM exports, so
    # the detector has no data for them (VLLMRetrywatchNoData) while they are there
    fleet = ScriptedFleet(lambda t: ["b", "a" if t < T0 + 600 else "c"])
    fleet_missing = ScriptedFleet(fleet.names, omit=("vllm:num_requests_waiting",))
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(fleet_missing, store)
    for i in range(0, 1500, 5):
        det.tick(T0 + i)
        nodata = {
            a["labels"]["instance"] for a in det.firing_alerts() if a["alertname"] == "VLLMRetrywatchNoData"
        }
        if 60 <= i < 600:
            assert nodata == {"b", "a"}
    assert nodata == {"b", "c"}  # "a" resolved once it was forgotten, and never fires again
    assert det.signals.instances == ["b", "c"]
    (a_episode,) = store.episodes(engine="a")
    assert a_episode.resolved_at is not None and a_episode.resolved_at < T0 + 1500
    store.close()


def test_a_fleet_larger_than_max_engines_is_followed_up_to_it_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = ScriptedFleet(lambda t: [f"10.0.{i // 200}.{i % 200}:8000" for i in range(12)])
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(fleet, store, max_engines=10)
    for i in range(0, 30, 5):
        det.tick(T0 + i)  # an evaluation of the ten followed, not an error for all twelve
    assert len(det.signals.instances) == 10 and len(det.signals.compute(T0 + 25)) == 10
    metrics = TestClient(create_app(det)).get("/metrics").text
    assert "retrywatch_detector_engines 10.0" in metrics
    assert "retrywatch_detector_engines_left_out 2.0" in metrics
    warnings = [r.getMessage() for r in caplog.records if "--max-engines" in r.getMessage()]
    assert warnings == [
        "following 10 engines, the most there may be: 2 more the source names are not watched"
        " (raise --max-engines)"
    ]
    store.close()


def test_the_api_keeps_the_signal_history_of_every_engine_the_detector_follows(tmp_path: Path) -> None:
    """A fleet of more engines than the history once kept (64): every engine evaluated has its
    history on ``/signals``, and none is left out (``retrywatch_detector_history_engines_left_out``)."""
    fleet = ScriptedFleet(lambda t: [f"10.0.0.{i}:8000" for i in range(70)])
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(fleet, store)
    for i in range(0, 15, 5):
        det.tick(T0 + i)
    client = TestClient(create_app(det))
    followed = sorted(det.signals.instances)
    assert len(followed) == 70 and client.get("/signals").json()["engines"] == followed
    series = client.get("/signals", params={"name": "capacity"}).json()["series"]
    assert sorted(s["labels"]["instance"] for s in series) == followed
    assert all(len(s["points"]) == 3 for s in series)
    last = client.get("/signals", params={"name": "capacity", "engine": followed[-1]}).json()["series"]
    assert [s["labels"]["instance"] for s in last] == [followed[-1]]
    assert "retrywatch_detector_history_engines_left_out 0.0" in client.get("/metrics").text
    store.close()


def test_signals_filters_without_a_signal_name_are_refused_not_ignored(tmp_path: Path) -> None:
    fleet = ScriptedFleet(lambda t: ["a:8000", "b:8000"])
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(fleet, store)
    det.tick(T0)
    client = TestClient(create_app(det))
    for params in ({"engine": "a:8000"}, {"since": T0}, {"engine": "a:8000", "since": T0}):
        response = client.get("/signals", params=params)
        assert response.status_code == 400, params
        assert "give name= too" in response.json()["detail"]
    assert client.get("/signals").json()["engines"] == ["a:8000", "b:8000"]
    one = client.get("/signals", params={"name": "capacity", "engine": "a:8000"}).json()["series"]
    assert [s["labels"]["instance"] for s in one] == ["a:8000"]
    store.close()


def test_scheduler_runs_evaluations_on_the_interval(tmp_path: Path, http_server: TestServer) -> None:
    from detector.sources.scrape import ScrapeSource
    from tests.detector.conftest import exposition, wait_until
    from tests.detector.factories import snapshot

    http_server.body = exposition(snapshot(0.0, first=1.0).samples)
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(ScrapeSource([http_server.url + "/metrics"]), store)
    det.start(interval_s=0.2)
    try:

        def evaluations() -> float:
            return det.metrics.registry.get_sample_value("retrywatch_detector_evaluations_total") or 0.0

        wait_until(lambda: evaluations() >= 4, 15, "four scheduled evaluations")
    finally:
        det.stop()
    assert det.status.up and det.status.last_scrape_at is not None
    assert det.signals.instances == [http_server.url + "/metrics"]
    store.close()


def test_the_wall_clock_going_back_does_not_stop_evaluation(tmp_path: Path) -> None:
    # An NTP step or a restored VM sets the wall clock back an hour: evaluation goes on at once,
    # the firing alert neither resolves nor fires again for it, and its hysteresis counts the
    # seconds that really pass (the monotonic clock's).
    backlog = {"waiting": 1000.0}

    class Proxy:
        name = "exporter"

        def fetch(self, now: float) -> FetchResult:
            return FetchResult(snapshots=[snapshot(now, first=3 * now, instance="p", **backlog)])

        def close(self) -> None:
            return None

    wall, mono = [T0], [100.0]
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(Proxy(), store, clock=lambda: wall[0], monotonic=lambda: mono[0])

    def ticks(n: int) -> list[tuple[str, str, float]]:
        out = []
        for _ in range(n):
            wall[0] += 5.0
            mono[0] += 5.0
            out += [(tr.alertname, tr.kind, mono[0]) for tr in det.tick()]
        return out

    assert [t[:2] for t in ticks(20)] == [("VLLMBacklogBeyondDeadline", "firing")]
    wall[0] -= 3600.0
    assert ticks(10) == []
    (frame,) = det.signals.compute(det.evaluator.last_eval or 0.0)
    assert frame.values["vllm_waiting"] == 1000.0 and not frame.missing
    backlog["waiting"] = 0.0  # the backlog clears: resolved after keep_firing_for (60 s) of steady time
    cleared_at = mono[0] + 5.0
    resolved = [t for t in ticks(20) if t[:2] == ("VLLMBacklogBeyondDeadline", "resolved")]
    assert resolved == [("VLLMBacklogBeyondDeadline", "resolved", cleared_at + 60.0)]
    store.close()


def test_a_slow_alertmanager_does_not_hold_the_evaluation(http_server: TestServer, tmp_path: Path) -> None:
    # The detector re-posts the alerts still firing to Alertmanager every refresh interval. It did
    # so inside the evaluation: an Alertmanager slow to answer held every engine's evaluation for
    # as long, once a refresh interval. Its worker posts it now.
    import time

    from detector.notify import AlertmanagerNotifier

    class Proxy:
        name = "exporter"

        def fetch(self, now: float) -> FetchResult:
            return FetchResult(snapshots=[snapshot(now, first=3 * now, instance="p", waiting=1000.0)])

        def close(self) -> None:
            return None

    http_server.delay_s = 2.0
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    am = AlertmanagerNotifier(http_server.url, timeout_s=10.0)
    det = Detector(Proxy(), store, notifiers=[am], alertmanager_refresh_s=30.0)
    det.dispatcher.start()
    try:
        took = []
        for i in range(40):  # fires at the 20th, then refreshes every 30 s
            started = time.monotonic()
            det.tick(T0 + 5.0 * i)
            took.append(time.monotonic() - started)
        assert store.firing()
        assert max(took) < 1.0, f"an evaluation took {max(took):.1f} s"
        # the refreshes were posted all the same: the firing alert, then its re-posts
        wait_until(lambda: len(http_server.posts) >= 2, 20.0, "a refresh to reach Alertmanager")
        assert all(p[0]["labels"]["alertname"] == "VLLMBacklogBeyondDeadline" for p in http_server.posts)  # type: ignore[index]
    finally:
        det.dispatcher.close(timeout_s=0.1)
        store.close()


def test_the_writer_deletes_episodes_resolved_past_the_retention_at_start_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    class Quiet:
        name = "exporter"

        def fetch(self, now: float) -> FetchResult:
            return FetchResult()

        def close(self) -> None:
            return None

    day = 86_400.0
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    labels = EngineLabels("0", "m", "proxy-a")
    for name, fired, resolved in (
        ("VLLMMetastableRetryLoop", -100 * day, -95 * day),  # past 30 days: deleted
        ("VLLMBacklogBeyondDeadline", -40 * day, -day),  # resolved yesterday: kept
        ("VLLMRetrywatchNoData", -200 * day, None),  # still open: kept, however old
    ):
        tr = Transition(kind="firing", alertname=name, severity="warning", labels=labels, at=T0 + fired,
                        started_at=T0 + fired, value=1.0, summary="s", description="d")  # fmt: skip
        store.record(tr, ["webhook0"])
        if resolved is not None:
            store.record(replace(tr, kind="resolved", at=T0 + resolved), ["webhook0"])
    det = Detector(Quiet(), store, clock=lambda: T0, retention_days=30)
    assert det.prune() == 0  # not the writer until its lease is taken
    det.start(interval_s=60)  # takes the lease at its first evaluation, then deletes
    det.stop()
    assert {e.alertname for e in store.episodes()} == {"VLLMBacklogBeyondDeadline", "VLLMRetrywatchNoData"}
    assert det.metrics.registry.get_sample_value("retrywatch_detector_episodes_pruned_total") == 1
    assert {(e.alertname, kind) for e, _, kind in store.unsent()} == {
        ("VLLMBacklogBeyondDeadline", "firing"), ("VLLMBacklogBeyondDeadline", "resolved"),
        ("VLLMRetrywatchNoData", "firing")}  # fmt: skip
    keep_all = Detector(Quiet(), store, clock=lambda: T0 + 1000 * day, retention_days=0)
    keep_all.tick()
    assert keep_all.prune() == 0 and len(store.episodes()) == 2
    store.close()


def test_alerts_say_when_they_were_evaluated_which_goes_on_while_the_source_is_down(tmp_path: Path) -> None:
    """``/alerts`` carries the time of the evaluation it is as of: past the last scrape while the
    source is down, so a page can draw an alert that fires now up to now, not to the last scrape."""
    series = _series(tmp_path)
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(source, store)
    client = TestClient(create_app(det))
    assert client.get("/alerts").json() == {"alerts": [], "evaluated_at": None}  # none yet
    first = source.snapshots[0].t
    det.tick(first)
    assert client.get("/alerts").json()["evaluated_at"] == first
    det.source = type("Down", (), {"name": "exporter", "fetch": lambda self, now: FetchResult(
        down=["proxy-a"], error="connection refused"), "close": lambda self: None})()  # fmt: skip
    det.tick(first + 600.0)
    answer = client.get("/alerts").json()
    assert answer["evaluated_at"] == first + 600.0
    assert client.get("/healthz").json()["source"]["last_scrape_at"] == first
    store.close()
