"""``retrywatch reproduce report DIR``: Markdown tables and an HTML page of a reproduce output.

``DIR/report.md`` holds one table per block (per condition and model: runs, recovered, recovery
time, delivery by cohort, rates over the primary window in multiples of Ĉ, the waiting queue
over Little's law, the prompt-token gap) and, for tracing runs, the trace breakdown.
``DIR/report.html`` is one page that works offline (plotly.js embedded once, no CDN): the
tables as HTML tables (rendered from the Markdown by markdown-it-py), plotly figures (delivery by
cohort per condition, stacked within the deadline / late / undelivered, and execution creation
rate vs recovery, both from the dashboard's pure figure builders; recovery times; the trace
breakdown) and, once ``retrywatch reproduce validate DIR`` has run, the alert validation: its
tables (``DIR/validation.md``) and, per block, a timeline of every run's collapses with each
alert's firings over them.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from markdown_it import MarkdownIt

from foundation.rundir import REPORT_HTML, REPORT_MD, VALIDATION_MD, read_summary, read_validation

__all__ = [
    "STYLE",
    "demote",
    "group_runs",
    "markdown_renderer",
    "recovery_times_figure",
    "render_html",
    "render_markdown",
    "trace_figure",
    "validation_timeline_figure",
    "write_report",
]

#: Delivery cohorts, in this order where a block's runs have them (a replayed trace has one:
#: every call of the run).
COHORTS = ("pulse", "hold", "primary", "trace")
RATES = ("attempts", "executions_created", "executions_accepted", "executions_completed")


def _condition_label(run: Mapping[str, Any]) -> str:
    """The condition, its variant, and its clients unless the study's (``--client``)."""
    variant = run.get("variant") or ""
    label = f"{run.get('condition', '?')} ({variant})" if variant else str(run.get("condition", "?"))
    settings = run.get("settings")
    client = settings.get("client") if isinstance(settings, Mapping) else None
    return f"{label} [{client} clients]" if client and client != "study" else label


