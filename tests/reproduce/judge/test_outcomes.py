"""Outcomes on hand-built records: cohorts, both delivery measures, the recovery rule's edges."""

from __future__ import annotations

import pytest

from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from reproduce.engine.model import ExecutionTrace
from reproduce.judge.outcomes import (
    RecoveryRule,
    RetryExecution,
    compute_outcomes,
    counter_at,
    delivery,
    recovery,
    retry_timing,
    trace_shares,
)
from reproduce.workloads.calls import WorkloadSpec
from reproduce.workloads.client import AttemptOutcome, AttemptRecord, CallRecord, ClientConfig
from reproduce.workloads.plan import RunClock, RunPlan, plan_run


def study_plan(time_scale: float = 1.0) -> RunPlan:
    """The study's pulse run planned at time scale ``time_scale`` (Ĉ = 1 call/s)."""
    return plan_run(WorkloadSpec(capacity=1.0), ClientConfig(), RunClock(time_scale))


TL = study_plan().timeline()


def call(planned: float, delivered_after: float | None, *, retries: int = 0) -> CallRecord:
    """A call whose first attempt is sent at ``planned``; delivered ``delivered_after`` later."""
    record = CallRecord(f"c{planned}", planned)
    t = planned
    for i in range(retries):
        record.attempts.append(
            AttemptRecord(i, t, t + 120, ended_at=t + 120, outcome=AttemptOutcome.DISCONNECTED)
        )
        t += 121
    last = AttemptRecord(retries, t, t + 120)
    record.attempts.append(last)
    if delivered_after is not None:
        record.delivered_at = planned + delivered_after
        last.ended_at = record.delivered_at
        last.outcome = AttemptOutcome.DELIVERED
    record.done = True
    return record


def quiet(
    t0: float = 0.0, t1: float = 1500.0, waiting: float = 0.0, slope: float = 0.0
) -> list[tuple[float, float]]:
    return [(t, waiting + slope * (t - t0)) for t in range(int(t0), int(t1) + 1, 5)]


def test_timeline_of_the_study_and_scaled() -> None:
    assert (TL.pulse_start, TL.pulse_end, TL.primary_start, TL.hold_end) == (120, 227, 347, 947)
    assert len(TL.windows()) == 12 and TL.windows()[0] == (227, 287)
    scaled = study_plan(10).timeline()
    assert scaled.primary_start == pytest.approx(34.7) and scaled.deadline_s == 12.0
    assert scaled.windows()[1] == pytest.approx((28.7, 34.7))


def test_cohorts_and_both_delivery_measures() -> None:
    calls = [
        call(119.9, 1.0),  # base: no cohort
        call(120.0, 10.0),  # pulse, within
        call(200.0, 300.0, retries=2),  # pulse, late (after the first deadline) but by horizon
        call(226.9, None),  # pulse, undelivered
        call(227.0, 120.0),  # hold, exactly at the deadline counts as within
        call(300.0, 900.0, retries=3),  # hold, after the horizon: not delivered
        call(400.0, 5.0),  # hold and primary
        call(947.0, 1.0),  # after the hold: no cohort
    ]
    d = delivery(calls, TL)
    assert d["pulse"] == {
        "offered": 3,
        "within_deadline": pytest.approx(1 / 3),
        "by_horizon": pytest.approx(2 / 3),
    }
    assert d["hold"] == {
        "offered": 3,
        "within_deadline": pytest.approx(2 / 3),
        "by_horizon": pytest.approx(2 / 3),
    }
    assert d["primary"] == {"offered": 1, "within_deadline": 1.0, "by_horizon": 1.0}


def calls_per_window(bad_windows: set[int], n: int = 50, late_per_bad: int = 2) -> list[CallRecord]:
    """``n`` calls in each hold window; a bad window has ``late_per_bad`` late calls."""
    out = []
    for i, (start, _) in enumerate(TL.windows()):
        for j in range(n):
            late = i in bad_windows and j < late_per_bad
            out.append(call(start + j * (60 / n), 200.0 if late else 3.0))
    return out


def test_recovery_is_the_end_of_the_second_good_window() -> None:
    ok, t, _ = recovery(calls_per_window({0, 1, 3}), quiet(), TL)
    assert ok and t == pytest.approx(6 * 60)  # windows 4 and 5 are the first good pair


def test_one_late_call_in_fifty_is_still_98_percent() -> None:
    ok, t, _ = recovery(calls_per_window(set(range(12)), late_per_bad=1), quiet(), TL)
    assert ok and t == pytest.approx(120)
    ok, _, _ = recovery(calls_per_window(set(range(12)), late_per_bad=2), quiet(), TL)
    assert not ok


def test_never_two_consecutive_good_windows_is_not_recovered() -> None:
    ok, t, detail = recovery(calls_per_window({0, 2, 4, 6, 8, 10}), quiet(), TL)
    assert not ok and t is None and len(detail) == 12


def test_waiting_queue_mean_and_growth_gate_recovery() -> None:
    good = calls_per_window(set())
    assert recovery(good, quiet(waiting=2.0), TL)[0]
    assert not recovery(good, quiet(waiting=2.5), TL)[0]
    # a queue that grows by 0.02/s from empty is low on average but still not recovered
    assert not recovery(good, quiet(waiting=0.0, slope=0.02), TL)[0]
    assert recovery(good, quiet(waiting=0.0, slope=0.001), TL)[0]
    # no scrape at all: unknown is not healthy
    assert not recovery(good, [], TL)[0]
    # a stricter rule
    assert not recovery(good, quiet(waiting=1.0), TL, RecoveryRule(max_waiting=0.5))[0]


