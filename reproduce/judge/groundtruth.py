"""The ground truth of a run over time (docs/protocol.md, "Ground truth over time"): its
collapses, and which of them are metastable.

A *collapse* is a stretch in which the calls that arrive are not delivered within the deadline.
Calls are grouped by planned arrival into the recovery rule's 60-s windows (in the run's
seconds, as its plan recorded them); a window in which fewer than 98 % of its calls are delivered
within the deadline is *bad*. A collapse starts in a bad window, at the planned arrival of the
first of its calls that missed the deadline, and ends at the end of the last window before two
consecutive *good* windows, good as the recovery rule counts a window (at least 98 % delivered
within the deadline, and the executions waiting in the proxy and the engine averaging at most
two and growing by at most 0.01/s, per study second); without two such windows it runs to the end of the run's
judged span (for the pulse protocol, the end of the hold). The queue conditions hold a collapse
open (a backlog that still waits is not over), but never start one: a queue whose calls are
all delivered in time is not a collapse.

A collapse is *metastable* when it outlasts the overload that started it: at some point inside
it, first attempts arrive below Ĉ over a 60-s window while executions are still created at or
above Ĉ (the proxy's counters in the run's series). Without the proxy's counters that is unknown
(None).

Windows are aligned to the pulse's end for the pulse protocol (as the recovery rule's, so that
both judge the same windows and their verdicts agree), to the run's start otherwise.

A run without a pulse (a replayed trace) names, for each collapse, the *burst* that started it
(:func:`burst_before`, the one definition): the busiest stretch of one window's length whose
start lies at most one deadline plus one window before the collapse's start, and not after it.

The record is computed once, when a run ends (:func:`truth_record`, by ``reproduce.judge.summary``),
and written into its summary entry; its types (``Collapse``, ``Window``, ``JudgedSpan``,
``GroundTruth``) live in ``foundation.groundtruth`` so that every reader shares them. An entry
written before runs recorded it is computed once on read (:func:`legacy_truth`).

NOTE: every time here is in the run's own seconds, like summary.json's: with ``--time-scale K``
the window and the deadline are already divided by K and Ĉ is in calls per run-second.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation import metricnames as mn
from foundation.groundtruth import Collapse, GroundTruth, JudgedSpan, Window
from foundation.rundir import RunDirError
from foundation.timeseries import Snapshot
from reproduce.judge.outcomes import counter_rate, mean_and_slope, waiting_series
from reproduce.workloads.client import CallRecord
from reproduce.workloads.plan import RecoveryRule

__all__ = [
    "CALLS_FILE",
    "CallTimes",
    "Collapse",
    "GroundTruth",
    "JudgedSpan",
    "Window",
    "agrees_with_recovery",
    "burst_before",
    "busiest_stretch",
    "calls_of_records",
    "collapsed_to_the_end",
    "find_collapses",
    "ground_truth",
    "judge_windows",
    "legacy_truth",
    "read_calls",
    "span_of",
    "truth_record",
]

#: The call records a run writes beside its metrics series (``reproduce/judge/summary.py``).
CALLS_FILE = "attempts.jsonl"
_EPS = 1e-9


@dataclass(frozen=True)
class CallTimes:
    """What the ground truth needs of one call: when it was planned to arrive, when its first
    attempt was sent, and when it was delivered (None: never)."""

    planned_at: float
    first_sent_at: float
    delivered_at: float | None

    def within(self, deadline_s: float) -> bool:
        """Delivered within the first attempt's deadline (docs/protocol.md §6)."""
        return self.delivered_at is not None and self.delivered_at <= self.first_sent_at + deadline_s + _EPS


def span_of(run: Mapping[str, Any]) -> JudgedSpan:
    """The judged span of a summary.json run entry written before runs recorded their ground
    truth (``legacy_truth``): the run's start to the end of the hold (``hold_end_s``; without
    one, ``duration_s``), windows aligned to the pulse's end when the run had a pulse, the
    window its plan recorded (``plan.window_s``), at its deadline, against its Ĉ."""
    pulse = run.get("pulse") if isinstance(run.get("pulse"), Mapping) else None
    pulse_start = None if pulse is None or pulse.get("start_s") is None else float(pulse["start_s"])
    pulse_end = None if pulse is None or pulse.get("end_s") is None else float(pulse["end_s"])
    end = run.get("hold_end_s")
    if end is None:
        end = run.get("duration_s")
    plan = run.get("plan")
    window = plan.get("window_s") if isinstance(plan, Mapping) else None
    growth = plan.get("max_growth_per_s") if isinstance(plan, Mapping) else None
    if end is None or window is None or growth is None:
        raise RunDirError(
            f"run {run.get('slug', '?')!r}: needs 'hold_end_s' or 'duration_s', 'plan.window_s' and "
            "'plan.max_growth_per_s' (a summary.json written before runs recorded their plan: run it again)"
        )
    return JudgedSpan(
        start_s=0.0,
        end_s=float(end),
        align_s=pulse_end if pulse_end is not None else 0.0,
        window_s=float(window),
        deadline_s=float(run["deadline_s"]),
        capacity=float(run["capacity"]),
        max_growth_per_s=float(growth),
        pulse_start_s=pulse_start,
        pulse_end_s=pulse_end,
    )


