"""The runs a validation judges (``retrywatch reproduce validate DIR``).

``DIR/summary.json`` parsed into :class:`RunInfo`: a run's identity, its recovery verdict, the
stretch of overload it is aligned on (its pulse; without one, the burst its ground truth names),
and its ground-truth record (``foundation.groundtruth``: read as the run recorded it, never
recomputed; an entry written before the record is computed once on read). A clear error names a
bad run. Also :class:`Firing` (one alert episode in a run), :class:`RunResult` (a run's firings
with its collapses) and the helpers over firings the scores and the targets share.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detector.episodes import AlertEpisode
from detector.replay import ReplaySettings
from foundation.groundtruth import Collapse, GroundTruth, GroundTruthError, Window
from foundation.rundir import (
    SUMMARY,
    RunDirError,
    read_summary,
    series_path,
)
from reproduce.judge.groundtruth import CALLS_FILE, legacy_truth
from reproduce.workloads.plan import RunClock


@dataclass(frozen=True)
class Firing:
    """One alert episode in a run, in seconds from the run's start (``resolved_at_s`` None while
    it was still firing at the end of the run)."""

    alertname: str
    fired_at_s: float
    resolved_at_s: float | None
    why: str = ""
    value: float | None = None  # the alert's value when it fired (creation / Ĉ for the loop)

    @classmethod
    def of(cls, episode: AlertEpisode) -> Firing:
        """A detector's alert episode as a firing."""
        return cls(
            alertname=episode.alertname,
            fired_at_s=round(float(episode.started_at), 3),
            resolved_at_s=None if episode.resolved_at is None else round(float(episode.resolved_at), 3),
            why=episode.description or "",
            value=None if episode.value is None else float(episode.value),
        )

    def overlaps(self, start: float, end: float) -> bool:
        """Firing at some moment of [start, end]."""
        return self.fired_at_s <= end and (self.resolved_at_s is None or self.resolved_at_s >= start)


@dataclass(frozen=True)
class RunInfo:
    """What validation needs from one run of ``summary.json``."""

    block: str
    condition: str
    model: str
    run: int
    recovered: bool
    recovery_time_s: float | None
    pulse_start_s: float
    pulse_end_s: float
    duration_s: float
    deadline_s: float
    capacity: float
    series: Path
    shed_or_attached: bool
    hold_creation_x_capacity: float | None = None  # executions created over the primary window, in Ĉ
    variant: str = ""  # e.g. the trigger sweep's "pulse-2"
    hold_end_s: float | None = None
    calls: Path | None = None  # the run's call records, when it wrote them
    #: A replayed trace: no pulse; ``pulse_start_s`` / ``pulse_end_s`` hold the burst it is
    #: aligned on, and its windows are aligned to the run's start.
    trace: bool = False
    #: When the run's client gave an attempt up (its plan's ``client.attempt_timeout_s``, run
    #: seconds): the deadline a proxy learns from abandons; None where the plan does not say.
    attempt_timeout_s: float | None = None
    #: The run's ground-truth record (summary.json's ``collapses`` and ``judged``); None for a run
    #: written before runs recorded it that has no call records to compute it from.
    truth: GroundTruth | None = field(default=None, compare=False, repr=False)

    #: The run's seconds against the study's, and the detector's settings in them, as its plan
    #: recorded them (summary.json's entry and ``plan.detector``).
    clock: RunClock = field(default_factory=RunClock)
    detector: ReplaySettings = field(default_factory=ReplaySettings, compare=False, repr=False)

    def run_s(self, study_s: float) -> float:
        """A duration at the study's scale in this run's seconds, by the run's recorded clock."""
        return self.clock.run_s(study_s)

    @property
    def recovery_at_s(self) -> float | None:
        """When the run recovered, from its start; None if it did not."""
        if not self.recovered or self.recovery_time_s is None:
            return None
        return self.pulse_end_s + self.recovery_time_s

    @property
    def judged_end_s(self) -> float:
        """The end of the judged span: the hold's end (the run's end without one)."""
        return self.hold_end_s if self.hold_end_s is not None else self.duration_s

    @property
    def slug(self) -> str:
        condition = f"{self.condition}-{self.variant}" if self.variant else self.condition
        return f"{self.block}__{condition}__{self.model}__r{self.run}"


@dataclass
class RunResult:
    """One run's firings and its collapses (None: no ground truth over time for it)."""

    info: RunInfo
    firings: list[Firing] = field(default_factory=list)
    collapses: list[Collapse] | None = None
    windows: list[Window] | None = None  # the judged windows behind ``collapses``


