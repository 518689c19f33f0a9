"""``DIR/validation.md``: the scores of ``validation.json`` written out, every table with its
legend, the tiers side by side, the targets and the runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reproduce.judge.validation.scoring import TIER_KINDS
from reproduce.judge.validation.targets import (
    BACKLOG,
    LOOP_FORMATION_WINDOW_S,
    RETRY_LOOP,
    SILENCE,
)

STILL_FIRING = "still firing at the end"

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
    """How to read the pulse's figures on runs without a pulse (a replayed trace, a stepped load:
    ``validation.json``'s ``trace``), which have none (docs/traces.md)."""
    traces = sum(1 for r in report["runs"] if r.get("trace"))
    if not traces:
        return []
    return [
        f"- {traces} of the runs have no pulse (a replayed trace, a stepped load): for them, read every "
        '"pulse" below as the burst the run is aligned on (the busiest 60-s stretch before its first '
        "collapse, or its busiest stretch when nothing collapsed; `burst` in summary.json) and "
        '"the hold" as the whole run, to three windows after its last call (docs/traces.md).'
    ]


def _error(stats: Mapping[str, Any]) -> str:
    def pct(v: float | None, sign: str = "") -> str:
        return NA if v is None else f"{round(100 * v, 1) + 0.0:{sign}.1f} %"  # + 0.0: no "-0.0"

    return f"{pct(stats['signed_median'], '+')} · {pct(stats['median'])} / {pct(stats['max'])}"


def learned_markdown(report: Mapping[str, Any]) -> list[str]:
    """With nothing stated: what the detector learned of Ĉ and the deadline, and when."""
    learned = report.get("learned")
    if not report.get("nothing_stated") or not learned:
        return []
    lines = [
        "## Learned, nothing stated",
        "",
        "The detector was given neither Ĉ nor the clients' deadline: Ĉ learned from the series "
        "(saturated measurement, else predicted from vLLM's series), the deadline from the clients' "
        "abandons by the proxy's learner (reproduce/judge/validation/nothingstated.py).",
        "",
        "| number | runs learned in | known before the overload | known at, median / max (s) "
        "| sources when first known | error when first known | error when the overload began |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, n in learned.items():
        sources = ", ".join(f"{k} {v}" for k, v in n["sources"].items()) or NA
        lines.append(
            f"| {name} | {n['learned_in']} of {n['runs']} | {n['known_before_overload']} "
            f"| {_pair(n['known_at_s'])} | {sources} | {_error(n['error_when_known'])} "
            f"| {_error(n['error_at_overload'])} |"
        )
    lines += [
        "",
        "- **error**: the learned value over the run's true one (its calibrated Ĉ, its client's "
        "deadline) minus 1: signed median · median / max of its size. **known before the overload**: "
        "runs where it was known when the pulse (a trace: the burst it is aligned on) began.",
        "",
    ]
    return lines


def summary_markdown(report: Mapping[str, Any]) -> list[str]:
    """The scores: the ground truth, a table per kind with its legend, and per block."""
    gt = report["ground_truth"]
    lines = [
        "# Alert validation" + (", nothing stated" if report.get("nothing_stated") else ""),
        "",
        "Each alert of the detector, replayed over every run, against the runs' ground truth over "
        'time (docs/protocol.md, "Ground truth over time"). Times are seconds from the run\'s '
        "start (with `--time-scale K`, the study's seconds divided by K).",
        "",
        *learned_markdown(report),
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