def snap(t: float, **values: float) -> Snapshot:
    samples = [
        (mn.ATTEMPTS, {"kind": "first"}, values.get("first", 0.0)),
        (mn.ATTEMPTS, {"kind": "retry"}, values.get("retry", 0.0)),
        (mn.ATTEMPTS_ATTACHED, {}, values.get("attached", 0.0)),
        (mn.EXECUTIONS_CREATED, {}, values.get("created", 0.0)),
        (mn.EXECUTIONS_DISPATCHED, {}, values.get("dispatched", 0.0)),
        (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, values.get("completed", 0.0)),
        (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, values.get("orphaned", 0.0)),
        (mn.EXECUTIONS_FINISHED, {"fate": "refused"}, values.get("refused", 0.0)),
        (mn.EXECUTIONS_QUEUED, {}, values.get("queued", 0.0)),
        (mn.VLLM_NUM_WAITING, {"model_name": "m"}, values.get("waiting", 0.0)),
        (mn.VLLM_PREFIX_CACHE_QUERIES, {"model_name": "m"}, values.get("queries", 0.0)),
        (mn.VLLM_PROMPT_TOKENS, {"model_name": "m"}, values.get("prompt", 0.0)),
    ]
    return Snapshot(t, samples)


def test_rates_counts_littles_law_and_token_gap_from_the_series() -> None:
    # Linear counters: 3 attempts/s (2 first + 1 retry), 2.5 created/s, 2 dispatched/s of which
    # 0.5 refused, engine completes 1/s + orphans 0.5/s; 20 waiting; queries 1000/s, counted 600/s.
    series = [
        snap(
            t,
            first=2 * t,
            retry=t,
            attached=0.5 * t,
            created=2.5 * t,
            dispatched=2 * t,
            refused=0.5 * t,
            completed=t,
            orphaned=0.5 * t,
            waiting=15.0,
            queued=5.0,
            queries=1000 * t,
            prompt=600 * t,
        )
        for t in range(0, 1200, 5)
    ]
    calls = [call(400.0, 5.0), call(500.0, 300.0, retries=2)]
    out = compute_outcomes(calls, series, TL, capacity=2.0)
    rates = out["rates_x_capacity"]
    assert rates == pytest.approx(
        {
            "attempts": 1.5,
            "executions_created": 1.25,
            "executions_accepted": 0.75,
            "executions_completed": 0.75,
        }
    )
    assert out["waiting_over_littles_law"] == pytest.approx(20 / (3 * 120))
    assert out["prompt_token_gap_hold"] == pytest.approx(0.4)
    assert out["retries"] == {"total": 2, "refused": 0, "attached": round(0.5 * 1195)}
    ex = out["executions"]
    assert ex["created"] == round(2.5 * 1195) and ex["accepted"] == 2 * 1195 - round(0.5 * 1195)
    assert not out["recovered"]  # 20 waiting: never healthy


def test_counter_interpolates_between_scrapes() -> None:
    series = [snap(0, created=0), snap(5, created=10), snap(10, created=10)]
    assert counter_at(series, mn.EXECUTIONS_CREATED, 2.5) == pytest.approx(5)
    assert counter_at(series, mn.EXECUTIONS_CREATED, 100) == 10
    assert counter_at([], mn.EXECUTIONS_CREATED, 1) == 0


def test_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        compute_outcomes([], [], TL, capacity=0)


def test_trace_shares_on_hand_built_traces() -> None:
    completed = ExecutionTrace(
        "a", 1000, 10, 0.0, prefill_steps=[(0, 0.0, 600), (1, 0.1, 400)], first_token_at=0.2
    )
    # aborted after its first token: 1,000 computed, the last 200 by the step in flight at the abort
    body_and_flight = ExecutionTrace(
        "b", 1000, 10, 0.0, prefill_steps=[(2, 0.2, 800), (3, 0.3, 200)], first_token_at=0.4, aborted_at=0.5
    )
    body_and_flight.in_flight_steps = (3,)
    # aborted before its first token: 500 computed, never counted by vllm:prompt_tokens_total
    missed = ExecutionTrace("c", 1000, 10, 0.0, prefill_steps=[(4, 0.4, 500)], aborted_at=0.6)
    never_ran = ExecutionTrace("d", 1000, 10, 0.0, aborted_at=0.1)  # aborted while waiting
    shares = trace_shares([completed, body_and_flight, missed, never_ran])
    assert shares["computed_prompt_tokens"] == 2500
    assert shares["aborted_share"] == pytest.approx(1500 / 2500)
    assert shares["in_flight_share_of_aborted"] == pytest.approx(200 / 1500)
    assert shares["missed_share"] == pytest.approx(500 / 2500)
    assert trace_shares([])["aborted_share"] is None


def test_retry_timing_medians_and_the_share_never_scheduled() -> None:
    retries = [
        RetryExecution(first_scheduled_at=119.8, deadline_at=120.0, predecessor_abort_at=0.0),
        RetryExecution(first_scheduled_at=239.5, deadline_at=240.0, predecessor_abort_at=119.0),
        RetryExecution(first_scheduled_at=300.0, deadline_at=301.0),  # predecessor not aborted
        RetryExecution(first_scheduled_at=None, deadline_at=400.0, predecessor_abort_at=280.0),
    ]
    timing = retry_timing(retries)
    assert timing["retry_scheduled_before_deadline_s"] == pytest.approx(0.5)
    assert timing["retry_scheduled_after_predecessor_abort_s"] == pytest.approx((119.8 + 120.5) / 2)
    assert timing["retry_never_scheduled_share"] == pytest.approx(0.25)
    assert timing["retries_traced"] == 4
    empty = retry_timing([])
    assert empty["retry_never_scheduled_share"] is None and empty["retry_scheduled_before_deadline_s"] is None
