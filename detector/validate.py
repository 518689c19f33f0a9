"""Validation of the alerts against a reproduce output: ``retrywatch reproduce validate DIR``.

Replays every run listed in ``DIR/summary.json`` through the detector (``replay_run``), then
scores each alert against the run's outcome (docs/protocol.md §6: recovered or not, recovery time):

- recall over the runs that did not recover (the alert fired at all after the pulse began);
- false-positive runs among the runs that recovered: an episode that fired before the pulse
  began or after the run's recovery time (``pulse.end_s + recovery_time_s``);
- lead time: first firing at or after the pulse's start, minus the pulse's end (negative when
  the alert fires before the pulse ends), over the runs that did not recover;
- resolve after recovery: in recovered runs in which the alert fired between the pulse's start
  and the recovery, the resolution of the last such episode minus the recovery time (an
  episode still firing at the end of the run counts as resolved at the run's end).

Writes ``DIR/validation.json`` (the shape in docs/architecture.md, plus a ``targets`` section:
the checks of :func:`check_targets`) and ``DIR/validation.md``. Times are seconds from the run's start.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
from exporter import metricnames as mn
from exporter.timeseries import read_series

PAPER = "paper"  # the block made of every block: runs carry their own block's name
RETRY_LOOP = "VLLMMetastableRetryLoop"
BACKLOG = "VLLMBacklogBeyondDeadline"
# The retry-loop alert must fire within this long after the pulse's end, in the study's seconds
# (divided by the run's time scale).
RETRY_LOOP_LEAD_TARGET_S = 120.0
# A late firing is put beside when the loop formed: executions created over this window (study
# seconds) rising to Ĉ, the loop's fuel, seen at a finer grain than the detector's rate window.
LOOP_FORMATION_WINDOW_S = 10.0


@dataclass(frozen=True)
class Firing:
    """One alert episode in a run, in seconds from the run's start (``resolved_at_s`` None while
    it was still firing at the end of the run)."""

    alertname: str
    fired_at_s: float
    resolved_at_s: float | None
    why: str = ""
    value: float | None = None  # the alert's value when it fired (creation / Ĉ for the loop)


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
    hold_creation_x_capacity: float | None = None  # executions created over 347–947 s, in Ĉ
    variant: str = ""  # e.g. the trigger sweep's "pulse-2"

    @property
    def recovery_at_s(self) -> float | None:
        """When the run recovered, from its start; None if it did not."""
        if not self.recovered or self.recovery_time_s is None:
            return None
        return self.pulse_end_s + self.recovery_time_s

    @property
    def slug(self) -> str:
        condition = f"{self.condition}-{self.variant}" if self.variant else self.condition
        return f"{self.block}__{condition}__{self.model}__r{self.run}"


@dataclass
class RunResult:
    info: RunInfo
    firings: list[Firing] = field(default_factory=list)


def _field(run: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in run:
        raise RunDirError(f"{where}: missing field {key!r}")
    return run[key]


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RunDirError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


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


def _hold_and_control(info: RunInfo, below: str, prefix: str = "") -> list[str]:
    """The figures both explanations give: execution creation over the hold against Ĉ (``below``
    says what creation under Ĉ means), and whether the run's controls shed or attached retries."""
    parts = []
    x = info.hold_creation_x_capacity
    if x is not None:
        parts.append(f"{prefix}{x:.2f} Ĉ over the hold (347–947 s){below if x < 1.0 else ': at or above Ĉ'}")
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
        pulse = _field(run, "pulse", where)
        if not isinstance(pulse, dict):
            raise RunDirError(f"{where}: 'pulse' must be an object with start_s and end_s")
        recovered = _field(run, "recovered", where)
        if not isinstance(recovered, bool):
            raise RunDirError(f"{where}: 'recovered' must be true or false")
        recovery_time = run.get("recovery_time_s")
        if recovered and recovery_time is None:
            raise RunDirError(f"{where}: a recovered run needs 'recovery_time_s'")
        _field(run, "series", where)
        series = series_path(out_dir, run, must_exist=True)
        infos.append(
            RunInfo(
                block=str(_field(run, "block", where)),
                condition=str(_field(run, "condition", where)),
                model=str(_field(run, "model", where)),
                run=int(_field(run, "run", where)),
                recovered=recovered,
                recovery_time_s=None if recovery_time is None else _number(recovery_time, where),
                pulse_start_s=_number(_field(pulse, "start_s", where), where),
                pulse_end_s=_number(_field(pulse, "end_s", where), where),
                duration_s=_number(_field(run, "duration_s", where), where),
                deadline_s=_number(_field(run, "deadline_s", where), where),
                capacity=_number(_field(run, "capacity", where), where),
                time_scale=_number(run.get("time_scale", 1.0), where),
                series=series,
                shed_or_attached=_shed_or_attached(run),
                hold_creation_x_capacity=_hold_creation(run),
                variant=str(run.get("variant") or ""),
            )
        )
    return infos


# --- scoring -----------------------------------------------------------------------------


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(float(statistics.median(values)), 3), "max": round(float(max(values)), 3)}


def _first_after(firings: Sequence[Firing], t: float) -> Firing | None:
    after = [f for f in firings if f.fired_at_s >= t]
    return min(after, key=lambda f: f.fired_at_s) if after else None


def false_positive(info: RunInfo, firings: Sequence[Firing]) -> list[Firing]:
    """Episodes of a recovered run that fired before the pulse or after the recovery."""
    recovery_at = info.recovery_at_s
    return [
        f
        for f in firings
        if f.fired_at_s < info.pulse_start_s or (recovery_at is not None and f.fired_at_s > recovery_at)
    ]


