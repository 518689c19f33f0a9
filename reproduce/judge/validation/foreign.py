"""Any Prometheus rule file's alerts scored over a reproduce output:
``retrywatch reproduce validate DIR --rules FILE``.

The rule file is checked with ``promtool check rules`` first (:func:`load_rule_file`). Every run
of ``DIR`` is then loaded into one real Prometheus (``rules.backfill``: promtool turns the runs'
series into TSDB blocks, promtool materialises the recording rules, Prometheus evaluates each
alert's expression with ``query_range`` and the alerting state machine applies ``for`` and
``keep_firing_for``). The runs lie apart in time, each in a TSDB block of its own with a gap
longer than the rules' widest window after it (:func:`slot_s`), so an alert that aggregates
``instance`` away (``avg by (pod) (...)``) still reads one run at a time, and each run is queried
over its own span.

The series carry their names as the runs recorded them (vLLM's with colons, the proxy's
``retrywatch_*``), each run's ``instance`` (its slug) and one ``job`` label the caller chooses
(``--rules-job``, ``vllm`` by default), plus ``up{job, instance} = 1`` at every scrape. A group's
alerts are evaluated on its own ``interval`` (``--rules-interval`` for a group that sets none),
which must be a multiple of the runs' scrape interval; recording rules are materialised at every
scrape, which gives them the same value at each evaluation of any such grid.

Each alert is scored both ways with the scorers of ``validation.json``
(:func:`reproduce.judge.validation.scoring.score_alert`): as a cause (fires in the runs that did
not recover, not in those that drained; its first firing after the pulse's start, from the
pulse's end) and as a symptom (covers every collapse of the ground truth). Writes
``DIR/rules-validation.json`` and ``DIR/rules-validation.md``, which sets our own tiers' pages
(from ``DIR/validation.json`` when it is there) beside the file's alerts.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from foundation.rundir import RULES_VALIDATION, RULES_VALIDATION_MD, RunDirError, read_validation
from foundation.timeseries import Snapshot, read_series
from reproduce.judge.validation.runs import Firing, RunInfo, RunResult, firings_of
from reproduce.judge.validation.scoring import ground_truth_summary, score_alert

#: The ``job`` label every backfilled series carries unless the caller names another.
DEFAULT_JOB = "vllm"
#: The evaluation interval of a group that sets none (Prometheus' own ``evaluation_interval``).
DEFAULT_INTERVAL = "1m"
# Runs a rule file is evaluated over are placed this far apart at most (Prometheus' retention,
# ``rules.backfill``, keeps 30 days).
_MAX_SPAN_S = 25 * 86400.0


class RuleFileError(ValueError):
    """The rule file is not one Prometheus would load; the message is one line."""


class RulesUnavailable(RuntimeError):
    """Prometheus' tools are missing or failed (``rules.backfill.BackfillError``'s message)."""


@dataclass(frozen=True)
class ForeignAlert:
    """One alerting rule of the file, as Prometheus evaluates it."""

    name: str
    group: str
    expr: str
    interval_s: float
    for_s: float
    keep_firing_for_s: float
    severity: str | None


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    wanted = [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
    return (wanted or lines or ["no output"])[-1][:400]


def load_rule_file(
    path: Path, *, default_interval: str = DEFAULT_INTERVAL, promtool: str = "promtool"
) -> tuple[list[dict[str, Any]], list[ForeignAlert]]:
    """The file's recording rules and alerts, once ``promtool check rules`` accepts it. An alert
    name used by more than one rule (a warning and a critical threshold, say) is scored once per
    rule: the second is ``NAME#2``, and so on, in the file's order."""
    from rules.backfill import parse_duration

    if shutil.which(promtool) is None:
        raise RulesUnavailable(
            f"{promtool} not found: install Prometheus' tools (Debian's package prometheus)"
        )
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        raise RuleFileError(f"{path}: promtool check rules: {_one_line(proc.stderr + proc.stdout)}")
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    try:
        default_s = parse_duration(default_interval)
    except ValueError as exc:
        raise RuleFileError(str(exc)) from None
    records: list[dict[str, Any]] = []
    alerts: list[ForeignAlert] = []
    for group in doc.get("groups") or []:
        interval_s = parse_duration(str(group["interval"])) if "interval" in group else default_s
        for rule in group.get("rules") or []:
            if "record" in rule:
                records.append(dict(rule))
                continue
            name = str(rule["alert"])
            taken = sum(1 for a in alerts if a.name.split("#")[0] == name)
            name = f"{name}#{taken + 1}" if taken else name  # a second rule of one name: NAME#2
            alerts.append(
                ForeignAlert(
                    name=name,
                    group=str(group["name"]),
                    expr=str(rule["expr"]),
                    interval_s=interval_s,
                    for_s=parse_duration(str(rule.get("for", "0s"))),
                    keep_firing_for_s=parse_duration(str(rule.get("keep_firing_for", "0s"))),
                    severity=(rule.get("labels") or {}).get("severity"),
                )
            )
    if not alerts:
        raise RuleFileError(f"{path}: no alerting rule to score")
    return records, alerts


