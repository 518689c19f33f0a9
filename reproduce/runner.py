"""Run many (block, condition, model, run) combinations and write ``DIR/summary.json``.

The runs execute where the sweep's executor puts them (``reproduce.executors``: worker processes
of this machine, ``jobs`` of them, by default; or a Ray cluster); this module keeps what every
executor shares. A progress bar (tqdm) counts runs. The summary is rewritten by this process
after every finished run, so an interrupted invocation (its driver or a worker killed) keeps what
it finished; entries of other runs already in ``DIR`` (another block run into the same folder)
are kept, and a rerun replaces its own by slug; a summary there that cannot be read is an error,
never replaced. Nothing is created before the executor accepts the backend and the backend's
``prepare`` accepts the runs; a validation or report there (``foundation.rundir.DERIVED``) is
removed, as it describes the runs before.

One invocation writes a DIR at a time (``reproduce.dirlock``): a second is refused at once. A
SIGTERM exits through the executor's clean-up (the runs still going are stopped; those finished
stay in the summary), and the summary is never left half-written.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

from foundation.rundir import DERIVED, SUMMARY, read_summary
from reproduce.conditions import RunSpec
from reproduce.dirlock import hold
from reproduce.executors import Executor
from reproduce.executors.local import LocalExecutor, cap_jobs, usable_cores
from reproduce.judge.summary import write_summary
from reproduce.registry import Backend, RunJob
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = ["cap_jobs", "run_many", "usable_cores"]  # the first and last: reproduce.executors.local's


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
    executor: Executor | None = None,
    clock: RunClock = STUDY_CLOCK,
    progress: bool = True,
    meta: Mapping[str, Any] | None = None,
    stamp: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Execute ``runs`` with ``backend`` at ``clock`` on ``executor`` (None: ``jobs`` local processes); return
    their summary entries in the order given, each with ``stamp``'s fields added (what a caller
    needs every run to record). ``DirBusy`` when another invocation writes ``out``;
    ``ExecutorError`` when the executor cannot run the backend's runs (nothing is written)."""
    if not runs:
        raise ValueError("no runs to execute")
    executor = executor if executor is not None else LocalExecutor(jobs)
    executor.check(backend)
    done: dict[str, dict[str, Any]] = {}
    full_meta = {"backend": backend.name, **clock.record(), **(meta or {})}

    with _sigterm_exits():
        backend.prepare(runs)  # before anything is created: it checks the runs' models
        try:
            with hold(out):
                own = {r.slug for r in runs}
                kept = [r for r in _existing(out) if r.get("slug") not in own]  # read under the lock
                bar = tqdm(
                    total=len(runs), unit="run", disable=not progress, file=sys.stderr, dynamic_ncols=True
                )

                def finished(entry: dict[str, Any]) -> None:
                    entry = {**entry, **(stamp or {})}
                    done[entry["slug"]] = entry
                    ordered = [done[r.slug] for r in runs if r.slug in done]
                    with _uninterrupted():
                        write_summary(out, [*kept, *ordered], full_meta)
                    bar.update(1)

                for name in DERIVED:  # a validation or report of the runs before these would be stale
                    (out / name).unlink(missing_ok=True)
                with bar:
                    executor.execute(backend, [RunJob(r, out, clock) for r in runs], finished)
        finally:
            backend.close()
    return [done[r.slug] for r in runs]
