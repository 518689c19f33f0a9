"""Writes the database refuses: a real full SQLite file (``PRAGMA max_page_count``, which fails a
write with SQLITE_FULL, "database or disk is full", as a full disk does). An episode that fires
and resolves while the disk is full lands once space returns, in order, and is notified once;
what waits is bounded and what is dropped is counted; a delivery the store cannot mark sent is
not sent again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event, text

from detector.api import create_app
from detector.evaluator import Transition
from detector.notify import Dispatcher, WebhookNotifier
from detector.pending import PendingWrites
from detector.service import Detector
from detector.signals import EngineLabels
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from foundation.timeseries import write_series
from tests.detector.conftest import TestServer
from tests.detector.minisim import MiniSim

T0 = 1_800_000_000.0
LOOP = "VLLMMetastableRetryLoop"


def fill_disk(store: EpisodeStore) -> Callable[[bool], None]:
    """``full(True)``: the store's SQLite file may not grow by one page (every connection of
    its engine gets ``max_page_count`` = the pages it has now); ``full(False)``: space is back.

    An earlier episode whose description fills its page is written first, so that the next
    episode cannot fit in a page the file already has."""
    limit: dict[str, int | None] = {"pages": None}

    @event.listens_for(store.engine, "connect")
    def _limit(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        if limit["pages"] is not None:
            dbapi_conn.execute(f"PRAGMA max_page_count = {limit['pages']}")

    earlier = Transition(
        kind="firing", alertname="VLLMBacklogBeyondDeadline", severity="warning",
        labels=EngineLabels("0", "m", "an-earlier-engine"), at=T0 - 86_400, started_at=T0 - 86_400,
        value=1.0, summary="an earlier episode", description="x" * 3_900,
    )  # fmt: skip
    store.record(earlier)
    store.record(replace(earlier, kind="resolved", at=T0 - 86_000))

    def full(on: bool) -> None:
        with store.engine.connect() as conn:
            pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar_one())
        limit["pages"] = pages if on else None
        store.engine.dispose()  # every new connection takes the limit (or its absence)

    return full


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EpisodeStore]:
    s = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    yield s
    s.close()


def _loop_posts(server: TestServer) -> list[str]:
    return [p["status"] for p in server.posts if p["alert"]["alertname"] == LOOP]  # type: ignore[index]


def test_an_episode_fired_and_resolved_on_a_full_disk_lands_once_space_returns(
    tmp_path: Path, store: EpisodeStore, http_server: TestServer
) -> None:
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    times = sorted({s.t for s in source.snapshots})
    full = fill_disk(store)
    det = Detector(source, store, notifiers=[WebhookNotifier(http_server.url, name="webhook0")])
    det.dispatcher.start()
    client = TestClient(create_app(det))

    def metric(name: str) -> float:
        return det.metrics.registry.get_sample_value(name) or 0.0

    def loop_episodes() -> list[dict[str, object]]:
        eps = client.get("/episodes", params={"alertname": LOOP}).json()["episodes"]
        return list(eps)

    full(True)
    fired_at = resolved_at = None
    for t in times:
        det.tick(t)
        loop_firing = any(a["alertname"] == LOOP for a in client.get("/alerts").json()["alerts"])
        if fired_at is None and loop_firing:
            fired_at = t
            # it fires, the write is refused: it waits, nothing is stored, nobody is told
            assert metric("retrywatch_detector_store_write_failures_total") >= 1
            assert metric("retrywatch_detector_store_writes_pending") >= 1
            assert loop_episodes() == []
        if fired_at is not None and not loop_firing:
            resolved_at = t
            break
    assert fired_at is not None and resolved_at is not None, "the replay must fire and resolve the loop"
    assert det.dispatcher.wait_idle(10)
    assert loop_episodes() == [] and _loop_posts(http_server) == []
    waiting = det.pending.waiting()
    assert [(t.kind, t.at) for t in waiting if t.alertname == LOOP] == [
        ("firing", fired_at),
        ("resolved", resolved_at),
    ]
    failures = metric("retrywatch_detector_store_write_failures_total")
    assert failures >= 2  # retried at every evaluation, counted each time
    assert "retrywatch_detector_store_writes_pending 0.0" not in client.get("/metrics").text

    full(False)  # space is back: the next retry writes everything, in order
    assert det.write_pending() == 0
    assert det.dispatcher.wait_idle(10)
    (episode,) = loop_episodes()
    assert episode["started_at"] == fired_at and episode["resolved_at"] == resolved_at
    assert _loop_posts(http_server) == ["firing", "resolved"]
    assert metric("retrywatch_detector_store_writes_pending") == 0
    assert metric("retrywatch_detector_store_write_failures_total") == failures
    assert metric("retrywatch_detector_store_writes_dropped_total") == 0
    assert store.unsent() == []

    # later evaluations and a restart on the same database repeat nothing
    for t in times:
        if t > resolved_at:
            det.tick(t)
    det2 = Detector(
        ReplaySource(series, instance="proxy-a", offset=T0),
        EpisodeStore(store.url),
        notifiers=[WebhookNotifier(http_server.url, name="webhook0")],
    )
    det2.dispatcher.start()
    assert det2.dispatcher.requeue_unsent() == 0
    assert det.dispatcher.wait_idle(10) and det2.dispatcher.wait_idle(10)
    assert _loop_posts(http_server) == ["firing", "resolved"]
    assert len(loop_episodes()) == 1
    det.dispatcher.close()
    det2.dispatcher.close()
    det2.store.close()


def _tr(kind: str, at: float, instance: str) -> Transition:
    return Transition(
        kind=kind, alertname=LOOP, severity="critical", labels=EngineLabels("0", "m", instance),  # type: ignore[arg-type]
        at=at, started_at=at if kind == "firing" else at - 50, value=2.0, summary="s", description="d" * 400,
    )  # fmt: skip


def test_what_waits_is_bounded_whole_episodes_go_first_and_every_drop_is_counted(
    store: EpisodeStore, caplog: pytest.LogCaptureFixture
) -> None:
    full = fill_disk(store)
    full(True)
    dropped: list[int] = []
    failures: list[int] = []
    pending = PendingWrites(
        store, max_pending=3, on_drop=dropped.append, on_failure=lambda: failures.append(1)
    )
    # a fires and resolves, b fires: three waiting writes, the bound
    pending.add([_tr("firing", 100, "a"), _tr("resolved", 150, "a"), _tr("firing", 160, "b")])
    assert pending.flush() == [] and len(failures) == 1 and dropped == []
    assert "database or disk is full" in caplog.text
    pending.add([_tr("firing", 170, "c")])
    # past the bound the oldest whole episode goes (a 100..150), never half of one
    assert dropped == [2]
    assert [(t.labels.instance, t.kind) for t in pending.waiting()] == [("b", "firing"), ("c", "firing")]
    assert "dropped the episode VLLMMetastableRetryLoop on a (firing at 100), resolved at 150" in caplog.text
    pending.add([_tr("firing", 180, "d")])
    assert dropped == [2]
    # no whole episode waits: the oldest transition goes, and says so
    pending.add([_tr("firing", 190, "e")])
    assert dropped == [2, 1]
    assert [(t.labels.instance, t.kind) for t in pending.waiting()] == [
        ("c", "firing"), ("d", "firing"), ("e", "firing")]  # fmt: skip
    assert "dropped VLLMMetastableRetryLoop on b (firing at 160)" in caplog.text
    assert pending.flush() == [] and len(failures) == 2

    full(False)
    landed = pending.flush()
    assert [(t.labels.instance, t.kind, ep is not None) for t, ep in landed] == [
        ("c", "firing", True),
        ("d", "firing", True),
        ("e", "firing", True),
    ]
    assert len(pending) == 0
    pending.add([_tr("resolved", 200, "b")])  # the resolution of the dropped firing
    ((_, nothing),) = pending.flush()
    assert nothing is None  # nothing open to resolve: the drop lost that episode, and said so
    assert sorted(e.labels.instance for e in store.episodes(alertname=LOOP)) == ["c", "d", "e"]
    with pytest.raises(ValueError, match="at least"):
        PendingWrites(store, max_pending=1)


def test_a_delivery_the_store_cannot_mark_sent_is_not_sent_again(
    store: EpisodeStore, http_server: TestServer
) -> None:
    read_only = {"on": False}

    @event.listens_for(store.engine, "connect")
    def _query_only(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        if read_only["on"]:
            dbapi_conn.execute("PRAGMA query_only = ON")  # every write fails: a read-only database

    disp = Dispatcher(store, [WebhookNotifier(http_server.url, name="webhook0")], retries=0)
    disp.start()
    ep = store.record(_tr("firing", 100, "a"), disp.names)
    assert ep is not None
    read_only["on"] = True
    store.engine.dispose()
    disp.submit(ep, "webhook0", "firing")
    assert disp.wait_idle(10)
    assert [p["status"] for p in http_server.posts] == ["firing"]  # type: ignore[index]
    assert len(store.unsent()) == 1  # the store could not record it
    with pytest.raises(Exception, match="readonly"):
        disp.requeue_unsent()  # marking is retried first, and still refused
    disp.submit(ep, "webhook0", "firing")
    assert disp.wait_idle(10)
    assert len(http_server.posts) == 1  # delivered once: not again while it cannot be marked
    # the worker survived a delivery whose failure it could not record either
    http_server.fail_next = 1
    disp.submit(ep, "webhook0", "resolved")
    assert disp.wait_idle(10)
    read_only["on"] = False
    store.engine.dispose()
    assert disp.requeue_unsent() == 0  # marked now; nothing left to send
    assert store.unsent() == [] and len(http_server.posts) == 1
    done = store.record(_tr("resolved", 150, "a"), disp.names)
    assert done is not None
    disp.submit(done, "webhook0", "resolved")
    assert disp.wait_idle(10)
    assert [p["status"] for p in http_server.posts] == ["firing", "resolved"]  # type: ignore[index]
    disp.close()


@pytest.mark.postgres
def test_a_transition_the_database_refuses_for_its_values_is_dropped_not_waited_on(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A LATIN1 database cannot hold a model name in another script: PostgreSQL refuses the
    # write with a data exception on every try, which, waited on, would hold back every later
    # transition and every notification.
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("CREATE DATABASE latin ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C'"
                          " TEMPLATE template0"))  # fmt: skip
    admin.dispose()
    store = EpisodeStore(postgres_url.rsplit("/", 1)[0] + "/latin")
    dropped: list[int] = []
    pending = PendingWrites(store, on_drop=dropped.append)
    refused = replace(_tr("firing", 100, "a"), labels=EngineLabels("0", "通义千问", "a"))
    pending.add([refused, _tr("firing", 110, "b"), replace(refused, kind="resolved", at=150)])
    landed = pending.flush()
    # the rest land; the refused firing's resolution finds nothing open
    assert [(t.labels.instance, t.kind, ep is None) for t, ep in landed] == [
        ("b", "firing", False), ("a", "resolved", True)]  # fmt: skip
    assert dropped == [1] and len(pending) == 0
    dropping = "dropped VLLMMetastableRetryLoop on a (firing at 100): the database refuses its values"
    assert dropping in caplog.text
    assert [e.labels.instance for e in store.episodes()] == ["b"]
    store.close()


@pytest.mark.postgres
def test_a_database_that_hangs_does_not_stall_evaluation(postgres_url: str, tmp_path: Path) -> None:
    # Another session holds the episodes table (a migration, a VACUUM FULL): the write waits on
    # it. Evaluation must go on, the transition wait and land once the database answers again.
    import threading

    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = EpisodeStore(postgres_url)
    det = Detector(ReplaySource(series, instance="proxy-a", offset=T0), store)
    times = [s.t for s in det.source.snapshots]  # type: ignore[attr-defined]
    holder = create_engine(postgres_url).connect()
    locked = holder.begin()
    holder.execute(text("LOCK TABLE episodes IN ACCESS EXCLUSIVE MODE"))
    done = threading.Event()

    def evaluate() -> None:
        for t in times:
            det.tick(t)
            if det.writes_waiting():
                break
        done.set()

    threading.Thread(target=evaluate, daemon=True).start()
    try:
        assert done.wait(60), "an evaluation waited on the locked table"
        assert det.writes_waiting() >= 1  # it waits for the database
    finally:
        locked.rollback()
        holder.close()
    assert det.write_pending() == 0
    assert store.firing()
    store.close()
