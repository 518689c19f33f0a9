"""The run plan: a run planned once, from its workload, and the clock it is judged on.

A :class:`RunPlan` holds what is fixed before a run starts, in the run's own seconds: the
planned calls (arrival, prompt and response lengths), the workload's phases where it has
them (name, start, end, multiple of Ĉ: a pulse run's base / pulse / hold), the client the
calls follow (deadline, backoff, horizon) and its :class:`RunClock`. :func:`plan_run` is the one
place where a workload and a client given at the study's scale are divided by the time scale.

The :class:`RunClock` is the one thing that carries K past the command line: a run's job, its
backend, the simulator's world, the workloads' ``plan``, the emulator's driver and the what-if
take the clock, and convert with its methods (study ↔ run seconds and rates, the ``--time-scale``
argument of a child process, the value a summary records), never by dividing by a float.

Whatever judges a run reads the :class:`Timeline` its plan derives: ``reproduce.judge.outcomes``
(cohorts, recovery windows), ``reproduce.judge.summary`` (the run's entry, with the plan's phases)
and, through summary.json, reports, validation and the dashboard. Every backend (simulator,
emulated engine, real vLLM) judges a run on the phases it ran, not on the protocol's.

Each kind of workload plans itself into a :class:`RunPlan` (``reproduce.workloads``): a workload
without a designated pulse (a request-trace replay, a stepped load) has no phase named ``pulse``,
so it has no pulse timeline: it is judged by its ground truth over time (``reproduce.judge.groundtruth``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from detector.replay import ReplaySettings
from detector.signals import DEFAULT_DEADLINE_S, DELIVERY_OBJECTIVE, WINDOWS
from detector.thresholds import ALERTS, scale_rules
from reproduce.workloads.calls import PlannedCall, WorkloadSpec, generate_trace, prompt_segments
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.traces.planned import Segments

if TYPE_CHECKING:
    from reproduce.workloads.base import Shaping, Workload

__all__ = [
    "OPTION",
    "PULSE",
    "RECORD_KEY",
    "RECOVERY_WINDOWS",
    "RECOVERY_WINDOW_S",
    "REPLAY_TAIL_WINDOWS",
    "STUDY_CLOCK",
    "Phase",
    "PlanError",
    "RecoveryRule",
    "RunClock",
    "RunPlan",
    "Timeline",
    "check_pulse",
    "detector_settings",
    "generated_spec",
    "make_plan",
    "outline",
    "plan_generated",
    "plan_run",
]

#: The phase whose calls are the pulse cohort; every phase after it is the hold.
PULSE = "pulse"
#: The hold's recovery windows (docs/protocol.md §6), at the study's scale.
RECOVERY_WINDOW_S = 60.0
#: Consecutive good windows the recovery rule asks for (docs/protocol.md §6).
RECOVERY_WINDOWS = 2
#: How long a run without a hold (a replayed trace, a stepped load) goes on after its last call
#: is done, in recovery windows: time for the recovery rule's two good windows to be seen.
REPLAY_TAIL_WINDOWS = RECOVERY_WINDOWS + 1


@dataclass(frozen=True)
class RecoveryRule:
    """docs/protocol.md §6's recovery thresholds, at the study's scale: the plan gives judges its
    growth limit in run seconds (:attr:`RunPlan.max_growth_per_s`)."""

    min_delivered: float = DELIVERY_OBJECTIVE  # share of a window's calls delivered within the deadline
    max_waiting: float = 2.0  # mean executions waiting in proxy + engine over a window
    max_growth_per_s: float = 0.01  # their growth (least-squares slope) over a window, per study second

    def growth_per_run_s(self, clock: RunClock) -> float:
        """The growth limit per run-second of a run at ``clock``: the one place K scales it."""
        return clock.run_rate(self.max_growth_per_s)


class PlanError(ValueError):
    """A plan that cannot be built or judged as asked; the message says what is missing."""


#: The key under which a run's summary entry, its plan, a sweep's meta and a what-if's setup
#: record K (:meth:`RunClock.record`, :meth:`RunClock.of_record`).
RECORD_KEY = "time_scale"
#: The option by which a child process (``retrywatch detect``, ``retrywatch emulate``) is given K.
OPTION = "--time-scale"


@dataclass(frozen=True)
class RunClock:
    """A run's time scale K (engine or study seconds per run-second), checked once, and the one
    object that carries it: what plans a run at it (:meth:`plan`), what converts a study-scale
    number into the run's and back (a calibration's stage, the simulator's Ĉ, the emulator's
    wall clock), what gives K to a child process (:meth:`argv`) and what a summary records
    (:meth:`record`); read back from a run's summary entry (:meth:`of_record`), what a
    validation target at the study's scale is in the run's seconds: never a reader's own K."""

    k: float = 1.0

    def __post_init__(self) -> None:
        k = self.k
        if isinstance(k, bool) or not (isinstance(k, int | float) and math.isfinite(k) and k > 0):
            raise PlanError(f"time scale must be a finite number > 0, got {k!r}")
        object.__setattr__(self, "k", float(k))

    @property
    def is_scaled(self) -> bool:
        """Whether the run is faster than the study (K ≠ 1)."""
        return self.k != 1.0

    def run_s(self, study_s: float) -> float:
        """A duration at the study's scale (engine seconds) in the run's seconds (wall seconds)."""
        return study_s / self.k

    def study_s(self, run_s: float) -> float:
        """A duration in the run's seconds (wall seconds) at the study's scale (engine seconds)."""
        return run_s * self.k

    def run_rate(self, per_study_s: float) -> float:
        """A rate per study second (the simulator's Ĉ) per run-second."""
        return per_study_s * self.k

    def study_rate(self, per_run_s: float) -> float:
        """A rate per run-second (Ĉ as the run sees it) per study second."""
        return per_run_s / self.k

    def argv(self) -> list[str]:
        """K for a child process's command line (``--time-scale K``, K exact): none at the
        study's scale, which is every child's default."""
        return [OPTION, repr(self.k)] if self.is_scaled else []

    def record(self) -> dict[str, float]:
        """What a summary entry, a plan, a sweep's meta or a what-if's setup records of this clock
        (read back by :meth:`of_record`)."""
        return {RECORD_KEY: self.k}

    def plan_spec(self, workload: WorkloadSpec, client: ClientConfig) -> RunPlan:
        """:func:`plan_run` at this clock: a generated workload (study seconds) for clients of
        ``client`` (the study's), in run seconds."""
        return plan_run(workload, client, self)

    def plan(
        self, workload: Workload, capacity: float, client: ClientConfig, *, seed: int, shaping: Shaping
    ) -> RunPlan:
        """``workload``'s run at Ĉ = ``capacity`` calls per run-second, for clients of ``client``
        (the study's), planned at this clock: every time of it in run seconds."""
        return workload.plan(capacity, client, seed=seed, clock=self, shaping=shaping)

    @classmethod
    def of_record(cls, entry: Mapping[str, Any]) -> RunClock:
        """The clock of a run's summary entry (its :data:`RECORD_KEY`; absent: the study's).
        Raises :class:`PlanError` for one that is not a finite number > 0."""
        value = entry.get(RECORD_KEY, 1.0)
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and number > 0):
            raise PlanError(f"{RECORD_KEY!r} must be a finite number > 0, got {value!r}")
        return cls(float(number))


