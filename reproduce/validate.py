"""Validation of the alerts against a reproduce output: ``retrywatch reproduce validate DIR``.

Replays every run listed in ``DIR/summary.json`` through the detector (``detector.replay``),
computes each run's ground truth over time (``reproduce.groundtruth``: its collapses, and which
are metastable) and scores each alert by its kind (``AlertRule.kind``, docs/protocol.md "Ground
truth over time"):

- a **cause** alert (the loop, the backlog, orphaned work) is scored per run: recall over the
  runs that did not recover (§6) and over the runs with a metastable collapse; a false positive
  is a firing that starts outside every collapse and outside the overload's own stretch (from
  the pulse's start to the end of the collapse it caused, or to the pulse's end when it caused
  none); lead after the pulse's end, and after the collapse turned metastable; the resolution of
  the last firing between the pulse and a recovery, against the recovery time;
- a **symptom** alert (calls not delivered within the deadline, whatever the cause) is scored
  per collapse: recall over collapses, delay from the collapse's start, whether it stays firing
  to the collapse's end, firings that start outside every collapse, and its resolution after
  the collapse ended. A call's miss is known one deadline after it arrived, so a symptom firing
  that starts within one deadline after a collapse's end still belongs to it;
- a **data** alert (no data) is reported, not scored: it says the detector could not judge.

A replayed trace has no pulse: its run is aligned on the burst that started its first collapse
(summary.json's ``burst``, ``reproduce.groundtruth.burst_before``; the run's busiest stretch
when nothing collapsed), which stands where a pulse run's pulse stands (the overload's own
stretch, the lead after its end), and its windows are aligned to the run's start.

Each tier of alerts (``AlertRule.tier``: what series an alert needs) is also scored side by side
with the others: a tier's pages (its critical alerts of a kind, taken together as one alert) get
the figures above, the runs they missed or fired in while the run recovered, and, against the tier
that needs the most series, the runs where one tier's cause pages fired and the other's did not.

Runs without their call records (``attempts.jsonl``) have no ground truth over time: cause
alerts then fall back on the recovery verdict (a false positive fires before the pulse or after
the recovery), and symptom alerts skip them.

Writes ``DIR/validation.json`` (the shape in docs/architecture.md: per alert, per run with its
``collapses``, per block, and the ``targets`` of :func:`check_targets`) and ``DIR/validation.md``,
whose every table carries a legend. Times are seconds from the run's start.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from detector.rundir import (
    SUMMARY,
    VALIDATION,
    VALIDATION_MD,
    NotARunDir,
    RunDirError,
    read_summary,
    series_path,
)
from detector.signals import WINDOWS, Windows
from detector.thresholds import ALERTS, ALERTS_BY_NAME, TIERS, AlertKind, AlertRule
from foundation import metricnames as mn
from foundation.groundtruth import Collapse, GroundTruth, GroundTruthError, Window
from foundation.timeseries import read_series
from reproduce.groundtruth import CALLS_FILE, collapsed_to_the_end, legacy_truth

PAPER = "paper"  # the block made of every block: runs carry their own block's name
RETRY_LOOP = "VLLMMetastableRetryLoop"
SILENCE = "no collapse is silent"
BACKLOG = "VLLMBacklogBeyondDeadline"
# The retry-loop alert must fire within this long after the pulse's end, in the study's seconds
# (divided by the run's time scale).
RETRY_LOOP_LEAD_TARGET_S = 120.0
# No collapse is silent: in a run that never recovers, a critical alert fires within this long
# after the collapse that lasts to the end of the hold began (study seconds, divided by the
# run's time scale) and is still firing at the hold's end. A miss is known only one deadline
# after its call arrived, so the symptom alert cannot fire sooner than about a deadline.
SILENCE_TARGET_S = 300.0
# A late firing is put beside when the loop formed: executions created over this window (study
# seconds) rising to Ĉ, the loop's fuel, seen at a finer grain than the detector's rate window.
LOOP_FORMATION_WINDOW_S = 10.0
STILL_FIRING = "still firing at the end"


@dataclass(frozen=True)
class Firing:
    """One alert episode in a run, in seconds from the run's start (``resolved_at_s`` None while
    it was still firing at the end of the run)."""

    alertname: str
    fired_at_s: float
    resolved_at_s: float | None
    why: str = ""
    value: float | None = None  # the alert's value when it fired (creation / Ĉ for the loop)

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
    time_scale: float
    series: Path
    shed_or_attached: bool
    hold_creation_x_capacity: float | None = None  # executions created over the primary window, in Ĉ
    variant: str = ""  # e.g. the trigger sweep's "pulse-2"
    hold_end_s: float | None = None
    calls: Path | None = None  # the run's call records, when it wrote them
    #: A replayed trace: no pulse; ``pulse_start_s`` / ``pulse_end_s`` hold the burst it is
    #: aligned on, and its windows are aligned to the run's start.
    trace: bool = False
    #: The run's ground-truth record (summary.json's ``collapses`` and ``judged``); None for a run
    #: written before runs recorded it that has no call records to compute it from.
    truth: GroundTruth | None = field(default=None, compare=False, repr=False)

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


def _time_scale(value: Any, where: str) -> float:
    k = _number(value, where)
    if k <= 0:
        raise RunDirError(f"{where}: 'time_scale' must be a finite number > 0, got {value!r}")
    return k


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


def _primary(info: RunInfo) -> str:
    """The primary window (the hold minus its first deadline) as the run's entry gives it."""
    if info.hold_end_s is None:
        return "the hold"
    return f"the hold ({info.pulse_end_s + info.deadline_s:g}–{info.hold_end_s:g} s)"


def _hold_and_control(info: RunInfo, below: str, prefix: str = "") -> list[str]:
    """The figures both explanations give: execution creation over the hold against Ĉ (``below``
    says what creation under Ĉ means), and whether the run's controls shed or attached retries."""
    parts = []
    x = info.hold_creation_x_capacity
    if x is not None:
        parts.append(f"{prefix}{x:.2f} Ĉ over {_primary(info)}{below if x < 1.0 else ': at or above Ĉ'}")
    if info.shed_or_attached:
        parts.append(f"retries shed or attached ({info.condition})")
    else:
        parts.append(f"condition {info.condition}: retries neither shed nor attached")
    return parts


def explain_transient_loop(info: RunInfo, firing: Firing) -> str:
    """Why a run that recovered showed the retry-loop signature between its pulse and recovery:
    the figures that separate a loop that drains from one that holds (docs/protocol.md §8)."""
    parts = []
    if firing.value is not None:
        parts.append(f"executions created at {firing.value:.2f} Ĉ when it fired")
    below = ": below Ĉ, so the backlog drained" if info.recovered else ": below Ĉ"
    return "; ".join(parts + _hold_and_control(info, below))


