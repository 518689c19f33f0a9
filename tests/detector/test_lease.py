"""The writer lease: two detectors on one database (SQLite file, real PostgreSQL) as real
processes; one writes and notifies, the other takes over when it dies, and nothing is told twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from detector.evaluator import Transition
from detector.lease import AdvisoryLease, FileLease, LeaseState
from detector.notify import WebhookNotifier
from detector.service import Detector
from detector.signals import EngineLabels
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore, make_engine
from exporter.processes import free_port
from exporter.timeseries import write_series
from tests.detector.conftest import TestServer, exposition, wait_until
from tests.detector.factories import snapshot
from tests.detector.minisim import MiniSim

NODATA = "VLLMRetrywatchNoData"
LOOP = "VLLMMetastableRetryLoop"
T0 = 1_800_000_000.0  # the replayed run is shifted to Unix time


def _writer(base: str) -> float | None:
    """The detector's ``retrywatch_detector_writer`` gauge (None while it does not answer)."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("retrywatch_detector_writer "):
            return float(line.split()[1])
    return None


def _firing(base: str) -> set[str]:
    return {a["alertname"] for a in httpx.get(f"{base}/alerts", timeout=2).json()["alerts"]}


def _posts(hook: TestServer, status: str) -> list[object]:
    return [p for p in hook.posts if p["alert"]["alertname"] == NODATA and p["status"] == status]  # type: ignore[index]


def _two_detectors(tmp_path: Path, db: str, hook: TestServer, source: TestServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETRYWATCH_")} | {"RETRYWATCH_DB": db}
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "retrywatch",
                "detect",
                "--exporter",
                source.url + "/metrics",
                "--webhook",
                hook.url,
                "--time-scale",
                "5",
                "--port",
                str(port),
                "--log-level",
                "info",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"detector{i}.log").open("wb"),
        )
        for i, port in enumerate(ports)
    ]
    bases = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        wait_until(lambda: None not in [_writer(b) for b in bases], 60, "both detectors")
        assert sorted(_writer(b) for b in bases) == [0.0, 1.0]  # type: ignore[type-var]
        writer = next(i for i, b in enumerate(bases) if _writer(b) == 1.0)
        standby = 1 - writer
        # Ĉ is unknown: NoData fires (3 s at time scale 5), in both detectors' evaluations.
        wait_until(lambda: bool(_posts(hook, "firing")), 30, "the firing notification")
        wait_until(lambda: NODATA in _firing(bases[standby]), 30, "the standby to evaluate the alert too")
        time.sleep(3)  # several more evaluations of both
        assert len(_posts(hook, "firing")) == 1
        episodes = httpx.get(f"{bases[standby]}/episodes", params={"alertname": NODATA}).json()["episodes"]
        assert len(episodes) == 1 and episodes[0]["resolved_at"] is None

        os.kill(procs[writer].pid, signal.SIGKILL)  # the writer dies; the standby takes over
        procs[writer].wait(10)
        wait_until(lambda: _writer(bases[standby]) == 1.0, 30, "the standby to take the lease")
        source.body = exposition(snapshot(0.0, first=1.0, capacity=2.0).samples)  # Ĉ known: it resolves
        wait_until(lambda: bool(_posts(hook, "resolved")), 30, "the resolution, from the new writer")
        time.sleep(3)
        assert len(_posts(hook, "firing")) == 1 and len(_posts(hook, "resolved")) == 1
        (episode,) = httpx.get(f"{bases[standby]}/episodes", params={"alertname": NODATA}).json()["episodes"]
        assert episode["resolved_at"] is not None
        log = (tmp_path / f"detector{standby}.log").read_text()
        assert "another detector holds the writer lease" in log and "this detector writes the episodes" in log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)


@pytest.mark.slow
def test_two_detectors_on_one_sqlite_file_notify_once_and_the_survivor_takes_over(
    tmp_path: Path, http_server: TestServer
) -> None:
    source = TestServer()
    source.body = exposition(snapshot(0.0, first=1.0, capacity=None).samples)
    try:
        _two_detectors(tmp_path, f"sqlite:///{tmp_path / 'detector.db'}", http_server, source)
    finally:
        source.close()
    assert (tmp_path / "detector.db-writer").exists()


