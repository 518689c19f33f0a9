"""The replay with nothing stated (``retrywatch reproduce validate DIR --nothing-stated``).

A run's series states both numbers every alert rests on: the proxy exports Ĉ
(``retrywatch_capacity_calls_per_second``, the run's calibrated Ĉ) and the clients' deadline
(``retrywatch_client_deadline_seconds``: the run's proxy was given it, as the study's proxy was).
This replay withholds both from the detector and lets it learn them from the series, as a live
detector beside a proxy started without ``--capacity`` and with ``--deadline auto`` would:

* Ĉ: the series' gauge is exported as NaN (what such a proxy exports) and nothing is stated to
  the detector, so its Ĉ in force is the saturated measurement, else the prediction below
  saturation from vLLM's series (``detector.capacity``), as on a live detector.
* the deadline: a proxy with ``--deadline auto`` publishes the deadline its learner
  (``exporter.deadlines``) finds in the ages at which clients abandoned attempts. The run's proxy
  did not learn it (it was stated), so the replay runs that same learner over the run's own
  abandons (its call records: every attempt that ended ``disconnected``, at its age, in the order
  they ended) and rewrites each snapshot's deadline families to what the learning proxy would have
  exported at that moment: the deadline in force (NaN while none is learned), its source
  (``learned`` / ``unknown``), each class's learned deadline and its abandons. A run without call
  records has no abandons to learn from: its deadline stays unknown.

NOTE: what the rewrite cannot undo: the run's proxy counted its calls against the stated
deadline. A learning proxy exports no missed-deadline counter before it knows a deadline, so the
replay drops that series until the learned one is published; from then on it is the run's own
(counted against the true deadline, which the learned one matches within a few per cent), and the
delivered-within-deadline counter is the run's throughout. The vLLM tier, with no proxy's deadline,
has none (its deadline alerts cannot evaluate and its NoData says so), as live and in the rules.

Each run gets ``learned``: for Ĉ (the proxy tier's) and the deadline, when the detector first
knew it (``known_at_s``, seconds from the run's start; None: never), its value then, where it came
from, the value in force when the overload began (``at_overload``) and the run's true value (its
calibrated Ĉ, and the deadline at which its client gave attempts up: summary.json's ``capacity``,
and its plan's ``client.attempt_timeout_s``, else its ``deadline_s``, the deadline its calls are
judged on, which the study's client shares).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detector.capacity import CAPACITY_SOURCES
from detector.replay import replay_snapshots
from detector.signals import SignalConfig, SignalFrame, Windows
from detector.sources.replay import load_snapshots, run_slug
from exporter.deadlines import DeadlineLearner
from foundation import metricnames as mn
from foundation.rundir import RunDirError
from foundation.timeseries import Sample, Snapshot
from reproduce.judge.validation.runs import Firing, RunInfo
from reproduce.workloads.client import AttemptOutcome

__all__ = [
    "Learned",
    "NothingStatedRun",
    "abandons_of",
    "learned_summary",
    "replay_nothing_stated",
    "unstated_snapshots",
]

# The series a learning proxy exports otherwise than the run's stating proxy did (rewritten).
_DEADLINE_FAMILIES = frozenset(
    {mn.CLIENT_DEADLINE, mn.CLIENT_DEADLINE_SOURCE, mn.CLIENT_DEADLINE_LEARNED, mn.CLIENT_DEADLINE_ABANDONS}
)


@dataclass
class Learned:
    """One number as the detector learned it over a run (module docstring)."""

    true_value: float
    known_at_s: float | None = None
    value: float | None = None  # when first known
    source: str | None = None  # where it came from when first known
    at_overload: float | None = None  # in force when the overload began (None: unknown then)

    def note(self, t: float, value: float | None, source: str | None, overload_s: float) -> None:
        if value is None or not value > 0:
            return
        if self.known_at_s is None:
            self.known_at_s, self.value, self.source = round(t, 3), value, source
        if t <= overload_s + 1e-9:
            self.at_overload = value

    def to_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {
            "known_at_s": self.known_at_s,
            "value": r(self.value),
            "source": self.source,
            "at_overload": r(self.at_overload),
            "true_value": r(self.true_value),
        }


@dataclass
class NothingStatedRun:
    """One run replayed with nothing stated: its firings and what the detector learned."""

    firings: list[Firing]
    capacity: Learned
    deadline: Learned

    def learned(self) -> dict[str, Any]:
        return {"capacity": self.capacity.to_dict(), "deadline": self.deadline.to_dict()}


def abandons_of(calls: Path | None) -> list[tuple[float, float]]:
    """``(ended_at, age)`` of every attempt the client abandoned (``disconnected``) in a run's call
    records, in the order they ended; empty without records. A clear error names a bad line."""
    if calls is None:
        return []
    out: list[tuple[float, float]] = []
    with calls.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                for attempt in json.loads(line).get("attempts") or []:
                    if (
                        attempt.get("outcome") == AttemptOutcome.DISCONNECTED
                        and attempt.get("ended_at") is not None
                    ):
                        ended, sent = float(attempt["ended_at"]), float(attempt["sent_at"])
                        out.append((ended, ended - sent))
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
                raise RunDirError(f"{calls}:{lineno}: not a call record ({exc})") from None
    out.sort()
    return out


def _deadline_samples(learner: DeadlineLearner, labels: dict[str, str]) -> list[Sample]:
    """The deadline families a proxy with ``--deadline auto`` exports (``exporter.metrics``)."""
    in_force = learner.in_force()
    source = mn.DEADLINE_UNKNOWN if in_force is None else mn.DEADLINE_LEARNED
    samples: list[Sample] = [
        (mn.CLIENT_DEADLINE, dict(labels), math.nan if in_force is None else in_force.deadline_s)
    ]
    samples += [
        (mn.CLIENT_DEADLINE_SOURCE, {**labels, "source": name}, 1.0 if name == source else 0.0)
        for name in mn.DEADLINE_SOURCES
    ]
    classes = learner.classes()
    for i, label in enumerate(mn.DEADLINE_CLASSES):
        found = classes[i] if i < len(classes) else None
        samples.append(
            (
                mn.CLIENT_DEADLINE_LEARNED,
                {**labels, "class": label},
                math.nan if found is None else found.deadline_s,
            )
        )
        samples.append(
            (
                mn.CLIENT_DEADLINE_ABANDONS,
                {**labels, "class": label},
                0.0 if found is None else float(found.abandons),
            )
        )
    return samples


def unstated_snapshots(
    snapshots: Sequence[Snapshot], abandons: Sequence[tuple[float, float]], instance: str
) -> list[Snapshot]:
    """``snapshots`` as a proxy with neither ``--capacity`` nor ``--deadline`` would have exported
    them: Ĉ NaN, the deadline families from the learner fed ``abandons`` (``(ended_at, age)``) up
    to each snapshot, the missed-deadline counter only once a deadline is learned."""
    learner = DeadlineLearner()
    labels = {"instance": instance}
    out: list[Snapshot] = []
    i = 0
    for snap in snapshots:
        while i < len(abandons) and abandons[i][0] <= snap.t + 1e-9:
            learner.observe(abandons[i][1])
            i += 1
        known = learner.in_force() is not None
        samples: list[Sample] = []
        for name, lb, value in snap.samples:
            if name in _DEADLINE_FAMILIES or (name == mn.CALLS_MISSED_DEADLINE and not known):
                continue
            samples.append((name, lb, math.nan if name == mn.CAPACITY else value))
        samples += _deadline_samples(learner, labels)
        out.append(Snapshot(snap.t, samples))
    return out


def replay_nothing_stated(info: RunInfo, windows: Windows | None = None) -> NothingStatedRun:
    """Replay one run with nothing stated (module docstring): its firings and what was learned."""
    instance = run_slug(info.series)
    snapshots = unstated_snapshots(load_snapshots(info.series, instance), abandons_of(info.calls), instance)
    capacity = Learned(info.capacity)
    deadline = Learned(info.deadline_s if info.attempt_timeout_s is None else info.attempt_timeout_s)

    def observe(t: float, frames: list[SignalFrame]) -> None:
        for frame in frames:
            if frame.labels.instance != instance:
                continue
            source = frame.values.get("capacity_source")
            capacity.note(
                t,
                frame.values.get("capacity"),
                None if source is None else CAPACITY_SOURCES[int(source)],
                info.pulse_start_s,
            )
            deadline.note(t, frame.values.get("deadline"), mn.DEADLINE_LEARNED, info.pulse_start_s)

    # At the settings the run's plan recorded, as ``replay_reproduce_run`` replays a stated run,
    # but assuming no deadline: like `retrywatch detect` and the rules, the vLLM tier has one only
    # once the proxy publishes what it learned.
    settings = info.detector
    windows = settings.windows if windows is None else windows
    config = SignalConfig(windows=windows, assumed_deadline=None)
    episodes = replay_snapshots(snapshots, config, rules=settings.rules, on_frames=observe)
    return NothingStatedRun([Firing.of(e) for e in episodes], capacity, deadline)


def _error(value: float | None, true_value: float) -> float | None:
    return None if value is None or not true_value > 0 else value / true_value - 1.0


def learned_summary(runs: Sequence[NothingStatedRun]) -> dict[str, Any]:
    """Over the runs, per number: how many learned it, when (seconds from the run's start, median /
    max) and its relative error when first known and when the overload began (median / max of
    the error's size, signed median)."""

    def stats(values: Sequence[float]) -> dict[str, float | None]:
        return {
            "median": None if not values else round(statistics.median(values), 4),
            "max": None if not values else round(max(values), 4),
        }

    out: dict[str, Any] = {}
    for name in ("capacity", "deadline"):
        learned = [getattr(r, name) for r in runs]
        known = [x for x in learned if x.known_at_s is not None]
        first = [e for x in known if (e := _error(x.value, x.true_value)) is not None]
        overload = [e for x in learned if (e := _error(x.at_overload, x.true_value)) is not None]
        out[name] = {
            "runs": len(learned),
            "learned_in": len(known),
            "known_before_overload": sum(1 for x in learned if x.at_overload is not None),
            "known_at_s": stats([x.known_at_s for x in known if x.known_at_s is not None]),
            "sources": dict(Counter(x.source for x in known if x.source is not None)),
            "error_when_known": {**stats([abs(e) for e in first]), "signed_median": stats(first)["median"]},
            "error_at_overload": {
                **stats([abs(e) for e in overload]),
                "signed_median": stats(overload)["median"],
            },
        }
    return out
