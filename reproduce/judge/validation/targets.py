"""The targets the alerts are held to (``validation.json``'s ``targets``), with the figures that
explain a run that breaks one: the retry-loop alert fires in every run that did not recover,
soon after the pulse's end, and never before the pulse, after a recovery or where retries were
shed or attached; the backlog alert fires before the pulse's end in every run that did not
recover; and no collapse is silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from detector.thresholds import ALERTS_BY_NAME
from foundation import metricnames as mn
from foundation.timeseries import read_series
from reproduce.judge.validation.runs import Firing, RunInfo, RunResult, firings_of, first_after, stats

RETRY_LOOP = "VLLMMetastableRetryLoop"
SILENCE = "no collapse is silent"
BACKLOG = "VLLMBacklogBeyondDeadline"
# The retry-loop alert must fire within this long after the pulse's end, in the study's seconds
# (a run's: ``RunInfo.run_s``).
RETRY_LOOP_LEAD_TARGET_S = 120.0
# No collapse is silent: in a run that never recovers, a critical alert fires within this long
# after the collapse that lasts to the end of the hold began (study seconds; a
# run's: ``RunInfo.run_s``) and is still firing at the hold's end. A miss is known only one deadline
# after its call arrived, so the symptom alert cannot fire sooner than about a deadline.
SILENCE_TARGET_S = 300.0
# A late firing is put beside when the loop formed: executions created over this window (study
# seconds) rising to Ĉ, the loop's fuel, seen at a finer grain than the detector's rate window.
LOOP_FORMATION_WINDOW_S = 10.0


def _primary(info: RunInfo) -> str:
    """The primary window (the hold minus its first deadline) as the run's entry gives it."""
    if info.hold_end_s is None:
        return "the hold"
    return f"the hold ({info.pulse_end_s + info.deadline_s:g}–{info.hold_end_s:g} s)"


def _hold_and_control(info: RunInfo, below: str, prefix: str = "") -> list[str]:
    """The figures both explanations give: execution creation over the hold against Ĉ (``below``
    says what creation under Ĉ means), and whether the run's controls shed or attached retries."""
    parts = []
    x = info.hold_creation_x_capacity
    if x is not None:
        parts.append(f"{prefix}{x:.2f} Ĉ over {_primary(info)}{below if x < 1.0 else ': at or above Ĉ'}")
    if info.shed_or_attached:
        parts.append(f"retries shed or attached ({info.condition})")
    else:
        parts.append(f"condition {info.condition}: retries neither shed nor attached")
    return parts


def explain_transient_loop(info: RunInfo, firing: Firing) -> str:
    """Why a run that recovered showed the retry-loop signature between its pulse and recovery:
    the figures that separate a loop that drains from one that holds (docs/protocol.md §8)."""
    parts = []
    if firing.value is not None:
        parts.append(f"executions created at {firing.value:.2f} Ĉ when it fired")
    below = ": below Ĉ, so the backlog drained" if info.recovered else ": below Ĉ"
    return "; ".join(parts + _hold_and_control(info, below))


def explain_miss(info: RunInfo) -> str:
    """Why the retry-loop alert stayed silent (or came late) in a run that did not recover: the
    loop needs executions created at or above Ĉ; below it the backlog drains, however slowly,
    or sits at the deadline's edge (an engine queue cap of Ĉ x deadline holds it there)."""
    return "; ".join(
        _hold_and_control(info, ": below Ĉ, so not the loop's fuel", prefix="executions created at ")
    )


def loop_formed_at_s(info: RunInfo, before_s: float) -> float | None:
    """When the loop formed, for a firing at ``before_s``: the last time, from the pulse's end
    to ``before_s``, at which executions created over ``LOOP_FORMATION_WINDOW_S`` (scaled) rose
    to Ĉ. None when creation stayed at or above Ĉ over all that time (the loop had formed by
    the pulse's end) or the run's series is not there."""
    if not info.series.exists():
        return None
    window = info.run_s(LOOP_FORMATION_WINDOW_S)
    points = [
        (snap.t, created)
        for snap in read_series(info.series)
        if (created := snap.value(mn.EXECUTIONS_CREATED)) is not None
    ]
    formed = None
    j = 0
    below = False
    for t, created in points:
        while j + 1 < len(points) and points[j + 1][0] <= t - window:
            j += 1
        t0, c0 = points[j]
        if t - t0 < window or t < info.pulse_end_s:
            continue
        if t > before_s:
            break
        at_capacity = (created - c0) / (t - t0) >= info.capacity
        if at_capacity and below:
            formed = t
        below = not at_capacity
    return formed


def _run_ref(r: RunResult, **extra: Any) -> dict[str, Any]:
    return {"run": r.info.slug, **extra}


def _critical(r: RunResult) -> list[Firing]:
    return sorted(
        (f for f in r.firings if (rule := ALERTS_BY_NAME.get(f.alertname)) and rule.severity == "critical"),
        key=lambda f: f.fired_at_s,
    )


def _why_silent(r: RunResult) -> str:
    """What the last judged windows of a run that did not recover show: a run whose calls were
    delivered in time again is held unrecovered by the queue part of the recovery rule alone."""
    windows = [w for w in r.windows or [] if w.calls]
    if not windows:
        return "no judged window with calls"
    last = windows[-3:]
    shares = ", ".join(f"{w.delivered_within_deadline:.0%}" for w in last)
    if all(w.delivered_ok for w in last):
        waiting = ", ".join(f"{w.waiting_mean:.1f}" for w in last)
        return (
            f"its last {len(last)} windows delivered {shares} of their calls within the deadline: calls are "
            f"answered in time again, and only the queue part of the recovery rule holds it unrecovered "
            f"(mean executions waiting {waiting})"
        )
    return f"its last {len(last)} windows delivered {shares} of their calls within the deadline"


