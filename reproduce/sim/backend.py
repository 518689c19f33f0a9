"""The ``sim`` backend of ``retrywatch reproduce run``: each run is one simulated run of any
workload (``reproduce.workloads``).

Ĉ depends on the workload's token mix (``Workload.mix``): the study's is the preset's calibrated
capacity; mixed prompts recalibrate it on the simulator (docs/protocol.md §7), once per model,
and a trace's own mix calibrates it on that mix (``reproduce.workloads.tracecapacity``, cached), before
the runs start. Every run's entry says which Ĉ it ran at and how it was found
(``capacity_source``). Runs are independent and deterministic for their seed, so they run in
parallel worker processes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reproduce.conditions import PRIMARY_MODEL, RunSpec
from reproduce.engine.presets import PRESET_NAMES, PresetError, preset_capacity
from reproduce.judge.summary import run_entry, write_run_files
from reproduce.registry import Backend, RunJob, register_backend
from reproduce.sim import engine_link
from reproduce.sim.world import SimSpec, simulate
from reproduce.workloads.base import Shaping
from reproduce.workloads.calls import WorkloadSpec
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import PlanError, check_pulse
from reproduce.workloads.trace import TraceFacts
from reproduce.workloads.tracecapacity import trace_capacity

__all__ = ["SimBackend", "trace_mix_capacity"]


def trace_mix_capacity(
    model: str, facts: TraceFacts, *, tokens_per_step: int, engine: Mapping[str, Any] | None = None
) -> tuple[float, dict[str, object]]:
    """Ĉ of a trace's token mix (``facts``) on the simulator's ``model`` with ``tokens_per_step``
    and ``engine``'s overrides of the preset (calibrated once, then cached), and how it was found:
    what a ``sim`` run of that trace runs at, for any caller that must state it beforehand."""
    overrides = dict(engine or {})
    config = engine_link.Engine.for_preset(
        model, tokens_per_step=tokens_per_step, overrides=overrides
    ).model.config
    settings = f"tokens_per_step={tokens_per_step}|engine={json.dumps(overrides, sort_keys=True)}"
    found = trace_capacity(model, config, facts, settings=settings)
    return found.capacity, found.describe()


@dataclass
class SimBackend(Backend):
    """Simulated runs. ``workload`` / ``engine`` override fields of the workload spec and the
    preset's engine config (for quick scaled experiments); ``capacity`` forces Ĉ."""

    workload: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    client: ClientConfig | None = None  # instead of each run's client (``--client``'s profile)
    capacity: float | None = None
    capacities: dict[tuple[str, str], float] = field(default_factory=dict)
    capacity_sources: dict[tuple[str, str], dict[str, object]] = field(default_factory=dict)

    name = "sim"
    parallel = True

    def __post_init__(self) -> None:
        """Refuse options (``--backend-option``'s JSON) that would fail only inside a run, in a
        worker process, as a traceback: a ValueError naming the option."""
        capacity = self.capacity
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, int | float):
                raise ValueError(f"capacity must be a number of calls per second, not {capacity!r}")
            if not (math.isfinite(capacity) and capacity > 0):
                raise ValueError(f"capacity must be a positive number of calls per second, got {capacity!r}")
            self.capacity = float(capacity)
        if isinstance(self.client, Mapping):
            try:
                self.client = ClientConfig(**self.client)
            except TypeError as exc:
                raise ValueError(f"client: {exc}") from None
        if self.client is not None and not isinstance(self.client, ClientConfig):
            raise ValueError(f"client must be a JSON object of client settings, not {self.client!r}")
        for name in ("workload", "engine"):
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"{name} must be a JSON object, not {getattr(self, name)!r}")
        try:
            workload = WorkloadSpec(capacity=1.0, **Shaping.of(self.workload).fields)
            engine_link.Engine.for_preset(PRIMARY_MODEL, overrides=self.engine)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        try:
            check_pulse(workload)
        except PlanError as exc:
            raise ValueError(
                f"workload: {exc}; name its phases with phase_names, one of them 'pulse'"
            ) from None

    def prepare(self, runs: Sequence[RunSpec]) -> None:
        for model in dict.fromkeys(r.model for r in runs):
            if model not in PRESET_NAMES:  # before any run: a PresetError, not a worker's failure
                raise PresetError(f"unknown engine preset {model!r}; choose one of {', '.join(PRESET_NAMES)}")
        for r in runs:
            key = self._capacity_key(r)
            if key in self.capacities:
                continue
            mix = r.condition.workload.mix()
            if self.capacity is not None:
                found: tuple[float, dict[str, object]] = (self.capacity, {"method": "given (capacity=)"})
            elif mix.facts is not None:
                found = trace_mix_capacity(
                    r.model, mix.facts, tokens_per_step=r.condition.engine.tokens_per_step, engine=self.engine
                )
            elif mix.mixed_prompts:
                capacity = engine_link.calibrated_capacity(
                    r.model, mixed_prompts=True, workload=self.workload, engine=self.engine
                )
                found = (capacity, {"method": "docs/protocol.md §5 on the simulator, mixed prompts"})
            else:
                found = (preset_capacity(r.model), {"method": f"the study's calibration of {r.model}"})
            r.condition.workload.check_capacity(found[0])  # a load that stretches it too far, before any run
            self.capacities[key], self.capacity_sources[key] = found

    def capacity_of(self, r: RunSpec) -> tuple[float, dict[str, object]]:
        """Ĉ of run ``r`` in calls per study second and how it was found (found now if need be)."""
        key = self._capacity_key(r)
        if key not in self.capacities:
            self.prepare([r])
        return self.capacities[key], self.capacity_sources[key]

    def _capacity_key(self, r: RunSpec) -> tuple[str, str]:
        """Ĉ depends on the model and the workload's token mix (a trace's, on tokens per step)."""
        mix = r.condition.workload.mix()
        if mix.facts is not None:
            return r.model, f"{mix.key}:{r.condition.engine.tokens_per_step}"
        return r.model, mix.key

    def spec_for(self, job: RunJob) -> SimSpec:
        r = job.run
        return SimSpec(
            model=r.model,
            condition=r.condition,
            seed=r.seed,
            capacity=self.capacity_of(r)[0],
            clock=job.clock,
            client=self.client,
            workload=self.workload,
            engine=self.engine,
        )

    def run(self, job: RunJob) -> dict[str, Any]:
        spec = self.spec_for(job)
        result = simulate(spec)
        series = write_run_files(job.out, job.run, result.snapshots, result.calls)
        return run_entry(
            run=job.run,
            backend=self.name,
            capacity=result.capacity,
            plan=result.plan,
            calls=result.calls,
            snapshots=result.snapshots,
            series=series,
            duration_s=result.end_s,
            trace=result.trace_shares,
            extra={
                "wall_s": round(result.wall_s, 4),
                "cpu_s": round(result.cpu_s, 4),
                "capacity_source": self.capacity_sources.get(self._capacity_key(job.run)),
            },
        )


register_backend("sim", SimBackend)
