"""Where a sweep's runs execute: one small interface, chosen from a registry by name.

Every sweep (``reproduce run`` over conditions and seeds, ``reproduce whatif`` and its headroom
search) hands its runs to ``reproduce.runner.run_many``, which keeps the DIR's lock, its summary
and what a rerun resumes; an :class:`Executor` only executes runs and hands back each one's
summary entry as it finishes, its files already under DIR. ``local`` runs them in worker
processes of this machine (``reproduce.executors.local``); ``ray`` on a Ray cluster
(``reproduce.executors.ray``, an optional dependency imported only when used).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from reproduce.registry import Backend, RunJob

__all__ = [
    "EXECUTORS",
    "Executor",
    "ExecutorError",
    "Finished",
    "get_executor",
    "run_here",
]

#: Called by an executor with each run's summary entry as the run finishes (in the calling
#: thread; the run's files are under its DIR by then).
Finished = Callable[[dict[str, Any]], None]


class ExecutorError(ValueError):
    """An executor that cannot be had or used as asked (unknown, not installed, wrong options)."""


class Executor(Protocol):
    """Executes runs somewhere and reports each as it finishes."""

    name: str

    def check(self, backend: Backend) -> None:
        """Raise :class:`ExecutorError` when ``backend``'s runs cannot execute here (called before
        anything is prepared or written)."""

    def execute(self, backend: Backend, jobs: Sequence[RunJob], finished: Finished) -> None:
        """Execute ``jobs`` (any order), calling ``finished`` with each entry as it comes; on any
        error or exit, stop the runs still going (their runs are not finished: nothing recorded is
        lost) and raise."""

    def close(self) -> None:
        """Release what the executor holds (a cluster connection)."""


def run_here(backend: Backend, jobs: Sequence[RunJob], finished: Finished) -> None:
    """``jobs`` one at a time in this process (a backend that is not ``parallel``, or one job)."""
    for job in jobs:
        finished(backend.run(job))


def _local(jobs: int, address: str | None) -> Executor:
    from reproduce.executors.local import LocalExecutor

    if address is not None:
        raise ExecutorError("--address names a Ray cluster: it needs --executor ray")
    return LocalExecutor(jobs)


def _ray(jobs: int, address: str | None) -> Executor:
    from reproduce.executors.ray import RayExecutor

    if jobs != 1:
        raise ExecutorError(
            "--jobs counts local processes; on Ray each run takes one CPU of the cluster (drop --jobs)"
        )
    return RayExecutor(address)


#: name -> factory(jobs, address): the executors a sweep may name (``--executor``).
EXECUTORS: dict[str, Callable[[int, str | None], Executor]] = {"local": _local, "ray": _ray}


def get_executor(name: str, *, jobs: int = 1, address: str | None = None) -> Executor:
    """The executor called ``name``: ``local`` with ``jobs`` worker processes, or ``ray`` on the
    running cluster at ``address`` (None: ``RAY_ADDRESS``)."""
    factory = EXECUTORS.get(name)
    if factory is None:
        raise ExecutorError(f"unknown executor {name!r} (known: {', '.join(EXECUTORS)})")
    return factory(jobs, address)
