"""Episodes and their notification state in SQL (SQLAlchemy 2.x): SQLite by default, any URL.

An episode is written when its alert fires and updated when it resolves, each in its own
committed transaction, so a fired episode survives a restart and a ``kill -9``. Each notifier's
delivery of its firing and of its resolution is a row beside it (written in the same
transaction, marked sent on success), so a restarted detector neither loses nor repeats one.

Text is stored as the columns can hold it (:func:`fit`): a label value from a source is whatever
an engine or Prometheus sent, and PostgreSQL refuses a NUL character and a value longer than its
column. A refused write would wait forever and hold back every alert's notifications behind it.

A URL that cannot be used (an unknown scheme, a missing driver, a server that does not answer,
a SQLite file in a directory that does not exist or a file that is not a database) raises
:class:`StoreOpenError` with one line that names the URL with its password masked.

The schema is versioned: table ``schema_version`` holds one row; :func:`migrate` brings any
older schema to :data:`SCHEMA_VERSION` step by step and refuses a newer one.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    create_engine,
    event,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError, SQLAlchemyError
from sqlalchemy.sql.elements import ColumnElement

from detector.episodes import AlertEpisode
from detector.evaluator import Transition
from detector.signals import MAX_INSTANCE_CHARS, EngineLabels
from foundation.redact import redact_text, redact_url

SCHEMA_VERSION = 2
#: The default database's file, under :func:`state_dir`.
DEFAULT_DB_FILE = "detector.db"


def state_dir() -> Path:
    """The user's state directory for retrywatch: ``$XDG_STATE_HOME/retrywatch`` (by default
    ``~/.local/state/retrywatch``), as the XDG Base Directory specification places it."""
    base = os.environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "state"
    return root / "retrywatch"


def default_url() -> str:
    """The default database: SQLite in :func:`state_dir` (created when missing)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / DEFAULT_DB_FILE}"


metadata = MetaData()

schema_version = Table("schema_version", metadata, Column("version", Integer, nullable=False))

episodes = Table(
    "episodes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("alertname", String(128), nullable=False, index=True),
    Column("severity", String(16), nullable=False),
    Column("engine", String(256), nullable=False, default=""),
    Column("model", String(256), nullable=False, default=""),
    Column("instance", String(MAX_INSTANCE_CHARS), nullable=False, default=""),
    Column("started_at", Float, nullable=False, index=True),
    Column("resolved_at", Float, nullable=True),
    Column("summary", Text, nullable=False),
    Column("description", Text, nullable=False),
    Column("value", Float, nullable=True),
    Column("extra", Text, nullable=False, default="{}"),
)
# Schema version 2: without them, ``GET /episodes?since=`` and ``?engine=``, ``firing()`` and the
# lookup of an alert's open episode on every transition read the whole table (it only grows).
EPISODE_INDEXES = (
    Index("ix_episodes_resolved_at", episodes.c.resolved_at),
    Index("ix_episodes_instance_started_at", episodes.c.instance, episodes.c.started_at),
)

# One row per (episode, notifier, firing|resolved), written in the transaction that opens or
# resolves the episode; ``sent`` turns true once that notifier accepted it.
notifications = Table(
    "notifications",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("episode_id", Integer, ForeignKey("episodes.id"), nullable=False, index=True),
    Column("notifier", String(64), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("sent", Boolean, nullable=False, default=False, index=True),
    Column("attempts", Integer, nullable=False, default=0),
    Column("last_error", Text, nullable=True),
    UniqueConstraint("episode_id", "notifier", "kind"),
)


#: How both ends of a connection to PostgreSQL give up on a peer that stops answering (a network
#: partition, a host that drops packets), instead of after the kernel's retransmission timeout
#: (about 15 min) or its keepalive time (2 h): data unacknowledged for ``user_timeout_s``, or a
#: connection silent for ``idle_s`` whose peer then answers none of ``count`` probes ``interval_s``
#: apart, is closed by the kernel. The detector's end fails its statement (the transition waits in
#: ``PendingWrites``); the server's end ends the session, and with it the writer lease's advisory
#: lock, which another detector can then take.
PG_KEEPALIVE = {"idle_s": 10, "interval_s": 5, "count": 3, "user_timeout_s": 10}
#: A connect to PostgreSQL that has not completed in this time fails.
PG_CONNECT_TIMEOUT_S = 10
#: A statement PostgreSQL has not finished in this time is cancelled (``statement_timeout``): one
#: waiting on a lock another session holds would otherwise hold the detector's writes for as long;
#: cancelled, the transition waits in ``PendingWrites`` and is tried again.
PG_STATEMENT_TIMEOUT_S = 5


def pg_connection_parameters() -> dict[str, int | str]:
    """libpq's connection parameters for every connection the detector makes to PostgreSQL (its
    store's and its writer lease's, which share :func:`make_engine`'s engine): the client's
    keepalives and ``tcp_user_timeout``, and in ``options`` the server's same settings for the
    session, with its ``statement_timeout``. A URL's own parameter (its own ``options``) wins."""
    k = PG_KEEPALIVE
    server = {
        "statement_timeout": PG_STATEMENT_TIMEOUT_S * 1000,
        "tcp_keepalives_idle": k["idle_s"],
        "tcp_keepalives_interval": k["interval_s"],
        "tcp_keepalives_count": k["count"],
        "tcp_user_timeout": k["user_timeout_s"] * 1000,
    }
    return {
        "connect_timeout": PG_CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": k["idle_s"],
        "keepalives_interval": k["interval_s"],
        "keepalives_count": k["count"],
        "tcp_user_timeout": k["user_timeout_s"] * 1000,
        "options": " ".join(f"-c {name}={value}" for name, value in server.items()),
    }


class SchemaError(RuntimeError):
    """The database holds a schema this version cannot use."""


class StoreOpenError(ValueError):
    """The database URL cannot be used; the message is one line, its password masked."""


def _create_v1(conn: Connection) -> None:
    metadata.create_all(conn, tables=[episodes, notifications])


def _add_v2_indexes(conn: Connection) -> None:
    for index in EPISODE_INDEXES:  # a database created at version 2 has them already
        index.create(conn, checkfirst=True)


# version reached -> step from the previous version (a new column or index goes here as 3, 4, ...)
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _create_v1, 2: _add_v2_indexes}


