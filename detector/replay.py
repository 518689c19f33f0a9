"""``replay_run``: a reproduce run's series through the detector, as fast as possible.

The public entry point ``retrywatch reproduce validate`` builds on. Evaluation happens on the
replay clock: at every snapshot (or on a fixed grid with ``interval``), times in seconds from
the run's start.
"""

from __future__ import annotations

from pathlib import Path

from detector.episodes import AlertEpisode, EpisodeLog
from detector.evaluator import Evaluator
from detector.signals import SignalConfig, SignalEngine
from detector.sources.replay import load_snapshots
from detector.thresholds import ALERTS, AlertRule


def replay_run(
    series_path: Path | str,
    capacity: float | None = None,
    deadline: float | None = None,
    *,
    interval: float | None = None,
    rules: tuple[AlertRule, ...] = ALERTS,
    instance: str | None = None,
    time_scale: float = 1.0,
) -> list[AlertEpisode]:
    """Replay one run's ``metrics.jsonl`` and return every alert episode, in firing order.

    ``capacity`` (Ĉ, calls/s) and ``deadline`` (s) override the series' own gauges; pass None
    to use the exported (or estimated) values. ``interval``: evaluate every ``interval`` seconds
    of run time instead of at each snapshot. ``time_scale`` (K): the run was scaled by K
    (``reproduce --time-scale K``), so every signal window and every alert's ``for`` and
    hysteresis are divided by K (K = 1: real time). Episodes still firing at the end have
    ``resolved_at = None``.
    """
    if capacity is not None and not capacity > 0:
        raise ValueError(f"capacity must be positive calls/s, got {capacity!r}")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"deadline must be positive seconds, got {deadline!r}")
    if interval is not None and not interval > 0:
        raise ValueError(f"interval must be positive seconds, got {interval!r}")
    config = SignalConfig(capacity=capacity, deadline=deadline, time_scale=time_scale)
    snapshots = load_snapshots(Path(series_path), instance)
    signals = SignalEngine(config)
    evaluator = Evaluator(rules, time_scale=config.time_scale)
    log = EpisodeLog()
    if not snapshots:
        return []
    if interval is None:
        for snap in snapshots:
            signals.add(snap)
            log.apply(evaluator.evaluate(snap.t, signals.compute(snap.t)))
        return log.episodes
    i = 0
    t = snapshots[0].t
    end = snapshots[-1].t
    while t <= end + 1e-9:
        while i < len(snapshots) and snapshots[i].t <= t + 1e-9:
            signals.add(snapshots[i])
            i += 1
        log.apply(evaluator.evaluate(t, signals.compute(t)))
        t += interval
    return log.episodes
