"""Episodes in SQL: open/resolve, queries, notification rows, versioned schema; SQLite and a
real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import event, insert, inspect, text

from detector.evaluator import Transition
from detector.signals import EngineLabels
from detector.store import SCHEMA_VERSION, EpisodeStore, SchemaError, current_version, migrate
from detector.store import episodes as episodes_table

LABELS = EngineLabels("0", "qwen", "http://proxy:8000/metrics")


def _tr(
    kind: str, at: float, name: str = "VLLMMetastableRetryLoop", labels: EngineLabels = LABELS
) -> Transition:
    started = at if kind == "firing" else 100.0
    return Transition(
        kind=kind, alertname=name, severity="critical", labels=labels, at=at,  # type: ignore[arg-type]
        started_at=started, value=2.5, summary="s", description="d",
    )  # fmt: skip


def _exercise(store: EpisodeStore) -> None:
    ep = store.record(_tr("firing", 100.0), ["webhook0", "alertmanager"])
    assert ep is not None and ep.id is not None and ep.resolved_at is None
    # a second "firing" for the same open episode (another detector's) neither duplicates it
    # nor is anything to notify (the notifications were queued with the episode)
    assert store.record(_tr("firing", 105.0), ["webhook0"]) is None
    assert store.open_episode(_tr("firing", 105.0), ["webhook0"]).id == ep.id
    other = EngineLabels("0", "llama", "b")
    store.record(_tr("firing", 150.0, "VLLMBacklogBeyondDeadline", other), [])
    assert [e.alertname for e in store.firing()] == ["VLLMMetastableRetryLoop", "VLLMBacklogBeyondDeadline"]
    unsent = store.unsent()
    assert [(e.id, n, k) for e, n, k in unsent] == [
        (ep.id, "webhook0", "firing"),
        (ep.id, "alertmanager", "firing"),
    ]
    store.mark_sent(ep.id, "webhook0", "firing")
    store.mark_failed(ep.id, "alertmanager", "firing", "HTTP 500")
    assert [(n, k) for _, n, k in store.unsent()] == [("alertmanager", "firing")]
    # a resolution from before the episode began (one that waited) is not this episode's
    assert store.record(_tr("resolved", 99.0), ["webhook0"]) is None
    done = store.record(_tr("resolved", 300.0), ["webhook0", "alertmanager"])
    assert done is not None and done.resolved_at == 300.0 and done.started_at == 100.0
    assert store.record(_tr("resolved", 310.0), ["webhook0"]) is None  # nothing open any more
    assert [(n, k) for _, n, k in store.unsent()] == [
        ("alertmanager", "firing"), ("webhook0", "resolved"), ("alertmanager", "resolved")]  # fmt: skip
    # queries: since / until / alertname / engine
    assert len(store.episodes()) == 2
    assert [e.alertname for e in store.episodes(since=301.0)] == ["VLLMBacklogBeyondDeadline"]
    assert [e.alertname for e in store.episodes(until=120.0)] == ["VLLMMetastableRetryLoop"]
    assert len(store.episodes(alertname="VLLMBacklogBeyondDeadline")) == 1
    # engines are keyed by instance: both carry vLLM's engine label "0", which selects neither
    assert [e.alertname for e in store.episodes(engine="b")] == ["VLLMBacklogBeyondDeadline"]
    assert [e.alertname for e in store.episodes(engine=LABELS.instance)] == ["VLLMMetastableRetryLoop"]
    assert store.episodes(engine="0") == [] and store.episodes(engine="9") == []
    d = store.episodes(alertname="VLLMMetastableRetryLoop")[0].as_dict()
    assert d["labels"] == LABELS.as_dict() and d["resolved_at"] == 300.0 and d["value"] == 2.5
    # past the retention: a resolved episode goes with its notification rows, an open one stays
    assert store.prune(300.0) == 0  # resolved at 300, not before
    assert store.prune(300.5, batch=1) == 1
    assert [e.alertname for e in store.episodes()] == ["VLLMBacklogBeyondDeadline"]
    assert store.unsent() == [] and store.prune(1e12) == 0
    assert len(store.firing()) == 1


def _labels_beyond_the_columns(store: EpisodeStore) -> None:
    # what an engine or Prometheus may send: a NUL, and values longer than their columns
    # (a model served by its path; two instances alike in their first 512 characters)
    long_a, long_b = "http://" + "a" * 600 + "/1", "http://" + "a" * 600 + "/2"
    odd = EngineLabels("0\x00", "/models/" + "m" * 300, long_a)
    ep = store.record(_tr("firing", 100.0, labels=odd), ["webhook0"])
    assert ep is not None and ep.labels.engine == "0\ufffd"
    assert ep.labels.model.startswith("/models/mmm") and len(ep.labels.model) == 256
    assert ep.labels.instance.startswith("http://aaa") and len(ep.labels.instance) == 512
    other = store.record(_tr("firing", 110.0, labels=EngineLabels("0", "m", long_b)))
    assert other is not None and other.id != ep.id and other.labels.instance != ep.labels.instance
    nul_labels = EngineLabels("0", "m", "a\x00b")
    nul = store.record(_tr("firing", 120.0, "VLLMBacklogBeyondDeadline\x00", nul_labels))
    assert nul is not None and nul.labels.instance == "a\ufffdb"
    # looked up, resolved and filtered by the values as they came
    assert [e.id for e in store.episodes(engine=long_a)] == [ep.id]
    assert [e.id for e in store.episodes(engine="a\x00b")] == [nul.id]
    assert [e.id for e in store.episodes(alertname="VLLMBacklogBeyondDeadline\x00")] == [nul.id]
    done = store.record(_tr("resolved", 300.0, labels=odd))
    assert done is not None and done.id == ep.id and done.resolved_at == 300.0
    assert [e.id for e in store.firing()] == [other.id, nul.id]


def test_sqlite_episodes_and_notifications(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}"
    store = EpisodeStore(url)
    _exercise(store)
    store.close()
    again = EpisodeStore(url)  # reopening keeps everything and does not migrate twice
    assert len(again.episodes()) == 1
    again.close()


def test_schema_is_versioned_and_a_newer_schema_is_refused(tmp_path: Path) -> None:
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    with store.engine.connect() as conn:
        assert current_version(conn) == SCHEMA_VERSION
    assert migrate(store.engine) == SCHEMA_VERSION
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE schema_version SET version = :v"), {"v": SCHEMA_VERSION + 1})
    with pytest.raises(SchemaError, match="newer"):
        migrate(store.engine)
    store.close()


@pytest.mark.postgres
def test_postgresql_episodes_and_notifications(postgres_url: str) -> None:
    store = EpisodeStore(postgres_url)
    assert store.engine.dialect.name == "postgresql"
    _exercise(store)
    store.close()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_label_values_beyond_the_columns_are_stored_and_found(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    store = EpisodeStore(url)
    _labels_beyond_the_columns(store)
    store.close()


def _plans(store: EpisodeStore) -> dict[str, str]:
    """The query plan of each query the API and the evaluation run, as the store emits it."""
    sql: list[tuple[str, object]] = []

    def grab(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        sql.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", grab)
    queries = {
        "since": lambda: store.episodes(since=1000.0),
        "engine": lambda: store.episodes(engine=LABELS.instance),
        "firing": store.firing,
    }
    plans = {}
    for name, run in queries.items():
        sql.clear()
        run()
        statement, parameters = sql[-1]
        with store.engine.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            if store.engine.dialect.name == "postgresql":
                cursor.execute("SET enable_seqscan = off")  # would it use an index at all?
                cursor.execute("EXPLAIN " + statement, parameters)
            else:
                cursor.execute("EXPLAIN QUERY PLAN " + statement, parameters)
            plans[name] = "\n".join(str(row[-1] if len(row) > 1 else row[0]) for row in cursor.fetchall())
    event.remove(store.engine, "before_cursor_execute", grab)
    return plans


def _fill(store: EpisodeStore, n: int) -> None:
    rows = [
        {"alertname": "VLLMBacklogBeyondDeadline", "severity": "warning", "engine": "0", "model": "m",
         "instance": f"http://10.0.{i % 200}.1/metrics", "started_at": float(i), "resolved_at": i + 60.0,
         "summary": "s", "description": "d", "value": 1.0, "extra": "{}"}
        for i in range(n)
    ]  # fmt: skip
    with store.engine.begin() as conn:
        conn.execute(insert(episodes_table), rows)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_episode_queries_use_their_indexes(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # the tables only grow: a filter without an index reads every episode ever recorded, on each
    # refresh of the dashboard and on each alert transition
    url = f"sqlite:///{tmp_path / 'd.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    store = EpisodeStore(url)
    _fill(store, 2000)
    plans = _plans(store)
    assert "ix_episodes_instance_started_at" in plans["engine"], plans["engine"]
    assert "ix_episodes_resolved_at" in plans["firing"], plans["firing"]
    if backend == "postgresql":  # SQLite's planner prefers the ordered scan of started_at for it
        assert "ix_episodes_resolved_at" in plans["since"], plans["since"]
    store.close()


def test_an_older_schema_gains_the_episode_indexes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}"
    store = EpisodeStore(url)
    ep = store.record(_tr("firing", 100.0), ["webhook0"])
    with store.engine.begin() as conn:  # the schema as version 1 left it
        conn.execute(text("DROP INDEX ix_episodes_resolved_at"))
        conn.execute(text("DROP INDEX ix_episodes_instance_started_at"))
        conn.execute(text("UPDATE schema_version SET version = 1"))
    store.close()
    again = EpisodeStore(url)
    with again.engine.connect() as conn:
        assert current_version(conn) == SCHEMA_VERSION == 2
        names = {ix["name"] for ix in inspect(conn).get_indexes("episodes")}
    assert {"ix_episodes_resolved_at", "ix_episodes_instance_started_at"} <= names
    assert ep is not None and [e.id for e in again.firing()] == [ep.id]  # nothing lost
    assert [(n, k) for _, n, k in again.unsent()] == [("webhook0", "firing")]
    again.close()


_OPEN_AT = """
import sys, time
from detector.store import EpisodeStore
start = float(sys.argv[2])
while time.time() < start:
    pass
try:
    EpisodeStore(sys.argv[1]).close()
    print("ok")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_detectors_opening_a_new_database_at_once_all_start(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two detectors started together on a new database (a second replica kept for availability)
    each created the schema: all but one stopped with "table ... already exists"."""
    import subprocess
    import sys
    import time

    from sqlalchemy import create_engine

    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'd.db'}"
    else:
        server: str = request.getfixturevalue("postgres_url")
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE DATABASE fresh"))
        admin.dispose()
        url = server.rsplit("/", 1)[0] + "/fresh"
    start = time.time() + 3  # every process imported and waiting, then all at once
    procs = [
        subprocess.Popen([sys.executable, "-c", _OPEN_AT, url, str(start)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outcomes = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outcomes == ["ok"] * 4, outcomes
    store = EpisodeStore(url)
    with store.engine.connect() as conn:
        assert current_version(conn) == SCHEMA_VERSION
        assert conn.execute(text("SELECT count(*) FROM schema_version")).scalar_one() == 1
    store.close()
