"""``replay_run``: a reproduce run's series through the detector, as fast as possible;
``replay_snapshots``: the same over snapshots already read, with an eye on the signals;
``replay_reproduce_run``: one run of a reproduce output folder, the way ``retrywatch reproduce
validate`` and the dashboard's runs page judge it; ``ReplaySettings``: the detector's settings in
a run's seconds, as the run's plan recorded them (summary.json's ``plan.detector``).

Evaluation happens on the replay clock: at every snapshot (or on a fixed grid with
``interval``), times in seconds from the run's start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from detector.episodes import AlertEpisode, EpisodeLog
from detector.evaluator import Evaluator
from detector.signals import (
    DEFAULT_DEADLINE_S,
    WINDOWS,
    SignalConfig,
    SignalEngine,
    SignalFrame,
    Windows,
)
from detector.sources.replay import load_snapshots
from detector.thresholds import ALERTS, AlertRule
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, read_series


def replay_run(
    series_path: Path | str,
    capacity: float | None = None,
    deadline: float | None = None,
    *,
    interval: float | None = None,
    rules: tuple[AlertRule, ...] = ALERTS,
    instance: str | None = None,
    windows: Windows = WINDOWS,
    assumed_deadline: float | None = DEFAULT_DEADLINE_S,
) -> list[AlertEpisode]:
    """Replay one run's ``metrics.jsonl`` and return every alert episode, in firing order.

    ``capacity`` (Ĉ, calls/s) and ``deadline`` (s) override the series' own gauges; pass None
    to use the exported (or estimated) values. ``interval``: evaluate every ``interval`` seconds
    of run time instead of at each snapshot. ``rules``, ``windows`` and ``assumed_deadline`` (the
    vLLM tier's deadline where none is known) are in run seconds: a scaled run's come already
    divided (:func:`replay_reproduce_run`).
    Episodes still firing at the end have ``resolved_at = None``.
    """
    if capacity is not None and not capacity > 0:
        raise ValueError(f"capacity must be positive calls/s, got {capacity!r}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"deadline must be positive seconds, got {deadline!r}")
    if interval is not None and not interval > 0:
        raise ValueError(f"interval must be positive seconds, got {interval!r}")
    config = SignalConfig(
        capacity=capacity, deadline=deadline, windows=windows, assumed_deadline=assumed_deadline
    )
    return replay_snapshots(
        load_snapshots(Path(series_path), instance), config, interval=interval, rules=rules
    )


FrameObserver = Callable[[float, list[SignalFrame]], None]


def replay_snapshots(
    snapshots: Sequence[Snapshot],
    config: SignalConfig,
    *,
    interval: float | None = None,
    rules: tuple[AlertRule, ...] = ALERTS,
    on_frames: FrameObserver | None = None,
) -> list[AlertEpisode]:
    """:func:`replay_run` over snapshots already read (and, for a replay with nothing stated,
    rewritten): every alert episode, in firing order. ``on_frames`` sees the signals computed at
    each evaluation (its time and every instance's frame), e.g. to tell when Ĉ became known."""
    signals = SignalEngine(config)
    evaluator = Evaluator(rules)
    log = EpisodeLog()
    if not snapshots:
        return []

    def evaluate(t: float) -> None:
        frames = signals.compute(t)
        if on_frames is not None:
            on_frames(t, frames)
        log.apply(evaluator.evaluate(t, frames))

    if interval is None:
        for snap in snapshots:
            signals.add(snap)
            evaluate(snap.t)
        return log.episodes
    i = 0
    t = snapshots[0].t
    end = snapshots[-1].t
    while t <= end + 1e-9:
        while i < len(snapshots) and snapshots[i].t <= t + 1e-9:
            signals.add(snapshots[i])
            i += 1
        evaluate(t)
        t += interval
    return log.episodes


@dataclass(frozen=True)
class ReplaySettings:
    """The detector's settings for a replay of a run, in the run's seconds: the alerts, the
    signals' windows and the assumed deadline. A run's plan makes them (``reproduce.workloads.plan``)
    and records them (:meth:`record`); readers take them back (:meth:`of_record`), never
    re-deriving them. The defaults are the study's."""

    rules: tuple[AlertRule, ...] = ALERTS
    windows: Windows = WINDOWS
    assumed_deadline: float = DEFAULT_DEADLINE_S

    def record(self) -> dict[str, Any]:
        """JSON-ready: the windows, the assumed deadline and each alert's ``for`` and
        ``keep_firing_for`` (seconds)."""
        return {
            "windows": asdict(self.windows),
            "assumed_deadline_s": self.assumed_deadline,
            "alerts": {r.name: [r.for_s, r.keep_firing_for_s] for r in self.rules},
        }

    @classmethod
    def of_entry(cls, entry: Mapping[str, Any]) -> ReplaySettings:
        """The settings a reproduce run's summary entry recorded (its ``plan.detector``); the
        study's for an unscaled run that recorded none. ValueError for a scaled run that did not
        record them (written before runs did) or for a record that does not fit."""
        plan = entry.get("plan")
        record = plan.get("detector") if isinstance(plan, Mapping) else None
        if record is None and entry.get("time_scale") not in (None, 1, 1.0):
            raise ValueError(
                "a scaled run written before runs recorded their detector settings "
                "(summary.json's plan.detector): run it again"
            )
        return cls.of_record(record)

    @classmethod
    def of_record(cls, record: Mapping[str, Any] | None) -> ReplaySettings:
        """The settings :meth:`record` wrote; None (a run written before runs recorded them): the
        study's. Raises ValueError for a record that does not fit."""
        if record is None:
            return cls()
        try:
            windows = Windows(**{k: float(v) for k, v in record["windows"].items()})
            durations = record["alerts"]
            rules = tuple(
                replace(r, for_s=float(durations[r.name][0]), keep_firing_for_s=float(durations[r.name][1]))
                if r.name in durations
                else r
                for r in ALERTS
            )
            return cls(rules, windows, float(record["assumed_deadline_s"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"the run's recorded detector settings do not fit: {exc}") from None


def replay_reproduce_run(
    series_path: Path | str,
    capacity: float | None,
    deadline: float | None,
    settings: ReplaySettings = ReplaySettings(),
) -> list[AlertEpisode]:
    """One run of a reproduce output folder through the detector, and, like Prometheus, with Ĉ
    and the deadline read from the run's own gauges; the summary's ``capacity`` and ``deadline``
    stand in only where the series does not export them. ``settings``: the alerts, windows and
    assumed deadline in the run's seconds, as its plan recorded them (:class:`ReplaySettings`)."""
    try:
        first = next(read_series(Path(series_path)), None)
    except OSError:
        first = None  # replay_run says what is wrong with the file
    exported = {name for name, _, _ in first.samples} if first is not None else set()
    return replay_run(
        series_path,
        capacity=None if mn.CAPACITY in exported else capacity,
        deadline=None if mn.CLIENT_DEADLINE in exported else deadline,
        rules=settings.rules,
        windows=settings.windows,
        assumed_deadline=settings.assumed_deadline,
    )
