"""The simulator: determinism, the counter balance, the metric names, and a scaled pulse in
which retries without controls keep the engine from recovering while retries off recover."""

from __future__ import annotations

from typing import Any

import pytest

from foundation import metricnames as mn
from foundation.vllmbuckets import SERIES_HISTOGRAMS
from reproduce.conditions import Condition, block
from reproduce.judge.outcomes import compute_outcomes
from reproduce.sim import SimResult, SimSpec, simulate
from reproduce.workloads.client import AttemptOutcome, ClientConfig
from reproduce.workloads.clients import parse_client
from reproduce.workloads.plan import RunClock
from tests.reproduce.small_engine import CAPACITY, ENGINE, WORKLOAD

TIME_SCALE = 10.0


def run(condition: Condition, seed: int = 1, **changes: Any) -> tuple[SimSpec, SimResult]:
    spec = SimSpec(
        model="test",
        condition=condition,
        seed=seed,
        capacity=CAPACITY,
        clock=RunClock(TIME_SCALE),
        engine_config=ENGINE,
        workload=WORKLOAD,
        **changes,
    )
    return spec, simulate(spec)


def outcomes(spec: SimSpec, result: SimResult) -> dict[str, Any]:
    return compute_outcomes(result.calls, result.snapshots, result.plan.timeline(), result.capacity)


DIAG = block("diagnostic")


def test_deterministic_for_a_seed() -> None:
    cond = DIAG.condition("retries-on-cancel-on")
    _, a = run(cond, seed=3)
    _, b = run(cond, seed=3)
    _, c = run(cond, seed=4)
    assert [x.to_dict() for x in a.calls] == [x.to_dict() for x in b.calls]
    assert [s.to_json() for s in a.snapshots] == [s.to_json() for s in b.snapshots]
    assert [x.to_dict() for x in a.calls] != [x.to_dict() for x in c.calls]


def test_scaled_pulse_retries_without_controls_never_recover_while_retries_off_do() -> None:
    spec, off = run(DIAG.condition("retries-off-cancel-off"))
    out_off = outcomes(spec, off)
    spec, on = run(DIAG.condition("retries-on-cancel-off"))
    out_on = outcomes(spec, on)
    assert out_off["recovered"] and out_off["recovery_time_s"] is not None
    assert not out_on["recovered"] and out_on["recovery_time_s"] is None
    # docs/protocol.md §8: the collapsed run creates executions above Ĉ, the recovered one below it,
    # and with cancellation off the engine keeps completing (orphaned) executions at about Ĉ.
    assert out_on["rates_x_capacity"]["executions_created"] > 2.0
    assert out_off["rates_x_capacity"]["executions_created"] < 1.0
    assert out_on["rates_x_capacity"]["executions_completed"] > 0.8
    assert out_on["executions"]["orphaned"] > 5 * out_on["executions"]["completed"]
    assert out_on["delivery"]["primary"]["within_deadline"] < 0.05
    # the proxy's own derived gauge (its collector, its sliding window) shows the loop
    tl = on.plan.timeline()
    ratios = [
        s.value(mn.CREATION_CAPACITY_RATIO) for s in on.snapshots if tl.primary_start < s.t <= tl.hold_end
    ]
    assert ratios and min(r for r in ratios if r is not None) > 1.5
    assert out_off["delivery"]["primary"]["within_deadline"] > 0.5


def test_retries_with_cancellation_collapse_completions_and_fill_the_queue_to_littles_law() -> None:
    spec, result = run(DIAG.condition("retries-on-cancel-on"))
    out = outcomes(spec, result)
    assert not out["recovered"]
    assert out["rates_x_capacity"]["executions_completed"] < 0.1
    assert out["waiting_over_littles_law"] == pytest.approx(1.0, abs=0.5)
    assert out["prompt_token_gap_hold"] >= 0.0