# --- evaluation -----------------------------------------------------------------------------

_RANGE_RE = re.compile(r"\[\s*([0-9][0-9a-z]*)\s*(?::\s*[0-9a-z]*\s*)?\]")
_OFFSET_RE = re.compile(r"\boffset\s+([0-9][0-9a-z]*)")


def reach_s(exprs: Sequence[str]) -> float:
    """How far back in time any of ``exprs`` reads: its widest range or subquery plus its largest
    offset (``[1h]``, ``[1h:5m]``, ``offset 24h``)."""
    from rules.backfill import parse_duration

    def widest(pattern: re.Pattern[str]) -> float:
        return max((parse_duration(m) for e in exprs for m in pattern.findall(e)), default=0.0)

    return widest(_RANGE_RE) + widest(_OFFSET_RE)


def slot_s(duration_s: float, reach: float, step_s: float) -> float:
    """The stretch of time each run is given: whole TSDB blocks, the run and a gap longer than
    what the rules read back (so no window reaches into the run before)."""
    from rules.backfill import BLOCK_S

    return math.ceil((duration_s + reach + 2 * step_s) / BLOCK_S) * BLOCK_S


def scrape_times(series: Path) -> list[float]:
    """The times of a run's scrapes, from its start."""
    return [s.t for s in read_series(series)]


def scrape_step_s(times: Sequence[Sequence[float]]) -> float:
    """The runs' scrape interval (the smallest gap between two scrapes of any run)."""
    positive = [b - a for ts in times for a, b in itertools.pairwise(ts) if b > a]
    if not positive:
        raise RunDirError("the runs hold fewer than two scrapes: nothing to evaluate a rule over")
    return round(min(positive), 3)


@dataclass(frozen=True)
class Episode:
    """One episode of an alert in a run, in seconds from the run's start."""

    alertname: str
    labels: tuple[tuple[str, str], ...]
    fired_at_s: float
    resolved_at_s: float | None