def check_silence(results: Sequence[RunResult]) -> dict[str, Any]:
    """No collapse is silent: in every run with a collapse that lasts to the end of its hold, a
    critical alert (any cause, or the symptom) fires within ``SILENCE_TARGET_S`` (scaled) of that
    collapse's start and is still firing at the hold's end. Lists the runs silent at the end (with
    what their last windows show) and those whose first critical firing came later."""
    silent: list[dict[str, Any]] = []
    late: list[dict[str, Any]] = []
    delays: list[float] = []
    judged = 0
    for r in results:
        lasting = [c for c in r.collapses or [] if not c.ended]
        if not lasting:
            continue
        judged += 1
        start, end = lasting[0].start_s, r.info.judged_end_s
        critical = _critical(r)
        first = first_after(critical, start)
        if first is not None:
            delay = first.fired_at_s - start
            delays.append(delay)
            if delay > r.info.run_s(SILENCE_TARGET_S):
                late.append(_run_ref(r, after_collapse_s=round(delay, 3), alertname=first.alertname))
        if not any(
            f.fired_at_s <= end and (f.resolved_at_s is None or f.resolved_at_s >= end) for f in critical
        ):
            silent.append(_run_ref(r, why=_why_silent(r)))
    return {
        "runs_collapsed_to_the_end": judged,
        "target_s": SILENCE_TARGET_S,
        "first_critical_after_collapse_s": stats(delays),
        "silent_at_the_end": silent,
        "late_first_firing": late,
        "met": not (silent or late),
    }


def check_targets(results: Sequence[RunResult]) -> dict[str, Any]:
    """The targets the alerts are held to, computed on every run given (the ``paper`` block's
    runs when validating ``--block paper``): the retry-loop alert fires in every run that did not
    recover, at most ``RETRY_LOOP_LEAD_TARGET_S`` (scaled) after the pulse's end, and never
    before the pulse, after a recovery or in a run whose retries were shed or attached; the
    backlog alert fires before the pulse's end in every run that did not recover. Each list
    names the runs that break or qualify a target."""
    loop_missed: list[dict[str, Any]] = []
    loop_late: list[dict[str, Any]] = []
    loop_before_pulse: list[dict[str, Any]] = []
    loop_after_recovery: list[dict[str, Any]] = []
    loop_controlled: list[dict[str, Any]] = []
    loop_between: list[dict[str, Any]] = []
    backlog_missed: list[dict[str, Any]] = []
    backlog_recovering: list[dict[str, Any]] = []
    for r in results:
        info = r.info
        loop = firings_of(r, RETRY_LOOP)
        backlog = firings_of(r, BACKLOG)
        lead_target = info.run_s(RETRY_LOOP_LEAD_TARGET_S)
        first_loop = first_after(loop, info.pulse_start_s)
        if not info.recovered:
            if first_loop is None:
                loop_missed.append(_run_ref(r, why=explain_miss(info)))
            elif first_loop.fired_at_s - info.pulse_end_s > lead_target:
                lead = round(first_loop.fired_at_s - info.pulse_end_s, 3)
                formed = loop_formed_at_s(info, first_loop.fired_at_s)
                extra = {} if formed is None else {"loop_formed_s": round(formed - info.pulse_end_s, 3)}
                loop_late.append(_run_ref(r, lead_time_s=lead, why=explain_miss(info), **extra))
            if not any(info.pulse_start_s <= f.fired_at_s <= info.pulse_end_s for f in backlog):
                backlog_missed.append(_run_ref(r))
        before = [f for f in loop if f.fired_at_s < info.pulse_start_s]
        if before:
            loop_before_pulse.append(_run_ref(r, fired_at_s=before[0].fired_at_s))
        recovery_at = info.recovery_at_s
        if recovery_at is not None:
            after = [f for f in loop if f.fired_at_s > recovery_at]
            if after:
                loop_after_recovery.append(_run_ref(r, fired_at_s=after[0].fired_at_s))
            between = [f for f in loop if info.pulse_start_s <= f.fired_at_s <= recovery_at]
            for f in between:
                loop_between.append(
                    _run_ref(
                        r,
                        fired_at_s=f.fired_at_s,
                        resolved_at_s=f.resolved_at_s,
                        recovery_at_s=recovery_at,
                        why=explain_transient_loop(info, f),
                    )
                )
            if backlog:
                backlog_recovering.append(_run_ref(r, fired_at_s=backlog[0].fired_at_s))
        if info.shed_or_attached and loop:
            loop_controlled.append(
                _run_ref(
                    r,
                    fired_at_s=loop[0].fired_at_s,
                    recovered=info.recovered,
                    why=explain_transient_loop(info, loop[0]),
                )
            )
    collapsed = sum(1 for r in results if not r.info.recovered)
    recovering = sum(1 for r in results if r.info.recovered)
    return {
        RETRY_LOOP: {
            "missed_runs": loop_missed,
            "late_runs": loop_late,
            "lead_target_s": RETRY_LOOP_LEAD_TARGET_S,
            "fired_before_pulse": loop_before_pulse,
            "fired_after_recovery": loop_after_recovery,
            "fired_in_shed_or_attached_runs": loop_controlled,
            "fired_between_pulse_and_recovery": loop_between,
            "met": not (
                loop_missed or loop_late or loop_before_pulse or loop_after_recovery or loop_controlled
            ),
        },
        BACKLOG: {
            "runs_not_recovered": collapsed,
            "missed_before_pulse_end": backlog_missed,
            "runs_recovered": recovering,
            "fired_in_recovering_runs": backlog_recovering,
            "fired_in_recovering_runs_count": len(backlog_recovering),
            "met": not backlog_missed,
        },
        SILENCE: check_silence(results),
    }
