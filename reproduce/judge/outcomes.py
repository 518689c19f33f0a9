"""Outcomes of a pulse run (docs/protocol.md §6), from call records and the metrics series.

Whichever world produced them (the simulator or an HTTP driver against a real engine), a run
is judged the same way: cohorts by planned arrival, delivery within the deadline and by the
horizon, the recovery rule and time, rates over the primary window in multiples of Ĉ, counts of
attempts, executions and their fates, the waiting queue over Little's law, and the prompt-token
gap over the hold. Counts of executions come from the proxy's counters in the series (the
client cannot see them); delivery comes from the client's records.

NOTE: every time here is in the run's own seconds: with ``--time-scale K`` the timeline's
durations are already divided by K, and ``capacity`` is in calls per run-second. The timeline
comes from the run's plan (``reproduce.workloads.plan.RunPlan.timeline``): the phases the run ran.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from reproduce.workloads.client import AttemptOutcome, CallRecord
from reproduce.workloads.plan import RecoveryRule, Timeline

__all__ = [
    "RecoveryRule",
    "RetryExecution",
    "Timeline",
    "cohort_delivery",
    "compute_outcomes",
    "counter_at",
    "counter_rate",
    "counts",
    "delivery",
    "mean_and_slope",
    "rates_x_capacity",
    "recovery",
    "retry_timing",
    "trace_shares",
    "waiting_series",
]


# --- delivery -------------------------------------------------------------------------


def _within_deadline(call: CallRecord, deadline_s: float) -> bool:
    """Delivered within the first attempt's deadline."""
    return call.delivered_at is not None and call.delivered_at <= call.first_sent_at + deadline_s + 1e-9


def _by_horizon(call: CallRecord, horizon_s: float) -> bool:
    return call.delivered_at is not None and call.delivered_at <= call.planned_at + horizon_s + 1e-9


def cohort(calls: Iterable[CallRecord], start: float, end: float) -> list[CallRecord]:
    """Calls planned in ``[start, end)``."""
    return [c for c in calls if start <= c.planned_at < end]


def delivery(calls: Sequence[CallRecord], timeline: Timeline) -> dict[str, dict[str, float | int | None]]:
    """Delivery of the pulse, hold and primary cohorts as fractions of offered calls."""
    cohorts = {
        "pulse": (timeline.pulse_start, timeline.pulse_end),
        "hold": (timeline.pulse_end, timeline.hold_end),
        "primary": (timeline.primary_start, timeline.hold_end),
    }
    return cohort_delivery(calls, cohorts, timeline.deadline_s, timeline.horizon_s)


def cohort_delivery(
    calls: Sequence[CallRecord],
    cohorts: Mapping[str, tuple[float, float]],
    deadline_s: float,
    horizon_s: float,
) -> dict[str, dict[str, float | int | None]]:
    """Delivery of each named cohort ``[start, end)`` as fractions of its offered calls."""
    out: dict[str, dict[str, float | int | None]] = {}
    for name, (start, end) in cohorts.items():
        members = cohort(calls, start, end)
        n = len(members)
        within = sum(_within_deadline(c, deadline_s) for c in members)
        by_horizon = sum(_by_horizon(c, horizon_s) for c in members)
        out[name] = {
            "offered": n,
            "within_deadline": within / n if n else None,
            "by_horizon": by_horizon / n if n else None,
        }
    return out


# --- the metrics series ---------------------------------------------------------------


def _value(snapshot: Snapshot, name: str, labels: dict[str, str] | None = None) -> float:
    value = snapshot.value(name, **(labels or {}))
    return 0.0 if value is None or math.isnan(value) else value


def counter_at(
    snapshots: Sequence[Snapshot], name: str, t: float, labels: dict[str, str] | None = None
) -> float:
    """A counter's value at ``t``, linearly interpolated between scrapes (held at the ends)."""
    if not snapshots:
        return 0.0
    if t <= snapshots[0].t:
        return _value(snapshots[0], name, labels)
    if t >= snapshots[-1].t:
        return _value(snapshots[-1], name, labels)
    i = bisect.bisect_right(snapshots, t, key=lambda s: s.t)  # snapshots[i-1].t <= t < snapshots[i].t
    prev, nxt = snapshots[i - 1], snapshots[i]
    a, b = _value(prev, name, labels), _value(nxt, name, labels)
    span = nxt.t - prev.t
    return a if span <= 0 else a + (b - a) * (t - prev.t) / span


def counter_rate(snapshots: Sequence[Snapshot], name: str, t0: float, t1: float, **labels: str) -> float:
    """A counter's mean rate over ``[t0, t1]`` (interpolated at both ends; 0 for an empty span)."""
    if t1 <= t0:
        return 0.0
    return (counter_at(snapshots, name, t1, labels) - counter_at(snapshots, name, t0, labels)) / (t1 - t0)


def waiting_series(snapshots: Iterable[Snapshot]) -> list[tuple[float, float]]:
    """Executions waiting in the proxy's queue and the engine's waiting queue, per scrape."""
    return [(s.t, _value(s, mn.EXECUTIONS_QUEUED) + _value(s, mn.VLLM_NUM_WAITING)) for s in snapshots]