def evaluate_apart(
    runs: Mapping[str, Path],
    records: Sequence[Mapping[str, Any]],
    alerts: Sequence[ForeignAlert],
    *,
    job: str = DEFAULT_JOB,
    promtool: str = "promtool",
    prometheus: str = "prometheus",
) -> dict[str, list[Episode]]:
    """Prometheus' verdict on each run (``{run: episodes}``) of ``runs`` (a run's name: its series
    file), the runs placed apart in one TSDB. Each series is read when it is needed, never all at
    once."""
    from rules.backfill import (
        BLOCK_S,
        Prometheus,
        active_times,
        alert_episodes,
        backfill_recording_rules,
        place_run,
        write_blocks,
    )

    scrapes = {name: scrape_times(path) for name, path in runs.items()}
    ends = {name: ts[-1] for name, ts in scrapes.items() if ts}
    if not ends:
        return {}
    step = scrape_step_s(list(scrapes.values()))
    for a in alerts:
        ratio = a.interval_s / step
        if abs(ratio - round(ratio)) > 1e-6 or round(ratio) < 1:
            raise RuleFileError(
                f"group {a.group}: its interval {a.interval_s:g} s is not a multiple of the runs' "
                f"{step:g}-s scrape interval"
            )
    longest = max(ends.values())
    slot = slot_s(longest, reach_s([a.expr for a in alerts] + [str(r["expr"]) for r in records]), step)
    if slot * len(ends) > _MAX_SPAN_S:
        raise RunDirError(f"{len(ends)} runs of {longest:g} s do not fit apart in Prometheus' retention")
    out: dict[str, list[Episode]] = {name: [] for name in ends}
    with tempfile.TemporaryDirectory(prefix="rw-foreign-") as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        with Prometheus(data, lookback_delta_s=max(1.0, step - 1.0), binary=prometheus) as prom:
            # The last run where place_run puts one run; the others a slot apart before it.
            rule_file, last = place_run(
                prom,
                rule_dir=Path(tmp),
                group_name="retrywatch-foreign",
                duration_s=longest,
                step_s=step,
                promtool=promtool,
            )
            base = last - slot * (len(ends) - 1)
            assert slot % BLOCK_S == 0
            starts = {name: base + i * slot for i, name in enumerate(ends)}
            prom.stop()
            for name in ends:  # one run at a time: its blocks are its own
                scraped = [
                    Snapshot(
                        s.t, [(n, {**lb, "instance": name}, v) for n, lb, v in [*s.samples, ("up", {}, 1.0)]]
                    )
                    for s in read_series(runs[name])
                ]
                write_blocks(
                    scraped, data, start_unix_s=starts[name], extra_labels={"job": job}, promtool=promtool
                )
            prom.start()
            if records:
                backfill_recording_rules(
                    prom,
                    records,
                    rule_file=rule_file,
                    group_name="retrywatch-foreign",
                    start_unix_s=base,
                    end_unix_s=last + longest,
                    step_s=step,
                    promtool=promtool,
                )
            for name, run_end in ends.items():
                start, end = starts[name], starts[name] + run_end
                for a in alerts:
                    times = [
                        round(start + i * a.interval_s, 3)
                        for i in range(int((end - start) // a.interval_s) + 1)
                    ]
                    result = prom.query_range(a.expr, times[0], times[-1], a.interval_s)
                    active = {
                        labels: [round(t, 3) for t in ts] for labels, ts in active_times(result).items()
                    }
                    for ep in alert_episodes(
                        active, times, for_s=a.for_s, keep_firing_for_s=a.keep_firing_for_s
                    ):
                        resolved = None if ep.resolved_at is None else round(ep.resolved_at - start, 3)
                        out[name].append(Episode(a.name, ep.labels, round(ep.fired_at - start, 3), resolved))
    return {k: sorted(v, key=lambda e: (e.fired_at_s, e.alertname)) for k, v in out.items()}


# --- scores ---------------------------------------------------------------------------------


def score_foreign(name: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """An alert of another rule file scored both ways: its cause figures (``score_alert``'s, and
    the recovered runs it fired in at all) and, under ``as_symptom``, its symptom figures, with
    the collapses it covered and those it left silent."""
    cause = score_alert(name, results, "cause")
    symptom = score_alert(name, results, "symptom")
    return {
        **cause,
        "fired_in_recovered_runs": sum(1 for r in results if r.info.recovered and firings_of(r, name)),
        "fired_in_loop_runs": round(cause["recall"] * cause["runs_not_recovered"])
        if cause["recall"] is not None
        else 0,
        "collapses": symptom["collapses"],
        "collapses_detected": symptom["collapses_detected"],
        "collapses_silent": symptom["collapses"] - symptom["collapses_detected"],
        "as_symptom": symptom,
    }


def _label_text(labels: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels if k not in ("instance", "job"))


def build_rules_report(
    rule_file: Path,
    job: str,
    alerts: Sequence[ForeignAlert],
    results: Sequence[RunResult],
    ours: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The whole ``rules-validation.json`` document."""
    return {
        "rules": str(rule_file),
        "job": job,
        "alerts": {
            a.name: {
                **score_foreign(a.name, results),
                "rule": {
                    "group": a.group,
                    "expr": a.expr,
                    "interval_s": a.interval_s,
                    "for_s": a.for_s,
                    "severity": a.severity,
                },
            }
            for a in alerts
        },
        "ours": ours_pages(ours),
        "ground_truth": ground_truth_summary(results),
        "runs": [
            {
                "block": r.info.block,
                "condition": r.info.condition,
                "variant": r.info.variant,
                "model": r.info.model,
                "run": r.info.run,
                "recovered": r.info.recovered,
                "trace": r.info.trace,
                "pulse": {"start_s": r.info.pulse_start_s, "end_s": r.info.pulse_end_s},
                "collapses": None if r.collapses is None else [c.to_dict() for c in r.collapses],
                "alerts": [
                    {
                        "alertname": f.alertname,
                        "labels": f.why,
                        "fired_at_s": f.fired_at_s,
                        "resolved_at_s": f.resolved_at_s,
                    }
                    for f in r.firings
                ],
            }
            for r in results
        ],
    }


def ours_pages(validation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Our tiers' pages from ``validation.json`` (its ``tiers``), in the foreign alerts' terms:
    per tier, the cause pages' recall, recovered runs fired in, false positives and lead, and the
    symptom pages' collapses covered. None without a validation.json."""
    if not validation:
        return None
    out: dict[str, Any] = {}
    for tier, pages in (validation.get("tiers") or {}).get("tiers", {}).items():
        cause, symptom = pages.get("cause") or {}, pages.get("symptom") or {}
        out[tier] = {
            "cause_alerts": cause.get("alerts", []),
            "symptom_alerts": symptom.get("alerts", []),
            "recall": cause.get("recall"),
            "runs_not_recovered": cause.get("runs_not_recovered"),
            "fired_in_recovered_runs": len(cause.get("fired_in_recovered_runs", [])),
            "false_positive_runs": cause.get("false_positive_runs"),
            "lead_time_s": cause.get("lead_time_s"),
            "collapses": symptom.get("collapses"),
            "collapses_detected": symptom.get("collapses_detected"),
            "symptom_delay_s": symptom.get("lead_time_s"),
        }
    return out


def _num(value: Any) -> str:
    return "—" if value is None else f"{value:+.0f}"


def render_rules_markdown(report: Mapping[str, Any]) -> str:
    """``rules-validation.md``: one row an alert, ours beside."""
    gt = report["ground_truth"]
    alerts = report["alerts"]
    any_alert = next(iter(alerts.values()))
    loops, recovered = any_alert["runs_not_recovered"], any_alert["runs_recovered"]
    lines = [
        f"# Rules validation: `{report['rules']}`",
        "",
        f"{gt['runs']} runs: {loops} did not recover (a loop or a collapse to the end), {recovered} "
        f"recovered; {gt['collapses']} collapses in the ground truth. Series backfilled into "
        f'Prometheus with `job="{report["job"]}"`.',
        "",
        "| alert | fired in loops | fired in recovering runs | false-positive runs | median lead (s) "
        "| collapses covered | collapses silent | median delay after a collapse began (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in alerts.items():
        lines.append(
            f"| {name} | {s['fired_in_loop_runs']}/{s['runs_not_recovered']} "
            f"| {s['fired_in_recovered_runs']}/{s['runs_recovered']} | {s['false_positive_runs']} "
            f"| {_num(s['lead_time_s']['median'])} | {s['collapses_detected']}/{s['collapses']} "
            f"| {s['collapses_silent']} | {_num(s['as_symptom']['lead_time_s']['median'])} |"
        )
    for tier, s in (report.get("ours") or {}).items():
        hits = 0 if s["recall"] is None else round(s["recall"] * (s["runs_not_recovered"] or 0))
        silent = None if s["collapses"] is None else s["collapses"] - (s["collapses_detected"] or 0)
        lines.append(
            f"| ours: {tier} tier's pages | {hits}/{s['runs_not_recovered']} "
            f"| {s['fired_in_recovered_runs']}/{recovered} | {s['false_positive_runs']} "
            f"| {_num((s['lead_time_s'] or {}).get('median'))} "
            f"| {s['collapses_detected']}/{s['collapses']} | {silent} "
            f"| {_num((s['symptom_delay_s'] or {}).get('median'))} |"
        )
    lines += [
        "",
        "Legend: *fired in loops*: runs that did not recover in which the alert fired from the "
        "pulse's start on (a cause's recall); *fired in recovering runs*: runs that drained in "
        "which it fired at all; *false-positive runs*: runs where it started firing outside the "
        "overload and its collapses; *median lead*: its first firing from the pulse's start on, "
        "minus the pulse's end (negative: before the pulse ended); *collapses covered*: collapses "
        "of the ground truth it fired during (a symptom's recall); *silent*: those it missed; *delay*: "
        "its first firing during a collapse it covered, from the collapse's start."
        + ("" if report.get("ours") else " Our own pages appear here once `validation.json` is written."),
        "",
    ]
    return "\n".join(lines)


# --- the whole validation --------------------------------------------------------------------


def validate_rules_dir(
    out_dir: Path,
    infos: Sequence[RunInfo],
    rule_file: Path,
    *,
    job: str = DEFAULT_JOB,
    default_interval: str = DEFAULT_INTERVAL,
    promtool: str = "promtool",
    prometheus: str = "prometheus",
) -> dict[str, Any]:
    """Score ``rule_file``'s alerts over the runs ``infos`` of ``out_dir``; write
    ``rules-validation.json`` and ``.md`` there."""
    records, alerts = load_rule_file(rule_file, default_interval=default_interval, promtool=promtool)
    runs = {info.slug: info.series for info in infos}
    from rules.backfill import BackfillError

    try:
        verdict = evaluate_apart(runs, records, alerts, job=job, promtool=promtool, prometheus=prometheus)
    except (BackfillError, subprocess.TimeoutExpired) as exc:
        raise RulesUnavailable(f"Prometheus' evaluation failed: {exc}") from exc
    results = []
    for info in infos:
        truth = info.truth
        firings = [
            Firing(e.alertname, e.fired_at_s, e.resolved_at_s, why=_label_text(e.labels))
            for e in verdict.get(info.slug, [])
        ]
        results.append(
            RunResult(
                info,
                firings,
                None if truth is None else truth.collapses,
                None if truth is None else truth.windows,
            )
        )
    report = build_rules_report(rule_file, job, alerts, results, read_validation(out_dir))
    (out_dir / RULES_VALIDATION).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_dir / RULES_VALIDATION_MD).write_text(render_rules_markdown(report), encoding="utf-8")
    return report
