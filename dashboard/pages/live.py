"""Live page: per engine, the alert state (a banner while anything fires), Ĉ and the deadline
with where they come from (stated, learned or missing), its tiles and five
panels (attempts vs Ĉ, execution fates, queues vs executions created × deadline, prompt
tokens, the delivery SLO's burn), with alert episodes shaded, refreshed on a timer, over a
chosen time range.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import dash
import numpy as np
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html

from dashboard import figures, style
from dashboard.context import Context
from dashboard.data import (
    Alert,
    DetectorError,
    EngineInputs,
    Episode,
    engine_of,
    instance_label,
    signals_for_engine,
)
from dashboard.figures import Shade
from dashboard.pages import Page, range_choice, runbook_link, text_choice
from dashboard.tiles import Tile, input_tiles, tiles
from detector.thresholds import SEVERITIES

RANGES: tuple[tuple[str, int], ...] = (("5 min", 300), ("15 min", 900), ("1 h", 3600), ("6 h", 21600))
DEFAULT_RANGE_S = 3600  # the callback's fallback; the page opens on fitting_range()
# The signal whose first point dates an engine's data (every proxy scrape yields it).
SPAN_SIGNAL = "attempt_rate"
GRAPH_IDS: tuple[str, ...] = (
    "graph-attempts",
    "graph-fates",
    "graph-queue",
    "graph-prompt",
    "graph-delivery",
)
SEVERITY_ORDER: dict[str, int] = {severity: i for i, severity in enumerate(SEVERITIES)}  # most severe first


@dataclass
class LiveView:
    """Everything the live page shows for one engine at one refresh (pure data)."""

    engine: str | None
    now: float
    range_s: float = 3600.0
    detector_url: str = ""  # relative runbook links resolve against it
    alerts: list[Alert] = field(default_factory=list)
    error: str | None = None
    source_up: bool = True
    signals: dict[str, np.ndarray] = field(default_factory=dict)
    episodes: list[Episode] = field(default_factory=list)
    inputs: EngineInputs | None = None  # Ĉ and the deadline, where they come from
    inputs_error: str | None = None  # why the detector did not say

    @property
    def engine_alerts(self) -> list[Alert]:
        # Alert.engine is the instance: the detector's key (vLLM's engine label is "0" everywhere).
        return [a for a in self.alerts if not self.engine or a.engine in ("", self.engine)]

    def shades(self) -> list[Shade]:
        return [Shade(e.started_at, e.resolved_at, e.alertname, e.severity) for e in self.episodes]

    def tiles(self) -> list[Tile]:
        # The last minute only, for a tile and the parts it falls back on alike: a value from
        # before an outage is no value now.
        since = self.now - figures.TILE_LOOKBACK_S
        recent = {name: points[points[:, 0] >= since] for name, points in self.signals.items()}
        return [
            *input_tiles(self.inputs, self.inputs_error),
            *tiles(recent, {a.alertname for a in self.engine_alerts}),
        ]

    def figures(self) -> list[go.Figure]:
        rev = f"{self.engine}:{self.range_s:g}"  # a new engine or range resets any zoom
        return [
            build(
                self.signals,
                self.shades(),
                now=self.now,
                uirevision=rev,
                x_range=(self.now - self.range_s, self.now),
            )
            for build in figures.LIVE_PANELS
        ]


def live_view(ctx: Context, engine: str | None, range_s: int, *, now: float | None = None) -> LiveView:
    """Fetch what the live page needs for ``engine`` over the last ``range_s`` seconds."""
    try:
        health = ctx.detector.health()
        alerts, evaluated_at = ctx.detector.alerts_at()
        # The detector's last evaluation: past its last scrape while the source is down, so the
        # tiles' last minute holds no value then (never the minute before the outage as healthy).
        known = [t for t in (health.last_scrape_at, evaluated_at) if t is not None]
        data_at = max(known) if known else None
        ref_now = now if now is not None else (data_at or time.time())
        view = LiveView(
            engine=engine,
            now=ref_now,
            range_s=range_s,
            detector_url=ctx.detector.display_url,
            source_up=health.source_up and health.status == "ok",
        )
        view.alerts = alerts
        since = ref_now - range_s
        view.episodes = ctx.detector.episodes(since=since, engine=engine or None)
        view.inputs, view.inputs_error = engine_inputs(ctx, engine)

        def fetch() -> dict[str, np.ndarray]:
            out = signals_for_engine(ctx.signals, figures.LIVE_SIGNALS, engine=engine, since=since)
            tile_since = ref_now - figures.TILE_LOOKBACK_S
            out.update(signals_for_engine(ctx.signals, figures.TILE_SIGNALS, engine=engine, since=tile_since))
            return out

        if now is None and data_at is not None and ctx.signals is ctx.detector:
            # The detector's history changes only with an evaluation (one per scrape, and on while
            # the source is down): several tabs on the same engine and range share one fetch.
            view.signals = dict(ctx.memo(("live", engine, range_s, data_at), fetch))
        else:
            view.signals = fetch()
        if now is None:
            # The source moved on while we fetched: "now" is the newest thing we were shown.
            newest = [float(p[-1, 0]) for p in view.signals.values() if p.shape[0]]
            newest += [a.started_at for a in view.alerts] + [e.started_at for e in view.episodes]
            view.now = max([ref_now, *newest])
    except DetectorError as exc:
        return LiveView(
            engine=engine, now=now or time.time(), range_s=range_s, error=str(exc), source_up=False
        )
    return view


def engine_inputs(ctx: Context, engine: str | None) -> tuple[EngineInputs | None, str | None]:
    """The engine's Ĉ and deadline as the detector knows them, or why it does not say (a detector
    without ``/inputs`` answers 404: the rest of the page does not depend on it)."""
    try:
        found = ctx.detector.inputs()
    except DetectorError:
        return (
            None,
            "the detector does not say where Ĉ and the deadline come from (an older one, without /inputs)",
        )
    mine = next((i for i in found if i.engine == engine), None) if engine else (found[0] if found else None)
    return mine, None if mine is not None else "the detector follows no such engine yet"


# --- rendering --------------------------------------------------------------------------


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _runbook(alert: Alert, detector_url: str) -> list[Any]:
    if not alert.runbook_url:
        return []
    return [" ", runbook_link(alert.runbook_url, detector_url, "banner-runbook")]


def _alert_order(alert: Alert) -> tuple[int, bool, float]:
    # The worst severity first; within one, what still fires before what is resolving.
    return (SEVERITY_ORDER.get(alert.severity, 9), alert.resolving, alert.started_at)


def render_banner(view: LiveView) -> tuple[list[Any], dict[str, str]]:
    """The banner: every firing alert (any engine), worst first, a resolving one (its condition
    cleared, it keeps firing a while) said to be resolving; "no data" when the detector or its
    source is down; hidden when nothing fires."""
    if view.error is not None:
        return [html.B("NO DATA "), f"detector unreachable: {view.error}"], style.banner("nodata")
    items: list[Any] = []
    if not view.source_up:
        items.append(html.Div([html.B("NO DATA "), "the detector's metrics source is down"]))
    alerts = sorted(view.alerts, key=_alert_order)
    if alerts:
        # The worst alert in full; the others on one line, so the panels stay in view.
        worst = alerts[0]
        where = f" on {worst.engine_name}" if worst.engine else ""
        if worst.resolving:
            cleared = worst.resolving_since if worst.resolving_since is not None else view.now
            until = f", resolves at {_fmt_time(worst.resolves_at)}" if worst.resolves_at is not None else ""
            head = f"RESOLVING {worst.severity} {worst.alertname}"
            text = f"{where}: condition cleared at {_fmt_time(cleared)}{until} unless it returns"
            text += f"; {worst.summary}"
        else:
            head = f"{worst.severity.upper()} {worst.alertname}"
            text = f"{where} since {_fmt_time(worst.started_at)}: {worst.summary}"
        items.append(
            html.Div([html.B(head), text, *_runbook(worst, view.detector_url)], className="banner-alert")
        )
    if len(alerts) > 1:
        # Each named with its engine where that is not the worst alert's (a fleet), else briefly.
        others = ", ".join(
            f"{a.alertname} ({a.severity}{', resolving' if a.resolving else ''}"
            f"{', ' + a.engine_name if a.engine and a.engine != worst.engine else ''})"
            for a in alerts[1:]
        )
        items.append(html.Div([html.B("Also firing: "), others], className="banner-others"))
    if not items:
        return [], style.BANNER_HIDDEN
    if not alerts:
        return items, style.banner("nodata")
    return items, style.banner(alerts[0].severity, resolving=all(a.resolving for a in alerts))


def recent_engines(ctx: Context, now: float) -> set[str] | None:
    """The engines with a point (a value or none) in the minute before ``now``. The detector adds
    one at each evaluation for every engine it follows, so an engine without one has left (a
    replica scaled down: its history stays listed, its alerts resolved). None when unknown."""
    try:
        series = ctx.signals.signal(SPAN_SIGNAL, since=now - figures.TILE_LOOKBACK_S)
    except DetectorError:
        return None
    return {engine_of(s.labels) for s in series if s.points.shape[0]}


def render_engine_states(
    view: LiveView, engines: Sequence[str], recent: Collection[str] | None = None
) -> list[Any]:
    """One chip per engine (host:port, as people read it): its worst firing alert and severity,
    "no data" when it is not in ``recent`` (it left, or its source answers nothing), or "ok"."""
    chips: list[Any] = [html.Span("Engines: ", style=style.LABEL)]
    for engine in engines:
        firing = sorted((a for a in view.alerts if a.engine == engine), key=_alert_order)
        name = firing[0].engine_name if firing else instance_label(engine)
        if firing:
            state = ", resolving" if firing[0].resolving else ""
            text = f"{name}: {firing[0].alertname} ({firing[0].severity}{state})"
            if len(firing) > 1:
                text += f" +{len(firing) - 1}"
            chips.append(html.Span(text, style=style.chip(firing[0].severity)))
        elif recent is not None and engine not in recent:
            chips.append(html.Span(f"{name}: no data in the last minute", style=style.chip("nodata")))
        else:
            chips.append(html.Span(f"{name}: ok", style=style.chip(None)))
    return chips


def render_tiles(view: LiveView) -> list[Any]:
    out = []
    for t in view.tiles():
        suffix = f" · {', '.join(t.firing)}" if t.firing else ""
        out.append(
            html.Div(
                [
                    html.Div(t.label, style=style.TILE_LABEL),
                    html.Div(
                        [t.text, html.Span(f" · {t.detail}", style=style.TILE_DETAIL) if t.detail else ""],
                        style=style.TILE_VALUE,
                        className="tile-value",
                    ),
                    html.Div(t.explanation + suffix, style=style.TILE_HELP),
                ],
                style=style.tile(t.status),
                id=f"tile-{t.key}",
            )
        )
    return out


def render_status(view: LiveView) -> str:
    if view.error is not None:
        return "detector unreachable"
    return f"data up to {_fmt_time(view.now)} · refreshed {time.strftime('%H:%M:%S', time.gmtime())} UTC"


def update(ctx: Context, engine: str | None, range_s: int | None) -> tuple[Any, ...]:
    """The live page's refresh callback: banner, engine chips, tiles, four figures, status."""
    view = live_view(ctx, engine, int(range_s or DEFAULT_RANGE_S))
    try:
        engines = ctx.signals.signal_index().engines if view.error is None else []
    except DetectorError:
        engines = []
    recent = recent_engines(ctx, view.now) if engines else None
    banner_children, banner_style = render_banner(view)
    return (
        banner_children,
        banner_style,
        render_engine_states(view, engines, recent),
        render_tiles(view),
        *view.figures(),
        render_status(view),
    )