def mean_and_slope(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Mean and least-squares slope of (t, v) points, as the recovery rule measures growth."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t <= 0:
        return mean_v, 0.0
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / var_t
    return mean_v, slope


# --- recovery -------------------------------------------------------------------------


def recovery(
    calls: Sequence[CallRecord],
    waiting: Sequence[tuple[float, float]],
    timeline: Timeline,
    rule: RecoveryRule | None = None,
) -> tuple[bool, float | None, list[dict[str, object]]]:
    """The recovery rule: the first two consecutive hold windows that each deliver at least
    ``min_delivered`` of their calls within the deadline while the waiting executions average at
    most ``max_waiting`` and grow by at most the timeline's ``max_growth_per_s`` (the plan's, in
    run seconds). Returns (recovered, time from
    the pulse's end to the end of the second window, per-window detail).

    A window with no calls meets the delivery part; one with no scrape fails the waiting part
    (unknown is not healthy).
    """
    rule = rule or RecoveryRule()
    growth_limit = timeline.max_growth_per_s  # the plan's, per run-second
    detail: list[dict[str, object]] = []
    ok_prev = False
    for start, end in timeline.windows():
        members = cohort(calls, start, end)
        n = len(members)
        within = sum(_within_deadline(c, timeline.deadline_s) for c in members)
        share = within / n if n else 1.0
        pts = [(t, v) for t, v in waiting if start <= t <= end]
        if pts:
            mean_wait, slope = mean_and_slope(pts)
            waiting_ok = mean_wait <= rule.max_waiting and slope <= growth_limit
        else:
            mean_wait, slope, waiting_ok = math.nan, math.nan, False
        ok = share >= rule.min_delivered and waiting_ok
        detail.append(
            {
                "start_s": start,
                "end_s": end,
                "calls": n,
                "delivered_within_deadline": share,
                "waiting_mean": mean_wait,
                "waiting_slope_per_s": slope,
                "ok": ok,
            }
        )
        if ok and ok_prev:
            return True, round(end - timeline.pulse_end, 6), detail
        ok_prev = ok
    return False, None, detail


# --- everything for summary.json -------------------------------------------------------


def _final(snapshots: Sequence[Snapshot], name: str, **labels: str) -> int:
    return round(_value(snapshots[-1], name, labels)) if snapshots else 0


def compute_outcomes(
    calls: Sequence[CallRecord],
    snapshots: Sequence[Snapshot],
    timeline: Timeline,
    capacity: float,
    rule: RecoveryRule | None = None,
) -> dict[str, object]:
    """Every outcome of one run, shaped as the summary.json contract asks.

    ``capacity`` is Ĉ in calls per run-second; ``snapshots`` is the run's metrics series in
    time order (its last snapshot is taken at the run's end).
    """
    if not (math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"capacity must be a positive call rate, got {capacity!r}")
    snapshots = sorted(snapshots, key=lambda s: s.t)
    recovered, recovery_time, windows = recovery(calls, waiting_series(snapshots), timeline, rule)
    t0, t1 = timeline.primary_start, timeline.hold_end
    attempts_rate = counter_rate(snapshots, mn.ATTEMPTS, t0, t1)

    in_primary = [(t, v) for t, v in waiting_series(snapshots) if t0 <= t <= t1]
    mean_waiting = sum(v for _, v in in_primary) / len(in_primary) if in_primary else math.nan
    littles = attempts_rate * timeline.deadline_s
    waiting_ratio = mean_waiting / littles if littles > 0 and not math.isnan(mean_waiting) else None

    h0, h1 = timeline.pulse_end, timeline.hold_end
    queries = counter_at(snapshots, mn.VLLM_PREFIX_CACHE_QUERIES, h1) - counter_at(
        snapshots, mn.VLLM_PREFIX_CACHE_QUERIES, h0
    )
    counted = counter_at(snapshots, mn.VLLM_PROMPT_TOKENS, h1) - counter_at(
        snapshots, mn.VLLM_PROMPT_TOKENS, h0
    )
    gap = (queries - counted) / queries if queries > 0 else None

    return {
        "recovered": recovered,
        "recovery_time_s": recovery_time,
        "recovery_windows": windows,
        "delivery": delivery(calls, timeline),
        "rates_x_capacity": rates_x_capacity(snapshots, t0, t1, capacity),
        **counts(calls, snapshots),
        "waiting_over_littles_law": waiting_ratio,
        "prompt_token_gap_hold": gap,
    }


def rates_x_capacity(
    snapshots: Sequence[Snapshot], t0: float, t1: float, capacity: float
) -> dict[str, float]:
    """Attempts and executions created, accepted and completed over ``[t0, t1]``, in Ĉ."""
    accepted_rate = counter_rate(snapshots, mn.EXECUTIONS_DISPATCHED, t0, t1) - counter_rate(
        snapshots, mn.EXECUTIONS_FINISHED, t0, t1, fate="refused"
    )
    # The engine ran an execution to its end whether or not a subscriber still waited.
    engine_completed_rate = sum(
        counter_rate(snapshots, mn.EXECUTIONS_FINISHED, t0, t1, fate=fate)
        for fate in ("completed", "orphaned")
    )
    return {
        "attempts": counter_rate(snapshots, mn.ATTEMPTS, t0, t1) / capacity,
        "executions_created": counter_rate(snapshots, mn.EXECUTIONS_CREATED, t0, t1) / capacity,
        "executions_accepted": accepted_rate / capacity,
        "executions_completed": engine_completed_rate / capacity,
    }


def counts(calls: Sequence[CallRecord], snapshots: Sequence[Snapshot]) -> dict[str, dict[str, int]]:
    """Calls, retries and executions of the whole run, by what became of them (``snapshots`` in
    time order: the last one is the run's end)."""
    retries = [a for c in calls for a in c.attempts if a.is_retry]
    refused_outcomes = (AttemptOutcome.SHED, AttemptOutcome.REFUSED)
    fates = {f: _final(snapshots, mn.EXECUTIONS_FINISHED, fate=f) for f in mn.FATES}
    dispatched = _final(snapshots, mn.EXECUTIONS_DISPATCHED)
    return {
        "calls": {
            "offered": len(calls),
            "delivered": sum(c.delivered for c in calls),
            "attempts": sum(len(c.attempts) for c in calls),
        },
        "retries": {
            "total": len(retries),
            "refused": sum(a.outcome in refused_outcomes for a in retries),
            "attached": _final(snapshots, mn.ATTEMPTS_ATTACHED),
        },
        "executions": {
            "created": _final(snapshots, mn.EXECUTIONS_CREATED),
            "accepted": dispatched - fates["refused"],
            "refused_by_engine": fates["refused"],
            "dropped_at_proxy": fates["dropped"],
            "cancelled": fates["cancelled"],
            "completed": fates["completed"],
            "orphaned": fates["orphaned"],
            "failed": fates["failed"],
        },
    }


# --- tracing ---------------------------------------------------------------------------


class ExecutionTraceLike(Protocol):
    """What the trace shares need of one execution's trace (``reproduce.engine.ExecutionTrace``)."""

    @property
    def computed_prompt_tokens(self) -> int: ...

    first_token_at: float | None
    aborted_at: float | None

    def prompt_tokens_in_flight(self) -> int: ...


def trace_shares(traces: Iterable[ExecutionTraceLike]) -> dict[str, float | None]:
    """docs/protocol.md §6's tracing shares over every execution of a run:

    * ``aborted_share``: computed prompt tokens held by aborted executions / all computed;
    * ``in_flight_share_of_aborted``: of the aborted executions' computed prompt tokens, those
      computed by steps in flight at the abort (the rest is their body);
    * ``missed_share``: computed prompt tokens of executions aborted before their first output
      (never counted by ``vllm:prompt_tokens_total``) / all computed.
    """
    total = aborted = in_flight = missed = 0
    for tr in traces:
        computed = tr.computed_prompt_tokens
        total += computed
        if tr.aborted_at is None:
            continue
        aborted += computed
        in_flight += tr.prompt_tokens_in_flight()
        if tr.first_token_at is None:
            missed += computed
    return {
        "aborted_share": aborted / total if total else None,
        "in_flight_share_of_aborted": in_flight / aborted if aborted else None,
        "missed_share": missed / total if total else None,
        "computed_prompt_tokens": float(total),
    }


@dataclass(frozen=True)
class RetryExecution:
    """The execution a retry created, as the tracing timing (what the study's traces report)
    needs it: when vLLM's scheduler first scheduled it (None: never), its attempt's deadline,
    and when the abort of the call's previous execution reached the engine (None: that one was
    not aborted)."""

    first_scheduled_at: float | None
    deadline_at: float
    predecessor_abort_at: float | None = None


def retry_timing(retries: Iterable[RetryExecution]) -> dict[str, float | None]:
    """When the executions of retries were first scheduled (medians over those scheduled):

    * ``retry_scheduled_before_deadline_s``: how long before the retry's own deadline;
    * ``retry_scheduled_after_predecessor_abort_s``: how long after the abort of the call's
      previous execution (retries whose predecessor was aborted);
    * ``retry_never_scheduled_share``: of the retries' executions the engine accepted, those
      never scheduled (they waited out their deadline in the queue);
    * ``retries_traced``: how many retries' executions these figures cover.
    """
    items = list(retries)
    scheduled = [r for r in items if r.first_scheduled_at is not None]
    before = [r.deadline_at - r.first_scheduled_at for r in scheduled if r.first_scheduled_at is not None]
    after = [
        r.first_scheduled_at - r.predecessor_abort_at
        for r in scheduled
        if r.first_scheduled_at is not None and r.predecessor_abort_at is not None
    ]
    return {
        "retry_scheduled_before_deadline_s": statistics.median(before) if before else None,
        "retry_scheduled_after_predecessor_abort_s": statistics.median(after) if after else None,
        "retry_never_scheduled_share": (len(items) - len(scheduled)) / len(items) if items else None,
        "retries_traced": float(len(items)),
    }
