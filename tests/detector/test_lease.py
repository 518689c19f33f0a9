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
from foundation.processes import free_port
from foundation.timeseries import write_series
from tests.detector.conftest import ScriptedLease, TestServer, exposition, wait_until
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


def _nodata_firing(labels: EngineLabels) -> Transition:
    """NoData fired at ``T0`` for ``labels``' engine: an episode another detector left open."""
    return Transition(kind="firing", alertname=NODATA, severity="warning", labels=labels, at=T0,
                      started_at=T0, value=1.0, summary="s", description="d")  # fmt: skip


def test_a_standby_that_takes_over_writes_what_fired_meanwhile_and_rearms_what_is_open(
    tmp_path: Path, http_server: TestServer
) -> None:
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    other = EngineLabels("0", "m", "proxy-b")  # an episode the detector that died left open
    store.record(
        _nodata_firing(other),
        ["webhook0"],
    )
    store.mark_sent(1, "webhook0", "firing")
    lease = ScriptedLease()
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


_TRY = """
import sys
from pathlib import Path
from detector.lease import FileLease
print(FileLease(Path(sys.argv[1])).hold().value, flush=True)
"""


def test_a_lock_file_lease_is_its_own_in_a_process_and_survives_another_lease_released(
    tmp_path: Path,
) -> None:
    """Two leases on one file in one process exclude each other (as two processes do), and the
    second one released (its descriptor closed) leaves the first one's lock held: a process's
    POSIX lock would be released by any close of the file, and another process would take it."""
    path = tmp_path / "detector.db-writer"
    first, second = FileLease(path), FileLease(path)
    try:
        assert first.hold() is LeaseState.ACQUIRED
        assert second.hold() is LeaseState.TAKEN
        second.release()
        assert first.hold() is LeaseState.HELD
        other = subprocess.run(
            [sys.executable, "-c", _TRY, str(path)], capture_output=True, text=True, timeout=60
        )
        assert other.stdout.strip() == LeaseState.TAKEN.value, other.stderr
    finally:
        first.release()
        second.release()
    other = subprocess.run(
        [sys.executable, "-c", _TRY, str(path)], capture_output=True, text=True, timeout=60
    )
    assert other.stdout.strip() == LeaseState.ACQUIRED.value, other.stderr


@pytest.mark.postgres
def test_a_writer_whose_lease_session_is_lost_writes_nothing_until_it_takes_the_lease_again(
    tmp_path: Path, http_server: TestServer, postgres_url: str
) -> None:
    """The lease's session ends (the server killed it) and the detector cannot open another one
    while its pooled connections still work: another detector may hold the lock by now, so this
    one queues its transitions and neither writes nor notifies until it has the lease again."""
    import psycopg

    from detector.lease import LEASE_KEY

    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(postgres_url)
    lease = AdvisoryLease(make_engine(postgres_url))
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    det = Detector(source, store, notifiers=[WebhookNotifier(http_server.url, name="webhook0")], lease=lease)
    det.dispatcher.start()
    times = sorted({s.t for s in source.snapshots})
    det.tick(times[0])
    assert det.writer and lease._conn is not None
    pid = lease._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
    dsn = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn, autocommit=True) as other:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # the other detector takes the lease once the killed session has gone (which takes a moment)
        wait_until(
            lambda: other.execute("SELECT pg_try_advisory_lock(%s)", (LEASE_KEY,)).fetchone() == (True,),
            10,
            "the killed session to release the lock",
        )
        reachable, lease.engine = (
            lease.engine,
            make_engine("postgresql+psycopg://u@127.0.0.1:1/none?connect_timeout=2"),
        )
        fired_at = None
        for t in times[1:]:
            det.tick(t)
            if any(a["alertname"] == LOOP for a in det.firing_alerts()):
                fired_at = t
                break
        assert fired_at is not None
        assert det.dispatcher.wait_idle(10)
        assert store.episodes(alertname=LOOP) == [] and http_server.posts == []
        assert det.write_pending() > 0  # they wait, unwritten
        assert store.episodes(alertname=LOOP) == []
    lease.engine = reachable  # the other detector stopped: this one takes the lease again
    det.tick(next(t for t in times if t > fired_at))
    assert det.writer and det.dispatcher.wait_idle(10)
    (loop,) = store.episodes(alertname=LOOP)
    assert loop.started_at == fired_at
    told = [(p["status"], p["alert"]["alertname"]) for p in http_server.posts]  # type: ignore[index]
    assert told.count(("firing", LOOP)) == 1
    det.dispatcher.close()
    lease.release()
    store.close()


def test_an_episode_opened_between_start_up_and_the_first_hold_is_rearmed(tmp_path: Path) -> None:
    """A detector restores its alerts from the store when it is made, and takes the lease a
    moment later: an episode the writer before it opened in between (and left open as it
    stopped) is re-armed too, so it resolves instead of staying open for good."""
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    lease = ScriptedLease()
    lease.state = LeaseState.ACQUIRED
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    det = Detector(source, store, lease=lease)
    other = EngineLabels("0", "m", "proxy-b")
    store.record(_nodata_firing(other))
    times = sorted({s.t for s in source.snapshots})
    det.tick(times[0])
    assert det.writer
    assert (NODATA, "proxy-b") in {(a.alertname, a.labels.instance) for a in det.evaluator.firing()}
    det.tick(times[1])
    (nodata,) = [ep for ep in store.episodes(alertname=NODATA) if ep.labels.instance == "proxy-b"]
    assert nodata.resolved_at is not None
    store.close()
