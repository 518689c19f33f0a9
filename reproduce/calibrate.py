"""Calibration of the capacity Ĉ (docs/protocol.md §5), generic over a stage runner.

Stages of ``stage_s`` seconds, each at ``factor`` times the previous arrival rate, run without
retries until the engine's waiting queue grows by at least ``growth_threshold`` calls/s. In that
saturated stage Ĉ = the stage's arrival rate - the queue's growth rate, where the growth rate
is the slope of a least-squares line through the waiting-queue samples over the stage.

A stage runner is any callable ``run_stage(rate, duration_s, stage_index) -> StageObservation``
taking the rate in calls per (its own) second; ``sim_stage_runner`` runs stages on the engine
model, another runner can drive a real engine. Stages and rates are in the runner's own seconds:
a scaled run's calibration gives stages already shortened (``reproduce.harness.calibration``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from reproduce.engine import EngineConfig, EngineEvent, EngineModel, EngineRequest, EventKind, preset
from reproduce.engine.process import EngineProcess
from reproduce.simenv import Environment
from reproduce.workloads.calls import PlannedCall, WorkloadSpec, generate_trace, prompt_segments

__all__ = [
    "CalibrationError",
    "CalibrationResult",
    "LatencySummary",
    "StageObservation",
    "StageRunner",
    "StageSummary",
    "TimedStageObservation",
    "calibrate",
    "queue_growth_rate",
    "sim_latency",
    "sim_stage_runner",
]


class CalibrationError(RuntimeError):
    """Calibration could not find a saturated stage, or a stage runner returned unusable data."""


@dataclass(frozen=True, slots=True)
class StageObservation:
    """What a stage runner saw: arrivals sent, and ``(t, waiting)`` samples over the stage."""

    arrivals: int
    duration_s: float
    waiting_samples: Sequence[tuple[float, float]]
    completed: int = 0


@dataclass(frozen=True, slots=True)
class TimedStageObservation(StageObservation):
    """A stage observation that also says when each call completed (seconds from the stage's start)."""

    completion_times: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StageSummary:
    """One stage in protocol units (unscaled calls/s)."""

    index: int
    planned_rate: float
    arrival_rate: float
    growth_rate: float
    completion_rate: float
    saturated: bool


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Median times to first and last token of calls sent directly (no proxy, no retries)."""

    rate: float
    calls: int
    median_ttft_s: float
    median_ttlt_s: float


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """Ĉ and how it was measured."""

    capacity: float
    saturated_stage: int
    stages: tuple[StageSummary, ...]
    method: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


StageRunner = Callable[[float, float, int], StageObservation]


def queue_growth_rate(samples: Sequence[tuple[float, float]]) -> float:
    """Slope (per second) of the least-squares line through ``(t, waiting)`` samples."""
    if len(samples) < 2:
        raise CalibrationError(f"need at least two waiting-queue samples to fit a line, got {len(samples)}")
    t = np.array([s[0] for s in samples], dtype=float)
    w = np.array([s[1] for s in samples], dtype=float)
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(w))):
        raise CalibrationError("waiting-queue samples must be finite numbers")
    if float(np.ptp(t)) <= 0:
        raise CalibrationError("waiting-queue samples must span some time")
    slope, _ = np.polyfit(t, w, 1)
    return float(slope)


def calibrate(
    run_stage: StageRunner,
    start_rate: float,
    stage_s: float = 300.0,
    factor: float = 1.5,
    growth_threshold: float = 0.1,
    max_stages: int = 12,
    use_observed_rate: bool = True,
) -> CalibrationResult:
    """Run stages at growing rates until the waiting queue grows; Ĉ = arrival rate - growth.

    With ``use_observed_rate`` the stage's arrival rate is the arrivals actually sent divided
    by the stage length (less Poisson noise than the planned rate); otherwise the planned rate.
    """
    if not (start_rate > 0 and math.isfinite(start_rate)):
        raise CalibrationError(f"start_rate must be a positive call rate, got {start_rate!r}")
    if factor <= 1.0:
        raise CalibrationError(f"factor must be > 1, got {factor!r}")
    if stage_s <= 0:
        raise CalibrationError("stage_s must be > 0")
    stages: list[StageSummary] = []
    rate = start_rate
    for index in range(max_stages):
        obs = run_stage(rate, stage_s, index)
        if obs.duration_s <= 0:
            raise CalibrationError(f"stage {index}: the runner reported a duration of {obs.duration_s}")
        growth = queue_growth_rate(obs.waiting_samples)
        arrival_rate = obs.arrivals / obs.duration_s
        saturated = growth >= growth_threshold
        stages.append(
            StageSummary(
                index=index,
                planned_rate=rate,
                arrival_rate=arrival_rate,
                growth_rate=growth,
                completion_rate=obs.completed / obs.duration_s,
                saturated=saturated,
            )
        )
        if saturated:
            base = arrival_rate if use_observed_rate else rate
            return CalibrationResult(
                capacity=base - growth,
                saturated_stage=index,
                stages=tuple(stages),
                method=(
                    f"{stage_s:g}-s stages x{factor:g} from {start_rate:g} calls/s; growth = least-squares "
                    f"slope of the waiting queue over the stage; Ĉ = "
                    f"{'observed' if use_observed_rate else 'planned'} arrival rate - growth"
                ),
            )
        rate *= factor
    raise CalibrationError(
        f"no stage saturated the engine in {max_stages} stages (last rate {rate / factor:g} calls/s): "
        "its capacity is higher; start from a higher rate (--start-rate)"
    )


def sim_stage_runner(
    engine: str | EngineConfig,
    *,
    workload: WorkloadSpec | None = None,
    seed: int = 0,
    sample_every_s: float = 1.0,
    include_running: bool = False,
    stage_calls: Callable[[float, float, int], Sequence[PlannedCall]] | None = None,
    **preset_options: object,
) -> StageRunner:
    """A stage runner on the engine model: open-loop Poisson arrivals, no retries.

    Every stage runs on a fresh engine with its own trace (seed and stage index). ``workload``
    supplies the prompt and response parameters (the protocol's by default); its capacity and
    phases are replaced by the stage's rate and length. The samples count the waiting queue, or
    waiting plus running executions with ``include_running`` (what a real engine's backlog
    reads); each stage also reports when every call completed. ``stage_calls(rate, duration_s,
    seed)`` draws a stage's calls instead (a trace's token mix: ``reproduce.workloads.tracecapacity``).
    """
    config = preset(engine, **preset_options) if isinstance(engine, str) else engine  # type: ignore[arg-type]
    base = workload or WorkloadSpec(capacity=1.0)
    if sample_every_s <= 0:
        raise CalibrationError("sample_every_s must be > 0")

    def backlog(model: EngineModel) -> float:
        return float(model.num_waiting + model.num_running if include_running else model.num_waiting)

    def run_stage(rate: float, duration_s: float, index: int) -> TimedStageObservation:
        stage_seed = seed * 1_000 + index
        if stage_calls is not None:
            trace = list(stage_calls(rate, duration_s, stage_seed))
        else:
            spec = dataclasses.replace(
                base,
                capacity=rate,
                phases=((duration_s, 1.0),),
                phase_names=("stage",),
                seed=stage_seed,
            )
            trace = generate_trace(spec)
        env = Environment()
        model = EngineModel(config)
        completions: list[float] = []

        def on_event(event: EngineEvent) -> None:
            if event.kind == EventKind.FINISHED:
                completions.append(env.now)

        proc = EngineProcess(env, model, on_event)
        for call in trace:
            env.schedule(
                call.arrival_s,
                proc.submit,
                EngineRequest(call.call_id, prompt_segments(call), call.response_len),
            )
        samples: list[tuple[float, float]] = []
        n_samples = int(duration_s / sample_every_s) + 1
        for k in range(n_samples):
            env.schedule(k * sample_every_s, lambda: samples.append((env.now, backlog(model))))
        env.run(until=duration_s)
        return TimedStageObservation(
            arrivals=len(trace),
            duration_s=duration_s,
            waiting_samples=samples,
            completed=len(completions),
            completion_times=tuple(completions),
        )

    return run_stage


def sim_latency(
    config: EngineConfig,
    rate: float,
    *,
    duration_s: float = 600.0,
    warmup_s: float = 60.0,
    workload: WorkloadSpec | None = None,
    seed: int = 0,
) -> LatencySummary:
    """Low-load reference on the engine model: calls at ``rate`` sent directly, no retries.

    Medians are over calls planned after ``warmup_s``; the run continues until all finish.
    """
    base = workload or WorkloadSpec(capacity=1.0)
    spec = dataclasses.replace(
        base, capacity=rate, phases=((duration_s, 1.0),), phase_names=("low",), seed=seed
    )
    trace = generate_trace(spec)
    env = Environment()
    model = EngineModel(config)
    arrival = {c.call_id: c.arrival_s for c in trace if c.arrival_s >= warmup_s}
    ttft: list[float] = []
    ttlt: list[float] = []

    def on_event(event: EngineEvent) -> None:
        start = arrival.get(event.request_id)
        if start is None:
            return
        if event.kind == EventKind.FIRST_TOKEN:
            ttft.append(event.t - start)
        elif event.kind == EventKind.FINISHED:
            ttlt.append(event.t - start)

    proc = EngineProcess(env, model, on_event)
    for call in trace:
        env.schedule(
            call.arrival_s, proc.submit, EngineRequest(call.call_id, prompt_segments(call), call.response_len)
        )
    env.run()
    if not ttlt:
        raise CalibrationError("no call finished in the low-load run; lengthen duration_s")
    return LatencySummary(rate, len(ttlt), float(np.median(ttft)), float(np.median(ttlt)))