def current_version(conn: Connection) -> int:
    if not inspect(conn).has_table("schema_version"):
        return 0
    row = conn.execute(select(schema_version.c.version)).first()
    return int(row[0]) if row else 0


#: PostgreSQL's advisory lock that one migration at a time holds (detectors opening a new
#: database together would each create the schema, and all but one fail).
MIGRATION_KEY = int.from_bytes(
    hashlib.blake2b(b"retrywatch schema", digest_size=8).digest(), "big", signed=True
)
MIGRATION_TRIES = 5


def migrate(engine: Engine) -> int:
    """Bring the database to :data:`SCHEMA_VERSION`; returns the version found before.

    Detectors opening a new database at once each create the schema: on PostgreSQL one migration
    waits for another's (an advisory lock for the transaction), and then finds the schema made;
    SQLite commits each table as it is created, so one that another process made between the
    check and the create, or a file another process holds locked (switching it to WAL), is tried
    again (every step checks first)."""
    tries = 1
    while True:
        try:
            return _migrate(engine)
        except OperationalError as exc:
            message = str(exc.orig)
            raced = engine.dialect.name == "sqlite" and ("already exists" in message or "locked" in message)
            if not raced or tries == MIGRATION_TRIES:
                raise
        time.sleep(0.05 * tries)
        tries += 1


def _migrate(engine: Engine) -> int:
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_KEY})
        found = current_version(conn)
        if found > SCHEMA_VERSION:
            raise SchemaError(
                f"database schema version {found} is newer than this detector's {SCHEMA_VERSION};"
                " upgrade retrywatch"
            )
        if found == SCHEMA_VERSION:
            return found
        metadata.create_all(conn, tables=[schema_version])
        for version in range(found + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version](conn)
        conn.execute(schema_version.delete())
        conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
    return found


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL and full fsync so a commit survives ``kill -9``.

    A SQLite file's directory must exist: a mistyped path (``sqlite:///var/...`` for
    ``sqlite:////var/...``) is refused rather than created.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise _refused(url, "not a database URL (dialect+driver://...)") from None
    except ValueError as exc:  # e.g. a port that is not a number
        raise _refused(url, f"not a database URL ({exc})") from None
    connect_args: dict[str, object] = {}
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        path = parsed.database or ""
        if path and path != ":memory:" and not path.startswith("file:"):
            folder = Path(path).absolute().parent
            if not folder.is_dir():
                raise _refused(url, f"directory {folder} does not exist")
    elif backend == "postgresql" and _libpq(parsed.drivername):
        connect_args.update({k: v for k, v in pg_connection_parameters().items() if k not in parsed.query})
    try:
        engine = create_engine(url, future=True, pool_pre_ping=True, connect_args=connect_args)
    except NoSuchModuleError:
        raise _refused(url, f"unknown database scheme {parsed.drivername!r}") from None
    except ImportError as exc:
        raise _refused(url, f"the driver for {parsed.drivername!r} is not installed ({exc})") from None
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.close()

    return engine


