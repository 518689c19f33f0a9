"""Which detector writes a database: one writer lease per database.

Two detectors on one database (a rolling update, a second replica kept for availability, a
mistake) would each open an episode for the same alert and each send its notifications. Only
the detector that holds the database's writer lease writes episodes and notifies; another one
evaluates and serves its API (its alerts and signals, the stored episodes) but writes nothing and
notifies nobody, and tries to take the lease at every evaluation (``detector.service``).

The lease is something the database or the kernel releases when its holder dies, so a
``kill -9``, a lost node or a broken connection hands it over with no timeout of ours:

- PostgreSQL: a session-level advisory lock (``pg_try_advisory_lock``) held on a connection of
  its own and checked at every evaluation; a lost session is a lost lock, which the server has
  released (another detector may have it by now).
- A SQLite file: an exclusive lock on ``<file>-writer`` beside the database, as SQLite keeps its
  ``-wal`` and ``-shm`` files there: an open file description lock (Linux's ``F_OFD_SETLK``, which
  conflicts with a POSIX ``lockf`` lock of another process; ``flock`` elsewhere). It belongs to
  the lease's own open file, not to the process, so two detectors in one process exclude each
  other like two processes, and closing another descriptor of the file (a second lease released)
  leaves it held, where a process's POSIX lock would be silently released. A child forked without
  ``exec`` shares the open file and so the lock (``exec`` closes it: ``O_CLOEXEC``).
- An in-memory SQLite database belongs to its process, and other databases have no lease here:
  the detector takes itself for the only writer.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import hashlib
import os
import struct
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

__all__ = ["LEASE_KEY", "AdvisoryLease", "FileLease", "LeaseState", "SoleWriter", "WriterLease", "lease_for"]

#: The advisory lock's key: the same in every detector, so that one database has one writer.
LEASE_KEY = int.from_bytes(
    hashlib.blake2b(b"retrywatch detector writer", digest_size=8).digest(), "big", signed=True
)
#: Beside a SQLite database ``detector.db``, its lease is the file ``detector.db-writer``.
LEASE_FILE_SUFFIX = "-writer"


class LeaseState(enum.Enum):
    ACQUIRED = "acquired"  # taken just now (it was not held at the last check)
    HELD = "held"  # still held since the last check
    TAKEN = "taken"  # another detector holds it
    UNREACHABLE = "unreachable"  # the database does not answer: whether it is held is not known


class WriterLease(Protocol):
    description: str

    def hold(self) -> LeaseState:
        """Take the lease, or confirm that it is still held."""
        ...

    def release(self) -> None: ...


class SoleWriter:
    """No lease: this detector is the only one that can reach its database."""

    description = "the only writer of its database"

    def __init__(self) -> None:
        self._held = False

    def hold(self) -> LeaseState:
        state = LeaseState.HELD if self._held else LeaseState.ACQUIRED
        self._held = True
        return state

    def release(self) -> None:
        self._held = False


class AdvisoryLease:
    """PostgreSQL's session-level advisory lock :data:`LEASE_KEY`, on a connection of its own
    (outside any transaction, so that it holds no snapshot while it waits)."""

    description = "PostgreSQL advisory lock"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None

    def hold(self) -> LeaseState:
        if self._conn is not None:
            try:
                self._conn.exec_driver_sql("SELECT 1")
                return LeaseState.HELD
            except SQLAlchemyError:  # the session ended, and with it the lock
                self._drop()
        try:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except SQLAlchemyError:
            return LeaseState.UNREACHABLE
        try:
            taken = bool(conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LEASE_KEY}).scalar())
        except SQLAlchemyError:
            conn.invalidate()
            conn.close()
            return LeaseState.UNREACHABLE
        if not taken:
            conn.close()
            return LeaseState.TAKEN
        self._conn = conn
        return LeaseState.ACQUIRED

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.invalidate()  # closes the session, which releases the lock: never pooled again
            conn.close()

    def release(self) -> None:
        self._drop()


def _try_lock(fd: int) -> None:
    """Take an exclusive lock on the whole of ``fd``'s file without waiting, owned by ``fd``'s
    open file description; OSError (EAGAIN or EACCES) when another holds one."""
    if hasattr(fcntl, "F_OFD_SETLK"):
        # struct flock: l_type, l_whence, l_start, l_len, l_pid (0, as OFD locks require)
        lock = struct.pack("hhqqi0q", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    else:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class FileLease:
    """An exclusive lock on ``path`` (created when missing), held by this lease's open file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"lock file {path}"
        # Opened now, so that a directory where it cannot be made is an error at start-up.
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._held = False

    def hold(self) -> LeaseState:
        if self._fd is None:
            raise RuntimeError("the lease was released")
        if self._held:
            return LeaseState.HELD
        try:
            _try_lock(self._fd)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return LeaseState.TAKEN
            raise
        self._held = True
        return LeaseState.ACQUIRED

    def release(self) -> None:
        fd, self._fd, self._held = self._fd, None, False
        if fd is not None:
            os.close(fd)  # releases the lock


def lease_for(engine: Engine) -> WriterLease:
    """The writer lease of the database ``engine`` reaches; OSError when its lock file cannot be
    made."""
    if engine.dialect.name == "postgresql":
        return AdvisoryLease(engine)
    database = engine.url.database or ""
    if (
        engine.dialect.name == "sqlite"
        and database
        and database != ":memory:"
        and not database.startswith("file:")
    ):
        return FileLease(Path(database + LEASE_FILE_SUFFIX).absolute())
    return SoleWriter()
