"""Experiments page: a reproduce output (``--runs DIR``): delivery by cohort per condition,
execution-creation rate against recovery, and any run's time series with the detector's alerts
(from ``validation.json``) shaded over it: a pulse run with its pulse marked; a replayed trace's
run led by its calls arriving and delivered in time, its collapses (and the bursts behind them)
shaded behind every panel and the alerts fired in a row of their own. A what-if's DIR
(``whatif.json``) shows its policies side by side and each one's headroom above its runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, dcc, html

from dashboard import figures, style
from dashboard.context import Context
from dashboard.figures import (
    alert_row,
    collapse_marks,
    collapses_text,
    creation_rate_vs_recovery_figure,
    delivery_by_cohort_figure,
    is_trace_run,
    pulse_marks,
    run_collapses,
    run_shades,
)
from dashboard.pages import Page, text_choice
from dashboard.runs import run_key, run_label, run_signals
from foundation.rundir import RunDirError, read_whatif

# What a hand-edited or corrupt reproduce output raises while it is read: shown, never a 500.
BROKEN = (RunDirError, ValueError, TypeError, KeyError, AttributeError, OSError)
RUN_GRAPH_IDS: tuple[str, ...] = (
    "graph-run-attempts",
    "graph-run-fates",
    "graph-run-queue",
    "graph-run-prompt",
    "graph-run-delivery",
)
# A replayed trace's run leads with its calls arriving and delivered in time; a pulse run hides it.
ARRIVALS_GRAPH_ID = "graph-run-arrivals"
HIDDEN: dict[str, str] = {"display": "none"}
# Shown, it takes its cell's size whenever that changes (responsive): laid out while hidden, a
# fixed-size plot would keep Plotly's default width and spill out of its cell.
SHOWN: dict[str, str] = {"height": f"{figures.TIME_PANEL_HEIGHT}px"}


@dataclass
class RunView:
    """One run on the page: its time-series panels (``RUN_GRAPH_IDS``' order, seconds from its
    start), its arrivals panel (None: a pulse run, which has none) and a one-line summary."""

    panels: list[go.Figure]
    arrivals: go.Figure | None
    summary: str


def _blank(summary: str) -> RunView:
    return RunView([figures.attempts_figure({}, x_kind="seconds") for _ in RUN_GRAPH_IDS], None, summary)


def trace_text(run: dict[str, Any]) -> str:
    """The workload a run without a pulse ran, in words (its entry's ``workload.label``; an entry
    written before it: the trace it replayed and at what load, e.g. ``trace azure_code at 3x Ĉ``)."""
    label = (run.get("workload") or {}).get("label")
    if isinstance(label, str):
        return label
    settings = run.get("settings") or {}
    name, load, window = settings.get("trace"), settings.get("load"), settings.get("window")
    text = f"trace {name or '?'}" + ("" if load is None else f" at {float(load):g}x Ĉ")
    return text if window in (None, "", "0:") else f"{text} (window {window} s)"


def run_view(ctx: Context, run_id: str | None) -> RunView:
    """The time-series panels of one run and a one-line summary: a pulse run's with the pulse
    marked; a replayed trace's with its arrivals panel, its collapses shaded behind every panel
    and the alerts fired over them in a row of their own."""
    runs_dir = ctx.runs()
    if runs_dir is None or not run_id:
        return _blank("no run selected")
    try:
        run = runs_dir.run(run_id)
    except KeyError as exc:
        return _blank(str(exc))
    try:
        signals = run_signals(runs_dir, run)
    except BROKEN as exc:
        return _blank(f"cannot read run: {exc}")
    try:
        alerts, origin = runs_dir.run_alerts(run)
        shades = run_shades(alerts)
        fired = (
            ", ".join(f"{a['alertname']} at {float(a['fired_at_s']):.0f} s" for a in alerts) or "no alerts"
        )
    except BROKEN as exc:
        alerts, origin, shades, fired = [], f"no alerts ({exc!r})", [], "no alerts"
    trace = is_trace_run(run)
    end = max((float(p[-1, 0]) for p in signals.values() if p.shape[0]), default=None)
    builders = (figures.arrivals_figure, *figures.LIVE_PANELS) if trace else figures.LIVE_PANELS
    figs = [
        build(
            signals,
            () if trace else shades,  # a trace run's alerts go in their own row, over its collapses
            now=end,
            x_kind="seconds",
            uirevision=run_id,
            x_range=None if end is None else (0.0, end),
        )
        for build in builders
    ]
    try:
        collapses = run_collapses(run)  # every run's ground-truth record: its collapses shaded
        figs = [collapse_marks(fig, collapses, legend=i == 0) for i, fig in enumerate(figs)]
        if trace:
            state = f"{trace_text(run)}: {collapses_text(collapses)}"
        else:
            figs = [pulse_marks(fig, run.get("pulse")) for fig in figs]
            state = _recovery_text(run) + ("" if "collapses" not in run else f"; {collapses_text(collapses)}")
    except BROKEN as exc:
        state = f"summary entry unreadable ({exc!r})"
    if trace:  # drawn after the collapse bands, so over them
        figs = [alert_row(fig, shades, end) for fig in figs]
    arrivals = figs.pop(0) if trace else None
    return RunView(figs, arrivals, f"{run_label(run)}: {state}; detector ({origin}): {fired}")


def _recovery_text(run: dict[str, Any]) -> str:
    recovered, rt = run.get("recovered"), run.get("recovery_time_s")
    if recovered and rt is not None:
        return f"recovered {float(rt):.0f} s after the pulse"
    return "recovered" if recovered else "not recovered"


WHATIF_COLUMNS = (
    "policy",
    "does",
    "calls",
    "within deadline %",
    "late %",
    "failed %",
    "executions per call",
    "recovered",
    "loop formed",
    "alerts fired (first)",
    "headroom",
    "loop onset",
    "overload",
)


def _pct(share: Any) -> str:
    return "–" if share is None else f"{100.0 * float(share):.1f}"


def whatif_section(whatif: dict[str, Any]) -> list[Any]:
    """A what-if's policies side by side (a table), its calls by fate, its headroom and each
    policy's curve against load (figures)."""
    rows = []
    for r in figures.whatif_rows(whatif):
        p = r["at_load"]
        cells = (
            r["policy"],
            str(r.get("does", "")),
            str(p.get("calls")),
            _pct(p.get("within_deadline_share")),
            _pct(p.get("late_share")),
            _pct(p.get("failed_share")),
            str(p.get("executions_per_call")),
            f"{p.get('recovered')}/{p.get('runs')}",
            figures.whatif_loops_text(p),
            figures.whatif_alerts_text(p),
            figures.whatif_headroom_text(r["headroom"]),
            figures.whatif_mark_text(r.get("loop_onset")),
            figures.whatif_mark_text(r.get("overload")),
        )
        rows.append(html.Tr([html.Td(c) for c in cells]))
    table = html.Table(
        [html.Thead(html.Tr([html.Th(c) for c in WHATIF_COLUMNS])), html.Tbody(rows)], id="whatif-table"
    )
    return [
        html.H3(f"What-if at {whatif.get('load', '?')}x Ĉ: {whatif.get('workload_text', '')}"),
        table,
        dcc.Graph(id="graph-whatif-delivery", figure=figures.whatif_delivery_figure(whatif)),
        dcc.Graph(id="graph-whatif-headroom", figure=figures.whatif_headroom_figure(whatif)),
        dcc.Graph(id="graph-whatif-curve", figure=figures.whatif_curve_figure(whatif)),
        html.Div(str(whatif.get("safe_rule", "")), style=style.NOTE),
    ]