def explain_miss(info: RunInfo) -> str:
    """Why the retry-loop alert stayed silent (or came late) in a run that did not recover: the
    loop needs executions created at or above Ĉ; below it the backlog drains, however slowly,
    or sits at the deadline's edge (an engine queue cap of Ĉ x deadline holds it there)."""
    return "; ".join(
        _hold_and_control(info, ": below Ĉ, so not the loop's fuel", prefix="executions created at ")
    )


def loop_formed_at_s(info: RunInfo, before_s: float) -> float | None:
    """When the loop formed, for a firing at ``before_s``: the last time, from the pulse's end
    to ``before_s``, at which executions created over ``LOOP_FORMATION_WINDOW_S`` (scaled) rose
    to Ĉ. None when creation stayed at or above Ĉ over all that time (the loop had formed by
    the pulse's end) or the run's series is not there."""
    if not info.series.exists():
        return None
    window = LOOP_FORMATION_WINDOW_S / info.time_scale
    points = [
        (snap.t, created)
        for snap in read_series(info.series)
        if (created := snap.value(mn.EXECUTIONS_CREATED)) is not None
    ]
    formed = None
    j = 0
    below = False
    for t, created in points:
        while j + 1 < len(points) and points[j + 1][0] <= t - window:
            j += 1
        t0, c0 = points[j]
        if t - t0 < window or t < info.pulse_end_s:
            continue
        if t > before_s:
            break
        at_capacity = (created - c0) / (t - t0) >= info.capacity
        if at_capacity and below:
            formed = t
        below = not at_capacity
    return formed


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
                time_scale=_time_scale(run.get("time_scale", 1.0), where),
                series=series,
                shed_or_attached=_shed_or_attached(run),
                hold_creation_x_capacity=_hold_creation(run),
                variant=str(run.get("variant") or ""),
                hold_end_s=None if hold_end is None else _number(hold_end, where),
                calls=calls if calls.is_file() else None,
                trace=trace,
                truth=truth,
            )
        )
    return infos


def truth_of(info: RunInfo) -> GroundTruth | None:
    """The run's ground truth over time, as its summary entry recorded it (None: a run written
    before runs recorded it, without call records to compute it from)."""
    return info.truth


# --- scoring -----------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(float(statistics.median(values)), 3), "max": round(float(max(values)), 3)}


def _first_after(firings: Sequence[Firing], t: float) -> Firing | None:
    after = [f for f in firings if f.fired_at_s >= t]
    return min(after, key=lambda f: f.fired_at_s) if after else None


def _own(r: RunResult, alertname: str) -> list[Firing]:
    return sorted((f for f in r.firings if f.alertname == alertname), key=lambda f: f.fired_at_s)


def _until(c: Collapse, tail: float = 0.0) -> float:
    """Where a collapse stops counting: its end (plus ``tail``), or never if it had not ended."""
    return c.end_s + tail if c.ended else math.inf


def expected_stretches(r: RunResult) -> list[tuple[float, float]]:
    """Where a cause alert may start firing in a run: inside any collapse, and from the overload's
    start (the pulse's) to the end of the collapse it caused (the first one under way after the
    pulse began), or to the pulse's end when it caused none. A collapse that ran to the end of
    the judged span had not ended there: it stretches to the run's end. Without a ground truth
    over time: from the pulse's start to the recovery (to the end when the run did not recover)."""
    info = r.info
    if r.collapses is None:
        end = info.recovery_at_s if info.recovered else math.inf
        return [(info.pulse_start_s, math.inf if end is None else end)]
    stretches = [(c.start_s, _until(c)) for c in r.collapses]
    caused = [c for c in r.collapses if c.end_s > info.pulse_start_s]
    stretches.append((info.pulse_start_s, _until(caused[0]) if caused else info.pulse_end_s))
    return stretches


def false_positive(r: RunResult, alertname: str) -> list[Firing]:
    """A cause alert's firings in the run that start outside :func:`expected_stretches`."""
    stretches = expected_stretches(r)
    return [
        f for f in _own(r, alertname) if not any(a - 1e-9 <= f.fired_at_s <= b + 1e-9 for a, b in stretches)
    ]


def _metastable(r: RunResult) -> Collapse | None:
    return next((c for c in r.collapses or [] if c.metastable), None)


