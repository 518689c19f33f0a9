"""The ``local`` executor: runs in worker processes of this machine that never outlive the sweep.

Each worker dies with the process that started it (``PR_SET_PDEATHSIG`` on Linux, a watchdog
thread elsewhere); an error, a SIGTERM or any exit of the sweep stops them at once (their runs
are not finished, so nothing recorded is lost). ``jobs`` is capped at the cores this process may
use (:func:`cap_jobs`); one job, or a backend that is not ``parallel``, runs in this process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from reproduce.executors import Finished, run_here
from reproduce.registry import Backend, RunJob

__all__ = ["LocalExecutor", "cap_jobs", "usable_cores"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_WATCHDOG_S = 1.0  # where the kernel cannot kill a worker with its parent, how often it looks
_STOP_S = 5.0  # how long a stopped worker has to exit before it is killed


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def cap_jobs(jobs: int, note: Callable[[str], None] | None = None) -> int:
    """``jobs``, at most :func:`usable_cores` (more processes than cores only slow each run and
    time-share the simulator); ``note`` is told when it caps."""
    cores = usable_cores()
    if jobs > cores:
        if note is not None:
            note(f"--jobs {jobs} capped to {cores}: the cores this process may use")
        return cores
    return jobs


class LocalExecutor:
    """Runs in at most ``jobs`` worker processes of this machine."""

    name = "local"

    def __init__(self, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs!r}")
        self.jobs = cap_jobs(jobs)

    def check(self, backend: Backend) -> None:
        """Any backend runs here (one that is not ``parallel`` in this process)."""

    def execute(self, backend: Backend, jobs: Sequence[RunJob], finished: Finished) -> None:
        workers = min(self.jobs, len(jobs))
        if not backend.parallel or workers <= 1:
            run_here(backend, jobs, finished)
            return
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_init, initargs=(os.getpid(),))
        try:
            futures = [pool.submit(_execute, backend, job) for job in jobs]
            for future in as_completed(futures):
                finished(future.result())
        except BaseException:
            _stop(pool)
            raise
        pool.shutdown()

    def close(self) -> None:
        """Nothing is held between sweeps (each ``execute`` has a pool of its own)."""


def _execute(backend: Backend, job: RunJob) -> dict[str, Any]:
    return backend.run(job)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watchdog(parent: int) -> None:
    while _alive(parent):
        time.sleep(_WATCHDOG_S)
    os._exit(1)


def _worker_init(parent: int) -> None:
    """In each worker before its first run: die with ``parent`` (SIGKILL included), leave SIGINT
    to the parent (which stops the workers) and take SIGTERM's default (a forked worker inherits
    the parent's handler)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    linked = False
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        linked = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if not linked:
        threading.Thread(target=_watchdog, args=(parent,), daemon=True, name="parent-watchdog").start()
    if not _alive(parent):  # it died before the link was made
        os._exit(1)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool`` now: nothing more starts, running workers are terminated (their runs are
    not finished, so nothing recorded is lost)."""
    workers = list((pool._processes or {}).values())  # no public way before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(_STOP_S)
        if worker.is_alive():
            worker.kill()
            worker.join()
