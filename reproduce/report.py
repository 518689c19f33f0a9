"""``retrywatch reproduce report DIR``: Markdown tables and an HTML page of a reproduce output.

``DIR/report.md`` holds one table per block (per condition and model: runs, recovered, recovery
time, delivery by cohort, rates over the primary window in multiples of Ĉ, the waiting queue
over Little's law, the prompt-token gap) and, for tracing runs, the trace breakdown.
``DIR/report.html`` holds plotly figures: delivery by cohort per condition (stacked within the
deadline / late / undelivered) and execution creation rate vs recovery (both from the
dashboard's pure figure builders), recovery times, and the trace breakdown.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from detector.rundir import REPORT_HTML, REPORT_MD, read_summary

__all__ = ["group_runs", "recovery_times_figure", "render_markdown", "trace_figure", "write_report"]

COHORTS = ("pulse", "hold", "primary")
RATES = ("attempts", "executions_created", "executions_accepted", "executions_completed")


def _condition_label(run: Mapping[str, Any]) -> str:
    variant = run.get("variant") or ""
    return f"{run.get('condition', '?')} ({variant})" if variant else str(run.get("condition", "?"))


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
        header = [
            "condition",
            "model",
            "recovered",
            "recovery s",
            *(f"{c} delivery" for c in COHORTS),
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
                *(_delivery(members, c) for c in COHORTS),
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


def render_html(runs: Sequence[Mapping[str, Any]], markdown: str) -> str:
    parts = []
    for i, fig in enumerate(_figures(runs)):
        parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_width="100%"))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>retrywatch reproduce report</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px} pre{white-space:pre-wrap}</style>"
        "</head><body><h1>retrywatch reproduce report</h1>"
        + "".join(f"<section>{p}</section>" for p in parts)
        + "<h2>Tables</h2><pre>"
        + html.escape(markdown)
        + "</pre></body></html>"
    )


def write_report(out: Path) -> tuple[Path, Path]:
    """Write ``out/report.md`` and ``out/report.html`` from ``out/summary.json``."""
    summary = read_summary(out)
    runs = [r for r in summary["runs"] if isinstance(r, dict)]
    markdown = render_markdown(runs, summary.get("meta"))
    md_path = out / REPORT_MD
    md_path.write_text(markdown + "\n", encoding="utf-8")
    html_path = out / REPORT_HTML
    html_path.write_text(render_html(runs, markdown), encoding="utf-8")
    return md_path, html_path