def _refused(url: str, reason: str) -> StoreOpenError:
    return StoreOpenError(f"cannot use the database {redact_url(url)}: {redact_text(reason, [url])}")


def _libpq(drivername: str) -> bool:
    """True for the drivers that pass libpq's connection parameters through (psycopg 3 and 2)."""
    return drivername in ("postgresql", "postgresql+psycopg", "postgresql+psycopg2")


def store_error(exc: BaseException) -> str:
    """One line for a database error: the driver's own first line, without SQLAlchemy's
    statement, parameters and background link."""
    inner = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(inner).strip().splitlines()
    return (lines[0] if lines else type(inner).__name__).strip()


#: What stands for a NUL character in stored text (PostgreSQL's text types cannot hold one).
NUL_STAND_IN = "\ufffd"
_DIGEST_CHARS = 16


def fit(value: str, column: Column[str]) -> str:
    """``value`` as ``column`` holds it: NUL replaced with U+FFFD, and a value longer than the
    column cut to its length, ending in a digest of the whole so that two long values stay apart.

    Deterministic, so that a lookup fits its value the same way the write did."""
    value = value.replace("\x00", NUL_STAND_IN)
    length = getattr(column.type, "length", None)
    if length is None or len(value) <= length:
        return value
    whole = value.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(whole, digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{value[: length - _DIGEST_CHARS - 1]}~{digest}"


def _row_to_episode(row) -> AlertEpisode:  # type: ignore[no-untyped-def]
    return AlertEpisode(
        id=row.id,
        alertname=row.alertname,
        severity=row.severity,
        labels=EngineLabels(engine=row.engine, model=row.model, instance=row.instance),
        started_at=row.started_at,
        resolved_at=row.resolved_at,
        summary=row.summary,
        description=row.description,
        value=row.value,
    )


class EpisodeStore:
    """Episodes in a SQL database; every write is its own committed transaction."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.display_url = redact_url(url)
        self.engine = make_engine(url)
        try:
            migrate(self.engine)
        except SQLAlchemyError as exc:
            self.engine.dispose()
            raise _refused(url, store_error(exc)) from None
        except SchemaError:
            self.engine.dispose()
            raise
        self._lock = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()

    def record(self, transition: Transition, notifiers: Sequence[str] = ()) -> AlertEpisode | None:
        """Open an episode on ``firing``, close the open one on ``resolved`` (queueing a
        notification for each of ``notifiers`` in the same transaction); returns it, or None when
        there was nothing to write (the alert's episode was already open, or none was open to
        resolve), and so nothing to notify."""
        if transition.kind == "firing":
            episode, opened = self._open(transition, notifiers)
            return episode if opened else None
        return self.resolve_episode(
            transition.alertname, transition.labels, transition.at, transition.value, notifiers
        )

    def open_episode(self, tr: Transition, notifiers: Sequence[str] = ()) -> AlertEpisode:
        """The alert's open episode: opened now (its notifications queued), or the one already open."""
        return self._open(tr, notifiers)[0]

    def _open(self, tr: Transition, notifiers: Sequence[str]) -> tuple[AlertEpisode, bool]:
        with self._lock, self.engine.begin() as conn:
            existing = conn.execute(
                select(episodes).where(self._key(tr.alertname, tr.labels), episodes.c.resolved_at.is_(None))
            ).first()
            if existing is not None:  # already open (by a detector before this one): keep the first record
                return _row_to_episode(existing), False
            result = conn.execute(
                episodes.insert().values(
                    alertname=fit(tr.alertname, episodes.c.alertname),
                    severity=fit(tr.severity, episodes.c.severity),
                    engine=fit(tr.labels.engine, episodes.c.engine),
                    model=fit(tr.labels.model, episodes.c.model),
                    instance=fit(tr.labels.instance, episodes.c.instance),
                    started_at=tr.started_at,
                    resolved_at=None,
                    summary=fit(tr.summary, episodes.c.summary),
                    description=fit(tr.description, episodes.c.description),
                    value=_finite(tr.value),
                    extra=json.dumps(tr.extra, default=str),
                )
            )
            if not result.inserted_primary_key:
                raise RuntimeError("the database returned no id for the new episode")
            new_id = int(result.inserted_primary_key[0])
            self._queue(conn, new_id, "firing", notifiers)
            row = conn.execute(select(episodes).where(episodes.c.id == new_id)).one()
            return _row_to_episode(row), True

    @staticmethod
    def _queue(conn: Connection, episode_id: int, kind: str, notifiers: Sequence[str]) -> None:
        for name in notifiers:
            conn.execute(notifications.insert().values(episode_id=episode_id, notifier=name, kind=kind))

    def resolve_episode(
        self,
        alertname: str,
        labels: EngineLabels,
        at: float,
        value: float | None,
        notifiers: Sequence[str] = (),
    ) -> AlertEpisode | None:
        with self._lock, self.engine.begin() as conn:
            # NOTE: never an episode that started after the resolution: a resolution that waited
            # (its database unreachable) must not close an episode another detector opened since.
            row = conn.execute(
                select(episodes)
                .where(
                    self._key(alertname, labels),
                    episodes.c.resolved_at.is_(None),
                    episodes.c.started_at <= at,
                )
                .order_by(episodes.c.id.desc())
            ).first()
            if row is None:
                return None
            conn.execute(
                update(episodes)
                .where(episodes.c.id == row.id)
                .values(resolved_at=at, value=_finite(value) if value is not None else row.value)
            )
            self._queue(conn, row.id, "resolved", notifiers)
            row = conn.execute(select(episodes).where(episodes.c.id == row.id)).one()
            return _row_to_episode(row)

    def mark_sent(self, episode_id: int, notifier: str, kind: str) -> None:
        with self._lock, self.engine.begin() as conn:
            conn.execute(
                update(notifications)
                .where(
                    notifications.c.episode_id == episode_id,
                    notifications.c.notifier == notifier,
                    notifications.c.kind == kind,
                )
                .values(sent=True)
            )

    def mark_failed(self, episode_id: int, notifier: str, kind: str, error: str) -> None:
        with self._lock, self.engine.begin() as conn:
            conn.execute(
                update(notifications)
                .where(
                    notifications.c.episode_id == episode_id,
                    notifications.c.notifier == notifier,
                    notifications.c.kind == kind,
                )
                .values(
                    attempts=notifications.c.attempts + 1,
                    last_error=fit(error[:500], notifications.c.last_error),
                )
            )

    def prune(self, resolved_before: float, batch: int = 1000) -> int:
        """Delete the episodes resolved before ``resolved_before`` (never an open one) and their
        notification rows, ``batch`` episodes to a transaction (a large backlog holds no lock for
        long); returns how many episodes were deleted."""
        deleted = 0
        while True:
            with self._lock, self.engine.begin() as conn:
                ids = list(
                    conn.scalars(
                        select(episodes.c.id)
                        .where(episodes.c.resolved_at < resolved_before)
                        .order_by(episodes.c.id)
                        .limit(batch)
                    )
                )
                if not ids:
                    return deleted
                conn.execute(notifications.delete().where(notifications.c.episode_id.in_(ids)))
                conn.execute(episodes.delete().where(episodes.c.id.in_(ids)))
            deleted += len(ids)

    def firing(self) -> list[AlertEpisode]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(episodes).where(episodes.c.resolved_at.is_(None)).order_by(episodes.c.id)
            ).all()
        return [_row_to_episode(r) for r in rows]

    def unsent(self, limit: int = 1000) -> list[tuple[AlertEpisode, str, str]]:
        """(episode, notifier, kind) not delivered yet, oldest first, firing before resolved."""
        query = (
            select(episodes, notifications.c.notifier, notifications.c.kind)
            .join(notifications, notifications.c.episode_id == episodes.c.id)
            .where(notifications.c.sent.is_(False))
            .order_by(notifications.c.id)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return [(_row_to_episode(r), r.notifier, r.kind) for r in conn.execute(query)]

    def episodes(
        self,
        since: float | None = None,
        until: float | None = None,
        alertname: str | None = None,
        engine: str | None = None,
        limit: int = 1000,
    ) -> list[AlertEpisode]:
        """Episodes overlapping [since, until], newest first (at most ``limit``)."""
        conds: list[ColumnElement[bool]] = []
        if since is not None:
            conds.append((episodes.c.resolved_at.is_(None)) | (episodes.c.resolved_at >= since))
        if until is not None:
            conds.append(episodes.c.started_at <= until)
        if alertname:
            conds.append(episodes.c.alertname == fit(alertname, episodes.c.alertname))
        if engine:  # engines are keyed by instance (vLLM's engine label is "0" on every vLLM)
            conds.append(episodes.c.instance == fit(engine, episodes.c.instance))
        query = select(episodes).order_by(episodes.c.started_at.desc(), episodes.c.id.desc()).limit(limit)
        if conds:
            query = query.where(and_(*conds))
        with self.engine.connect() as conn:
            return [_row_to_episode(r) for r in conn.execute(query)]

    @staticmethod
    def _key(alertname: str, labels: EngineLabels):  # type: ignore[no-untyped-def]
        return and_(
            episodes.c.alertname == fit(alertname, episodes.c.alertname),
            episodes.c.instance == fit(labels.instance, episodes.c.instance),
        )


def _finite(value: float | None) -> float | None:
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(value)