#: The study's clock (K = 1): every clock's default.
STUDY_CLOCK = RunClock()


@dataclass(frozen=True, slots=True)
class Phase:
    """One phase of a workload in run seconds: calls arrive at ``multiple`` x Ĉ in ``[start_s, end_s)``."""

    name: str
    start_s: float
    end_s: float
    multiple: float

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "start_s": self.start_s, "end_s": self.end_s, "multiple": self.multiple}


@dataclass(frozen=True)
class Timeline:
    """A pulse run's clock (run seconds): the pulse, the hold after it, the deadline, the horizon
    and the recovery windows. Built by :meth:`RunPlan.timeline` from the phases the run ran."""

    pulse_start: float
    pulse_end: float
    hold_end: float
    deadline_s: float
    horizon_s: float
    window_s: float
    max_growth_per_s: float = RecoveryRule().max_growth_per_s  # the recovery rule's, per run-second

    def __post_init__(self) -> None:
        for name in ("deadline_s", "horizon_s", "window_s", "max_growth_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"Timeline.{name} must be a positive number, got {value!r}")
        bounds = (self.pulse_start, self.pulse_end, self.hold_end)
        ordered = 0 <= self.pulse_start < self.pulse_end < self.hold_end
        if not (ordered and all(math.isfinite(b) for b in bounds)):
            raise ValueError(f"Timeline needs 0 <= pulse_start < pulse_end < hold_end, got {bounds!r}")

    @property
    def base_s(self) -> float:
        """How long calls arrived before the pulse."""
        return self.pulse_start

    @property
    def pulse_s(self) -> float:
        return self.pulse_end - self.pulse_start

    @property
    def hold_s(self) -> float:
        return self.hold_end - self.pulse_end

    @property
    def primary_start(self) -> float:
        """The hold minus its first deadline (347 s in the study)."""
        return self.pulse_end + self.deadline_s

    def windows(self) -> list[tuple[float, float]]:
        """The hold's recovery windows, aligned to the pulse's end."""
        n = int(self.hold_s / self.window_s + 1e-9)
        return [
            (self.pulse_end + i * self.window_s, self.pulse_end + (i + 1) * self.window_s) for i in range(n)
        ]


@dataclass(frozen=True)
class RunPlan:
    """One run, planned: its calls, its phases (optional), its client and its clock.

    Every time is in run seconds: ``client``'s durations and ``window_s`` are already divided by
    the clock's K, as are the calls' arrivals and the phases.
    """

    calls: tuple[PlannedCall, ...]
    client: ClientConfig
    clock: RunClock = STUDY_CLOCK
    phases: tuple[Phase, ...] = ()
    window_s: float = RECOVERY_WINDOW_S
    #: A trace's prompts as chained segments (prefix blocks), by call id, for the calls that
    #: have blocks; every other call's prompt is ``workload.prompt_segments`` of it.
    segments: Mapping[str, Segments] = field(default_factory=dict)
    #: How long the run goes on after its last call is done (within the horizon): a replay
    #: without a hold needs time for the recovery rule's two good windows to be seen.
    tail_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PlanError(f"window_s must be positive, got {self.window_s!r}")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise PlanError(f"phase names must be unique, got {names!r}")

    @property
    def deadline_s(self) -> float:
        return self.client.deadline_s

    @property
    def horizon_s(self) -> float:
        return self.client.horizon_s

    def run_s(self, study_s: float) -> float:
        """A duration at the study's scale in this run's seconds (:meth:`RunClock.run_s`)."""
        return self.clock.run_s(study_s)

    def run_rate(self, per_study_s: float) -> float:
        """A rate at the study's scale (Ĉ in calls per engine second) per run-second."""
        return self.clock.run_rate(per_study_s)

    @property
    def max_growth_per_s(self) -> float:
        """The recovery rule's growth limit of the waiting executions, per run-second."""
        return RecoveryRule().growth_per_run_s(self.clock)

    @property
    def detector(self) -> ReplaySettings:
        """The detector's alerts, windows and assumed deadline in this run's seconds."""
        return detector_settings(self.clock.k)

    @property
    def pulse(self) -> Phase | None:
        """The phase named ``pulse``, or None (a workload without a designated pulse)."""
        return next((p for p in self.phases if p.name == PULSE), None)

    def timeline(self) -> Timeline:
        """The clock this run is judged on: its own pulse, and every phase after it as the hold."""
        pulse = self.pulse
        if pulse is None:
            raise PlanError(
                "this run's workload has no phase named 'pulse', so it has no pulse to judge "
                f"(its phases: {', '.join(p.name for p in self.phases) or 'none'})"
            )
        after = [p for p in self.phases if p.start_s >= pulse.end_s]
        if not after:
            raise PlanError("a pulse run needs a phase after its pulse (the hold) to judge recovery on")
        return Timeline(
            pulse_start=pulse.start_s,
            pulse_end=pulse.end_s,
            hold_end=max(p.end_s for p in after),
            deadline_s=self.deadline_s,
            horizon_s=self.horizon_s,
            window_s=self.window_s,
            max_growth_per_s=self.max_growth_per_s,
        )

    def prompt_segments(self, call: PlannedCall) -> Segments:
        """``call``'s prompt as the engine model's segments."""
        return self.segments.get(call.call_id) or prompt_segments(call)

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (summary.json's ``plan``): phases, deadline, horizon, scale,
        and the client's numbers, the recovery rule's growth limit and the detector's settings in
        run seconds: what judges and the dashboard read instead of re-deriving them from K."""
        return {
            **self.clock.record(),
            "deadline_s": self.deadline_s,
            "horizon_s": self.horizon_s,
            "window_s": self.window_s,
            "max_growth_per_s": self.max_growth_per_s,
            "detector": self.detector.record(),
            "client": self.client.describe(),
            "calls": len(self.calls),
            "phases": [p.to_dict() for p in self.phases],
        }


def _phases(workload: WorkloadSpec, clock: RunClock) -> tuple[Phase, ...]:
    """The workload's phases (study seconds) in the run's."""
    return tuple(
        Phase(name, clock.run_s(start), clock.run_s(end), multiple)
        for (name, start, end), (_, multiple) in zip(workload.phase_bounds(), workload.phases, strict=True)
    )


def _calls(workload: WorkloadSpec, clock: RunClock) -> list[PlannedCall]:
    """The workload's calls with their arrivals (study seconds) in the run's."""
    calls = generate_trace(workload)
    return [replace(c, arrival_s=clock.run_s(c.arrival_s)) for c in calls] if clock.is_scaled else calls


def make_plan(
    calls: Iterable[PlannedCall],
    phases: Iterable[Phase],
    client: ClientConfig,
    clock: RunClock,
    *,
    segments: Mapping[str, Segments] | None = None,
    tail_windows: int = 0,
) -> RunPlan:
    """A plan of ``calls`` and ``phases`` (already in run seconds) for clients of ``client``: the
    one place where a study-scale client, the recovery window and the tail after the last call
    (``tail_windows`` recovery windows) are put in run seconds at ``clock``."""
    return RunPlan(
        calls=tuple(calls),
        client=client.scaled(clock.k),
        clock=clock,
        phases=tuple(phases),
        window_s=clock.run_s(RECOVERY_WINDOW_S),
        segments=dict(segments or {}),
        tail_s=clock.run_s(tail_windows * RECOVERY_WINDOW_S),
    )


def detector_settings(k: float) -> ReplaySettings:
    """The detector's settings for a run at time scale ``k``: its alerts' durations, its windows
    and its assumed deadline divided by K (K = 1: the study's)."""
    k = RunClock(k).k
    return ReplaySettings(scale_rules(ALERTS, k), WINDOWS.scaled(k), DEFAULT_DEADLINE_S / k)


def generated_spec(capacity: float, *, seed: int, clock: RunClock, **fields: Any) -> WorkloadSpec:
    """The spec of a generated workload (``fields``: phases and lengths at the study's scale) for
    a run at Ĉ = ``capacity`` calls per run-second: the spec takes Ĉ per study second;
    :func:`plan_run` puts its arrivals and phases in run seconds."""
    return WorkloadSpec(capacity=clock.study_rate(capacity), seed=seed, **fields)


def plan_run(
    workload: WorkloadSpec, client: ClientConfig, clock: RunClock = STUDY_CLOCK, *, tail_windows: int = 0
) -> RunPlan:
    """Plan a run of ``workload`` (its trace, its phases, at the study's scale) for clients of
    ``client`` (the study's), everything put in run seconds here and by :func:`make_plan`."""
    return make_plan(
        _calls(workload, clock), _phases(workload, clock), client, clock, tail_windows=tail_windows
    )


def plan_generated(
    capacity: float,
    client: ClientConfig,
    *,
    seed: int,
    clock: RunClock,
    tail_windows: int = 0,
    **fields: Any,
) -> RunPlan:
    """:func:`plan_run` of :func:`generated_spec`: a generated workload's run at Ĉ = ``capacity``
    calls per run-second."""
    spec = generated_spec(capacity, seed=seed, clock=clock, **fields)
    return plan_run(spec, client, clock, tail_windows=tail_windows)


def outline(workload: WorkloadSpec, client: ClientConfig, clock: RunClock = STUDY_CLOCK) -> RunPlan:
    """The plan of a run of ``workload`` without its calls: its phases, ``client`` and the recovery
    window in run seconds, for what reads a run's numbers before its calls are generated."""
    return make_plan((), _phases(workload, clock), client, clock)


def check_pulse(workload: WorkloadSpec) -> None:
    """Raise :class:`PlanError` unless a run of ``workload`` has a pulse and a hold to judge
    (before any run starts, instead of in the middle of one)."""
    outline(workload, ClientConfig()).timeline()
