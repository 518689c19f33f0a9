"""The ground-truth record of a run, as summary.json holds it: its judged span, its judged windows
and its collapses (docs/protocol.md, "Ground truth over time").

``reproduce`` computes the record once, when the run ends (``reproduce.judge.groundtruth``), and writes
it into the run's summary entry: ``"collapses"`` (each with its burst where the workload names
one, and whether it was metastable) and ``"judged"`` (the span, the stretch of overload the run is
aligned on, and each judged window). Validation, the what-if and the dashboard read it with
:meth:`GroundTruth.from_entry`; none recomputes it. The types live here, below every package, so
that the dashboard, which may not import ``reproduce``, reads the same record.

Every time is in the run's own seconds (with ``--time-scale K``, already divided by K).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Collapse", "GroundTruth", "GroundTruthError", "JudgedSpan", "Window"]

_EPS = 1e-9
_DIGITS = 3  # the record's times are rounded to the millisecond


class GroundTruthError(ValueError):
    """A summary entry whose ground-truth record is missing or of the wrong shape."""


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, _DIGITS)


def _seconds(value: Any, what: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise GroundTruthError(f"{what} must be a number of seconds, got {value!r}") from exc
    if not math.isfinite(out):
        raise GroundTruthError(f"{what} must be a finite number of seconds, got {value!r}")
    return out


def _optional(value: Any, what: str) -> float | None:
    return None if value is None else _seconds(value, what)


def _stretch(value: Any, what: str) -> tuple[float, float]:
    if not isinstance(value, Mapping):
        raise GroundTruthError(f"{what} must be an object with start_s and end_s, got {value!r}")
    return _seconds(value.get("start_s"), f"{what}.start_s"), _seconds(value.get("end_s"), f"{what}.end_s")


def _stretch_dict(stretch: tuple[float, float]) -> dict[str, float | None]:
    return {"start_s": _round(stretch[0]), "end_s": _round(stretch[1])}


@dataclass(frozen=True)
class JudgedSpan:
    """The part of a run that is judged, and the clock it is judged on (run seconds).

    ``pulse_start_s`` / ``pulse_end_s``: the workload's designated pulse, where it has one (the
    windows are then aligned to its end, as the recovery rule's); without one, each collapse is
    given the burst that started it."""

    start_s: float
    end_s: float
    align_s: float  # a window boundary: the pulse's end, or the run's start
    window_s: float
    deadline_s: float
    capacity: float  # Ĉ, calls per run-second
    #: The recovery rule's growth limit of the waiting executions, per run-second (the plan's);
    #: None: the rule's own (a span in study seconds).
    max_growth_per_s: float | None = None
    pulse_start_s: float | None = None
    pulse_end_s: float | None = None

    def windows(self) -> list[tuple[float, float]]:
        """Windows of ``window_s`` covering [start_s, end_s), one boundary at ``align_s``; the
        first (and a last, shorter one) are cut to the span."""
        w = self.window_s
        first = self.align_s - math.ceil((self.align_s - self.start_s) / w - _EPS) * w
        out = []
        a = first
        while a < self.end_s - _EPS:
            b = a + w
            out.append((max(a, self.start_s), min(b, self.end_s)))
            a = b
        return out


@dataclass(frozen=True)
class Window:
    """One judged window: its calls (by planned arrival) and the waiting executions."""

    start_s: float
    end_s: float
    calls: int
    delivered_within_deadline: float  # share of its calls; 1.0 for a window without calls
    waiting_mean: float  # NaN: no scrape in the window
    waiting_slope_per_s: float
    delivered_ok: bool
    queue_ok: bool

    @property
    def ok(self) -> bool:
        """Good as the recovery rule counts a window: delivered and drained."""
        return self.delivered_ok and self.queue_ok

    def to_dict(self) -> dict[str, Any]:
        def number(v: float) -> float | None:
            return round(v, 6) if math.isfinite(v) else None

        return {
            "start_s": _round(self.start_s),
            "end_s": _round(self.end_s),
            "calls": self.calls,
            "delivered_within_deadline": number(self.delivered_within_deadline),
            "waiting_mean": number(self.waiting_mean),
            "waiting_slope_per_s": number(self.waiting_slope_per_s),
            "delivered_ok": self.delivered_ok,
            "queue_ok": self.queue_ok,
        }

    @classmethod
    def from_dict(cls, item: Any, what: str) -> Window:
        if not isinstance(item, Mapping):
            raise GroundTruthError(f"{what} must be an object, got {item!r}")

        def number(key: str) -> float:
            value = item.get(key)
            return math.nan if value is None else _seconds(value, f"{what}.{key}")

        calls = item.get("calls")
        if isinstance(calls, bool) or not isinstance(calls, int):
            raise GroundTruthError(f"{what}.calls must be a whole number, got {calls!r}")
        return cls(
            _seconds(item.get("start_s"), f"{what}.start_s"),
            _seconds(item.get("end_s"), f"{what}.end_s"),
            calls,
            number("delivered_within_deadline"),
            number("waiting_mean"),
            number("waiting_slope_per_s"),
            bool(item.get("delivered_ok")),
            bool(item.get("queue_ok")),
        )


@dataclass(frozen=True)
class Collapse:
    """A stretch of the run in which its calls were not delivered within the deadline.
    ``ended``: False when it ran to the end of the judged span (never recovered);
    ``metastable_at_s``: the first time inside it that first attempts arrived below Ĉ while
    executions were created at or above Ĉ (None: never, or unknown); ``metastable_for_s``: how
    long that held in all (a control that breaks the loop soon after it forms holds it briefly);
    ``burst``: in a run without a pulse, the burst that started it."""

    start_s: float
    end_s: float
    ended: bool
    metastable: bool | None = None
    metastable_at_s: float | None = None
    metastable_for_s: float | None = None
    burst: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        burst = {} if self.burst is None else {"burst": _stretch_dict(self.burst)}
        return {
            **burst,
            "start_s": _round(self.start_s),
            "end_s": _round(self.end_s),
            "metastable": self.metastable,
            "ended": self.ended,
            "metastable_at_s": _round(self.metastable_at_s),
            "metastable_for_s": _round(self.metastable_for_s),
        }

    @classmethod
    def from_dict(cls, item: Any, what: str) -> Collapse:
        if not isinstance(item, Mapping):
            raise GroundTruthError(f"{what} must be an object, got {item!r}")
        metastable = item.get("metastable")
        return cls(
            start_s=_seconds(item.get("start_s"), f"{what}.start_s"),
            end_s=_seconds(item.get("end_s"), f"{what}.end_s"),
            ended=bool(item.get("ended", True)),
            metastable=None if metastable is None else bool(metastable),
            metastable_at_s=_optional(item.get("metastable_at_s"), f"{what}.metastable_at_s"),
            metastable_for_s=_optional(item.get("metastable_for_s"), f"{what}.metastable_for_s"),
            burst=None if item.get("burst") is None else _stretch(item["burst"], f"{what}.burst"),
        )


def _list(entry: Mapping[str, Any], key: str, where: str) -> list[Any]:
    if key not in entry:
        raise GroundTruthError(f"{where}: no {key!r}")
    raw = entry[key]
    if not isinstance(raw, list):
        raise GroundTruthError(f"{where}: {key!r} must be a list, got {type(raw).__name__}")
    return raw


@dataclass(frozen=True)
class GroundTruth:
    """A run's judged span, its judged windows and its collapses; ``overload`` the stretch the
    run is aligned on (its pulse, or the burst behind its first collapse, or its busiest stretch
    without a collapse)."""

    span: JudgedSpan
    windows: list[Window]
    collapses: list[Collapse]
    overload: tuple[float, float] | None = None

    def entry_fields(self) -> dict[str, Any]:
        """The record as summary.json's entry holds it: ``collapses`` and ``judged``."""
        span = self.span
        return {
            "collapses": [c.to_dict() for c in self.collapses],
            "judged": {
                "start_s": _round(span.start_s),
                "end_s": _round(span.end_s),
                "align_s": _round(span.align_s),
                "window_s": span.window_s,
                "max_growth_per_s": span.max_growth_per_s,
                "pulse": None
                if span.pulse_start_s is None or span.pulse_end_s is None
                else _stretch_dict((span.pulse_start_s, span.pulse_end_s)),
                "overload": None if self.overload is None else _stretch_dict(self.overload),
                "windows": [w.to_dict() for w in self.windows],
            },
        }

    @staticmethod
    def recorded(entry: Mapping[str, Any]) -> bool:
        """The entry holds the record (summary.json files written before it do not)."""
        return isinstance(entry.get("judged"), Mapping)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> GroundTruth:
        """The record of one summary.json run entry; its deadline and Ĉ are the entry's own. A
        missing or malformed record raises :class:`GroundTruthError`."""
        where = f"summary run {entry.get('slug') or entry.get('series') or '?'!r}"
        judged = entry.get("judged")
        if not isinstance(judged, Mapping):
            raise GroundTruthError(
                f"{where}: no ground-truth record ('judged'); it was written before runs recorded "
                "their ground truth: run it again"
            )
        pulse = None if judged.get("pulse") is None else _stretch(judged["pulse"], f"{where}: judged.pulse")
        span = JudgedSpan(
            start_s=_seconds(judged.get("start_s"), f"{where}: judged.start_s"),
            end_s=_seconds(judged.get("end_s"), f"{where}: judged.end_s"),
            align_s=_seconds(judged.get("align_s"), f"{where}: judged.align_s"),
            window_s=_seconds(judged.get("window_s"), f"{where}: judged.window_s"),
            deadline_s=_seconds(entry.get("deadline_s"), f"{where}: deadline_s"),
            capacity=_seconds(entry.get("capacity"), f"{where}: capacity"),
            max_growth_per_s=_optional(judged.get("max_growth_per_s"), f"{where}: judged.max_growth_per_s"),
            pulse_start_s=None if pulse is None else pulse[0],
            pulse_end_s=None if pulse is None else pulse[1],
        )
        overload = judged.get("overload")
        return cls(
            span,
            [
                Window.from_dict(w, f"{where}: judged.windows[{i}]")
                for i, w in enumerate(_list(judged, "windows", where))
            ],
            [
                Collapse.from_dict(c, f"{where}: collapses[{i}]")
                for i, c in enumerate(_list(entry, "collapses", where))
            ],
            None if overload is None else _stretch(overload, f"{where}: judged.overload"),
        )


def collapses_of(entry: Mapping[str, Any]) -> Sequence[Collapse]:
    """Just the collapses of a run entry (what the dashboard draws)."""
    where = f"summary run {entry.get('slug') or entry.get('series') or '?'!r}"
    return [
        Collapse.from_dict(c, f"{where}: collapses[{i}]")
        for i, c in enumerate(_list(entry, "collapses", where))
    ]