def _field(run: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in run:
        raise RunDirError(f"{where}: missing field {key!r}")
    return run[key]


def _number(value: Any, where: str) -> float:
    try:
        number = math.nan if isinstance(value, bool) or not isinstance(value, int | float) else float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise RunDirError(f"{where}: expected a finite number, got {value!r}")
    return number


def _run_number(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RunDirError(f"{where}: 'run' must be a whole number, got {value!r}")
    return value


def _recorded(run: Mapping[str, Any], where: str) -> tuple[RunClock, ReplaySettings]:
    """The run's clock and detector settings as its plan recorded them."""
    try:
        return RunClock.of_record(run), ReplaySettings.of_entry(run)
    except ValueError as exc:
        raise RunDirError(f"{where}: {exc}") from None


def _shed_or_attached(run: Mapping[str, Any]) -> bool:
    retries = run.get("retries") or {}
    executions = run.get("executions") or {}
    counts = (
        retries.get("refused", 0),
        retries.get("attached", 0),
        executions.get("dropped_at_proxy", 0),
        executions.get("refused_by_engine", 0),
    )
    return any(float(c or 0) > 0 for c in counts)


def _hold_creation(run: Mapping[str, Any]) -> float | None:
    value = (run.get("rates_x_capacity") or {}).get("executions_created")
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _attempt_timeout(run: Mapping[str, Any]) -> float | None:
    plan = run.get("plan")
    client = plan.get("client") if isinstance(plan, Mapping) else None
    value = client.get("attempt_timeout_s") if isinstance(client, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def load_runs(out_dir: Path) -> list[RunInfo]:
    """Read ``out_dir/summary.json`` into :class:`RunInfo`s; a clear error names a bad run."""
    summary_path = out_dir / SUMMARY
    infos: list[RunInfo] = []
    for i, run in enumerate(read_summary(out_dir)["runs"]):
        where = f"{summary_path}: runs[{i}]"
        if not isinstance(run, dict):
            raise RunDirError(f"{where}: expected an object")
        trace = run.get("pulse", {}) is None
        pulse = run.get("burst") if trace else _field(run, "pulse", where)
        if not isinstance(pulse, dict):
            what = "a run without a pulse needs 'burst'" if trace else "'pulse' must be"
            raise RunDirError(f"{where}: {what} an object with start_s and end_s")
        recovered = _field(run, "recovered", where)
        if not isinstance(recovered, bool):
            raise RunDirError(f"{where}: 'recovered' must be true or false")
        recovery_time = run.get("recovery_time_s")
        if recovered and recovery_time is None:
            raise RunDirError(f"{where}: a recovered run needs 'recovery_time_s'")
        _field(run, "series", where)
        series = series_path(out_dir, run, must_exist=True)
        hold_end = run.get("hold_end_s")
        calls = series.parent / CALLS_FILE
        try:
            truth = (
                GroundTruth.from_entry(run) if GroundTruth.recorded(run) else legacy_truth(run, calls, series)
            )
        except GroundTruthError as exc:
            raise RunDirError(f"{where}: {exc}") from None
        clock, detector = _recorded(run, where)
        infos.append(
            RunInfo(
                block=str(_field(run, "block", where)),
                condition=str(_field(run, "condition", where)),
                model=str(_field(run, "model", where)),
                run=_run_number(_field(run, "run", where), where),
                recovered=recovered,
                recovery_time_s=None if recovery_time is None else _number(recovery_time, where),
                pulse_start_s=_number(_field(pulse, "start_s", where), where),
                pulse_end_s=_number(_field(pulse, "end_s", where), where),
                duration_s=_number(_field(run, "duration_s", where), where),
                deadline_s=_number(_field(run, "deadline_s", where), where),
                capacity=_number(_field(run, "capacity", where), where),
                series=series,
                shed_or_attached=_shed_or_attached(run),
                hold_creation_x_capacity=_hold_creation(run),
                variant=str(run.get("variant") or ""),
                hold_end_s=None if hold_end is None else _number(hold_end, where),
                calls=calls if calls.is_file() else None,
                trace=trace,
                attempt_timeout_s=_attempt_timeout(run),
                truth=truth,
                clock=clock,
                detector=detector,
            )
        )
    return infos


def truth_of(info: RunInfo) -> GroundTruth | None:
    """The run's ground truth over time, as its summary entry recorded it (None: a run written
    before runs recorded it, without call records to compute it from)."""
    return info.truth


def stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(float(statistics.median(values)), 3), "max": round(float(max(values)), 3)}


def first_after(firings: Sequence[Firing], t: float) -> Firing | None:
    after = [f for f in firings if f.fired_at_s >= t]
    return min(after, key=lambda f: f.fired_at_s) if after else None


def firings_of(r: RunResult, alertname: str) -> list[Firing]:
    return sorted((f for f in r.firings if f.alertname == alertname), key=lambda f: f.fired_at_s)
