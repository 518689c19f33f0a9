"""Workload traces: determinism, Poisson rates per phase, lengths, segments and token IDs."""

from __future__ import annotations

import numpy as np
import pytest

from reproduce.workloads.calls import (
    PlannedCall,
    WorkloadError,
    WorkloadSpec,
    generate_trace,
    paper_phases,
    phase_rates,
    prompt_segments,
    prompt_token_ids,
    shared_prefix_segment_id,
)
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import RunClock, plan_run


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = generate_trace(WorkloadSpec(capacity=2.78, seed=7))
    b = generate_trace(WorkloadSpec(capacity=2.78, seed=7))
    c = generate_trace(WorkloadSpec(capacity=2.78, seed=8))
    assert a == b
    assert [x.arrival_s for x in a] != [x.arrival_s for x in c]


def test_arrivals_follow_the_phase_rates() -> None:
    spec = WorkloadSpec(capacity=2.78, seed=1)
    trace = generate_trace(spec)
    arrivals = [c.arrival_s for c in trace]
    assert arrivals == sorted(arrivals)
    for (name, start, end), rate in zip(spec.phase_bounds(), phase_rates(spec), strict=True):
        in_phase = [c for c in trace if c.phase == name]
        assert all(start <= c.arrival_s < end for c in in_phase)
        expected = rate * (end - start)
        assert abs(len(in_phase) - expected) < 4 * expected**0.5, (name, len(in_phase), expected)
    assert [name for name, _, _ in spec.phase_bounds()] == ["base", "pulse", "hold"]


def test_lengths_match_the_protocol() -> None:
    trace = generate_trace(WorkloadSpec(capacity=20.0, seed=3))
    prompts = np.array([c.prompt_len for c in trace])
    responses = np.array([c.response_len for c in trace])
    assert len(trace) > 10_000
    assert abs(prompts.mean() - 12_000) < 60
    assert abs(prompts.std() - 1_200) < 60
    assert abs(np.median(responses) - 300) < 12
    assert 380 < responses.mean() < 420
    assert all(c.shared_prefix_len == 2_000 for c in trace)


def test_mixed_prompts_gives_about_half_short_prompts() -> None:
    trace = generate_trace(WorkloadSpec(capacity=5.0, seed=2, mixed_prompts=True))
    short = sum(c.prompt_len == 3_000 for c in trace)
    assert 0.45 < short / len(trace) < 0.55


def test_a_plan_at_a_time_scale_compresses_the_same_calls() -> None:
    """A spec is at the study's scale; its plan divides every arrival and phase by K, once."""
    spec = WorkloadSpec(capacity=2.0, seed=5)
    full = generate_trace(spec)
    fast = plan_run(spec, ClientConfig(), RunClock(10.0))
    assert len(full) == len(fast.calls)
    for a, b in zip(full, fast.calls, strict=True):
        assert b.arrival_s == a.arrival_s / 10.0
        assert (a.prompt_len, a.response_len, a.phase) == (b.prompt_len, b.response_len, b.phase)
    assert spec.duration_s == pytest.approx(947.0) and fast.phases[-1].end_s == pytest.approx(94.7)


def test_pulse_multiple_and_custom_phases() -> None:
    spec = WorkloadSpec(capacity=1.0, phases=paper_phases(1.5))
    assert spec.phases[1] == (107.0, 1.5)
    assert paper_phases(hold_s=1_440.0) == ((120.0, 0.6), (107.0, 2.7), (1_440.0, 0.6))
    assert WorkloadSpec(capacity=1.0).phases == paper_phases()
    custom = WorkloadSpec(capacity=1.0, phases=((10, 1.0), (10, 2.0)))
    assert custom.names == ("phase0", "phase1")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0.0},
        {"capacity": 1.0, "phases": ()},
        {"capacity": 1.0, "phases": ((-1.0, 1.0),)},
        {"capacity": 1.0, "phase_names": ("a",)},
        {"capacity": 1.0, "prompt_mean": 1_000.0},
    ],
)
def test_bad_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(WorkloadError):
        WorkloadSpec(**kwargs)  # type: ignore[arg-type]


def test_segments_share_the_prefix_and_are_stable_per_call() -> None:
    a = PlannedCall("x-1", 0.0, 12_000, 2_000, 300, "base")
    b = PlannedCall("x-2", 1.0, 11_000, 2_000, 300, "base")
    sa, sb = prompt_segments(a), prompt_segments(b)
    assert sa[0] == sb[0] == (shared_prefix_segment_id(2_000), 2_000)
    assert sa[1][1] == 10_000 and sb[1][1] == 9_000
    assert sa[1][0] != sb[1][0]
    assert prompt_segments(a) == sa  # a retry resends the identical prompt


def test_token_ids_share_prefix_and_repeat_for_a_retry() -> None:
    a = PlannedCall("x-1", 0.0, 3_000, 2_000, 10, "base")
    b = PlannedCall("x-2", 0.0, 2_500, 2_000, 10, "base")
    ia, ib = prompt_token_ids(a, 32_000, seed=1), prompt_token_ids(b, 32_000, seed=1)
    assert len(ia) == 3_000 and len(ib) == 2_500
    assert ia[:2_000] == ib[:2_000]
    assert ia[2_000:2_500] != ib[2_000:]
    assert prompt_token_ids(a, 32_000, seed=1) == ia
    assert min(ia) >= 0 and max(ia) < 32_000
    assert prompt_token_ids(a, 32_000, seed=2)[:2_000] != ia[:2_000]
    with pytest.raises(WorkloadError):
        prompt_token_ids(a, 0)