def score_cause(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A cause alert's figures: per run, against the recovery verdict and metastable collapses."""
    not_recovered = [r for r in results if not r.info.recovered]
    recovered = [r for r in results if r.info.recovered]
    hits = 0
    lead_times: list[float] = []
    for r in not_recovered:
        first = _first_after(_own(r, alertname), r.info.pulse_start_s)
        if first is not None:
            hits += 1
            lead_times.append(first.fired_at_s - r.info.pulse_end_s)
    metastable = [(r, c) for r in results if (c := _metastable(r)) is not None]
    meta_hits = 0
    after_loop: list[float] = []
    for r, c in metastable:
        during = [f for f in _own(r, alertname) if f.overlaps(c.start_s, c.end_s)]
        if during:
            meta_hits += 1
            if c.metastable_at_s is not None:
                after_loop.append(during[0].fired_at_s - c.metastable_at_s)
    fp = [(r, false_positive(r, alertname)) for r in results]
    resolve_times: list[float] = []
    still_firing = 0
    for r in recovered:
        recovery_at = r.info.recovery_at_s
        assert recovery_at is not None
        during = [f for f in _own(r, alertname) if r.info.pulse_start_s <= f.fired_at_s <= recovery_at]
        if during:
            last = during[-1]
            if last.resolved_at_s is None:
                still_firing += 1
            else:
                resolve_times.append(last.resolved_at_s - recovery_at)
    return {
        "kind": "cause",
        "recall": round(hits / len(not_recovered), 4) if not_recovered else None,
        "runs_not_recovered": len(not_recovered),
        "false_positive_runs": sum(1 for _, f in fp if f),
        "false_positive_firings": sum(len(f) for _, f in fp),
        "runs": len(results),
        "runs_recovered": len(recovered),
        "lead_time_s": _stats(lead_times),
        "recall_metastable": round(meta_hits / len(metastable), 4) if metastable else None,
        "runs_metastable": len(metastable),
        "lead_after_metastable_s": _stats(after_loop),
        "resolve_after_recovery_s": _stats(resolve_times),
        "still_firing_after_recovery_runs": still_firing,
    }


def _covers(firings: Sequence[Firing], start: float, end: float) -> bool:
    """The firings, taken together, fire without a gap from ``start`` to ``end``."""
    t = start
    for f in sorted(firings, key=lambda f: f.fired_at_s):
        if f.fired_at_s > t + 1e-9:
            return False
        if f.resolved_at_s is None or f.resolved_at_s >= end:
            return True
        t = max(t, f.resolved_at_s)
    return False


def score_symptom(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A symptom alert's figures: per collapse (runs with a ground truth over time)."""
    judged = [r for r in results if r.collapses is not None]
    collapses = 0
    hits = 0
    held = 0
    delays: list[float] = []
    lags: list[float] = []
    still_firing = 0
    fp_runs = fp_firings = 0
    for r in judged:
        own = _own(r, alertname)
        grace = r.info.deadline_s  # a call's miss is known one deadline after it arrived
        stretches = [(c.start_s, _until(c, grace)) for c in r.collapses or []]
        outside = [f for f in own if not any(a - 1e-9 <= f.fired_at_s <= b + 1e-9 for a, b in stretches)]
        fp_runs += bool(outside)
        fp_firings += len(outside)
        for c in r.collapses or []:
            collapses += 1
            during = [f for f in own if f.overlaps(c.start_s, _until(c, grace))]
            if not during:
                continue
            hits += 1
            first = during[0]
            delays.append(first.fired_at_s - c.start_s)
            if _covers(during, max(first.fired_at_s, c.start_s), c.end_s):
                held += 1
            if c.ended:
                last = during[-1]
                if last.resolved_at_s is None:
                    still_firing += 1
                else:
                    lags.append(last.resolved_at_s - c.end_s)
    return {
        "kind": "symptom",
        "recall": round(hits / collapses, 4) if collapses else None,
        "collapses": collapses,
        "collapses_detected": hits,
        "held_to_collapse_end": held,
        "runs_not_recovered": sum(1 for r in results if not r.info.recovered),
        "false_positive_runs": fp_runs,
        "false_positive_firings": fp_firings,
        "runs": len(judged),
        "runs_recovered": sum(1 for r in results if r.info.recovered),
        "lead_time_s": _stats(delays),
        "resolve_after_collapse_s": _stats(lags),
        "still_firing_after_collapse": still_firing,
        "resolve_after_recovery_s": _stats([]),
    }


def score_data(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A data alert is reported, not scored: where it fired, the detector could not judge."""
    fired = [r for r in results if _own(r, alertname)]
    return {
        "kind": "data",
        "recall": None,
        "runs_not_recovered": sum(1 for r in results if not r.info.recovered),
        "false_positive_runs": None,
        "runs": len(results),
        "runs_recovered": sum(1 for r in results if r.info.recovered),
        "runs_fired": len(fired),
        "firings": sum(len(_own(r, alertname)) for r in fired),
        "fired_in": [r.info.slug for r in fired],
        "lead_time_s": _stats([]),
        "resolve_after_recovery_s": _stats([]),
    }


SCORERS: dict[str, Callable[[str, Sequence[RunResult]], dict[str, Any]]] = {
    "cause": score_cause,
    "symptom": score_symptom,
    "data": score_data,
}


def score_alert(alertname: str, results: Sequence[RunResult], kind: AlertKind = "cause") -> dict[str, Any]:
    """The per-alert figures of ``validation.json``, by the alert's kind."""
    return SCORERS[kind](alertname, results)


def _run_ref(r: RunResult, **extra: Any) -> dict[str, Any]:
    return {"run": r.info.slug, **extra}


def _critical(r: RunResult) -> list[Firing]:
    return sorted(
        (f for f in r.firings if (rule := ALERTS_BY_NAME.get(f.alertname)) and rule.severity == "critical"),
        key=lambda f: f.fired_at_s,
    )


def _why_silent(r: RunResult) -> str:
    """What the last judged windows of a run that did not recover show: a run whose calls were
    delivered in time again is held unrecovered by the queue part of the recovery rule alone."""
    windows = [w for w in r.windows or [] if w.calls]
    if not windows:
        return "no judged window with calls"
    last = windows[-3:]
    shares = ", ".join(f"{w.delivered_within_deadline:.0%}" for w in last)
    if all(w.delivered_ok for w in last):
        waiting = ", ".join(f"{w.waiting_mean:.1f}" for w in last)
        return (
            f"its last {len(last)} windows delivered {shares} of their calls within the deadline: calls are "
            f"answered in time again, and only the queue part of the recovery rule holds it unrecovered "
            f"(mean executions waiting {waiting})"
        )
    return f"its last {len(last)} windows delivered {shares} of their calls within the deadline"


def check_silence(results: Sequence[RunResult]) -> dict[str, Any]:
    """No collapse is silent: in every run with a collapse that lasts to the end of its hold, a
    critical alert (any cause, or the symptom) fires within ``SILENCE_TARGET_S`` (scaled) of that
    collapse's start and is still firing at the hold's end. Lists the runs silent at the end (with
    what their last windows show) and those whose first critical firing came later."""
    silent: list[dict[str, Any]] = []
    late: list[dict[str, Any]] = []
    delays: list[float] = []
    judged = 0
    for r in results:
        lasting = [c for c in r.collapses or [] if not c.ended]
        if not lasting:
            continue
        judged += 1
        start, end = lasting[0].start_s, r.info.judged_end_s
        critical = _critical(r)
        first = _first_after(critical, start)
        if first is not None:
            delay = first.fired_at_s - start
            delays.append(delay)
            if delay > SILENCE_TARGET_S / r.info.time_scale:
                late.append(_run_ref(r, after_collapse_s=round(delay, 3), alertname=first.alertname))
        if not any(
            f.fired_at_s <= end and (f.resolved_at_s is None or f.resolved_at_s >= end) for f in critical
        ):
            silent.append(_run_ref(r, why=_why_silent(r)))
    return {
        "runs_collapsed_to_the_end": judged,
        "target_s": SILENCE_TARGET_S,
        "first_critical_after_collapse_s": _stats(delays),
        "silent_at_the_end": silent,
        "late_first_firing": late,
        "met": not (silent or late),
    }


def check_targets(results: Sequence[RunResult]) -> dict[str, Any]:
    """The targets the alerts are held to, computed on every run given (the ``paper`` block's
    runs when validating ``--block paper``): the retry-loop alert fires in every run that did not
    recover, at most ``RETRY_LOOP_LEAD_TARGET_S`` (scaled) after the pulse's end, and never
    before the pulse, after a recovery or in a run whose retries were shed or attached; the
    backlog alert fires before the pulse's end in every run that did not recover. Each list
    names the runs that break or qualify a target."""
    loop_missed: list[dict[str, Any]] = []
    loop_late: list[dict[str, Any]] = []
    loop_before_pulse: list[dict[str, Any]] = []
    loop_after_recovery: list[dict[str, Any]] = []
    loop_controlled: list[dict[str, Any]] = []
    loop_between: list[dict[str, Any]] = []
    backlog_missed: list[dict[str, Any]] = []
    backlog_recovering: list[dict[str, Any]] = []
    for r in results:
        info = r.info
        loop = _own(r, RETRY_LOOP)
        backlog = _own(r, BACKLOG)
        lead_target = RETRY_LOOP_LEAD_TARGET_S / info.time_scale
        first_loop = _first_after(loop, info.pulse_start_s)
        if not info.recovered:
            if first_loop is None:
                loop_missed.append(_run_ref(r, why=explain_miss(info)))
            elif first_loop.fired_at_s - info.pulse_end_s > lead_target:
                lead = round(first_loop.fired_at_s - info.pulse_end_s, 3)
                formed = loop_formed_at_s(info, first_loop.fired_at_s)
                extra = {} if formed is None else {"loop_formed_s": round(formed - info.pulse_end_s, 3)}
                loop_late.append(_run_ref(r, lead_time_s=lead, why=explain_miss(info), **extra))
            if not any(info.pulse_start_s <= f.fired_at_s <= info.pulse_end_s for f in backlog):
                backlog_missed.append(_run_ref(r))
        before = [f for f in loop if f.fired_at_s < info.pulse_start_s]
        if before:
            loop_before_pulse.append(_run_ref(r, fired_at_s=before[0].fired_at_s))
        recovery_at = info.recovery_at_s
        if recovery_at is not None:
            after = [f for f in loop if f.fired_at_s > recovery_at]
            if after:
                loop_after_recovery.append(_run_ref(r, fired_at_s=after[0].fired_at_s))
            between = [f for f in loop if info.pulse_start_s <= f.fired_at_s <= recovery_at]
            for f in between:
                loop_between.append(
                    _run_ref(
                        r,
                        fired_at_s=f.fired_at_s,
                        resolved_at_s=f.resolved_at_s,
                        recovery_at_s=recovery_at,
                        why=explain_transient_loop(info, f),
                    )
                )
            if backlog:
                backlog_recovering.append(_run_ref(r, fired_at_s=backlog[0].fired_at_s))
        if info.shed_or_attached and loop:
            loop_controlled.append(
                _run_ref(
                    r,
                    fired_at_s=loop[0].fired_at_s,
                    recovered=info.recovered,
                    why=explain_transient_loop(info, loop[0]),
                )
            )
    collapsed = sum(1 for r in results if not r.info.recovered)
    recovering = sum(1 for r in results if r.info.recovered)
    return {
        RETRY_LOOP: {
            "missed_runs": loop_missed,
            "late_runs": loop_late,
            "lead_target_s": RETRY_LOOP_LEAD_TARGET_S,
            "fired_before_pulse": loop_before_pulse,
            "fired_after_recovery": loop_after_recovery,
            "fired_in_shed_or_attached_runs": loop_controlled,
            "fired_between_pulse_and_recovery": loop_between,
            "met": not (
                loop_missed or loop_late or loop_before_pulse or loop_after_recovery or loop_controlled
            ),
        },
        BACKLOG: {
            "runs_not_recovered": collapsed,
            "missed_before_pulse_end": backlog_missed,
            "runs_recovered": recovering,
            "fired_in_recovering_runs": backlog_recovering,
            "fired_in_recovering_runs_count": len(backlog_recovering),
            "met": not backlog_missed,
        },
        SILENCE: check_silence(results),
    }


# --- by tier ---------------------------------------------------------------------------------
# Each tier's pages, side by side: the alerts a tier needs (``AlertRule.tier``: vLLM's series
# alone, or the proxy's too) that page (critical), taken together per kind, scored as one alert.
# The last tier of ``TIERS`` needs the most series and is the reference the others are held to.
TIER_KINDS: tuple[AlertKind, ...] = ("cause", "symptom")  # a data alert is reported, not scored


def tier_pages(rules: Sequence[AlertRule], alertnames: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """Per tier (in ``TIERS`` order), per scored kind (cause, symptom), the names of the tier's
    critical alerts among ``alertnames``; a tier or kind with none gets an empty list."""
    wanted = set(alertnames)
    return {
        tier: {
            kind: [
                r.name
                for r in rules
                if r.name in wanted and r.tier == tier and r.kind == kind and r.severity == "critical"
            ]
            for kind in TIER_KINDS
        }
        for tier in TIERS
    }


def _union(firings: Sequence[Firing], label: str) -> list[Firing]:
    """Overlapping or touching firings merged into one episode named ``label``."""
    merged: list[Firing] = []
    for f in sorted(firings, key=lambda f: f.fired_at_s):
        last = merged[-1] if merged else None
        if last is not None and (last.resolved_at_s is None or f.fired_at_s <= last.resolved_at_s):
            end = (
                None
                if last.resolved_at_s is None or f.resolved_at_s is None
                else max(last.resolved_at_s, f.resolved_at_s)
            )
            merged[-1] = replace(last, resolved_at_s=end)
        else:
            merged.append(Firing(label, f.fired_at_s, f.resolved_at_s, f.why, f.value))
    return merged


def as_one_alert(results: Sequence[RunResult], names: Sequence[str], label: str) -> list[RunResult]:
    """The runs with only the firings of ``names``, merged into one alert named ``label``."""
    return [
        RunResult(
            r.info, _union([f for f in r.firings if f.alertname in names], label), r.collapses, r.windows
        )
        for r in results
    ]


def _fired_from_pulse(r: RunResult, label: str) -> Firing | None:
    return _first_after(_own(r, label), r.info.pulse_start_s)


def score_tier_cause(names: Sequence[str], results: Sequence[RunResult]) -> dict[str, Any]:
    """A tier's cause pages as one alert: :func:`score_cause`'s figures, and the runs that recover
    in which it fired at all, and the runs that did not recover in which it never fired."""
    label = " or ".join(names)
    merged = as_one_alert(results, names, label)
    scores = score_cause(label, merged)
    scores["fired_in_recovered_runs"] = [r.info.slug for r in merged if r.info.recovered and _own(r, label)]
    scores["missed_runs"] = [
        r.info.slug for r in merged if not r.info.recovered and _fired_from_pulse(r, label) is None
    ]
    return scores


def compare_to_reference(
    names: Sequence[str], reference: Sequence[str], results: Sequence[RunResult]
) -> dict[str, Any]:
    """A tier's cause pages against the reference tier's, run by run (from the pulse's start on):
    the runs where the reference fired and it did not, where it fired and the reference did not,
    and in the runs where both fired, its first firing minus the reference's."""
    own = as_one_alert(results, names, "own")
    ref = as_one_alert(results, reference, "reference")
    silent_where_fired: list[str] = []
    fired_where_silent: list[str] = []
    after_reference: list[float] = []
    for mine, theirs in zip(own, ref, strict=True):
        first, ref_first = _fired_from_pulse(mine, "own"), _fired_from_pulse(theirs, "reference")
        if ref_first is not None and first is None:
            silent_where_fired.append(mine.info.slug)
        elif first is not None and ref_first is None:
            fired_where_silent.append(mine.info.slug)
        elif first is not None and ref_first is not None:
            after_reference.append(first.fired_at_s - ref_first.fired_at_s)
    return {
        "silent_where_reference_fired": silent_where_fired,
        "fired_where_reference_silent": fired_where_silent,
        "after_reference_s": _stats(after_reference),
    }


def score_tiers(
    results: Sequence[RunResult], rules: Sequence[AlertRule], alertnames: Sequence[str]
) -> dict[str, Any]:
    """Each tier's pages scored side by side (``validation.json``'s ``tiers``): per tier, its
    cause pages as one alert (:func:`score_tier_cause`) and against the reference tier's
    (:func:`compare_to_reference`), its symptom pages as one alert (:func:`score_symptom`)."""
    pages = tier_pages(rules, alertnames)
    reference = TIERS[-1]
    out: dict[str, Any] = {}
    for tier, kinds in pages.items():
        cause, symptom = kinds["cause"], kinds["symptom"]
        label = " or ".join(symptom)
        out[tier] = {
            "cause": {"alerts": cause, **score_tier_cause(cause, results)} if cause else None,
            "symptom": (
                {"alerts": symptom, **score_symptom(label, as_one_alert(results, symptom, label))}
                if symptom
                else None
            ),
            "against_reference": (
                compare_to_reference(cause, pages[reference]["cause"], results)
                if cause and tier != reference and pages[reference]["cause"]
                else None
            ),
        }
    return {"reference": reference, "tiers": out}


def _ground_truth_summary(results: Sequence[RunResult]) -> dict[str, Any]:
    judged = [r for r in results if r.collapses is not None]
    disagree = [
        r.info.slug
        for r in judged
        if collapsed_to_the_end(r.collapses or [], 0.0 if r.info.trace else r.info.pulse_start_s)
        == r.info.recovered
    ]
    collapses = [c for r in judged for c in r.collapses or []]
    return {
        "runs": len(results),
        "runs_with_call_records": len(judged),
        "collapses": len(collapses),
        "metastable_collapses": sum(1 for c in collapses if c.metastable),
        "collapses_to_the_end": sum(1 for c in collapses if not c.ended),
        "agrees_with_recovered": len(judged) - len(disagree),
        "disagreeing_runs": disagree,
    }


def build_report(
    results: Sequence[RunResult],
    alertnames: Sequence[str],
    kinds: Mapping[str, AlertKind] | None = None,
    rules: Sequence[AlertRule] = ALERTS,
) -> dict[str, Any]:
    """The whole ``validation.json`` document (``kinds``: each alert's kind, by default those of
    ``rules``; an alert it does not name is scored as a cause; ``rules`` also give each alert's
    tier and severity for the tiers' pages, :func:`score_tiers`)."""
    kinds = {r.name: r.kind for r in rules} if kinds is None else kinds
    tiers = {r.name: r.tier for r in rules}

    def scores(subset: Sequence[RunResult]) -> dict[str, Any]:
        return {
            name: {**score_alert(name, subset, kinds.get(name, "cause")), "tier": tiers.get(name)}
            for name in alertnames
        }

    blocks = list(dict.fromkeys(r.info.block for r in results))
    return {
        "alerts": scores(results),
        "tiers": score_tiers(results, rules, alertnames),
        "tiers_by_condition": {
            c: score_tiers(subset, rules, alertnames)
            for c in dict.fromkeys(r.info.condition for r in results)
            if (subset := [r for r in results if r.info.condition == c])
        },
        "ground_truth": _ground_truth_summary(results),
        "by_block": {
            b: {
                "ground_truth": _ground_truth_summary(subset),
                "alerts": scores(subset),
                "tiers": score_tiers(subset, rules, alertnames),
            }
            for b in blocks
            if (subset := [r for r in results if r.info.block == b])
        },
        "runs": [
            {
                "block": r.info.block,
                "condition": r.info.condition,
                "variant": r.info.variant,
                "model": r.info.model,
                "run": r.info.run,
                "recovered": r.info.recovered,
                "trace": r.info.trace,  # a replayed trace: "pulse" holds the burst it is aligned on
                "pulse": {"start_s": r.info.pulse_start_s, "end_s": r.info.pulse_end_s},
                "judged_end_s": r.info.judged_end_s,
                "duration_s": r.info.duration_s,
                "collapses": None if r.collapses is None else [c.to_dict() for c in r.collapses],
                "alerts": [
                    {"alertname": f.alertname, "fired_at_s": f.fired_at_s, "resolved_at_s": f.resolved_at_s}
                    for f in sorted(r.firings, key=lambda f: (f.fired_at_s, f.alertname))
                ],
            }
            for r in results
        ],
        "targets": check_targets(results),
    }


# --- Markdown ------------------------------------------------------------------------------

NA = "n/a"


def _fmt(value: Any) -> str:
    if value is None:
        return NA
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _share(value: float | None) -> str:
    """A recall, to three significant digits."""
    return NA if value is None else f"{value:.3g}"


def _pair(stats: Mapping[str, Any]) -> str:
    return f"{_fmt(stats['median'])} / {_fmt(stats['max'])}"


def _by_kind(report: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return {name: a for name, a in report["alerts"].items() if a.get("kind", "cause") == kind}


def _cause_table(alerts: Mapping[str, Any]) -> list[str]:
    lines = [
        "| alert | recall | runs not recovered | false-positive runs | runs recovered "
        "| lead after the pulse's end, median / max (s) | recall over metastable collapses "
        "| runs with a metastable collapse | after the collapse turned metastable, median / max (s) "
        "| resolved after the recovery, median / max (s) | still firing after a recovery |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in alerts.items():
        lines.append(
            f"| {name} | {_share(a['recall'])} | {a['runs_not_recovered']} | {a['false_positive_runs']} "
            f"| {a['runs_recovered']} | {_pair(a['lead_time_s'])} | {_share(a['recall_metastable'])} "
            f"| {a['runs_metastable']} | {_pair(a['lead_after_metastable_s'])} "
            f"| {_pair(a['resolve_after_recovery_s'])} | {a['still_firing_after_recovery_runs']} |"
        )
    return lines


CAUSE_LEGEND = [
    "- **recall**: the share of the runs that did not recover (docs/protocol.md §6) in which the "
    "alert fired at or after the pulse's start.",
    "- **false-positive runs**: runs with a firing that starts outside every collapse and outside "
    "the overload's own stretch (the pulse's start to the end of the collapse it caused).",
    "- **lead after the pulse's end**: first firing at or after the pulse's start, minus the "
    "pulse's end, over the runs that did not recover; negative: it fired before the pulse ended "
    "(an early warning).",
    "- **recall over metastable collapses**: the share of the runs with a metastable collapse "
    "(first attempts below Ĉ while executions are created at or above it) in which it fired "
    "during that collapse. **After the collapse turned metastable**: its first firing there minus "
    "that moment; negative: it fired before the collapse turned metastable.",
    "- **resolved after the recovery**: in recovered runs in which it fired between the pulse and "
    "the recovery, the resolution of the last such firing minus the recovery time; negative: it "
    "resolved before the run recovered (the cause cleared before the calls caught up, as it "
    "should). Firings still going at the end count in the last column instead.",
    f"- {NA}: no run to measure it on.",
]


def _symptom_table(alerts: Mapping[str, Any]) -> list[str]:
    lines = [
        "| alert | recall over collapses | collapses | stayed firing to the collapse's end "
        "| false-positive runs | false-positive firings | after the collapse began, median / max (s) "
        "| resolved after the collapse ended, median / max (s) | still firing after a collapse ended |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in alerts.items():
        lines.append(
            f"| {name} | {_share(a['recall'])} | {a['collapses']} | {a['held_to_collapse_end']} "
            f"of {a['collapses_detected']} | {a['false_positive_runs']} | {a['false_positive_firings']} "
            f"| {_pair(a['lead_time_s'])} | {_pair(a['resolve_after_collapse_s'])} "
            f"| {a['still_firing_after_collapse']} |"
        )
    return lines


SYMPTOM_LEGEND = [
    "- **recall over collapses**: the share of all collapses (every run with call records) during "
    "which the alert fired, or within one deadline after the collapse ended (the last calls of a "
    "collapse miss their deadline one deadline after they arrive).",
    "- **stayed firing to the collapse's end**: of the collapses it fired in, those it kept firing "
    "through, without a gap, from its first firing to the collapse's end (the end of the hold for a "
    "run that never recovered).",
    "- **false-positive runs / firings**: firings that start outside every collapse (and its "
    "one-deadline tail).",
    "- **after the collapse began**: its first firing minus the collapse's start (the planned "
    "arrival of the first call that missed its deadline): at least about one deadline plus the "
    "alert's `for`, since a miss is known only once the deadline has passed.",
    "- **resolved after the collapse ended**: for collapses that ended, its resolution minus the "
    "collapse's end; negative: it resolved before the collapse ended.",
    f"- {NA}: no collapse to measure it on.",
]


def _data_lines(alerts: Mapping[str, Any]) -> list[str]:
    lines = ["| alert | runs it fired in | firings | runs |", "| --- | --- | --- | --- |"]
    for name, a in alerts.items():
        lines.append(f"| {name} | {a['runs_fired']} | {a['firings']} | {a['runs']} |")
    return lines


DATA_LEGEND = [
    "- A data alert says the detector lacks the series to judge an engine; it is not scored for "
    "recall, since no collapse is its cause. Every run writes its whole series, so it should fire "
    "in none: a run it fired in lost part of its series, and the other alerts of that run were "
    "judged on less.",
]


def _collapse_text(c: Mapping[str, Any]) -> str:
    end = f"{_fmt(c['end_s'])}" if c.get("ended", True) else f"{_fmt(c['end_s'])} (to the end)"
    if c.get("metastable"):
        at = c.get("metastable_at_s")
        held = c.get("metastable_for_s")
        kind = "metastable" + (f" from {_fmt(at)}" if at is not None else "")
        kind += f" for {_fmt(held)} s" if held is not None else ""
    elif c.get("metastable") is None:
        kind = "metastable unknown"
    else:
        kind = "not metastable"
    return f"{_fmt(c['start_s'])}–{end}, {kind}"


def _alert_text(a: Mapping[str, Any]) -> str:
    end = STILL_FIRING if a["resolved_at_s"] is None else _fmt(a["resolved_at_s"])
    return f"{a['alertname']} {_fmt(a['fired_at_s'])}–{end}"


def _cell(a: Mapping[str, Any]) -> str:
    return f"{_share(a['recall'])} · {a['false_positive_runs']} · {_pair(a['lead_time_s'])}"


def _trace_reading(report: Mapping[str, Any]) -> list[str]:
    """How to read the pulse's figures on replayed traces, which have none (docs/traces.md)."""
    traces = sum(1 for r in report["runs"] if r.get("trace"))
    if not traces:
        return []
    return [
        f"- {traces} of the runs replay a request trace, which has no pulse: for them, read every "
        '"pulse" below as the burst the run is aligned on (the busiest 60-s stretch before its first '
        "collapse, or its busiest stretch when nothing collapsed; `burst` in summary.json) and "
        '"the hold" as the whole run, to three windows after its last call (docs/traces.md).'
    ]


def summary_markdown(report: Mapping[str, Any]) -> list[str]:
    """The scores: the ground truth, a table per kind with its legend, and per block."""
    gt = report["ground_truth"]
    lines = [
        "# Alert validation",
        "",
        "Each alert of the detector, replayed over every run, against the runs' ground truth over "
        'time (docs/protocol.md, "Ground truth over time"). Times are seconds from the run\'s '
        "start (with `--time-scale K`, the study's seconds divided by K).",
        "",
        "## Ground truth",
        "",
        f"- {gt['runs']} runs, {gt['runs_with_call_records']} with call records: "
        f"{gt['collapses']} collapses, {gt['metastable_collapses']} of them metastable, "
        f"{gt['collapses_to_the_end']} running to the end of the hold.",
        "- A collapse: a stretch in which fewer than 98 % of the calls arriving in a 60-s window "
        "are delivered within the deadline, until two consecutive windows meet the recovery rule. "
        "Metastable: inside it, first attempts arrived below Ĉ while executions were still created "
        "at or above Ĉ.",
        f"- It agrees with the recovery verdict (a run did not recover exactly when a collapse runs "
        f"to the end of its hold) in {gt['agrees_with_recovered']} of {gt['runs_with_call_records']} "
        "runs" + (f"; not in {', '.join(gt['disagreeing_runs'])}." if gt["disagreeing_runs"] else "."),
        *_trace_reading(report),
        "",
    ]
    for kind, title, table, legend in (
        ("cause", "Cause alerts", _cause_table, CAUSE_LEGEND),
        ("symptom", "Symptom alerts", _symptom_table, SYMPTOM_LEGEND),
        ("data", "Data alerts", _data_lines, DATA_LEGEND),
    ):
        alerts = _by_kind(report, kind)
        lines += [f"## {title}", ""]
        if not alerts:
            lines += [f"No {kind} alert is defined.", ""]
            continue
        lines += [*table(alerts), "", *legend, ""]
    scored = [n for n, a in report["alerts"].items() if a.get("kind") != "data"]
    lines += [
        "## By block",
        "",
        "| block | runs not recovered | collapses (metastable) | " + " | ".join(scored) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in scored) + " |",
    ]
    for block, scores in report["by_block"].items():
        alerts, truth = scores["alerts"], scores["ground_truth"]
        not_recovered = next((a["runs_not_recovered"] for a in alerts.values()), NA)
        collapses = f"{truth['collapses']} ({truth['metastable_collapses']})"
        cells = " | ".join(_cell(alerts[n]) for n in scored)
        lines.append(f"| {block} | {not_recovered} | {collapses} | {cells} |")
    lines += [
        "",
        "- Each cell: recall · false-positive runs · lead, median / max (s), over the block's runs, "
        "as in the tables above: a cause alert's recall is over the runs that did not recover and "
        "its lead is after the pulse's end; a symptom alert's recall is over the collapses and its "
        f"lead after each collapse began. {NA}: nothing to measure in that block.",
        "",
        *tiers_markdown(report),
    ]
    return lines


def _tier_row(label: str, tier: str, scores: Mapping[str, Any]) -> str:
    cause, symptom, ref = scores["cause"], scores["symptom"], scores["against_reference"]
    cells = [label, tier]
    if cause is None:
        cells += ["no critical cause alert"] + [NA] * 9
    else:
        cells += [
            f"{_share(cause['recall'])} of {cause['runs_not_recovered']}",
            f"{_share(cause['recall_metastable'])} of {cause['runs_metastable']}",
            str(cause["false_positive_runs"]),
            f"{len(cause['fired_in_recovered_runs'])} of {cause['runs_recovered']}",
            _pair(cause["lead_time_s"]),
            _pair(cause["lead_after_metastable_s"]),
            str(len(cause["missed_runs"])),
        ]
        if ref is None:
            cells += [NA, NA]
        else:
            cells += [
                f"{len(ref['silent_where_reference_fired'])} · {len(ref['fired_where_reference_silent'])}",
                _pair(ref["after_reference_s"]),
            ]
    if symptom is None:
        cells += ["no critical symptom alert", NA, NA]
    else:
        cells += [
            f"{_share(symptom['recall'])} of {symptom['collapses']}",
            str(symptom["false_positive_runs"]),
            _pair(symptom["lead_time_s"]),
        ]
    return "| " + " | ".join(cells) + " |"


def tiers_markdown(report: Mapping[str, Any]) -> list[str]:
    """The tiers' pages side by side, over every run and per block, with a legend and the runs
    where a tier's cause pages part from the reference tier's."""
    whole = report["tiers"]
    reference = whole["reference"]
    lines = [
        "## By tier",
        "",
        "Each tier's pages (its critical alerts) side by side; a tier's alerts need only its own series "
        f"(`AlertRule.tier`), and the reference is the tier that needs the most, {reference}.",
        "",
    ]
    for tier, scores in whole["tiers"].items():
        for kind in TIER_KINDS:
            named = (scores[kind] or {}).get("alerts") or []
            lines.append(f"- {tier}, {kind}: {', '.join(named) if named else 'none'}")
    lines += [
        "",
        "| block | tier | recall | over metastable collapses | false-positive runs "
        "| recovering runs it fired in | lead after the pulse's end, median / max (s) "
        "| after the collapse turned metastable, median / max (s) | missed runs "
        f"| silent where {reference} fired · fired where it was silent "
        f"| after {reference}'s first firing, median / max (s) "
        "| symptom: recall over collapses | symptom: false-positive runs "
        "| symptom: after the collapse began, median / max (s) |",
        "| " + " | ".join("---" for _ in range(15)) + " |",
    ]
    for label, block in [("all runs", whole), *((b, s["tiers"]) for b, s in report["by_block"].items())]:
        lines += [_tier_row(label, tier, scores) for tier, scores in block["tiers"].items()]
    lines += [
        "",
        "- The tier's cause pages are taken together as one alert (a firing of any of them), as are its "
        "symptom pages; each figure is the one of the tables above: **recall** over the runs that did "
        "not recover, **over metastable collapses** over the runs with one, **false-positive runs** "
        "firing outside every collapse and the overload's own stretch, **lead** after the pulse's end.",
        "- **recovering runs it fired in**: runs that recovered in which it fired at any time (inside "
        "their collapse or not); **missed runs**: runs that did not recover in which it never fired from "
        "the pulse's start on.",
        f"- **silent where {reference} fired · fired where it was silent**: runs, from the pulse's start "
        f"on, where one tier's cause pages fired and the other's did not; **after {reference}'s first "
        f"firing**: in the runs where both fired, its first firing minus {reference}'s (negative: sooner).",
        f"- {NA}: no run to measure it on, or the tier has no such page.",
        "",
    ]
    tiers = list(whole["tiers"])
    lines += [
        "By condition (every block's runs of a condition together), each tier's cause pages: "
        "recall over the runs that did not recover · recovering runs it fired in · lead after the "
        "pulse's end, median / max (s).",
        "",
        "| condition | runs not recovered | runs recovered | " + " | ".join(tiers) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in tiers) + " |",
    ]
    for condition, scored in report["tiers_by_condition"].items():
        causes = [scored["tiers"][t]["cause"] for t in tiers]
        known = next((c for c in causes if c is not None), None)
        counts = (NA, NA) if known is None else (known["runs_not_recovered"], known["runs_recovered"])
        cells = [
            NA
            if c is None
            else f"{_share(c['recall'])} · {len(c['fired_in_recovered_runs'])} · {_pair(c['lead_time_s'])}"
            for c in causes
        ]
        lines.append(f"| {condition} | {counts[0]} | {counts[1]} | " + " | ".join(cells) + " |")
    lines.append("")
    for tier, scores in whole["tiers"].items():
        cause, ref = scores["cause"], scores["against_reference"]
        parts = [] if cause is None else [("missed (did not recover, never fired)", cause["missed_runs"])]
        parts += (
            [] if cause is None else [("fired in a run that recovered", cause["fired_in_recovered_runs"])]
        )
        if ref is not None:
            parts += [
                (f"silent where {reference} fired", ref["silent_where_reference_fired"]),
                (f"fired where {reference} was silent", ref["fired_where_reference_silent"]),
            ]
        for what, runs in parts:
            if runs:
                lines.append(f"- {tier}, {what}: {', '.join(runs)}")
    return [*lines, ""]


def _silence_markdown(silence: Mapping[str, Any]) -> list[str]:
    delay = silence["first_critical_after_collapse_s"]
    lines = [
        f"### No collapse is silent: {'met' if silence['met'] else 'NOT met'}",
        "",
        f"In every run whose collapse lasts to the end of its hold, a critical alert fires within "
        f"{silence['target_s']:g} s (study seconds) of that collapse's start and is still firing at the "
        "hold's end.",
        "",
        f"- runs with a collapse to the end of the hold: {silence['runs_collapsed_to_the_end']}; first "
        f"critical firing after the collapse began, median / max: {_pair(delay)} s",
        f"- no critical alert firing at the hold's end: {len(silence['silent_at_the_end'])}",
    ]
    lines += [f"  - {r['run']}: {r['why']}" for r in silence["silent_at_the_end"]]
    lines.append(
        f"- first critical firing later than {silence['target_s']:g} s: {len(silence['late_first_firing'])}"
    )
    lines += [
        f"  - {r['run']}: {r['alertname']} at +{_fmt(r['after_collapse_s'])} s"
        for r in silence["late_first_firing"]
    ]
    return [*lines, ""]


def render_markdown(report: Mapping[str, Any]) -> str:
    lines = summary_markdown(report)
    targets = report["targets"]
    loop, backlog = targets[RETRY_LOOP], targets[BACKLOG]
    lines += [
        "## Targets",
        "",
        f"What the alerts are held to: {RETRY_LOOP} fires in every run that did not recover, at "
        f"most {loop['lead_target_s']:g} s (study seconds) after the pulse's end, and never before "
        f"the pulse, after a recovery or in a run whose retries were shed or attached; {BACKLOG} "
        "fires before the pulse's end in every run that did not recover. Each line counts the runs "
        "that break a target, and names them with the figures that explain why.",
        "",
        f"### {RETRY_LOOP}: {'met' if loop['met'] else 'NOT met'}",
        "",
    ]
    checks = [
        ("did not fire in a run that did not recover", loop["missed_runs"]),
        (f"fired later than {loop['lead_target_s']:g} s after the pulse's end", loop["late_runs"]),
        ("fired before the pulse", loop["fired_before_pulse"]),
        ("fired after the run's recovery", loop["fired_after_recovery"]),
        ("fired in a run whose retries were shed or attached", loop["fired_in_shed_or_attached_runs"]),
    ]
    for label, runs in checks:
        lines.append(f"- {label}: {len(runs)}")
        for r in runs:
            extra = []
            if "lead_time_s" in r:
                extra.append(f"+{_fmt(r['lead_time_s'])} s")
            if "loop_formed_s" in r:
                extra.append(
                    f"the loop formed at +{_fmt(r['loop_formed_s'])} s (executions created over "
                    f"{LOOP_FORMATION_WINDOW_S:g} s reached Ĉ)"
                )
            if "recovered" in r:
                extra.append("recovered" if r["recovered"] else "did not recover")
            if r.get("why"):
                extra.append(r["why"])
            lines.append(f"  - {r['run']}" + (f": {'; '.join(extra)}" if extra else ""))
    between = loop["fired_between_pulse_and_recovery"]
    lines += [
        "",
        f"Recovering runs in which it fired between the pulse and the recovery: {len(between)} (no "
        "target is broken: the loop's signature held for a while and a control or the drain broke "
        "it; against the ground truth, a firing inside a collapse is no false positive)",
        "",
    ]
    if between:
        lines += ["| run | fired at | resolved at | recovered at | why |", "| --- | --- | --- | --- | --- |"]
        for b in between:
            resolved = STILL_FIRING if b["resolved_at_s"] is None else _fmt(b["resolved_at_s"])
            lines.append(
                f"| {b['run']} | {_fmt(b['fired_at_s'])} | {resolved} "
                f"| {_fmt(b['recovery_at_s'])} | {b['why'] or 'no figures'} |"
            )
    lines += [
        "",
        f"### {BACKLOG}: {'met' if backlog['met'] else 'NOT met'}",
        "",
        f"- runs that did not recover: {backlog['runs_not_recovered']}; without a firing before the "
        f"pulse's end: {len(backlog['missed_before_pulse_end'])}",
        f"- recovering runs in which it fired: {backlog['fired_in_recovering_runs_count']} of "
        f"{backlog['runs_recovered']}",
        "",
        *_silence_markdown(targets[SILENCE]),
        "## Runs",
        "",
        "| block | condition | model | run | recovered | collapses (start–end, s) "
        "| alerts (fired–resolved, s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        alerts = "; ".join(_alert_text(a) for a in r["alerts"])
        if r.get("collapses") is None:
            collapses = "no call records"
        else:
            collapses = "; ".join(_collapse_text(c) for c in r["collapses"]) or "none"
        condition = f"{r['condition']}-{r['variant']}" if r.get("variant") else r["condition"]
        lines.append(
            f"| {r['block']} | {condition} | {r['model']} | {r['run']} | {r['recovered']} "
            f"| {collapses} | {alerts or 'none fired'} |"
        )
    lines += [
        "",
        "- Collapses: start (the planned arrival of the first call that missed its deadline) – "
        "end (the end of the last window before two windows that meet the recovery rule); "
        '"to the end": it ran to the end of the hold; "metastable from T for D s": the first '
        "moment first attempts arrived below Ĉ while executions were created at or above Ĉ, and "
        "how long that held in all.",
        f'- Alerts: fired – resolved; "{STILL_FIRING}": the episode had not resolved when the '
        "run's series ended.",
    ]
    return "\n".join(lines) + "\n"


# --- replay and the command ---------------------------------------------------------------

Replayer = Callable[[RunInfo], list[Firing]]


def replay_firings(info: RunInfo, windows: Windows = WINDOWS) -> list[Firing]:
    """Replay one run's series through the detector (its signals over ``windows``) and return
    its episodes."""
    from detector.replay import replay_reproduce_run  # the detector's public replay API

    episodes = replay_reproduce_run(
        info.series, info.capacity, info.deadline_s, info.time_scale, windows=windows
    )
    return [
        Firing(
            alertname=e.alertname,
            fired_at_s=round(float(e.started_at), 3),
            resolved_at_s=None if e.resolved_at is None else round(float(e.resolved_at), 3),
            why=str(getattr(e, "description", "") or ""),
            value=None if e.value is None else float(e.value),
        )
        for e in episodes
    ]


def all_alertnames() -> list[str]:
    return [a.name for a in ALERTS]


def validate_dir(
    out_dir: Path,
    *,
    replayer: Replayer = replay_firings,
    alertnames: Sequence[str] | None = None,
    kinds: Mapping[str, AlertKind] | None = None,
    block: str | None = None,
) -> dict[str, Any]:
    """Validate every run of ``out_dir`` (or of one block), write validation.json and .md."""
    infos = load_runs(out_dir)
    if block is not None and block != PAPER:
        infos = [i for i in infos if i.block == block]
        if not infos:
            raise RunDirError(f"{out_dir / SUMMARY}: no run of block {block!r}")
    results = []
    for info in infos:
        truth = info.truth
        results.append(
            RunResult(
                info,
                replayer(info),
                None if truth is None else truth.collapses,
                None if truth is None else truth.windows,
            )
        )
    names = list(alertnames) if alertnames is not None else all_alertnames()
    report = build_report(results, names, kinds)
    (out_dir / VALIDATION).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / VALIDATION_MD).write_text(render_markdown(report), encoding="utf-8")
    return report


@click.command("validate")
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--block", default=None, help="Validate only the runs of this block (paper: every run).")
def validate(out_dir: Path, block: str | None) -> None:
    """Replay every run of a reproduce output DIR through the detector and score each alert
    against the runs' ground truth over time; print the scores (the tables docs/results.md
    quotes) and write DIR/validation.json and DIR/validation.md."""
    try:
        report = validate_dir(out_dir, block=block)
    except NotARunDir as exc:  # a usage mistake: exit 2, and nothing was written
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("\n".join(summary_markdown(report)))
    click.echo(f"wrote {out_dir / VALIDATION} and {out_dir / VALIDATION_MD}")