def engine_options(ctx: Context, current: str | None) -> tuple[list[dict[str, str]], str | None]:
    """The engine selector's options and value (kept when the engine is still known)."""
    try:
        engines = ctx.signals.signal_index().engines
    except DetectorError:
        return [], current
    options = [{"label": instance_label(e), "value": e} for e in engines]
    value = current if current in engines else (engines[0] if engines else None)
    return options, value


def range_for_span(span_s: float | None) -> int:
    """The smallest preset range that shows ``span_s`` seconds of data whole (the largest when
    none does; the smallest when there is no data): the data never sits in a sliver."""
    if span_s is None:
        return RANGES[0][1]
    return next((s for _, s in RANGES if s >= span_s), RANGES[-1][1])


def fitting_range(ctx: Context, engine: str | None) -> int:
    """The range the page opens on: the smallest preset covering the engine's data."""
    try:
        now = ctx.now()
        got = signals_for_engine(ctx.signals, (SPAN_SIGNAL,), engine=engine, since=now - RANGES[-1][1])
    except DetectorError:
        return DEFAULT_RANGE_S
    points = got.get(SPAN_SIGNAL)
    first = float(points[0, 0]) if points is not None and points.shape[0] else None
    return range_for_span(None if first is None else now - first)


def layout(ctx: Context, query: dict[str, str] | None = None) -> html.Div:
    """The live page; ``?engine=`` and ``?range=`` (seconds, one of RANGES) preselect; without a
    range it opens on the smallest one that shows the engine's data whole."""
    query = query or {}
    options, value = engine_options(ctx, query.get("engine"))
    asked = range_choice(query.get("range"), RANGES)
    range_value = asked if asked is not None else fitting_range(ctx, value)
    # The first view is rendered with the layout (one round trip to the first paint); the
    # refresh callback then only runs on the timer or a new selection.
    banner_children, banner_style, chips, tile_divs, *figs, status = update(ctx, value, range_value)
    return html.Div(
        [
            html.Div(
                [
                    html.Div(
                        [
                            html.Span("Engine", style=style.LABEL),
                            dcc.Dropdown(
                                id="live-engine",
                                options=options,
                                value=value,
                                clearable=False,
                                style=style.DROPDOWN,
                            ),
                        ],
                        style={"display": "flex", "alignItems": "center"},
                    ),
                    html.Div(
                        [
                            html.Span("Time range", style=style.LABEL),
                            dcc.RadioItems(
                                id="live-range",
                                options=[{"label": label, "value": s} for label, s in RANGES],
                                value=range_value,
                                inline=True,
                                inputStyle={"marginRight": "3px", "marginLeft": "8px"},
                            ),
                        ],
                        style={"display": "flex", "alignItems": "center"},
                    ),
                    html.Span(status, id="live-status", style=style.STATUS),
                ],
                style=style.CONTROLS,
            ),
            html.Div(banner_children, id="alert-banner", style=banner_style),
            html.Div(chips, id="engine-states"),
            html.Div(tile_divs, id="tiles", style=style.TILES),
            html.Div(
                [
                    dcc.Graph(id=gid, figure=fig, config=style.GRAPH_CONFIG)
                    for gid, fig in zip(GRAPH_IDS, figs, strict=True)
                ],
                style=style.GRID,
                id="graph-grid",
            ),
            dcc.Interval(id="live-refresh", interval=int(ctx.config.refresh_s * 1000)),
        ]
    )


def register(app: dash.Dash, ctx: Context) -> None:
    outputs = [
        Output("alert-banner", "children"),
        Output("alert-banner", "style"),
        Output("engine-states", "children"),
        Output("tiles", "children"),
        *[Output(gid, "figure") for gid in GRAPH_IDS],
        Output("live-status", "children"),
    ]

    @app.callback(
        outputs,
        Input("live-refresh", "n_intervals"),
        Input("live-engine", "value"),
        Input("live-range", "value"),
        prevent_initial_call=True,
    )
    def _refresh(_n: int | None, engine: object, range_s: object) -> tuple[Any, ...]:
        return update(ctx, text_choice(engine), range_choice(range_s, RANGES))

    @app.callback(
        Output("live-engine", "options"),
        Output("live-engine", "value"),
        Input("live-refresh", "n_intervals"),
        State("live-engine", "value"),
        prevent_initial_call=True,
    )
    def _engines(_n: int | None, current: object) -> tuple[Any, ...]:
        options, value = engine_options(ctx, text_choice(current))
        if value == current:
            return options, dash.no_update
        return options, value


PAGE = Page(key="live", path="/", name="Live", layout=layout, register=register)
