"""The ``ray`` executor: each run a Ray task of one CPU, on the cluster at ``--address``.

Ray is an optional dependency (``pip install 'retrywatch[ray]'``), imported only when a sweep
first needs the cluster. A task runs its run into a temporary folder on whichever node it lands
and returns the run's entry with the run's files; the driver writes them under DIR, so DIR needs
no filesystem shared with the nodes (a replayed trace must be at the same path on every node, and
every node needs this project installed, as ``reproduce.*`` is imported there). A run lost with
its node or worker is run again (runs are deterministic for their seed); the driver's exit or
error cancels the tasks still going (a driver killed outright: Ray ends its tasks itself).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

from reproduce.executors import ExecutorError, Finished
from reproduce.registry import Backend, RunJob

__all__ = ["RAY_MISSING", "RayExecutor"]

#: The one line a sweep that names Ray gets where Ray is not installed.
RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'retrywatch[ray]'"
_RETRIES = 3  # times a run lost with its worker or node is run again
_PROBE_S = 10.0  # how long the cluster's address has to accept a connection
_POLL_S = 0.5  # how often the driver wakes while it waits (a SIGTERM is handled between waits)
# NOTE: Ray swaps a loopback address (its own or the cluster's) for this machine's interface
# address unless told that this is a single-machine Ray; a cluster bound to 127.0.0.1 alone is
# then out of reach. This variable (Ray's name for it) keeps a loopback address as given.
_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class RayExecutor:
    """Runs on the running Ray cluster at ``address`` (None: ``RAY_ADDRESS``); connects at the
    first run, disconnects at :meth:`close`. It starts no Ray of its own: on one machine ``local``
    does the same work, and a Ray started here would leave a token under ``~/.ray`` that keeps a
    later cluster's nodes out."""

    name = "ray"

    def __init__(self, address: str | None = None) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ExecutorError(RAY_MISSING)
        address = address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ExecutorError(
                "--executor ray needs --address HOST:PORT, a running Ray cluster's (or RAY_ADDRESS)"
            )
        _probe(address)
        self.address = address
        self._ray: ModuleType | None = None

    def check(self, backend: Backend) -> None:
        if not backend.parallel:
            raise ExecutorError(
                f"backend {backend.name!r} runs one run at a time in this process: it cannot run on Ray"
            )

    def execute(self, backend: Backend, jobs: Sequence[RunJob], finished: Finished) -> None:
        self.check(backend)
        ray = self._connect()
        task = ray.remote(num_cpus=1, max_retries=_RETRIES)(_run_shipped)
        shared = ray.put(backend)
        pending = {task.remote(shared, job): job for job in jobs}
        try:
            with _sigterm_between_waits() as deliver:
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
                    for ref in done:
                        job = pending.pop(ref)
                        entry, files = _result(ray, ref)
                        _unpack(job.out, files)
                        finished(entry)
                    deliver()
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise

    def close(self) -> None:
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None

    def _connect(self) -> ModuleType:
        if self._ray is not None:
            return self._ray
        if self.address.removeprefix("ray://").rpartition(":")[0] in _LOOPBACK:
            os.environ.setdefault(_LOOPBACK_ONLY, "0")  # read when Ray is first imported
        ray = importlib.import_module("ray")
        main = threading.current_thread() is threading.main_thread()
        before = signal.getsignal(signal.SIGTERM) if main else None
        try:
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
        finally:
            if main:  # ray.init takes SIGTERM over; the sweep's own handling stays
                signal.signal(signal.SIGTERM, before)
        self._ray = ray
        return ray


def _probe(address: str) -> None:
    """Refuse an ``address`` that is not HOST:PORT or where nothing answers (Ray itself would retry
    it for ever, before any run)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ExecutorError(f"--address must be HOST:PORT, not {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_S).close()
    except OSError as exc:
        raise ExecutorError(f"no Ray cluster answers at {address}: {exc.strerror or exc}") from None


@contextmanager
def _sigterm_between_waits() -> Iterator[Callable[[], None]]:
    """While the driver waits on Ray: a SIGTERM is held, and handed to the handler before (the
    sweep's, which exits through its clean-up) when the returned function is called between
    waits, or at the end. (Ray's waits catch an exit a handler raises inside them and exit with
    code 1 instead, skipping the clean-up.)"""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    caught: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))

    def deliver() -> None:
        if caught:
            signal.signal(signal.SIGTERM, before)
            signal.raise_signal(signal.SIGTERM)

    try:
        yield deliver
    finally:
        signal.signal(signal.SIGTERM, before)
    deliver()


def _run_shipped(backend: Backend, job: RunJob) -> tuple[dict[str, Any], dict[str, bytes]]:
    """On a node: run ``job`` into a folder of its own; its entry and its files (path relative to
    DIR -> content)."""
    with tempfile.TemporaryDirectory(prefix="retrywatch-run-") as tmp:
        root = Path(tmp)
        entry = backend.run(replace(job, out=root))
        found = sorted(p for p in root.rglob("*") if p.is_file())
        files = {p.relative_to(root).as_posix(): p.read_bytes() for p in found}
    return entry, files


def _result(ray: ModuleType, ref: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The task's result; a run's own error raised as itself (as the local executor raises it),
    Ray's (a run lost more often than it is retried) as one line."""
    try:
        entry, files = ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise RuntimeError(f"a run failed on Ray: {_first_line(exc)}") from None
    except ray.exceptions.RayError as exc:
        raise RuntimeError(f"Ray lost a run: {_first_line(exc)}") from None
    return entry, files


def _first_line(exc: BaseException) -> str:
    return next(iter(str(exc).splitlines()), "") or type(exc).__name__


def _unpack(out: Path, files: dict[str, bytes]) -> None:
    """Write a run's ``files`` under ``out``, each whole (a file is complete or absent)."""
    for name, content in files.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise RuntimeError(f"a run on Ray returned a file outside its DIR: {name!r}")
        path = out.joinpath(*rel.parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        tmp.replace(path)