def test_counters_stay_balanced_and_names_are_the_contract() -> None:
    cond = block("queue-policy").condition("lifo")
    spec, result = run(cond)
    every = spec.clock.run_s(spec.snapshot_every_s)
    assert result.snapshots[1].t - result.snapshots[0].t == pytest.approx(every)
    known = {v for k, v in vars(mn).items() if k.isupper() and isinstance(v, str)}
    known |= {family + suffix for family in SERIES_HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")}
    for snap in [*result.snapshots[:: max(1, len(result.snapshots) // 15)], result.snapshots[-1]]:
        names = {n for n, _, _ in snap.samples}
        assert names <= known, names - known
        assert {mn.EXECUTION_CREATION_RATE, mn.WAITING_LITTLES_LAW_RATIO, mn.PROMPT_TOKEN_GAP_RATIO} <= names
        v = snap.value
        attempts = v(mn.ATTEMPTS)
        assert attempts == v(mn.ATTEMPTS_ATTACHED) + v(mn.ATTEMPTS_SHED) + v(mn.EXECUTIONS_CREATED)
        fate = {f: v(mn.EXECUTIONS_FINISHED, fate=f) for f in mn.FATES}
        assert v(mn.EXECUTIONS_CREATED) == v(mn.EXECUTIONS_DISPATCHED) + fate["dropped"] + v(
            mn.EXECUTIONS_QUEUED
        )
        finished = fate["completed"] + fate["orphaned"] + fate["cancelled"] + fate["failed"] + fate["refused"]
        assert v(mn.EXECUTIONS_DISPATCHED) == finished + v(mn.EXECUTIONS_LIVE)
        assert v(mn.CAPACITY) == CAPACITY and v(mn.CLIENT_DEADLINE) == pytest.approx(12.0)
        # the run's proxy was given the deadline: its series says so (not "learned")
        assert v(mn.CLIENT_DEADLINE_SOURCE, source=mn.DEADLINE_STATED) == 1.0
        assert v(mn.UPSTREAM_UP) == 1.0
        assert v(mn.VLLM_NUM_WAITING) is not None and v(mn.VLLM_PREFIX_CACHE_QUERIES) is not None
    final = result.snapshots[-1]
    assert final.value(mn.EXECUTIONS_FINISHED, fate="dropped") > 0  # LIFO over 50 queued drops some
    # every call ended: delivered, or failed after its attempts
    assert all(c.done for c in result.calls)
    delivered = sum(c.delivered for c in result.calls)
    assert final.value(mn.CALLS_DELIVERED) == delivered


def test_every_call_is_judged_once_on_the_proxys_clock_missed_or_delivered_in_time() -> None:
    spec, result = run(DIAG.condition("retries-on-cancel-off"))
    timeline = spec.plan().timeline()
    deadline = timeline.deadline_s
    missed = [s.value(mn.CALLS_MISSED_DEADLINE) for s in result.snapshots]
    assert all(m is not None for m in missed) and missed == sorted(missed)  # a counter, in every scrape
    before_pulse = [m for s, m in zip(result.snapshots, missed, strict=True) if s.t < timeline.pulse_start]
    assert before_pulse[-1] == 0  # the base load is served in time
    final = result.snapshots[-1]
    in_time = sum(
        c.delivered_at is not None and c.delivered_at <= c.first_sent_at + deadline + 1e-9
        for c in result.calls
    )
    # every call is good (delivered within the deadline) or missed, never both, never neither
    assert final.value(mn.CALLS_DELIVERED, within_deadline="true") == in_time
    assert final.value(mn.CALLS_MISSED_DEADLINE) == len(result.calls) - in_time > 0
    assert final.value(mn.ATTEMPTS, kind="first") == len(result.calls)


def test_attempts_follow_the_client_rules() -> None:
    _, result = run(DIAG.condition("retries-on-cancel-off"))
    deadline = result.plan.deadline_s
    for call in result.calls:
        assert 1 <= len(call.attempts) <= 4
        for prev, nxt in zip(call.attempts, call.attempts[1:], strict=False):
            assert prev.outcome is AttemptOutcome.DISCONNECTED
            assert prev.ended_at == pytest.approx(prev.sent_at + deadline)
            assert 0.025 - 1e-9 <= nxt.sent_at - prev.ended_at <= 0.3 + 1e-9  # backoff / 10
    _, no_retry = run(DIAG.condition("retries-off-cancel-off"))
    assert all(len(c.attempts) == 1 for c in no_retry.calls)


def test_engine_cap_refuses_and_the_client_retries_after_a_503() -> None:
    spec, result = run(block("engine-cap").condition("engine-cap-100"))
    refused = [a for c in result.calls for a in c.attempts if a.outcome is AttemptOutcome.REFUSED]
    assert refused
    out = outcomes(spec, result)
    assert out["executions"]["refused_by_engine"] == len(refused)
    assert result.snapshots[-1].value("vllm:admission_rejections_total") == len(refused)


def test_deferred_cancellation_lets_retries_attach() -> None:
    spec, result = run(block("deferral").condition("deferred-cancellation"))
    out = outcomes(spec, result)
    assert out["retries"]["attached"] > 0
    assert out["retries"]["attached"] == out["retries"]["total"] - out["retries"]["refused"] - (
        out["executions"]["created"] - len(result.calls)
    )
    assert out["delivery"]["hold"]["by_horizon"] == 1.0  # attaching delivers every hold call
    spec, result = run(block("deferral").condition("coalescing-cancel-on"))
    assert outcomes(spec, result)["retries"]["attached"] < out["retries"]["attached"] / 10


def test_retry_budget_sheds_with_retry_after() -> None:
    _, result = run(block("composition").condition("retry-budget"))
    shed = [a for c in result.calls for a in c.attempts if a.outcome is AttemptOutcome.SHED]
    assert shed and all(a.retry_after_s is not None and a.retry_after_s >= 0 for a in shed)


def test_tracing_reports_the_shares() -> None:
    _, result = run(block("tracing").condition("steps-2k-cancel-on"))
    shares = result.trace_shares
    assert shares is not None
    assert 0 < shares["aborted_share"] <= 1
    assert 0 <= shares["in_flight_share_of_aborted"] <= 1
    assert 0 < shares["missed_share"] <= shares["aborted_share"]
    # retries reach the engine only as their own deadline arrives (the study's finding): scheduled
    # within seconds of it, about a deadline after their predecessor was aborted, or never
    before = shares["retry_scheduled_before_deadline_s"]
    after = shares["retry_scheduled_after_predecessor_abort_s"]
    assert before is not None and after is not None and shares["retries_traced"]
    deadline = ClientConfig().deadline_s / TIME_SCALE
    assert 0 < before < 0.1 * deadline
    assert 0.8 * deadline < after < deadline + ClientConfig().backoff_max_s / TIME_SCALE
    assert 0 < shares["retry_never_scheduled_share"] < 1
    _, untraced = run(DIAG.condition("retries-on-cancel-on"))
    assert untraced.trace_shares is None


def test_a_read_timeout_gives_up_only_an_attempt_still_waiting_for_its_first_token() -> None:
    client = parse_client("openai-sdk,read-timeout=20").config  # 2 s at the test's time scale
    _, result = run(DIAG.condition("retries-on-cancel-off"), client=client)
    attempts = [a for c in result.calls for a in c.attempts]
    gave_up = [a for a in attempts if a.outcome is AttemptOutcome.DISCONNECTED]
    assert gave_up and all(a.first_byte_at is None for a in gave_up)
    assert all(a.ended_at == pytest.approx(a.sent_at + 20 / TIME_SCALE) for a in gave_up)
    # once its tokens flow, nothing bounds the attempt: some took longer than the read timeout
    late = [a for a in attempts if a.outcome is AttemptOutcome.DELIVERED and a.ended_at - a.sent_at > 2.0]
    assert late and all(a.first_byte_at is not None and a.first_byte_at - a.sent_at <= 2.0 for a in late)
    assert max(len(c.attempts) for c in result.calls) == 3