def layout(ctx: Context, query: dict[str, str] | None = None) -> html.Div:
    """The experiments page; ``?run=`` preselects a run by its slug."""
    query = query or {}
    if ctx.config.runs_dir is None:
        return html.Div(
            "Start the dashboard with --runs DIR (a `retrywatch reproduce run` output) to see experiments.",
            style=style.NOTE,
            id="experiments-note",
        )
    try:
        found = read_whatif(ctx.config.runs_dir)
        whatif = whatif_section(found) if found is not None else []
    except BROKEN as exc:
        return html.Div(f"Cannot open {ctx.config.runs_dir}: {exc}", style=style.NOTE, id="experiments-note")
    try:
        runs_dir = ctx.runs()
        if runs_dir is None:
            raise RunDirError("no runs directory configured")
        delivery = delivery_by_cohort_figure(runs_dir.runs)
        creation = creation_rate_vs_recovery_figure(runs_dir.runs)
    except BROKEN as exc:
        return html.Div(f"Cannot open {ctx.config.runs_dir}: {exc}", style=style.NOTE, id="experiments-note")
    options = [{"label": run_label(r), "value": run_key(r)} for r in runs_dir.runs]
    return html.Div(
        [
            *whatif,
            html.Div(f"{len(runs_dir.runs)} runs from {runs_dir.root.name}", style=style.STATUS),
            dcc.Graph(id="graph-delivery", figure=delivery, config={"displaylogo": False}),
            dcc.Graph(id="graph-creation", figure=creation, config={"displaylogo": False}),
            html.Div(
                [
                    html.Span("Run", style=style.LABEL),
                    dcc.Dropdown(
                        id="experiments-run",
                        options=options,
                        value=query["run"]
                        if query.get("run") in {o["value"] for o in options}
                        else (options[0]["value"] if options else None),
                        clearable=False,
                        style={**style.DROPDOWN, "width": "640px"},
                    ),
                ],
                style=style.CONTROLS,
            ),
            html.Div(id="experiments-run-summary", style=style.STATUS),
            html.Div(
                [
                    dcc.Graph(
                        id=ARRIVALS_GRAPH_ID, config={"displaylogo": False}, style=HIDDEN, responsive=True
                    ),
                    *(dcc.Graph(id=gid, config={"displaylogo": False}) for gid in RUN_GRAPH_IDS),
                ],
                style=style.GRID,
            ),
        ]
    )


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        *[Output(gid, "figure") for gid in RUN_GRAPH_IDS],
        Output(ARRIVALS_GRAPH_ID, "figure"),
        Output(ARRIVALS_GRAPH_ID, "style"),
        Output("experiments-run-summary", "children"),
        Input("experiments-run", "value"),
    )
    def _run(run_id: object) -> tuple[Any, ...]:
        view = run_view(ctx, text_choice(run_id))
        if view.arrivals is None:  # a pulse run: as it always looked, without the panel
            return (*view.panels, go.Figure(), HIDDEN, view.summary)
        return (*view.panels, view.arrivals, SHOWN, view.summary)


PAGE = Page(key="experiments", path="/experiments", name="Experiments", layout=layout, register=register)