@pytest.mark.slow
@pytest.mark.postgres
def test_two_detectors_on_one_postgresql_notify_once_and_the_survivor_takes_over(
    tmp_path: Path, http_server: TestServer, postgres_url: str
) -> None:
    source = TestServer()
    source.body = exposition(snapshot(0.0, first=1.0, capacity=None).samples)
    try:
        _two_detectors(tmp_path, postgres_url, http_server, source)
    finally:
        source.close()


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def test_a_lock_file_another_process_holds_is_taken_and_comes_free_when_it_dies(tmp_path: Path) -> None:
    path = tmp_path / "detector.db-writer"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        lease = FileLease(path)
        assert lease.hold() is LeaseState.TAKEN
    finally:
        holder.kill()
        holder.wait(10)
    assert lease.hold() is LeaseState.ACQUIRED
    assert lease.hold() is LeaseState.HELD
    lease.release()


@pytest.mark.postgres
def test_an_advisory_lease_is_taken_held_lost_with_its_session_and_unreachable_when_the_server_is(
    postgres_url: str,
) -> None:
    store = EpisodeStore(postgres_url)  # the schema; the leases use engines of their own
    first, second = AdvisoryLease(make_engine(postgres_url)), AdvisoryLease(make_engine(postgres_url))
    assert first.hold() is LeaseState.ACQUIRED and first.hold() is LeaseState.HELD
    assert second.hold() is LeaseState.TAKEN
    first.release()
    assert second.hold() is LeaseState.ACQUIRED
    assert first.hold() is LeaseState.TAKEN
    second.release()
    store.close()
    nobody = AdvisoryLease(make_engine("postgresql+psycopg://u@127.0.0.1:1/none?connect_timeout=2"))
    assert nobody.hold() is LeaseState.UNREACHABLE


class _Scripted:
    """A lease whose states the test sets: the detector's side of the lease, without a second
    process."""

    description = "a scripted lease"

    def __init__(self) -> None:
        self.state = LeaseState.TAKEN

    def hold(self) -> LeaseState:
        state = self.state
        if state is LeaseState.ACQUIRED:
            self.state = LeaseState.HELD
        return state

    def release(self) -> None:
        return None


def test_a_standby_that_takes_over_writes_what_fired_meanwhile_and_rearms_what_is_open(
    tmp_path: Path, http_server: TestServer
) -> None:
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    other = EngineLabels("0", "m", "proxy-b")  # an episode the detector that died left open
    store.record(
        Transition(
            kind="firing",
            alertname=NODATA,
            severity="warning",
            labels=other,
            at=T0,
            started_at=T0,
            value=1.0,
            summary="s",
            description="d",
        ),
        ["webhook0"],
    )
    store.mark_sent(1, "webhook0", "firing")
    lease = _Scripted()
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    det = Detector(source, store, notifiers=[WebhookNotifier(http_server.url, name="webhook0")], lease=lease)
    det.dispatcher.start()
    times = sorted({s.t for s in source.snapshots})
    fired_at = None
    for t in times:  # a standby: it evaluates, writes nothing, tells nobody
        det.tick(t)
        if any(a["alertname"] == LOOP for a in det.firing_alerts()):
            fired_at = t
            break
    assert fired_at is not None and not det.writer
    assert store.episodes(alertname=LOOP) == [] and det.dispatcher.wait_idle(10) and http_server.posts == []
    lease.state = LeaseState.ACQUIRED  # the writer died
    later = next(t for t in times if t > fired_at)
    det.tick(later)
    assert det.writer and det.dispatcher.wait_idle(10)
    (loop,) = store.episodes(alertname=LOOP)
    assert loop.started_at == fired_at and loop.resolved_at is None
    told = [(p["status"], p["alert"]["alertname"]) for p in http_server.posts]  # type: ignore[index]
    assert ("firing", LOOP) in told and all(status == "firing" for status, _ in told)
    assert len(told) == len(set(told)) == len(store.firing()) - 1  # once each; all but proxy-b's
    # The open episode of an engine this detector never saw is re-armed: it resolves through the
    # usual hysteresis (NoData keeps firing for 0 s), once, and is notified once.
    assert (NODATA, "proxy-b") in {(a.alertname, a.labels.instance) for a in det.evaluator.firing()}
    det.tick(next(t for t in times if t > later))
    assert det.dispatcher.wait_idle(10)
    (nodata,) = store.episodes(alertname=NODATA)
    assert nodata.resolved_at is not None
    assert [p["status"] for p in http_server.posts if p["alert"]["alertname"] == NODATA] == ["resolved"]  # type: ignore[index]
    det.dispatcher.close()
    store.close()
