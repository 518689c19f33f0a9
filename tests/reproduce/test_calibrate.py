"""Calibration of Ĉ: the line fit, the staged search, and a real run on a small engine model."""

from __future__ import annotations

import dataclasses

import pytest

from reproduce.calibrate import (
    CalibrationError,
    StageObservation,
    calibrate,
    queue_growth_rate,
    sim_latency,
    sim_stage_runner,
)
from reproduce.engine import EngineConfig, EngineModel, EngineRequest, EventKind, StepTimeModel
from reproduce.engine.process import EngineProcess
from reproduce.simenv import Environment
from reproduce.workloads.calls import WorkloadSpec, generate_trace, prompt_segments

SMALL_ENGINE = EngineConfig(
    num_gpu_blocks=3_000,
    step_time=StepTimeModel(
        fixed_s=0.05, per_prompt_token_s=2e-4, per_running_s=1e-4, per_context_token_s=1e-7
    ),
    block_size=16,
    max_num_batched_tokens=2_048,
    max_num_seqs=64,
    max_model_len=4_096,
)
SMALL_WORKLOAD = WorkloadSpec(
    capacity=1.0,
    prompt_mean=1_000.0,
    prompt_std=100.0,
    shared_prefix_len=200,
    response_median=40.0,
    max_context=4_096,
)


def test_growth_is_the_least_squares_slope() -> None:
    samples = [(t, 3.0 + 0.25 * t + (0.5 if t % 2 else -0.5)) for t in range(100)]
    assert queue_growth_rate(samples) == pytest.approx(0.25, abs=1e-3)
    with pytest.raises(CalibrationError):
        queue_growth_rate([(0.0, 1.0)])
    with pytest.raises(CalibrationError):
        queue_growth_rate([(1.0, 1.0), (1.0, 2.0)])


def linear_engine(capacity: float, seen: list[tuple[float, float]]):  # type: ignore[no-untyped-def]
    """A stand-in engine whose queue grows at exactly (rate - capacity) when overloaded."""

    def run_stage(rate: float, duration_s: float, index: int) -> StageObservation:
        seen.append((rate, duration_s))
        growth = max(0.0, rate - capacity)
        samples = [(t * duration_s / 50, growth * t * duration_s / 50) for t in range(51)]
        return StageObservation(
            arrivals=round(rate * duration_s), duration_s=duration_s, waiting_samples=samples
        )

    return run_stage


def test_stages_grow_by_the_factor_until_the_queue_grows() -> None:
    seen: list[tuple[float, float]] = []
    result = calibrate(linear_engine(3.0, seen), start_rate=1.0, use_observed_rate=False)
    assert [round(r, 4) for r, _ in seen] == [1.0, 1.5, 2.25, 3.375]
    assert all(d == 300.0 for _, d in seen)
    assert result.saturated_stage == 3
    assert result.capacity == pytest.approx(3.0, abs=1e-6)
    assert [s.saturated for s in result.stages] == [False, False, False, True]


def test_a_queue_below_threshold_is_not_saturated_and_no_saturation_is_an_error() -> None:
    seen: list[tuple[float, float]] = []
    # growth 0.05 calls/s at 1.5 is under the 0.1 threshold; 2.25 saturates
    result = calibrate(linear_engine(1.45, seen), start_rate=1.0)
    assert result.saturated_stage == 2
    with pytest.raises(CalibrationError, match="no stage saturated"):
        calibrate(linear_engine(1e9, []), start_rate=1.0, max_stages=3)
    with pytest.raises(CalibrationError):
        calibrate(linear_engine(1.0, []), start_rate=0.0)


def steady_throughput(rate: float, duration_s: float) -> float:
    """Completions per second over the second half of a long overloaded run."""
    spec = dataclasses.replace(SMALL_WORKLOAD, capacity=rate, phases=((duration_s, 1.0),), seed=99)
    env = Environment()
    engine = EngineModel(SMALL_ENGINE)
    done: list[float] = []
    proc = EngineProcess(env, engine, lambda e: done.append(e.t) if e.kind == EventKind.FINISHED else None)
    for call in generate_trace(spec):
        env.schedule(
            call.arrival_s, proc.submit, EngineRequest(call.call_id, prompt_segments(call), call.response_len)
        )
    env.run(until=duration_s)
    return sum(1 for t in done if t >= duration_s / 2) / (duration_s / 2)


def test_calibration_on_a_small_engine_finds_its_saturated_throughput() -> None:
    runner = sim_stage_runner(SMALL_ENGINE, workload=SMALL_WORKLOAD, seed=1)
    result = calibrate(runner, start_rate=2.0, stage_s=120.0)
    assert result.stages[result.saturated_stage].growth_rate >= 0.1
    throughput = steady_throughput(1.5 * result.capacity, 300.0)
    assert result.capacity == pytest.approx(throughput, rel=0.1)
    # the same seed gives the same calibration
    again = calibrate(
        sim_stage_runner(SMALL_ENGINE, workload=SMALL_WORKLOAD, seed=1), start_rate=2.0, stage_s=120.0
    )
    assert again == result


def test_low_load_latency_on_a_small_engine() -> None:
    summary = sim_latency(SMALL_ENGINE, 1.0, duration_s=120.0, warmup_s=10.0, workload=SMALL_WORKLOAD)
    # a ~800-token prefill (cache hit on the 200-token prefix) fits one 2,048-token step
    assert 0.2 < summary.median_ttft_s < 0.6
    assert summary.median_ttlt_s > summary.median_ttft_s
    assert summary.calls > 80