def read_calls(path: Path) -> list[CallTimes]:
    """The call records of ``attempts.jsonl`` (one call a line: ``planned_at``, ``attempts``
    with each ``sent_at``, ``delivered_at``); a clear error names a bad line."""
    calls = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                planned = float(obj["planned_at"])
                attempts = obj.get("attempts") or []
                sent = float(attempts[0]["sent_at"]) if attempts else planned
                delivered = obj.get("delivered_at")
                calls.append(CallTimes(planned, sent, None if delivered is None else float(delivered)))
            except (ValueError, KeyError, TypeError, IndexError, OverflowError) as exc:
                raise RunDirError(f"{path}:{lineno}: not a call record ({exc})") from None
    return calls


def judge_windows(
    calls: Sequence[CallTimes],
    snapshots: Sequence[Snapshot],
    span: JudgedSpan,
    rule: RecoveryRule | None = None,
) -> list[Window]:
    """Every window of the span, judged by the recovery rule's thresholds."""
    rule = rule or RecoveryRule()
    # the plan's limit, per run-second (a span without one is in study seconds: the rule's own)
    growth_limit = rule.max_growth_per_s if span.max_growth_per_s is None else span.max_growth_per_s
    waiting = waiting_series(snapshots)
    ordered = sorted(calls, key=lambda c: c.planned_at)
    planned = [c.planned_at for c in ordered]
    out = []
    for start, end in span.windows():
        members = ordered[bisect.bisect_left(planned, start) : bisect.bisect_left(planned, end)]
        share = sum(c.within(span.deadline_s) for c in members) / len(members) if members else 1.0
        pts = [(t, v) for t, v in waiting if start <= t <= end]
        if pts:
            mean, slope = mean_and_slope(pts)
            queue_ok = mean <= rule.max_waiting and slope <= growth_limit
        else:
            mean, slope, queue_ok = math.nan, math.nan, False  # unknown is not healthy
        out.append(
            Window(start, end, len(members), share, mean, slope, share >= rule.min_delivered, queue_ok)
        )
    return out


def busiest_stretch(
    planned_at: Sequence[float], lo: float, hi: float, length_s: float
) -> tuple[float, float]:
    """The stretch ``length_s`` long, starting in ``[lo, hi]``, that holds the most planned
    arrivals (the earliest of equals); ``planned_at`` sorted. Without an arrival starting one in
    that reach: the stretch ending at ``hi`` (starting at ``lo`` if that is later)."""
    best = (max(lo, hi - length_s), 0)
    for i in range(bisect.bisect_left(planned_at, lo), bisect.bisect_right(planned_at, hi)):
        a = planned_at[i]
        count = bisect.bisect_left(planned_at, a + length_s) - i
        if count > best[1]:
            best = (a, count)
    return best[0], best[0] + length_s


def burst_before(planned_at: Sequence[float], start_s: float, span: JudgedSpan) -> tuple[float, float]:
    """The burst that started a collapse beginning at ``start_s`` (docs/protocol.md §9): of the
    stretches one window long (60 s at the study's scale) that start at most one deadline plus
    one window before ``start_s`` and not after it, the one holding the most planned arrivals.
    ``planned_at``: every call's planned arrival, sorted.

    NOTE: a backlog makes a call miss its deadline only once about a deadline's worth of work
    waits ahead of it, so the overload behind a collapse began up to a deadline (plus the
    window it is counted over) before the collapse's first missed call."""
    w = span.window_s
    return busiest_stretch(planned_at, max(span.start_s, start_s - span.deadline_s - w), start_s, w)


def calls_of_records(records: Iterable[CallRecord]) -> list[CallTimes]:
    """The ground truth's view of a run's call records (``attempts.jsonl``'s, before writing)."""
    return [CallTimes(r.planned_at, r.first_sent_at, r.delivered_at) for r in records]


def find_collapses(
    windows: Sequence[Window], calls: Sequence[CallTimes], deadline_s: float
) -> list[Collapse]:
    """The collapses of judged windows (metastability not yet known)."""
    out = []
    ordered = sorted(calls, key=lambda c: c.planned_at)
    planned = [c.planned_at for c in ordered]
    i, n = 0, len(windows)
    while i < n:
        w = windows[i]
        if w.delivered_ok:
            i += 1
            continue
        members = ordered[bisect.bisect_left(planned, w.start_s) : bisect.bisect_left(planned, w.end_s)]
        missed = [c.planned_at for c in members if not c.within(deadline_s)]
        start = min(missed) if missed else w.start_s
        k = i + 1
        while k + 1 < n and not (windows[k].ok and windows[k + 1].ok):
            k += 1
        if k + 1 < n:  # windows k and k+1 are good: the collapse ended where k begins
            out.append(Collapse(start, windows[k].start_s, ended=True))
            i = k
        else:
            out.append(Collapse(start, windows[-1].end_s, ended=False))
            break
    return out