def group_runs(runs: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[Mapping[str, Any]]]:
    """Runs grouped by (block, condition label, model), in first-seen order."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for run in runs:
        key = (str(run.get("block", "?")), _condition_label(run), str(run.get("model", "?")))
        groups.setdefault(key, []).append(run)
    return groups


def _mean(values: Iterable[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _delivery(runs: Sequence[Mapping[str, Any]], cohort: str) -> str:
    within = _mean(r.get("delivery", {}).get(cohort, {}).get("within_deadline") for r in runs)
    horizon = _mean(r.get("delivery", {}).get(cohort, {}).get("by_horizon") for r in runs)
    if within is None or horizon is None:
        return "–"
    return f"{100 * within:.1f} / {100 * max(horizon - within, 0):.1f} / {100 * max(1 - horizon, 0):.1f}"


def _recovery(runs: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    times = [
        float(r["recovery_time_s"])
        for r in runs
        if r.get("recovered") and r.get("recovery_time_s") is not None
    ]
    n_rec = sum(1 for r in runs if r.get("recovered"))
    return f"{n_rec}/{len(runs)}", (f"{statistics.median(times):.0f}" if times else "–")


def render_markdown(runs: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> str:
    """The report's Markdown: one table per block, then the trace breakdown."""
    lines = ["# Reproduce report", ""]
    if meta:
        lines.append("Run with: " + ", ".join(f"{k} = {v}" for k, v in meta.items()) + ".")
        lines.append("")
    lines += [
        "Delivery: within the deadline / late / undelivered, % of the cohort's calls (mean over runs).",
        "Rates over the primary window (hold minus its first deadline) in multiples of Ĉ (mean over runs).",
        "Recovery time: median over recovered runs, seconds from the pulse's end.",
        "",
    ]
    groups = group_runs(runs)
    blocks = list(dict.fromkeys(b for b, _, _ in groups))
    for block in blocks:
        lines += [f"## {block}", ""]
        in_block = [r for (b, _, _), members in groups.items() if b == block for r in members]
        cohorts = [c for c in COHORTS if any(c in (r.get("delivery") or {}) for r in in_block)]
        header = [
            "condition",
            "model",
            "recovered",
            "recovery s",
            *(f"{c} delivery" for c in cohorts),
            "attempts ×Ĉ",
            "created ×Ĉ",
            "accepted ×Ĉ",
            "completed ×Ĉ",
            "waiting / λT",
            "prompt gap",
        ]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for (b, cond, model), members in groups.items():
            if b != block:
                continue
            rec, rec_t = _recovery(members)
            rates = [_num(_mean(r.get("rates_x_capacity", {}).get(k) for r in members)) for k in RATES]
            row = [
                cond,
                model,
                rec,
                rec_t,
                *(_delivery(members, c) for c in cohorts),
                *rates,
                _num(_mean(r.get("waiting_over_littles_law") for r in members)),
                _pct(_mean(r.get("prompt_token_gap_hold") for r in members)),
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    traced = {k: v for k, v in groups.items() if any(r.get("trace") for r in v)}
    if traced:
        lines += ["## Trace breakdown", ""]
        lines.append(
            "| block | condition | model | aborted share of computed prompt tokens "
            "| in flight share of aborted | missed by the prompt-token counter "
            "| retries first scheduled: s before own deadline / s after predecessor's abort "
            "| retries never scheduled |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for (b, cond, model), members in traced.items():

            def mean_of(key: str, runs: Sequence[Mapping[str, Any]] = members) -> float | None:
                return _mean((r.get("trace") or {}).get(key) for r in runs)

            shares = [
                _pct(mean_of(k)) for k in ("aborted_share", "in_flight_share_of_aborted", "missed_share")
            ]
            timing = (
                f"{_num(mean_of('retry_scheduled_before_deadline_s'))} / "
                f"{_num(mean_of('retry_scheduled_after_predecessor_abort_s'))}"
            )
            never = _pct(mean_of("retry_never_scheduled_share"))
            lines.append(f"| {b} | {cond} | {model} | " + " | ".join([*shares, timing, never]) + " |")
        lines.append("")
        lines.append(
            "Retry timing: medians per run over the executions retries created (their mean over "
            "runs); scheduled = when vLLM's scheduler took the execution into a step."
        )
        lines.append("")
    return "\n".join(lines)


def _labelled(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies for the figures: ``condition`` carries the variant (sweep cells stay apart) and
    cohorts without calls (no shares) are left out."""
    out = []
    for r in runs:
        delivery = {
            cohort: shares
            for cohort, shares in (r.get("delivery") or {}).items()
            if shares.get("within_deadline") is not None and shares.get("by_horizon") is not None
        }
        out.append({**r, "condition": _condition_label(r), "delivery": delivery})
    return out


def _label(run: Mapping[str, Any], many_blocks: bool, many_models: bool) -> str:
    parts = []
    if many_blocks:
        parts.append(str(run.get("block", "")))
    if many_models:
        parts.append(str(run.get("model", "")))
    parts.append(_condition_label(run))
    return " · ".join(parts)


def recovery_times_figure(runs: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Each run's recovery time per condition; runs that did not recover are marked at the
    end of the hold (right-censored)."""
    many_blocks = len({r.get("block") for r in runs}) > 1
    many_models = len({r.get("model") for r in runs}) > 1
    fig = go.Figure()
    for recovered, name, colour, symbol in (
        (True, "recovered", "#0072B2", "circle"),
        (False, "not recovered", "#D55E00", "x"),
    ):
        xs, ys, text = [], [], []
        for run in runs:
            if bool(run.get("recovered")) is not recovered:
                continue
            pulse = run.get("pulse") or {}
            hold_end = run.get("hold_end_s")
            if recovered:
                x = run.get("recovery_time_s")
            elif hold_end is not None and pulse.get("end_s") is not None:
                x = float(hold_end) - float(pulse["end_s"])
            else:
                x = None
            if x is None:
                continue
            xs.append(float(x))
            ys.append(_label(run, many_blocks, many_models))
            text.append(f"run {run.get('run', '?')}")
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=name,
                text=text,
                marker={"color": colour, "symbol": symbol, "size": 10},
            )
        )
    fig.update_layout(
        title="Recovery time after the pulse's end (not recovered: censored at the hold's end)",
        xaxis_title="seconds from the pulse's end",
        template="plotly_white",
        height=max(300, 130 + 22 * len({_label(r, many_blocks, many_models) for r in runs})),
    )
    fig.update_yaxes(autorange="reversed", automargin=True)
    return fig


def trace_figure(runs: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Computed prompt tokens by fate per tracing condition: completed executions, aborted
    executions' body and their in-flight part; and the share the prompt-token counter missed."""
    groups = group_runs(r for r in runs if r.get("trace"))
    labels, completed, body, in_flight, missed = [], [], [], [], []
    for (_, cond, model), members in groups.items():
        aborted = _mean((r.get("trace") or {}).get("aborted_share") for r in members) or 0.0
        flight = _mean((r.get("trace") or {}).get("in_flight_share_of_aborted") for r in members) or 0.0
        labels.append(f"{cond} · {model}")
        completed.append(100 * (1 - aborted))
        body.append(100 * aborted * (1 - flight))
        in_flight.append(100 * aborted * flight)
        missed.append(100 * (_mean((r.get("trace") or {}).get("missed_share") for r in members) or 0.0))
    fig = go.Figure()
    for name, values, colour in (
        ("not aborted", completed, "#009E73"),
        ("aborted: body", body, "#E69F00"),
        ("aborted: in flight", in_flight, "#D55E00"),
    ):
        fig.add_trace(go.Bar(x=values, y=labels, orientation="h", name=name, marker={"color": colour}))
    fig.add_trace(
        go.Scatter(
            x=missed,
            y=labels,
            mode="markers",
            name="missed by vllm:prompt_tokens_total",
            marker={"symbol": "diamond", "size": 12, "color": "#000000"},
        )
    )
    fig.update_layout(
        barmode="stack",
        title="Computed prompt tokens by fate (% of all computed)",
        xaxis={"range": [0, 100], "title": "% of computed prompt tokens"},
        template="plotly_white",
        height=max(260, 130 + 30 * len(labels)),
    )
    fig.update_yaxes(autorange="reversed", automargin=True)
    return fig


def _figures(runs: Sequence[Mapping[str, Any]]) -> list[go.Figure]:
    from dashboard.figures import creation_rate_vs_recovery_figure, delivery_by_cohort_figure

    labelled = _labelled(runs)
    figures = [
        delivery_by_cohort_figure(labelled),
        recovery_times_figure(runs),
        creation_rate_vs_recovery_figure(labelled),
    ]
    if any(r.get("trace") for r in runs):
        figures.append(trace_figure(runs))
    return figures


# Okabe-Ito, as the dashboard's figures (colour-blind safe); one colour an alert, in order.
ALERT_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#D55E00")
COLLAPSE_COLOUR = "rgba(213, 94, 0, 0.22)"
METASTABLE_COLOUR = "rgba(213, 94, 0, 0.5)"


def _run_row(run: Mapping[str, Any]) -> str:
    return f"{_condition_label(run)} · {run.get('model', '?')} · r{run.get('run', '?')}"


def validation_timeline_figure(runs: Sequence[Mapping[str, Any]], title: str) -> go.Figure:
    """One row a run (``validation.json``'s runs): its collapses shaded (darker when metastable)
    and, over them, each alert's firings as a thin bar of its own colour; the pulse as dotted
    lines. A firing still going at the end of the run is drawn to the run's end."""
    rows = [_run_row(r) for r in runs]
    names = list(dict.fromkeys(a["alertname"] for r in runs for a in r.get("alerts") or []))
    fig = go.Figure()
    for metastable, colour, label in (
        (False, COLLAPSE_COLOUR, "collapse"),
        (True, METASTABLE_COLOUR, "collapse, metastable"),
    ):
        xs, bases, ys, text = [], [], [], []
        for run, row in zip(runs, rows, strict=True):
            for c in run.get("collapses") or []:
                if bool(c.get("metastable")) is not metastable:
                    continue
                bases.append(float(c["start_s"]))
                xs.append(float(c["end_s"]) - float(c["start_s"]))
                ys.append(row)
                to_end = "" if c.get("ended", True) else ", to the end of the hold"
                text.append(f"{label} {c['start_s']:g}–{c['end_s']:g} s{to_end}")
        fig.add_trace(
            go.Bar(
                x=xs, base=bases, y=ys, orientation="h", name=label, width=0.9, offset=-0.45,
                marker={"color": colour}, hovertext=text, hoverinfo="text",
            )
        )  # fmt: skip
    band = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs, bases, ys, text = [], [], [], []
        for run, row in zip(runs, rows, strict=True):
            end_of_run = float(run.get("duration_s") or run.get("judged_end_s") or 0.0)
            for a in run.get("alerts") or []:
                if a["alertname"] != name:
                    continue
                start = float(a["fired_at_s"])
                resolved = a.get("resolved_at_s")
                end = max(end_of_run, start) if resolved is None else float(resolved)
                bases.append(start)
                xs.append(max(end - start, 0.0))
                ys.append(row)
                state = "still firing at the end" if resolved is None else f"resolved at {end:g} s"
                text.append(f"{name}: fired at {start:g} s, {state}")
        fig.add_trace(
            go.Bar(
                x=xs, base=bases, y=ys, orientation="h", name=name, width=band * 0.9,
                offset=-0.4 + i * band, marker={"color": ALERT_COLOURS[i % len(ALERT_COLOURS)]},
                hovertext=text, hoverinfo="text",
            )
        )  # fmt: skip
    pulse = next((r.get("pulse") for r in runs if r.get("pulse")), None)
    if pulse:
        for key in ("start_s", "end_s"):
            if pulse.get(key) is not None:
                fig.add_vline(x=float(pulse[key]), line={"color": "#888888", "dash": "dot", "width": 1})
    ends = [b + x for trace in fig.data for b, x in zip(trace.base, trace.x, strict=True)]
    fig.update_layout(
        title={"text": title, "x": 0.01},
        barmode="overlay",
        xaxis={
            "title": "seconds from the run's start (dotted: the pulse)",
            "range": [0, max(ends, default=1.0)],
        },
        template="plotly_white",
        height=max(360, 200 + 26 * len(rows)),
        margin={"t": 130},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0.0},
    )
    fig.update_yaxes(autorange="reversed", automargin=True, type="category", categoryarray=rows)
    return fig


def validation_figures(validation: Mapping[str, Any]) -> list[go.Figure]:
    """A timeline per block of ``validation.json``'s runs."""
    by_block: dict[str, list[Mapping[str, Any]]] = {}
    for run in validation.get("runs") or []:
        if isinstance(run, Mapping):
            by_block.setdefault(str(run.get("block", "?")), []).append(run)
    return [
        validation_timeline_figure(runs, f"{block}: collapses (shaded) and each alert's firings")
        for block, runs in by_block.items()
    ]


def markdown_renderer() -> MarkdownIt:
    # CommonMark with tables; raw HTML in the Markdown is escaped, never passed through.
    return MarkdownIt("commonmark", {"html": False}).enable("table")


def demote(markdown: str) -> str:
    """Every heading one level down, to sit under the page's own."""
    return re.sub(r"^(#{1,5}) ", r"#\1 ", markdown, flags=re.MULTILINE)


STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1400px}"
    "section{overflow-x:auto;margin-bottom:1.5em}"
    "table{border-collapse:collapse;margin:0.5em 0;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}"
)