def score_alert(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """The per-alert figures of ``validation.json``."""
    not_recovered = [r for r in results if not r.info.recovered]
    recovered = [r for r in results if r.info.recovered]
    hits = 0
    lead_times: list[float] = []
    for r in not_recovered:
        first = _first_after([f for f in r.firings if f.alertname == alertname], r.info.pulse_start_s)
        if first is not None:
            hits += 1
            lead_times.append(first.fired_at_s - r.info.pulse_end_s)
    fp_runs = 0
    resolve_times: list[float] = []
    for r in recovered:
        own = [f for f in r.firings if f.alertname == alertname]
        if false_positive(r.info, own):
            fp_runs += 1
        recovery_at = r.info.recovery_at_s
        assert recovery_at is not None
        during = [f for f in own if r.info.pulse_start_s <= f.fired_at_s <= recovery_at]
        if during:
            last = max(during, key=lambda f: f.fired_at_s)
            resolved = r.info.duration_s if last.resolved_at_s is None else last.resolved_at_s
            resolve_times.append(resolved - recovery_at)
    return {
        "recall": round(hits / len(not_recovered), 4) if not_recovered else None,
        "runs_not_recovered": len(not_recovered),
        "false_positive_runs": fp_runs,
        "runs_recovered": len(recovered),
        "lead_time_s": _stats(lead_times),
        "resolve_after_recovery_s": _stats(resolve_times),
    }


def _run_ref(r: RunResult, **extra: Any) -> dict[str, Any]:
    return {"run": r.info.slug, **extra}


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
        loop = [f for f in r.firings if f.alertname == RETRY_LOOP]
        backlog = [f for f in r.firings if f.alertname == BACKLOG]
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
    }


def build_report(results: Sequence[RunResult], alertnames: Sequence[str]) -> dict[str, Any]:
    """The whole ``validation.json`` document."""
    return {
        "alerts": {name: score_alert(name, results) for name in alertnames},
        "runs": [
            {
                "block": r.info.block,
                "condition": r.info.condition,
                "variant": r.info.variant,
                "model": r.info.model,
                "run": r.info.run,
                "recovered": r.info.recovered,
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


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render_markdown(report: Mapping[str, Any]) -> str:
    lines = [
        "# Alert validation",
        "",
        "Times in seconds from the run's start; lead time is firing minus "
        "the pulse's end (negative: before the pulse ended).",
        "",
    ]
    lines += [
        "| alert | recall | runs not recovered | false-positive runs | runs recovered "
        "| lead time median / max (s) | resolve after recovery median / max (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, a in report["alerts"].items():
        lead, res = a["lead_time_s"], a["resolve_after_recovery_s"]
        lines.append(
            f"| {name} | {_fmt(a['recall'])} | {a['runs_not_recovered']} | {a['false_positive_runs']} "
            f"| {a['runs_recovered']} | {_fmt(lead['median'])} / {_fmt(lead['max'])} "
            f"| {_fmt(res['median'])} / {_fmt(res['max'])} |"
        )
    targets = report["targets"]
    loop, backlog = targets[RETRY_LOOP], targets[BACKLOG]
    lines += ["", "## Targets", "", f"### {RETRY_LOOP}: {'met' if loop['met'] else 'NOT met'}", ""]
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
    lines += ["", f"Recovering runs in which it fired between the pulse and the recovery: {len(between)}", ""]
    if between:
        lines += ["| run | fired at | resolved at | recovered at | why |", "| --- | --- | --- | --- | --- |"]
        for b in between:
            lines.append(
                f"| {b['run']} | {_fmt(b['fired_at_s'])} | {_fmt(b['resolved_at_s'])} "
                f"| {_fmt(b['recovery_at_s'])} | {b['why'] or '–'} |"
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
        "## Runs",
        "",
        "| block | condition | model | run | recovered | alerts (fired–resolved, s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        alerts = "; ".join(
            f"{a['alertname']} {_fmt(a['fired_at_s'])}–{_fmt(a['resolved_at_s'])}" for a in r["alerts"]
        )
        condition = f"{r['condition']}-{r['variant']}" if r.get("variant") else r["condition"]
        lines.append(
            f"| {r['block']} | {condition} | {r['model']} | {r['run']} | {r['recovered']} | {alerts or '–'} |"
        )
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
    from detector.thresholds import ALERTS

    return [a.name for a in ALERTS]


def validate_dir(
    out_dir: Path,
    *,
    replayer: Replayer = replay_firings,
    alertnames: Sequence[str] | None = None,
    block: str | None = None,
) -> dict[str, Any]:
    """Validate every run of ``out_dir`` (or of one block), write validation.json and .md."""
    infos = load_runs(out_dir)
    if block is not None and block != PAPER:
        infos = [i for i in infos if i.block == block]
        if not infos:
            raise RunDirError(f"{out_dir / SUMMARY}: no run of block {block!r}")
    results = [RunResult(info, replayer(info)) for info in infos]
    report = build_report(results, list(alertnames) if alertnames is not None else all_alertnames())
    (out_dir / VALIDATION).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / VALIDATION_MD).write_text(render_markdown(report), encoding="utf-8")
    return report


@click.command("validate")
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--block", default=None, help="Validate only the runs of this block (paper: every run).")
def validate(out_dir: Path, block: str | None) -> None:
    """Replay every run of a reproduce output DIR through the detector and score each alert."""
    try:
        report = validate_dir(out_dir, block=block)
    except NotARunDir as exc:  # a usage mistake: exit 2, and nothing was written
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(render_markdown(report).split("\n## Targets")[0])
    click.echo(f"wrote {out_dir / 'validation.json'} and {out_dir / 'validation.md'}")
