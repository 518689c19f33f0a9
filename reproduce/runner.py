"""Run many (block, condition, model, run) combinations and write ``DIR/summary.json``.

Parallel backends (the simulator) run in ``jobs`` worker processes; the others run one at a
time. A progress bar (tqdm) counts runs. The summary is rewritten after every finished run, so
an interrupted invocation keeps what it finished; entries of other runs already in ``DIR``
(another block run into the same folder) are kept, and a rerun replaces its own by slug; a
summary there that cannot be read is an error, never replaced. Nothing is created before the
backend's ``prepare`` accepts the runs; a validation or report there (``foundation.rundir.DERIVED``)
is removed, as it describes the runs before.

One invocation writes a DIR at a time (``reproduce.dirlock``): a second is refused at once. The
workers never outlive the invocation: each dies with it (``PR_SET_PDEATHSIG`` on Linux, a watchdog
thread elsewhere), a SIGTERM or an error stops them at once (the runs finished stay in the
summary), and ``jobs`` is capped at the cores this process may use (:func:`cap_jobs`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

from foundation.rundir import DERIVED, SUMMARY, read_summary
from reproduce.conditions import RunSpec
from reproduce.dirlock import hold
from reproduce.judge.summary import write_summary
from reproduce.registry import Backend, RunJob

__all__ = ["cap_jobs", "run_many", "usable_cores"]

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


class _Terminated(SystemExit):
    """SIGTERM arrived: leave as an exit does, through the clean-up on the way."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(128 + signum)


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """While running: SIGTERM exits through ``finally`` blocks (workers stopped, backend closed)
    instead of killing the process where it stands."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """SIGTERM and SIGINT wait till the block ends (a summary is never left half-written)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _execute(backend: Backend, job: RunJob) -> dict[str, Any]:
    return backend.run(job)


def _existing(out: Path) -> list[dict[str, Any]]:
    """The runs of ``out/summary.json``, or none if there is none; a summary that cannot be read
    raises ``RunDirError`` (its runs would be lost if it were replaced)."""
    if not (out / SUMMARY).exists():
        return []
    return [r for r in read_summary(out)["runs"] if isinstance(r, dict)]


def run_many(
    backend: Backend,
    runs: Sequence[RunSpec],
    out: Path,
    *,
    jobs: int = 1,
    time_scale: float = 1.0,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
    stamp: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Execute ``runs`` with ``backend``; return their summary entries in the order given, each
    with ``stamp``'s fields added (what a caller needs every run to record). ``DirBusy`` when
    another invocation writes ``out``."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    if not runs:
        raise ValueError("no runs to execute")
    jobs = cap_jobs(jobs)
    done: dict[str, dict[str, Any]] = {}
    full_meta = {"backend": backend.name, "time_scale": time_scale, **(meta or {})}

    with _sigterm_exits():
        backend.prepare(runs)  # before anything is created: it checks the runs' models
        try:
            with hold(out):
                own = {r.slug for r in runs}
                kept = [r for r in _existing(out) if r.get("slug") not in own]  # read under the lock

                def finished(entry: dict[str, Any]) -> None:
                    entry = {**entry, **(stamp or {})}
                    done[entry["slug"]] = entry
                    ordered = [done[r.slug] for r in runs if r.slug in done]
                    with _uninterrupted():
                        write_summary(out, [*kept, *ordered], full_meta)

                for name in DERIVED:  # a validation or report of the runs before these would be stale
                    (out / name).unlink(missing_ok=True)
                bar = tqdm(
                    total=len(runs), unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True
                )
                with bar:
                    if backend.parallel and jobs > 1 and len(runs) > 1:
                        _run_parallel(
                            backend, runs, out, time_scale, min(jobs, len(runs)), finished, bar.update
                        )
                    else:
                        for r in runs:
                            finished(_execute(backend, RunJob(r, out, time_scale)))
                            bar.update(1)
        finally:
            backend.close()
    return [done[r.slug] for r in runs]


def _run_parallel(
    backend: Backend,
    runs: Sequence[RunSpec],
    out: Path,
    time_scale: float,
    workers: int,
    finished: Callable[[dict[str, Any]], None],
    tick: Callable[[int], object],
) -> None:
    """``runs`` over ``workers`` processes, ``finished`` called with each entry as it comes."""
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_worker_init, initargs=(os.getpid(),))
    try:
        futures = [pool.submit(_execute, backend, RunJob(r, out, time_scale)) for r in runs]
        for future in as_completed(futures):
            finished(future.result())
            tick(1)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()