def _metastable_times(
    collapse: Collapse, snapshots: Sequence[Snapshot], span: JudgedSpan
) -> tuple[float | None, float]:
    """When, inside the collapse, first attempts over the window before a scrape first arrived
    below Ĉ while executions were created at or above Ĉ; and for how long that held in all (the
    scrape intervals it held at, summed)."""
    w = span.window_s
    first_at: float | None = None
    held = 0.0
    inside = [s for s in snapshots if collapse.start_s <= s.t <= collapse.end_s + _EPS]
    for i, snap in enumerate(inside):
        t = snap.t
        if t - w < snapshots[0].t - _EPS:
            continue
        first = counter_rate(snapshots, mn.ATTEMPTS, t - w, t, kind="first")
        created = counter_rate(snapshots, mn.EXECUTIONS_CREATED, t - w, t)
        if first < span.capacity and created >= span.capacity:
            first_at = t if first_at is None else first_at
            nxt = inside[i + 1].t if i + 1 < len(inside) else collapse.end_s
            held += max(nxt - t, 0.0)
    return first_at, held


def _has_proxy_counters(snapshots: Sequence[Snapshot]) -> bool:
    return bool(snapshots) and all(
        snapshots[-1].value(name) is not None for name in (mn.ATTEMPTS, mn.EXECUTIONS_CREATED)
    )


def ground_truth(calls: Iterable[CallTimes], snapshots: Iterable[Snapshot], span: JudgedSpan) -> GroundTruth:
    """The collapses of one run, each marked metastable or not (None without proxy counters),
    and the overload the run is aligned on: its pulse; without one, the burst behind its first
    collapse, or its busiest stretch when nothing collapsed."""
    calls = list(calls)
    snapshots = sorted(snapshots, key=lambda s: s.t)
    windows = judge_windows(calls, snapshots, span)
    found = find_collapses(windows, calls, span.deadline_s)
    known = _has_proxy_counters(snapshots)
    pulse = (
        None
        if span.pulse_start_s is None or span.pulse_end_s is None
        else (span.pulse_start_s, span.pulse_end_s)
    )
    planned = sorted(c.planned_at for c in calls) if pulse is None else []
    marked = []
    for c in found:
        burst = burst_before(planned, c.start_s, span) if pulse is None else None
        if not known:
            marked.append(Collapse(c.start_s, c.end_s, c.ended, burst=burst))
            continue
        at, held = _metastable_times(c, snapshots, span)
        marked.append(
            Collapse(c.start_s, c.end_s, c.ended, at is not None, at, held if at is not None else 0.0, burst)
        )
    if pulse is not None:
        overload = pulse
    elif marked and marked[0].burst is not None:
        overload = marked[0].burst
    else:
        overload = busiest_stretch(planned, span.start_s, span.end_s, span.window_s)
    return GroundTruth(span, windows, marked, overload)


def legacy_truth(entry: Mapping[str, Any], calls_path: Path, series_path: Path) -> GroundTruth | None:
    """The ground truth of a run entry written before runs recorded it (no ``judged``), computed
    once on read from the run's call records and series; None without its call records."""
    if not calls_path.is_file():
        return None
    from foundation.timeseries import read_series

    return ground_truth(read_calls(calls_path), read_series(series_path), span_of(entry))


def truth_record(
    calls: Iterable[CallTimes], snapshots: Iterable[Snapshot], span: JudgedSpan
) -> dict[str, Any]:
    """The record a run's summary entry holds (``collapses`` and ``judged``), computed once when
    the run ends."""
    return ground_truth(calls, snapshots, span).entry_fields()


def collapsed_to_the_end(collapses: Iterable[Collapse], from_s: float) -> bool:
    """A collapse under way at or after ``from_s`` runs to the end of the judged span."""
    return any(not c.ended and c.end_s > from_s for c in collapses)


def agrees_with_recovery(truth: GroundTruth, recovered: bool) -> bool:
    """The pulse protocol's check: a run is not recovered (docs/protocol.md §6) exactly when a
    collapse under way at or after the pulse's start runs to the end of the hold.

    NOTE: "under way", not "started": the collapse a pulse causes can begin a few seconds before
    it (up to 10 s on the paper block's seeds 7321 and 12421), with base calls still running when
    the pulse arrives, slowed past their deadline by the pulse's prefills sharing every step."""
    pulse_start = truth.span.pulse_start_s if truth.span.pulse_start_s is not None else truth.span.start_s
    return collapsed_to_the_end(truth.collapses, pulse_start) == (not recovered)
