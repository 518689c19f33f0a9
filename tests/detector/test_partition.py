"""A PostgreSQL that stops answering (a network partition, a blackholed host): a real server on a
port of its own whose packets the kernel drops (``tc`` on loopback, that one port only). Its
connections fail in a bound instead of the kernel's retransmission timeout (about 15 minutes),
evaluation and the API go on meanwhile, and what fired lands and is notified once it answers.

Needs root's ``tc`` with the clsact qdisc and a BPF classifier (the test skips, saying why, where
they are not permitted); it adds its own qdisc to ``lo`` only when ``lo`` has none but the
default, and always removes it."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from detector.api import create_app
from detector.evaluator import Transition
from detector.lease import AdvisoryLease, LeaseState
from detector.notify import WebhookNotifier
from detector.service import Detector
from detector.signals import EngineLabels
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore, make_engine
from foundation.timeseries import write_series
from tests.detector.conftest import TestServer, wait_until
from tests.detector.minisim import MiniSim
from tests.systemtools import require

T0 = 1_800_000_000.0
LOOP = "VLLMMetastableRetryLoop"
#: How long one call may take before the test calls it stuck: far past the detector's own bounds
#: (seconds), far short of the kernel's retransmission timeout the fix replaces (minutes).
STUCK_S = 60.0
R = TypeVar("R")


def _bpf_drop(port: int) -> str:
    """Classic BPF for ``tc``'s BPF classifier in direct-action mode: an IPv4 TCP packet from or
    to ``port`` is dropped (TC_ACT_SHOT, 2), every other packet passes (TC_ACT_OK, 0). Offsets
    from the Ethernet header, which loopback packets carry."""
    prog = [
        (0x28, 0, 0, 12),  # ldh [12]: the EtherType
        (0x15, 0, 7, 0x0800),  # IPv4, else pass
        (0x30, 0, 0, 23),  # ldb [23]: the IP protocol
        (0x15, 0, 5, 6),  # TCP, else pass
        (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf): the IP header's length
        (0x48, 0, 0, 14),  # ldh [x+14]: the source port
        (0x15, 3, 0, port),  # drop
        (0x48, 0, 0, 16),  # ldh [x+16]: the destination port
        (0x15, 1, 0, port),  # drop
        (0x06, 0, 0, 0),  # pass
        (0x06, 0, 0, 2),  # drop
    ]
    return ",".join([str(len(prog))] + [" ".join(str(v) for v in ins) for ins in prog])


@contextlib.contextmanager
def blackholed(port: int) -> Iterator[None]:
    """Every TCP packet to or from ``port`` on loopback is dropped while this is open. Dropped as
    it arrives (``ingress``), not as it leaves: a packet the sending kernel's own queue drops is a
    local error, which fails the connection within seconds, where a partition's is silence."""
    tc = require("tc")
    shown = subprocess.run([tc, "qdisc", "show", "dev", "lo"], capture_output=True, text=True, timeout=10)
    qdiscs = [line for line in shown.stdout.splitlines() if line.strip()]
    if shown.returncode != 0 or any(not line.startswith("qdisc noqueue 0: root") for line in qdiscs):
        pytest.skip(f"lo has a qdisc this test did not add (left alone): {shown.stdout.strip()}")
    added = subprocess.run(
        [tc, "qdisc", "add", "dev", "lo", "clsact"], capture_output=True, text=True, timeout=10
    )
    if added.returncode != 0:
        pytest.skip(f"tc may not add a qdisc to lo here (needs CAP_NET_ADMIN): {added.stderr.strip()}")
    try:
        dropped = subprocess.run(
            [tc, "filter", "add", "dev", "lo", "ingress", "bpf", "da", "bytecode", _bpf_drop(port)],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        if dropped.returncode != 0:
            pytest.skip(f"tc's BPF classifier is not permitted here: {dropped.stderr.strip()}")
        yield
    finally:
        subprocess.run(
            [tc, "qdisc", "del", "dev", "lo", "clsact"], capture_output=True, timeout=10, check=True
        )


@pytest.fixture(autouse=True)
def quick_keepalives(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same connection parameters with shorter times (the mechanism under test, not its
    production values), so both ends give up in seconds rather than the default's ~25 s."""
    monkeypatch.setattr(
        "detector.store.PG_KEEPALIVE", {"idle_s": 2, "interval_s": 1, "count": 2, "user_timeout_s": 3}
    )


def returns(call: Callable[[], R], what: str) -> R:
    """``call()``'s result; fails the test when it has not returned after :data:`STUCK_S` (the
    call goes on in a daemon thread until its socket gives up)."""
    out: dict[str, R | BaseException] = {}

    def run() -> None:
        try:
            out["result"] = call()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(STUCK_S)
    if thread.is_alive():
        pytest.fail(f"{what} was stuck on the blackholed database for {STUCK_S:.0f} s")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]


def _port(url: str) -> int:
    port = make_url(url).port
    assert port is not None
    return port


@contextlib.contextmanager
def beside(url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A connection to ``url``'s server through its Unix socket, which the blackhole leaves alone."""
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as tcp:
        row = tcp.execute("SHOW unix_socket_directories").fetchone()
    assert row is not None
    folder = str(row[0]).split(",")[0].strip()
    with psycopg.connect(host=folder, port=_port(url), user="rw", dbname="postgres", autocommit=True) as conn:
        yield conn


def lease_held(admin: psycopg.Connection[tuple[object, ...]]) -> bool:
    """Whether a session holds an advisory lock (only the writer lease's outlives a migration)."""
    row = admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted").fetchone()
    return row is not None and row[0] != 0


@pytest.mark.postgres
def test_the_store_and_the_lease_give_up_on_a_blackholed_database_and_recover(postgres_url: str) -> None:
    """A write and the lease's check fail instead of waiting for the kernel, and the server ends
    the lease's partitioned session by its keepalives, so the lease can be taken again (by this
    or another detector) instead of after hours."""
    store = EpisodeStore(postgres_url)
    lease = AdvisoryLease(make_engine(postgres_url))
    assert lease.hold() is LeaseState.ACQUIRED
    fired = Transition(
        kind="firing", alertname=LOOP, severity="critical", labels=EngineLabels("0", "m", "proxy-a"),
        at=T0, started_at=T0, value=2.0, summary="s", description="d",
    )  # fmt: skip
    store.firing()  # a pooled connection that the partition then cuts off
    with beside(postgres_url) as admin, blackholed(_port(postgres_url)):
        with pytest.raises(OperationalError):
            returns(lambda: store.record(fired), "a write")
        assert returns(lease.hold, "the lease's check") is LeaseState.UNREACHABLE
        wait_until(lambda: not lease_held(admin), STUCK_S, "the server to end the lease's lost session")
    assert lease.hold() is LeaseState.ACQUIRED
    assert store.record(fired) is not None
    lease.release()
    store.close()


@pytest.mark.postgres
def test_evaluation_and_the_api_go_on_while_the_database_is_blackholed_and_it_gets_the_writes_after(
    tmp_path: Path, http_server: TestServer, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's database stops answering in the middle of an incident: every evaluation
    returns (the alert fires in ``/alerts``, the transition waits), nothing is written or
    notified while the lease cannot be confirmed, and once the database answers the lease is
    taken again and the episode lands, as it fired, and is notified once."""
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(postgres_url)
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    det = Detector(source, store, notifiers=[WebhookNotifier(http_server.url, name="webhook0")])
    det.dispatcher.start()
    client = TestClient(create_app(det))
    times = iter(sorted({s.t for s in source.snapshots}))
    det.tick(next(times))
    assert det.writer
    with beside(postgres_url) as admin, blackholed(_port(postgres_url)):
        fired_at = None
        for t in times:
            returns(lambda t=t: det.tick(t), "an evaluation")  # type: ignore[misc]
            if any(a["alertname"] == LOOP for a in det.firing_alerts()):
                fired_at = t
                break
        assert fired_at is not None
        returns(lambda: det.tick(next(times)), "an evaluation")
        alerts = client.get("/alerts").json()
        assert LOOP in {a["alertname"] for a in alerts["alerts"]} and alerts["evaluated_at"] > fired_at
        pending = [ln for ln in client.get("/metrics").text.splitlines()
                   if ln.startswith("retrywatch_detector_store_writes_pending ")]  # fmt: skip
        assert pending and float(pending[0].split()[1]) >= 1
        # the lease's check gives up, and the server ends the lease's session: a standby could
        # take the lease now
        wait_until(lambda: "cannot be confirmed" in caplog.text, STUCK_S, "the lease's check to give up")
        wait_until(lambda: not lease_held(admin), STUCK_S, "the server to end the lease's lost session")
        episodes = returns(lambda: client.get("/episodes"), "GET /episodes")
        assert episodes.status_code == 503 and "does not answer" in episodes.json()["detail"]
        row = admin.execute("SELECT count(*) FROM episodes WHERE alertname = %s", (LOOP,)).fetchone()
        assert row == (0,) and http_server.posts == []
    last = next(times)
    # the database answers again: an evaluation takes the lease again and writes what waited
    wait_until(lambda: det.tick(last) is not None and bool(store.episodes(alertname=LOOP)), 60, "the write")
    (loop,) = store.episodes(alertname=LOOP)
    assert loop.started_at == fired_at and det.writer
    assert det.dispatcher.wait_idle(10)
    told = [(p["status"], p["alert"]["alertname"]) for p in http_server.posts]  # type: ignore[index]
    assert told.count(("firing", LOOP)) == 1
    det.stop()
    store.close()
