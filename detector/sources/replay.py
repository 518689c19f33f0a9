"""Replay of a reproduce run's metrics time series (``metrics.jsonl``) on a replay clock.

The evaluation time is the snapshot's ``t`` (seconds from the run's start): a replay runs as
fast as the machine allows, or paced against wall time for a demo (``speed``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from detector.sources import FetchResult
from foundation.timeseries import Snapshot, read_series


def run_slug(series_path: Path) -> str:
    """The instance label of a replayed run: its run folder's name (or the file's stem)."""
    return series_path.parent.name if series_path.name == "metrics.jsonl" else series_path.stem


def load_snapshots(series_path: Path, instance: str | None = None, offset: float = 0.0) -> list[Snapshot]:
    """Read a series, adding ``instance`` to every sample that lacks one and ``offset`` to every
    time; errors name the file."""
    if not series_path.is_file():
        raise FileNotFoundError(f"no metrics series at {series_path}")
    label = instance if instance is not None else run_slug(series_path)
    out: list[Snapshot] = []
    last_t = float("-inf")
    for snap in read_series(series_path):
        if snap.t < last_t:
            raise ValueError(f"{series_path}: snapshot times go backwards at t={snap.t}")
        last_t = snap.t
        snap.t += offset
        snap.samples = [
            (n, lb if "instance" in lb else {**lb, "instance": label}, v) for n, lb, v in snap.samples
        ]
        out.append(snap)
    return out


class ReplaySource:
    """Hands out the run's snapshots up to the replay clock ``now`` (the run's own seconds)."""

    name = "replay"

    def __init__(self, series_path: Path, instance: str | None = None, offset: float = 0.0) -> None:
        """``offset`` shifts the run's clock (e.g. to Unix time, for serving a replay's API)."""
        self.path = series_path
        self.snapshots = load_snapshots(series_path, instance, offset)
        self._next = 0

    @property
    def start(self) -> float:
        return self.snapshots[0].t if self.snapshots else 0.0

    @property
    def end(self) -> float:
        return self.snapshots[-1].t if self.snapshots else 0.0

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.snapshots)

    def times(self) -> Iterator[float]:
        return (s.t for s in self.snapshots)

    def fetch(self, now: float) -> FetchResult:
        out: list[Snapshot] = []
        while self._next < len(self.snapshots) and self.snapshots[self._next].t <= now:
            out.append(self.snapshots[self._next])
            self._next += 1
        return FetchResult(snapshots=out)

    def close(self) -> None:
        return None
