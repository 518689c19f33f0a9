"""Backends of ``retrywatch reproduce run``, chosen by name from a registry.

A backend executes one run (a block, a condition, a model, a run index) and returns its
summary entry (``reproduce.judge.summary.run_entry``), having written the run's series under the
output directory. The simulator registers ``sim``; the HTTP backends (real vLLM, the emulated
engine, an external engine) register themselves in their own module, listed in ``LAZY_MODULES``
so that the registry imports it only when that backend is asked for.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reproduce.conditions import RunSpec
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = [
    "LAZY_MODULES",
    "Backend",
    "BackendNotFound",
    "RunJob",
    "backend_names",
    "get_backend",
    "register_backend",
]


class BackendNotFound(LookupError):
    """No backend by that name; the message lists the known ones."""


@dataclass(frozen=True)
class RunJob:
    """One run to execute, the clock it runs at and where its files go."""

    run: RunSpec
    out: Path
    clock: RunClock = STUDY_CLOCK


class Backend(ABC):
    """Executes runs. ``parallel`` backends may run in several worker processes at once (they
    must then be picklable); the others run one at a time in the calling process."""

    name: str = "base"
    parallel: bool = False

    def prepare(self, runs: Sequence[RunSpec]) -> None:  # noqa: B027
        """Once, before any run, in the calling process (e.g. calibrate what the runs need)."""

    @abstractmethod
    def run(self, job: RunJob) -> dict[str, Any]:
        """Execute one run; write ``DIR/runs/<slug>/metrics.jsonl``; return its summary entry."""

    def close(self) -> None:  # noqa: B027
        """Release what ``prepare`` started (engines, proxies)."""


BackendFactory = Callable[..., Backend]
_FACTORIES: dict[str, BackendFactory] = {}

#: backend name -> module whose import registers it
LAZY_MODULES: dict[str, str] = {
    "sim": "reproduce.sim.backend",
    "vllm": "reproduce.harness.backend",
    "emulated": "reproduce.harness.backend",
    "external": "reproduce.harness.backend",
}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory(**options)`` the backend called ``name``."""
    _FACTORIES[name] = factory


def backend_names() -> list[str]:
    return sorted(set(_FACTORIES) | set(LAZY_MODULES))


def get_backend(name: str, **options: Any) -> Backend:
    """A backend by name, built with ``options`` (the backend's own keyword arguments)."""
    if name not in _FACTORIES and name in LAZY_MODULES:
        importlib.import_module(LAZY_MODULES[name])
    factory = _FACTORIES.get(name)
    if factory is None:
        raise BackendNotFound(f"unknown backend {name!r} (known: {', '.join(backend_names())})")
    return factory(**options)
