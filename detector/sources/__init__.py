"""Sources of signals behind one interface: direct scrape, Prometheus HTTP API, replay.

A source returns :class:`exporter.timeseries.Snapshot` s whose samples carry an ``instance``
label; :class:`~detector.signals.SignalEngine` groups them per engine. A source that cannot
reach its target reports it in :attr:`FetchResult.down` (never an empty "healthy" answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from exporter.timeseries import Snapshot


@dataclass
class FetchResult:
    snapshots: list[Snapshot] = field(default_factory=list)
    down: list[str] = field(default_factory=list)  # instances that could not be read
    error: str | None = None


class Source(Protocol):
    """What the detector reads signals from."""

    name: str

    def fetch(self, now: float) -> FetchResult:
        """New snapshots up to ``now`` (the source's clock)."""
        ...

    def close(self) -> None: ...
