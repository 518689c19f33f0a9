"""The protocol of HTTP runs: the study's, and its scaled copy for a real vLLM on CPU."""

from __future__ import annotations

import statistics

import pytest

from reproduce.conditions import block
from reproduce.harness.backend import HttpBackend, HttpBackendError
from reproduce.harness.protocol import cpu_scaled, study
from reproduce.workloads.plan import RunClock

RETRIES_ON = block("diagnostic").condition("retries-on-cancel-off")


def test_cpu_scaled_protocol_divides_durations_and_token_lengths() -> None:
    proto = cpu_scaled(RunClock(10.0))
    plan = proto.plan(4.0, RETRIES_ON, seed=1)
    timeline = plan.timeline()
    assert (timeline.base_s, timeline.pulse_s, timeline.hold_s) == pytest.approx((12.0, 10.7, 72.0))
    assert timeline.deadline_s == pytest.approx(12.0)
    client = plan.client
    assert (client.deadline_s, client.backoff_min_s, client.backoff_max_s) == pytest.approx(
        (12.0, 0.025, 0.3)
    )
    assert client.retries == 3
    assert (proto.prompt_mean, proto.shared_prefix_len, proto.response_median) == (1_200.0, 200, 30.0)
    assert proto.scrape_every_s(plan) == pytest.approx(0.5)
    assert proto.gauge_window_s(plan) == pytest.approx(6.0)


def test_trace_rates_are_multiples_of_the_engines_capacity_per_wall_second() -> None:
    capacity = 4.0  # calls per wall second
    proto = cpu_scaled(RunClock(10.0)).with_hold(7_200.0)  # a long hold for a tight rate estimate
    plan = proto.plan(capacity, RETRIES_ON, seed=3)
    trace, timeline = plan.calls, plan.timeline()
    hold = [c for c in trace if c.phase == "hold"]
    assert len(hold) / timeline.hold_s == pytest.approx(0.6 * capacity, rel=0.05)
    pulse = [c for c in trace if c.phase == "pulse"]
    assert all(timeline.pulse_start <= c.arrival_s < timeline.pulse_end for c in pulse)
    assert statistics.mean(c.prompt_len for c in trace) == pytest.approx(1_200, rel=0.02)
    assert {c.shared_prefix_len for c in trace} == {200}
    assert statistics.median(c.response_len for c in trace) == pytest.approx(30, rel=0.1)


def test_study_protocol_keeps_the_study_lengths_at_any_time_scale() -> None:
    proto = study(RunClock(20.0))
    assert (proto.prompt_mean, proto.shared_prefix_len, proto.response_median) == (12_000.0, 2_000, 300.0)
    assert proto.plan(1.0, RETRIES_ON, seed=0).deadline_s == pytest.approx(6.0)


def test_backend_options_are_checked_up_front() -> None:
    # Only the emulated engine at the study's sizes takes the simulator's Ĉ (x the time scale).
    assert HttpBackend("emulated").capacity is None
    with pytest.raises(HttpBackendError, match="capacity"):
        HttpBackend("emulated", sizes="scaled")
    with pytest.raises(HttpBackendError, match="capacity"):
        HttpBackend("external", engine_url="http://127.0.0.1:1")
    with pytest.raises(HttpBackendError, match="python=VENV"):
        HttpBackend("vllm", capacity=1.0)
    with pytest.raises(HttpBackendError, match="engine_url"):
        HttpBackend("external", capacity=1.0)
    with pytest.raises(HttpBackendError, match="no option colour"):
        HttpBackend("emulated", capacity=1.0, colour="blue")
    with pytest.raises(HttpBackendError, match="capacity must be > 0"):
        HttpBackend("emulated", capacity=-1)
    with pytest.raises(HttpBackendError, match="sizes"):
        HttpBackend("emulated", capacity=1.0, sizes="huge")


def test_with_pulse_changes_only_the_pulse_and_names_it() -> None:
    from reproduce.conditions import expand
    from reproduce.harness.protocol import CI_PULSE_MULTIPLE
    from reproduce.workloads.pulse import with_pulse

    (run,) = expand("diagnostic", models="small", runs=1, conditions=["retries-on-cancel-off"])
    ci = with_pulse(run, CI_PULSE_MULTIPLE)
    assert ci.condition.workload.pulse_multiple == CI_PULSE_MULTIPLE != run.condition.workload.pulse_multiple
    assert ci.condition.slug == run.condition.slug  # outcomes and alerts still key on the condition
    assert ci.slug == f"diagnostic__retries-on-cancel-off-pulse-{CI_PULSE_MULTIPLE:g}__small__r0"
    assert (ci.condition.client, ci.condition.policy, ci.seed) == (
        run.condition.client,
        run.condition.policy,
        run.seed,
    )
    plan = cpu_scaled(RunClock(10.0)).plan(4.0, ci.condition, seed=1)
    pulse = [c for c in plan.calls if c.phase == "pulse"]
    assert plan.pulse is not None and plan.pulse.multiple == CI_PULSE_MULTIPLE
    assert len(pulse) / plan.timeline().pulse_s == pytest.approx(CI_PULSE_MULTIPLE * 4.0, rel=0.2)
    with pytest.raises(ValueError, match="positive"):
        with_pulse(run, 0.0)
