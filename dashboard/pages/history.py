"""History page: the detector's alert episodes as a timeline and a table, filterable by alert,
engine and time range. Engines are listed and filtered by ``instance``, the detector's key (vLLM's
``engine`` label is "0" on every vLLM)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, dcc, html

from dashboard import style
from dashboard.context import Context
from dashboard.data import DetectorError, Episode
from dashboard.figures import episodes_timeline_figure
from dashboard.pages import Page, range_choice, runbook_link, text_choice

RANGES: tuple[tuple[str, int], ...] = (
    ("1 h", 3600),
    ("6 h", 21600),
    ("24 h", 86400),
    ("7 d", 604800),
    ("all", 0),
)
DEFAULT_RANGE_S = 86400
MAX_ROWS = 500
ALL = "__all__"


def _fmt(t: float | None) -> str:
    return "firing" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def history_view(
    ctx: Context, alertname: str | None, engine: str | None, range_s: int | None, *, now: float | None = None
) -> tuple[list[Episode], float, str | None]:
    """Episodes matching the filters (newest first), the reference now, and an error if any."""
    ref_now = now if now is not None else ctx.now()
    since = ref_now - range_s if range_s else None
    try:
        episodes = ctx.detector.episodes(
            since=since,
            alertname=None if alertname in (None, ALL) else alertname,
            engine=None if engine in (None, ALL) else engine,
        )
    except DetectorError as exc:
        return [], ref_now, str(exc)
    if engine not in (None, ALL):
        episodes = [e for e in episodes if e.engine == engine]  # by instance, whatever the source
    episodes.sort(key=lambda e: e.started_at, reverse=True)
    return episodes, ref_now, None


def episodes_table(episodes: Sequence[Episode], detector_url: str = "") -> html.Table:
    """The episodes, newest first, each with a link to its alert's runbook section."""
    head = html.Tr(
        [
            html.Th(h, style=style.TH)
            for h in ("alert", "severity", "engine (model)", "started (UTC)", "resolved (UTC)", "summary", "")
        ]
    )
    rows = [
        html.Tr(
            [
                html.Td(e.alertname, style=style.TD),
                html.Td(e.severity, style=style.TD),
                html.Td(e.engine_name, style=style.TD),
                html.Td(_fmt(e.started_at), style=style.TD),
                html.Td(_fmt(e.resolved_at), style=style.TD),
                html.Td(e.summary, style=style.TD),
                html.Td(runbook_link(e.runbook_url, detector_url, "episode-runbook"), style=style.TD),
            ],
            className="episode-row",
        )
        for e in episodes[:MAX_ROWS]
    ]
    return html.Table([html.Thead(head), html.Tbody(rows)], style=style.TABLE, id="episodes-table")


def update(
    ctx: Context, alertname: str | None, engine: str | None, range_s: int | None
) -> tuple[go.Figure, Any, str, list[dict[str, str]], list[dict[str, str]]]:
    """The history page's callback: timeline, table, count line and the filter options."""
    episodes, now, error = history_view(ctx, alertname, engine, range_s)
    fig = episodes_timeline_figure([e.as_dict() for e in episodes], now=now, uirevision="history")
    count = f"detector unreachable: {error}" if error else f"{len(episodes)} episodes"
    if len(episodes) > MAX_ROWS:
        count += f" (table shows the newest {MAX_ROWS})"
    alert_opts, engine_opts = filter_options(ctx)
    return fig, episodes_table(episodes, ctx.detector.display_url), count, alert_opts, engine_opts


def filter_options(ctx: Context) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Alert and engine choices: every alert and engine seen in the history and signals."""
    alerts: set[str] = set()
    engines: dict[str, str] = {}  # instance (the detector's engine key) -> "instance (model)"
    try:
        for e in ctx.detector.episodes():
            alerts.add(e.alertname)
            if e.engine:
                engines[e.engine] = e.engine_name
        for key in ctx.signals.signal_index().engines:
            engines.setdefault(key, key)
    except DetectorError:
        pass
    alert_opts = [{"label": "all alerts", "value": ALL}] + [{"label": a, "value": a} for a in sorted(alerts)]
    engine_opts = [{"label": "all engines", "value": ALL}] + [
        {"label": engines[k], "value": k} for k in sorted(engines)
    ]
    return alert_opts, engine_opts


def layout(ctx: Context, query: dict[str, str] | None = None) -> html.Div:
    def labelled(text: str, component: Any) -> html.Div:
        return html.Div(
            [html.Span(text, style=style.LABEL), component], style={"display": "flex", "alignItems": "center"}
        )

    alert_opts, engine_opts = filter_options(ctx)
    return html.Div(
        [
            html.Div(
                [
                    labelled(
                        "Alert",
                        dcc.Dropdown(
                            id="history-alert",
                            options=alert_opts,
                            value=ALL,
                            clearable=False,
                            style=style.DROPDOWN,
                        ),
                    ),
                    labelled(
                        "Engine",
                        dcc.Dropdown(
                            id="history-engine",
                            options=engine_opts,
                            value=ALL,
                            clearable=False,
                            style=style.DROPDOWN,
                        ),
                    ),
                    labelled(
                        "Time range",
                        dcc.RadioItems(
                            id="history-range",
                            options=[{"label": label, "value": s} for label, s in RANGES],
                            value=DEFAULT_RANGE_S,
                            inline=True,
                            inputStyle={"marginRight": "3px", "marginLeft": "8px"},
                        ),
                    ),
                    html.Span(id="history-count", style=style.STATUS),
                ],
                style=style.CONTROLS,
            ),
            dcc.Graph(id="graph-history", config={"displaylogo": False}),
            html.Div(id="history-table"),
        ]
    )


def register(app: dash.Dash, ctx: Context) -> None:
    @app.callback(
        Output("graph-history", "figure"),
        Output("history-table", "children"),
        Output("history-count", "children"),
        Output("history-alert", "options"),
        Output("history-engine", "options"),
        Input("history-alert", "value"),
        Input("history-engine", "value"),
        Input("history-range", "value"),
    )
    def _update(alertname: object, engine: object, range_s: object) -> tuple[Any, ...]:
        return update(ctx, text_choice(alertname), text_choice(engine), range_choice(range_s, RANGES))


PAGE = Page(key="history", path="/history", name="History", layout=layout, register=register)
