"""The simulator's link to the engine model: presets, Ĉ, stepping in simulated time, traces.

The engine model (``reproduce.engine``) is a pure stepping object; this module steps it on the
simulator's event heap (a step starts whenever work exists and the engine is idle; its end
calls ``finish_step`` and forwards the events) and turns the per-execution trace into the
shares docs/protocol.md §6 asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from foundation.timeseries import Sample
from reproduce.engine.config import EngineConfig, StepTimeModel
from reproduce.engine.model import EngineEvent, EngineModel, EngineRequest, EventKind
from reproduce.engine.presets import preset
from reproduce.engine.process import EngineProcess
from reproduce.judge.outcomes import RetryExecution, retry_timing, trace_shares
from reproduce.simenv import Environment
from reproduce.workloads.calls import WorkloadSpec

__all__ = [
    "Engine",
    "EventKind",
    "calibrate_preset",
    "calibrated_capacity",
    "preset_config",
]

_FIRST_TOKEN = EventKind.FIRST_TOKEN


def preset_config(model: str, **options: Any) -> EngineConfig:
    """The preset's engine configuration (``reproduce.engine.presets``)."""
    return preset(model, **options)


def calibrate_preset(
    model: str,
    *,
    mixed_prompts: bool = False,
    tokens_per_step: int = 8_192,
    seed: int = 0,
    start_rate: float | None = None,
    workload: Mapping[str, Any] | None = None,
    engine: Mapping[str, Any] | None = None,
) -> Any:
    """docs/protocol.md §5's calibration on the simulator (``reproduce.calibrate``): 300-s stages at 1.5x
    the previous rate, from ``start_rate`` (1 call/s, as the presets' fit does), until the
    waiting queue grows."""
    from reproduce.calibrate import calibrate, sim_stage_runner

    config = Engine.for_preset(model, tokens_per_step=tokens_per_step, overrides=engine).model.config
    spec = WorkloadSpec(capacity=1.0, mixed_prompts=mixed_prompts, **dict(workload or {}))
    runner = sim_stage_runner(config, workload=spec, seed=seed)
    return calibrate(runner, start_rate if start_rate is not None else 1.0)


def calibrated_capacity(model: str, *, mixed_prompts: bool, **options: Any) -> float:
    """Ĉ measured by calibration on the simulator (e.g. for mixed prompts)."""
    return float(calibrate_preset(model, mixed_prompts=mixed_prompts, **options).capacity)


class Engine:
    """An engine model stepped on a simulation environment by ``EngineProcess``; execution
    ids are the policy's ints, request ids the engine's strings."""

    def __init__(self, config: EngineConfig, *, trace: bool = False, labels: Mapping[str, str] | None = None):
        self.model = EngineModel(config, trace=trace)
        self.labels = dict(labels or {"model_name": config.model_name})
        self.process: EngineProcess | None = None
        self._on_event: Callable[[EventKind, int], None] | None = None
        self._ids: dict[str, int] = {}

    @classmethod
    def for_preset(
        cls,
        model: str,
        *,
        tokens_per_step: int = 8_192,
        queue_cap: int | None = None,
        trace: bool = False,
        overrides: Mapping[str, Any] | None = None,
        config: EngineConfig | None = None,
    ) -> Engine:
        if config is None:
            cfg = preset_config(model, max_num_batched_tokens=tokens_per_step, max_num_queued_reqs=queue_cap)
        else:
            cfg = config.with_options(max_num_batched_tokens=tokens_per_step, max_num_queued_reqs=queue_cap)
        if overrides:
            changes = dict(overrides)
            if isinstance(changes.get("step_time"), Mapping):  # e.g. from --backend-option JSON
                changes["step_time"] = StepTimeModel(**changes["step_time"])
            cfg = cfg.with_options(**changes)
        return cls(cfg, trace=trace, labels={"model_name": model})

    def bind(self, env: Environment, on_event: Callable[[EventKind, int], None]) -> None:
        self.process = EngineProcess(env, self.model, on_events=self._forward)
        self._on_event = on_event

    def add(
        self, execution_id: int, segments: Sequence[tuple[Hashable, int]], max_tokens: int, now: float
    ) -> bool:
        """Queue an execution; False when the engine's queue cap refuses it."""
        process = self.process
        assert process is not None, "bind() the engine to an environment first"
        rid = str(execution_id)
        self._ids[rid] = execution_id
        prompt = segments if type(segments) is tuple else tuple(segments)
        if process.submit(EngineRequest(rid, prompt, max_tokens)):
            return True
        del self._ids[rid]
        return False

    def abort(self, execution_id: int, now: float) -> None:
        assert self.process is not None, "bind() the engine to an environment first"
        self.process.abort(str(execution_id))

    def _forward(self, events: list[EngineEvent]) -> None:
        ids, on_event = self._ids, self._on_event
        assert on_event is not None, "bind() the engine to an environment first"
        for event in events:
            kind, rid = event.kind, event.request_id
            execution_id = ids.get(rid) if kind is _FIRST_TOKEN else ids.pop(rid, None)
            if execution_id is not None:
                on_event(kind, execution_id)

    def metrics_samples(self) -> list[Sample]:
        return self.model.metrics_samples(self.labels)

    def shares(self) -> dict[str, float | None]:
        """docs/protocol.md §6's tracing shares of this engine's executions so far."""
        return trace_shares(self.model.trace_records())

    def retry_timing(self, retries: Sequence[tuple[int, int | None, float]]) -> dict[str, float | None]:
        """When the executions of retries were first scheduled (``reproduce.judge.outcomes.retry_timing``).

        ``retries``: (execution id, the call's previous execution id or None, the retry's
        deadline) for every execution a retry created; those the engine refused are left out.
        """
        traces = self.model.traces
        items = []
        for execution_id, predecessor, deadline_at in retries:
            trace = traces.get(str(execution_id))
            if trace is None or trace.refused:
                continue
            before = traces.get(str(predecessor)) if predecessor is not None else None
            abort_at = (
                before.abort_requested_at if before is not None and before.aborted_at is not None else None
            )
            first = trace.scheduled_at[0] if trace.scheduled_at else None
            items.append(RetryExecution(first, deadline_at, abort_at))
        return retry_timing(items)