def render_html(
    runs: Sequence[Mapping[str, Any]],
    markdown: str,
    validation: Mapping[str, Any] | None = None,
    validation_md: str | None = None,
) -> str:
    """The whole page: the figures, the tables, and the validation (when there is one)."""
    md = markdown_renderer()
    figures = _figures(runs)
    # the validation's figures only where its tables are shown too
    checks = validation_figures(validation) if validation is not None and validation_md is not None else []
    parts = []
    for i, fig in enumerate([*figures, *checks]):
        # plotly.js embedded once, in the first figure: the page needs no network
        parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_width="100%"))
    body = "".join(f"<section>{p}</section>" for p in parts[: len(figures)])
    body += "<section>" + md.render(demote(markdown)) + "</section>"
    body += "<h2 id='validation'>Alert validation</h2>"
    if validation_md is not None:
        body += "".join(f"<section>{p}</section>" for p in parts[len(figures) :])
        # under the page's own "Alert validation" heading, without the file's title
        own = re.sub(r"\A# [^\n]*\n", "", validation_md)
        body += "<section>" + md.render(demote(own)) + "</section>"
    else:
        body += (
            "<p>No validation yet: run <code>retrywatch reproduce validate DIR</code>, then "
            "<code>retrywatch reproduce report DIR</code> again.</p>"
        )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>retrywatch reproduce report</title>"
        f"<style>{STYLE}</style></head><body><h1>retrywatch reproduce report</h1>{body}</body></html>"
    )


def write_report(out: Path) -> tuple[Path, Path]:
    """Write ``out/report.md`` and ``out/report.html`` from ``out/summary.json`` (and the
    validation, ``out/validation.json`` and ``.md``, when ``reproduce validate`` wrote them)."""
    summary = read_summary(out)
    runs = [r for r in summary["runs"] if isinstance(r, dict)]
    markdown = render_markdown(runs, summary.get("meta"))
    md_path = out / REPORT_MD
    md_path.write_text(markdown + "\n", encoding="utf-8")
    validation = read_validation(out)
    validation_md_path = out / VALIDATION_MD
    validation_md = (
        validation_md_path.read_text(encoding="utf-8")
        if validation is not None and validation_md_path.is_file()
        else None
    )
    html_path = out / REPORT_HTML
    html_path.write_text(render_html(runs, markdown, validation, validation_md), encoding="utf-8")
    return md_path, html_path
