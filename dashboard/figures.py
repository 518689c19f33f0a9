"""Pure Plotly figure builders: the dashboard's panels and the reproduce report's figures.

Every function here takes plain data (summary dicts, signal points, alert spans) and returns a
``go.Figure``; none does I/O, so each is unit-tested without a browser and ``retrywatch reproduce
report`` can import the experiment figures (``delivery_by_cohort_figure``,
``creation_rate_vs_recovery_figure``) without Dash.

Colours come from the Okabe-Ito palette (colour-blind safe); every axis names its unit; sizes
are chosen to stay readable at 1280x720.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dashboard.data import engine_name
from dashboard.runs import STEP_SIGNALS, condition_text
from detector.signals import WINDOWS
from detector.thresholds import ALERTS_BY_NAME, DELIVERY_BURN_THRESHOLD, SEVERITIES
from foundation.groundtruth import Collapse, GroundTruthError, collapses_of
from foundation.rundir import RunDirError

# --- palette (Okabe & Ito, 2008) -------------------------------------------------------
BLACK = "#000000"
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
BLUISH_GREEN = "#009E73"
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
REDDISH_PURPLE = "#CC79A7"
GREY = "#999999"
PALETTE: tuple[str, ...] = (BLUE, ORANGE, BLUISH_GREEN, VERMILLION, SKY_BLUE, REDDISH_PURPLE, YELLOW, BLACK)

SEVERITY_COLOURS: dict[str, str] = {"critical": VERMILLION, "warning": ORANGE, "info": SKY_BLUE}
COHORTS: tuple[str, ...] = ("pulse", "hold", "primary", "trace")  # "trace": a replay's every call
MAX_POINTS = 600  # per trace: a panel is ~500 px wide at 1280x720; more points only slow it down
MAX_SHADES = 60  # alert spans drawn per panel (the newest ones)

XKind = Literal["date", "seconds"]
Points = Sequence[Sequence[float]] | np.ndarray


@dataclass(frozen=True)
class Shade:
    """An alert span to shade on time-series panels; ``end`` None while it still fires."""

    start: float
    end: float | None
    alertname: str
    severity: str = "warning"


# --- helpers ---------------------------------------------------------------------------


def plotly_text(value: object) -> str:
    """``value`` as text Plotly shows as written: Plotly reads tags (``<a href>``, ``<b>``,
    ``<br>``) and entities in tick labels and hover text, so a label value (a model name, an
    instance, a run's condition) is escaped and never becomes a link or markup."""
    return html.escape(str(value), quote=False)


def as_array(points: Points | None) -> np.ndarray:
    """``points`` as an (n, 2) float array of (t, value), sorted by t, non-finite t dropped."""
    if points is None:
        return np.empty((0, 2))
    arr: np.ndarray = np.asarray(points, dtype=float)
    if arr.size == 0:
        return np.empty((0, 2))
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"signal points must be pairs of (t, value), got shape {arr.shape}")
    arr = arr[np.isfinite(arr[:, 0])]
    if arr.shape[0] > 1 and np.any(np.diff(arr[:, 0]) < 0):
        arr = arr[np.argsort(arr[:, 0], kind="stable")]
    return arr


def downsample(points: Points | None, max_points: int = MAX_POINTS) -> np.ndarray:
    """Average ``points`` into at most ``max_points`` equal-count bins (NaNs ignored).

    A 6-h history at 5 s has 4,320 points per signal; a 1280-px panel shows ~1,000.
    """
    arr = as_array(points)
    n = arr.shape[0]
    if n <= max_points:
        return arr
    starts = np.linspace(0, n, max_points + 1).astype(int)[:-1]
    finite = np.isfinite(arr[:, 1])
    sums = np.add.reduceat(np.where(finite, arr[:, 1], 0.0), starts)
    counts = np.add.reduceat(finite.astype(float), starts)
    ends = np.append(starts[1:], n) - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), math.nan)
    return np.column_stack([arr[ends, 0], means])


def latest(points: Points | None) -> float | None:
    """The newest finite value of a signal, or None when it has none."""
    arr = as_array(points)
    finite = arr[np.isfinite(arr[:, 1])] if arr.size else arr
    if finite.shape[0] == 0:
        return None
    return float(finite[-1, 1])


def product(a: Points | None, b: Points | None) -> np.ndarray:
    """Pointwise ``a * b`` on ``a``'s timestamps (``b`` interpolated); empty if either is."""
    arr_a, arr_b = as_array(a), as_array(b)
    if arr_a.shape[0] == 0 or arr_b.shape[0] == 0:
        return np.empty((0, 2))
    b_on_a = np.interp(arr_a[:, 0], arr_b[:, 0], arr_b[:, 1])
    return np.column_stack([arr_a[:, 0], arr_a[:, 1] * b_on_a])


def _x(arr: np.ndarray, x_kind: XKind) -> np.ndarray:
    # Plotly date axes take milliseconds since the epoch; no datetime objects needed.
    return arr[:, 0] * 1000.0 if x_kind == "date" else arr[:, 0]


# Every time-series panel has the same fixed side margins and its legend in a row above the
# plot, so panels side by side have plot areas of equal width and their x-axes line up.
# The legend area holds three rows of three entries (the fates panel's seven fill it), so no
# panel's legend pushes its plot down more than another's.
TIME_MARGIN: dict[str, int] = {"l": 60, "r": 12, "t": 96, "b": 44}
TIME_PANEL_HEIGHT = 350  # px


def _time_layout(
    fig: go.Figure,
    title: str,
    y_title: str,
    x_kind: XKind,
    uirevision: str | None,
    x_range: tuple[float, float] | None = None,
) -> None:
    fig.update_layout(
        title={
            "text": title,
            "x": 0.01,
            "xanchor": "left",
            "y": 0.985,
            "yanchor": "top",
            "font": {"size": 15},
        },
        height=TIME_PANEL_HEIGHT,
        margin=TIME_MARGIN,
        legend={
            "orientation": "h",
            "x": 0.0,
            "xanchor": "left",
            "y": 1.02,
            "yanchor": "bottom",
            "entrywidth": 1 / 3,
            "entrywidthmode": "fraction",
            "traceorder": "normal",
            "font": {"size": 11},
        },
        hovermode="x unified",
        template="plotly_white",
        font={"size": 12},
        uirevision=uirevision,
    )
    fig.update_yaxes(automargin=False)
    if x_kind == "date":
        fig.update_xaxes(type="date", title_text="time (UTC)")
    else:
        fig.update_xaxes(title_text="time since run start (s)")
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    if x_range is not None:
        # Every panel shows exactly the chosen window, so panels line up with each other.
        scale = 1000.0 if x_kind == "date" else 1.0
        fig.update_xaxes(range=[x_range[0] * scale, x_range[1] * scale])


def merge_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) spans as disjoint spans, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _newest(shades: Iterable[Shade]) -> list[Shade]:
    """The newest ``MAX_SHADES`` alert spans, oldest first: those a panel draws."""
    return sorted(shades, key=lambda s: s.start)[-MAX_SHADES:]


Spans = list[tuple[float, float]]


def _severity_spans(shades: Iterable[Shade], now: float | None) -> list[tuple[str, Spans]]:
    """The newest alert spans as disjoint spans per severity, the more severe last (drawn on
    top); a span still firing ends at ``now`` (left out without one). Overlapping episodes of
    one severity are their union, so the shade's depth never depends on how many alerts fire at
    once."""
    spans = _newest(shades)
    by_severity: dict[str, list[tuple[float, float]]] = {}
    for shade in spans:
        end = shade.end if shade.end is not None else now
        if end is not None:
            by_severity.setdefault(shade.severity, []).append((shade.start, max(end, shade.start)))
    draw_order = tuple(reversed(SEVERITIES))  # the more severe drawn later, on top
    ordered = sorted(by_severity, key=lambda s: draw_order.index(s) if s in draw_order else -1)
    return [(severity, merge_spans(by_severity[severity])) for severity in ordered]


def _severity_legend(fig: go.Figure, shades: Iterable[Shade]) -> None:
    # One legend entry per severity shown, so the shading explains itself.
    for severity in sorted({s.severity for s in shades}):
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker={"symbol": "square", "size": 12, "color": SEVERITY_COLOURS.get(severity, GREY)},
                name=f"{severity} alert",
                hoverinfo="skip",
            )
        )


def _add_shades(fig: go.Figure, shades: Iterable[Shade], now: float | None, x_kind: XKind) -> None:
    shades = _newest(shades)
    scale = 1000.0 if x_kind == "date" else 1.0
    for severity, spans in _severity_spans(shades, now):
        for start, end in spans:
            fig.add_vrect(
                x0=start * scale,
                x1=end * scale,
                fillcolor=SEVERITY_COLOURS.get(severity, GREY),
                opacity=0.16 if severity == "critical" else 0.12,
                line_width=0,
                layer="below",
            )
    _severity_legend(fig, shades)


def _line(
    fig: go.Figure,
    points: Points | None,
    name: str,
    colour: str,
    x_kind: XKind,
    *,
    dash: str | None = None,
    width: float = 2.0,
    stack: str | None = None,
    hover_unit: str = "",
) -> None:
    arr = downsample(points)
    trace: dict[str, Any] = {
        "x": _x(arr, x_kind),
        "y": arr[:, 1],
        "name": name,
        "mode": "lines",
        "line": {"color": colour, "width": width, "dash": dash},
        "hovertemplate": f"%{{y:.3~g}} {hover_unit}<extra>{name}</extra>",
    }
    if stack is not None:
        trace.update(stackgroup=stack, fillcolor=colour, line={"color": colour, "width": 0.5})
    fig.add_trace(go.Scatter(**trace))


def has_data(points: Points | None, x_range: tuple[float, float] | None = None) -> bool:
    """Whether ``points`` holds a finite value (inside ``x_range`` when given). A source that
    stopped answering leaves nulls (NaN) or nothing, never a value."""
    arr = as_array(points)
    if arr.shape[0] == 0:
        return False
    keep = np.isfinite(arr[:, 1])
    if x_range is not None:
        keep &= (arr[:, 0] >= x_range[0]) & (arr[:, 0] <= x_range[1])
    return bool(np.any(keep))


def _no_data_note(
    fig: go.Figure,
    signals: Mapping[str, Points | None],
    needed: Mapping[str, Sequence[str]],
    x_range: tuple[float, float] | None = None,
) -> None:
    """When none of the panel's ``needed`` traces (name -> signals) has a value in the range,
    say so in the middle of the plot, naming what is missing."""
    if any(has_data(signals.get(n), x_range) for names in needed.values() for n in names):
        return
    fig.add_annotation(
        text=f"no data: {', '.join(needed)}<br>none in this time range (is the proxy's /metrics scraped?)",
        xref="paper",
        yref="paper",
        x=0.5,
        y=0.5,
        showarrow=False,
        font={"size": 14, "color": "#555"},
        bgcolor="rgba(255,255,255,0.85)",
    )


# --- live panels (signal names of detector/signals.py) ----------------------------------


def attempts_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Attempts by kind (stacked) and executions created, against the capacity Ĉ line."""
    fig = go.Figure()
    _line(
        fig, signals.get("attempt_rate_first"), "first attempts", SKY_BLUE, x_kind, stack="a", hover_unit="/s"
    )
    _line(fig, signals.get("attempt_rate_retry"), "retries", ORANGE, x_kind, stack="a", hover_unit="/s")
    _line(
        fig,
        signals.get("execution_creation_rate"),
        "executions created",
        BLUE,
        x_kind,
        width=3,
        hover_unit="/s",
    )
    _line(fig, signals.get("capacity"), "capacity Ĉ", BLACK, x_kind, dash="dash", hover_unit="calls/s")
    _add_shades(fig, shades, now, x_kind)
    _time_layout(fig, "Attempts and executions created vs Ĉ", "rate (per s)", x_kind, uirevision, x_range)
    needed = {
        "first attempts": ("attempt_rate_first",),
        "retries": ("attempt_rate_retry",),
        "executions created": ("execution_creation_rate",),
    }
    _no_data_note(fig, signals, needed, x_range)
    return fig


# What became of the executions: these add up (each execution has one fate), so they stack.
FATE_TRACES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("delivered", ("completion_rate_completed",), BLUISH_GREEN),
    ("orphaned", ("completion_rate_orphaned",), VERMILLION),
    ("cancelled", ("completion_rate_cancelled",), REDDISH_PURPLE),
    (
        "dropped / refused / failed",
        ("completion_rate_dropped", "completion_rate_refused", "completion_rate_failed"),
        GREY,
    ),
)
# Attempts that created no execution: another unit, so lines beside the stack, never on it.
ATTEMPT_FATE_TRACES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("attempts attached", ("attached_rate",), BLUE),
    ("attempts shed", ("shed_rate",), ORANGE),
)


def _sum_signals(signals: Mapping[str, Points | None], names: Sequence[str]) -> np.ndarray:
    arrays = [a for a in (as_array(signals.get(n)) for n in names) if a.shape[0]]
    if not arrays:
        return np.empty((0, 2))
    base = arrays[0].copy()
    for other in arrays[1:]:
        base[:, 1] = base[:, 1] + np.interp(base[:, 0], other[:, 0], other[:, 1])
    return base


def fates_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """What became of the executions, stacked (delivered, orphaned, cancelled, dropped/refused/
    failed: each execution has one fate); attempts attached to a live execution or shed by the
    proxy, which create none, as dashed lines beside the stack (all per second)."""
    fig = go.Figure()
    for name, signal_names, colour in FATE_TRACES:
        _line(fig, _sum_signals(signals, signal_names), name, colour, x_kind, stack="f", hover_unit="/s")
    for name, signal_names, colour in ATTEMPT_FATE_TRACES:
        _line(fig, _sum_signals(signals, signal_names), name, colour, x_kind, dash="dash", hover_unit="/s")
    _add_shades(fig, shades, now, x_kind)
    _time_layout(
        fig,
        "Execution fates (stacked); attempts",
        "executions or attempts per s",
        x_kind,
        uirevision,
        x_range,
    )
    needed = {name: names for name, names, _ in FATE_TRACES + ATTEMPT_FATE_TRACES}
    _no_data_note(fig, signals, needed, x_range)
    return fig


def queue_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """vLLM's waiting queue plus the proxy queue (stacked) against executions created × deadline,
    the level the queues sit at when every execution waits out its deadline (Little's law; the
    retry-loop alert's cancellation-on signature)."""
    fig = go.Figure()
    _line(fig, signals.get("vllm_waiting"), "vLLM waiting", BLUE, x_kind, stack="q", hover_unit="executions")
    _line(
        fig, signals.get("proxy_queued"), "proxy queue", SKY_BLUE, x_kind, stack="q", hover_unit="executions"
    )
    littles = product(signals.get("execution_creation_rate"), signals.get("deadline"))
    name = "created × deadline"
    _line(fig, littles, name, VERMILLION, x_kind, dash="dash", hover_unit="executions")
    _add_shades(fig, shades, now, x_kind)
    _time_layout(fig, "Queued vs created × deadline", "executions", x_kind, uirevision, x_range)
    needed = {"vLLM waiting": ("vllm_waiting",), "proxy queue": ("proxy_queued",)}
    _no_data_note(fig, signals, needed, x_range)
    return fig


def prompt_tokens_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Prompt tokens vLLM's counter shows against prompt tokens it admitted.

    NOTE: where nothing is missed the two lines coincide (the healthy case): "admitted" is drawn
    first as a wide band and "counted" over it thin and dashed, so both show either way."""
    fig = go.Figure()
    admitted = signals.get("prompt_tokens_admitted_rate")
    _line(fig, admitted, "admitted", ORANGE, x_kind, width=6.0, hover_unit="tokens/s")
    counted = signals.get("prompt_tokens_counted_rate")
    _line(fig, counted, "counted", BLUE, x_kind, dash="dash", hover_unit="tokens/s")
    _add_shades(fig, shades, now, x_kind)
    _time_layout(fig, "Prompt tokens: counted vs admitted", "tokens per s", x_kind, uirevision, x_range)
    needed = {
        "prompt tokens admitted": ("prompt_tokens_admitted_rate",),
        "prompt tokens counted": ("prompt_tokens_counted_rate",),
    }
    _no_data_note(fig, signals, needed, x_range)
    return fig


# The delivery SLO's burn rates, one trace per window (the symptom alert pages when both pass
# the threshold line).
BURN_TRACES: tuple[tuple[str, str, str], ...] = (
    (f"burn rate, {WINDOWS.slo_short_s:.0f} s", "delivery_burn_rate_short", VERMILLION),
    (f"burn rate, {WINDOWS.slo_long_s:.0f} s", "delivery_burn_rate_long", BLUE),
)


def delivery_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Calls missed over calls judged (missed, or delivered within the deadline) in error budgets
    of the delivery objective, over the short and the long window, against the line where the
    symptom alert (calls not delivered in time, whatever the cause) pages once both pass it."""
    fig = go.Figure()
    for name, signal, colour in BURN_TRACES:
        _line(fig, signals.get(signal), name, colour, x_kind, hover_unit="× budget")
    fig.add_hline(y=DELIVERY_BURN_THRESHOLD, line={"color": BLACK, "dash": "dash", "width": 1})
    _add_shades(fig, shades, now, x_kind)
    _time_layout(
        fig, "Calls not delivered in time: error-budget burn", "× error budget", x_kind, uirevision, x_range
    )
    _no_data_note(fig, signals, {name: (signal,) for name, signal, _ in BURN_TRACES}, x_range)
    return fig


def arrivals_figure(
    signals: Mapping[str, Points | None],
    shades: Iterable[Shade] = (),
    *,
    now: float | None = None,
    x_kind: XKind = "date",
    uirevision: str | None = None,
    x_range: tuple[float, float] | None = None,
) -> go.Figure:
    """Calls arriving (first attempts: a replayed trace's own burst shape) and calls delivered
    within the deadline, per second over each step of the run's series, against Ĉ: where the
    two part, the calls that arrive are not served in time."""
    arriving, in_time = STEP_SIGNALS
    fig = go.Figure()
    _line(fig, signals.get(arriving), "calls arriving (first attempts)", SKY_BLUE, x_kind, hover_unit="/s")
    _line(fig, signals.get(in_time), "delivered within the deadline", BLUISH_GREEN, x_kind, hover_unit="/s")
    _line(fig, signals.get("capacity"), "capacity Ĉ", BLACK, x_kind, dash="dash", hover_unit="calls/s")
    _add_shades(fig, shades, now, x_kind)
    _time_layout(fig, "Calls arriving and delivered in time", "calls per s", x_kind, uirevision, x_range)
    needed = {"calls arriving": (arriving,), "delivered within the deadline": (in_time,)}
    _no_data_note(fig, signals, needed, x_range)
    return fig


LIVE_PANELS = (attempts_figure, fates_figure, queue_figure, prompt_tokens_figure, delivery_figure)

# Every signal the live panels draw, fetched over the whole time range at each refresh.
LIVE_SIGNALS: tuple[str, ...] = (
    "attempt_rate_first",
    "attempt_rate_retry",
    "attempt_rate",
    "execution_creation_rate",
    "capacity",
    "deadline",
    "vllm_waiting",
    "proxy_queued",
    "completion_rate_completed",
    "completion_rate_orphaned",
    "completion_rate_cancelled",
    "completion_rate_dropped",
    "completion_rate_refused",
    "completion_rate_failed",
    "shed_rate",
    "attached_rate",
    "prompt_tokens_counted_rate",
    "prompt_tokens_admitted_rate",
    "delivery_burn_rate_short",
    "delivery_burn_rate_long",
)
# Ratios only the tiles read (their newest value): fetched over the last minute only.
TILE_SIGNALS: tuple[str, ...] = (
    "prompt_token_gap",
    "creation_capacity_ratio",
    "queue_littles_law_ratio",
    "delivered_rate_within_deadline",
    "delivered_rate_late",
)
TILE_LOOKBACK_S = 60.0


# --- history ----------------------------------------------------------------------------


def episodes_timeline_figure(
    episodes: Sequence[Mapping[str, Any]], *, now: float, uirevision: str | None = None
) -> go.Figure:
    """Alert episodes as horizontal bars, one row per (alert, engine), coloured by severity.

    ``episodes`` are detector API episodes (``alertname``, ``severity``, ``labels``,
    ``started_at``, ``resolved_at``; times in Unix seconds).
    """
    if not episodes:
        # No axes at all: empty date axes would show January 2000.
        return _empty_figure("no alert episodes in this time range", "Alert episodes")
    fig = go.Figure()
    rows: list[str] = []
    by_severity: dict[str, dict[str, list[Any]]] = {}
    for ep in sorted(episodes, key=lambda e: float(e["started_at"])):
        labels = ep.get("labels") or {}
        # One row per engine: keyed by instance, as the detector does (vLLM's engine label is "0"),
        # named as people read it (host:port and model).
        engine = engine_name(labels)
        row = plotly_text(f"{ep['alertname']} · {engine}" if engine else ep["alertname"])
        if row not in rows:
            rows.append(row)
        start = float(ep["started_at"])
        end = float(ep["resolved_at"]) if ep.get("resolved_at") is not None else now
        bucket = by_severity.setdefault(
            str(ep.get("severity", "warning")), {"x": [], "base": [], "y": [], "t": []}
        )
        bucket["base"].append(start * 1000.0)
        bucket["x"].append(max(end - start, 1.0) * 1000.0)
        bucket["y"].append(row)
        state = "firing" if ep.get("resolved_at") is None else f"{(end - start) / 60:.1f} min"
        bucket["t"].append(state)
    for severity, bucket in sorted(by_severity.items()):
        fig.add_trace(
            go.Bar(
                x=bucket["x"],
                base=bucket["base"],
                y=bucket["y"],
                orientation="h",
                name=severity,
                marker={"color": SEVERITY_COLOURS.get(severity, GREY)},
                customdata=bucket["t"],
                hovertemplate="%{y}<br>%{base|%Y-%m-%d %H:%M:%S} UTC, %{customdata}<extra></extra>",
            )
        )
    fig.update_layout(
        title={"text": "Alert episodes", "x": 0.01, "font": {"size": 15}},
        height=max(220, 40 + 28 * len(rows) + 90),
        margin={"l": 16, "r": 16, "t": 56, "b": 44},
        template="plotly_white",
        barmode="overlay",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom"},
        uirevision=uirevision,
        font={"size": 12},
    )
    fig.update_xaxes(type="date", title_text="time (UTC)")
    fig.update_yaxes(
        title_text="alert · engine", automargin=True, categoryorder="array", categoryarray=rows[::-1]
    )
    return fig


# --- experiments (pure functions of reproduce summary dicts) ---------------------------


def _require(run: Mapping[str, Any], key: str) -> Any:
    if key not in run:
        ident = run.get("series") or run.get("condition") or "?"
        raise RunDirError(f"summary run {ident!r} has no {key!r} field")
    return run[key]


def _group_labels(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A label per run: its condition, prefixed by block and model only where those vary."""
    blocks = {str(r.get("block", "")) for r in runs}
    models = {str(r.get("model", "")) for r in runs}
    labels = []
    for run in runs:
        parts = []
        if len(blocks) > 1:
            parts.append(str(run.get("block", "")))
        if len(models) > 1:
            parts.append(str(run.get("model", "")))
        _require(run, "condition")
        parts.append(condition_text(run))
        labels.append(plotly_text(" · ".join(parts)))
    return labels


def _ordered_unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def cohort_shares(run: Mapping[str, Any], cohort: str) -> tuple[float, float, float] | None:
    """(within the deadline, late, undelivered) shares in [0, 1] of a run's cohort, or None
    when the cohort offered no calls (shares null).

    ``delivery[cohort]`` holds ``within_deadline`` and ``by_horizon`` as shares of the
    cohort's calls (``by_horizon`` includes the calls delivered within the deadline); when the
    cohort also carries ``calls`` (or ``offered``) and the values exceed 1 they are read as counts.
    """
    delivery = _require(run, "delivery")
    if cohort not in delivery:
        raise RunDirError(f"summary run {run.get('series', '?')!r} has no delivery for cohort {cohort!r}")
    entry = delivery[cohort]
    if entry.get("within_deadline") is None and entry.get("by_horizon") is None:
        return None
    try:
        within = float(entry["within_deadline"])
        horizon = float(entry["by_horizon"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RunDirError(
            f"delivery[{cohort!r}] needs numeric within_deadline and by_horizon: {exc}"
        ) from exc
    calls = entry.get("calls") or entry.get("offered")
    if (within > 1.0 or horizon > 1.0) and calls:
        within, horizon = within / float(calls), horizon / float(calls)
    if not (0.0 <= within <= horizon + 1e-9 and horizon <= 1.0 + 1e-9):
        raise RunDirError(
            f"delivery[{cohort!r}] shares must satisfy 0 <= within_deadline <= by_horizon <= 1, "
            f"got {within} and {horizon}"
        )
    return within, max(horizon - within, 0.0), max(1.0 - horizon, 0.0)


def _empty_figure(text: str, title: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False)
    fig.update_layout(title={"text": title, "x": 0.01}, template="plotly_white", height=300)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def delivery_by_cohort_figure(runs: list[dict[str, Any]]) -> go.Figure:
    """Delivery by cohort per condition: share of calls delivered within the deadline, late
    (within the horizon) and undelivered, averaged over each condition's runs; one panel per
    cohort (pulse, hold, primary)."""
    title = "Delivery by cohort per condition (mean over runs)"
    if not runs:
        return _empty_figure("no runs", title)
    labels = _group_labels(runs)
    groups = _ordered_unique(labels)
    cohorts = [c for c in COHORTS if any(c in _require(r, "delivery") for r in runs)]
    fig = make_subplots(
        rows=1,
        cols=len(cohorts),
        shared_yaxes=True,
        subplot_titles=[f"{c} cohort" for c in cohorts],
        horizontal_spacing=0.04,
    )
    parts = (("within the deadline", BLUISH_GREEN), ("late", ORANGE), ("undelivered", VERMILLION))
    for col, cohort in enumerate(cohorts, start=1):
        sums = {g: np.zeros(3) for g in groups}
        counts = dict.fromkeys(groups, 0)
        for run, label in zip(runs, labels, strict=True):
            shares = cohort_shares(run, cohort) if cohort in run["delivery"] else None
            if shares is not None:
                sums[label] += np.array(shares)
                counts[label] += 1
        for i, (part, colour) in enumerate(parts):
            ys = [g for g in groups if counts[g]]
            xs = [100.0 * sums[g][i] / counts[g] for g in ys]
            ns = [counts[g] for g in ys]
            fig.add_trace(
                go.Bar(
                    x=xs,
                    y=ys,
                    orientation="h",
                    name=part,
                    legendgroup=part,
                    showlegend=col == 1,
                    marker={"color": colour},
                    customdata=ns,
                    hovertemplate=(
                        f"%{{y}}<br>{part}: %{{x:.1f}}% (%{{customdata}} runs)<extra>{cohort}</extra>"
                    ),
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="calls (% of cohort)", range=[0, 100], row=1, col=col)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        barmode="stack",
        template="plotly_white",
        height=max(300, 130 + 26 * len(groups)),
        margin={"l": 16, "r": 16, "t": 80, "b": 48},
        legend={"orientation": "h", "y": 1.08, "yanchor": "bottom", "x": 0.0},
        font={"size": 12},
    )
    return fig


def creation_rate_vs_recovery_figure(runs: list[dict[str, Any]]) -> go.Figure:
    """Each run's attempt rate and execution-creation rate (multiples of Ĉ, from
    ``rates_x_capacity``) per condition, marked recovered or not; a line at 1 Ĉ.

    Attempts alone do not separate recovered from collapsed runs; executions created do.
    """
    title = "Rates over the primary window vs recovery"
    if not runs:
        return _empty_figure("no runs", title)
    labels = _group_labels(runs)
    groups = _ordered_unique(labels)
    panels = [
        ("attempts", "attempts", "attempt rate (× Ĉ)"),
        ("executions_created", "executions created", "execution creation rate (× Ĉ)"),
    ]
    for run in runs:
        _require(run, "recovered")
        rates = _require(run, "rates_x_capacity")
        if "executions_created" not in rates:
            raise RunDirError(f"rates_x_capacity of run {run.get('series', '?')!r} has no executions_created")
    if not any("attempts" in r["rates_x_capacity"] for r in runs):
        panels = panels[1:]
    fig = make_subplots(
        rows=1,
        cols=len(panels),
        shared_yaxes=True,
        subplot_titles=[p[1] for p in panels],
        horizontal_spacing=0.04,
    )
    xmax = 1.2
    for col, (key, _, x_title) in enumerate(panels, start=1):
        for recovered, name, colour, symbol in (
            (True, "recovered", BLUE, "circle"),
            (False, "not recovered", VERMILLION, "x"),
        ):
            xs, ys, hover = [], [], []
            for run, label in zip(runs, labels, strict=True):
                value = run["rates_x_capacity"].get(key)
                if bool(run["recovered"]) is not recovered or value is None:
                    continue
                xs.append(float(value))
                ys.append(label)
                rt = run.get("recovery_time_s")
                rt_text = f"recovered after {float(rt):.0f} s" if recovered and rt is not None else name
                hover.append(plotly_text(f"run {run.get('run', '?')}: {rt_text}"))
            xmax = max([xmax, *xs])
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="markers",
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    marker={
                        "color": colour,
                        "symbol": symbol,
                        "size": 11,
                        "line": {"width": 1.5, "color": colour},
                    },
                    customdata=hover,
                    hovertemplate="%{y}<br>%{x:.2f} × Ĉ<br>%{customdata}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.add_vline(x=1.0, line={"color": BLACK, "dash": "dash", "width": 1.5}, row=1, col=col)
        fig.update_xaxes(title_text=x_title, row=1, col=col)
    fig.update_xaxes(range=[0, xmax * 1.08])
    fig.update_yaxes(autorange="reversed", automargin=True, categoryorder="array", categoryarray=groups)
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        template="plotly_white",
        height=max(300, 130 + 26 * len(groups)),
        margin={"l": 16, "r": 16, "t": 80, "b": 48},
        legend={"orientation": "h", "y": 1.08, "yanchor": "bottom", "x": 0.0},
        font={"size": 12},
    )
    return fig


def run_shades(alerts: Iterable[Mapping[str, Any]]) -> list[Shade]:
    """Shades from validation.json alerts (``alertname``, ``fired_at_s``, ``resolved_at_s``),
    with each alert's severity from its one definition (``detector.thresholds``)."""
    shades = []
    for alert in alerts:
        name = str(alert["alertname"])
        resolved = alert.get("resolved_at_s")
        rule = ALERTS_BY_NAME.get(name)
        shades.append(
            Shade(
                start=float(alert["fired_at_s"]),
                end=None if resolved is None else float(resolved),
                alertname=name,
                severity=str(alert.get("severity") or (rule.severity if rule else "warning")),
            )
        )
    return shades


def pulse_marks(fig: go.Figure, pulse: Mapping[str, Any] | None) -> go.Figure:
    """Mark the pulse window with dotted lines on a run's time-series panel (seconds axis)."""
    if pulse:
        for key in ("start_s", "end_s"):
            if pulse.get(key) is not None:
                fig.add_vline(x=float(pulse[key]), line={"color": GREY, "dash": "dot", "width": 1.5})
    return fig


# --- a run's collapses (its ground-truth record), the bursts behind them, the alerts over them ---

COLLAPSE_COLOUR = GREY
METASTABLE_COLOUR = REDDISH_PURPLE
BURST_COLOUR = BLUE
# A time panel's rows of marks, in fractions of its plot's height: the alerts fired along its
# top, the bursts along its foot; the collapses are bands behind all of it.
ALERT_ROW: tuple[float, float] = (0.93, 1.0)
BURST_ROW: tuple[float, float] = (0.0, 0.05)


def is_trace_run(run: Mapping[str, Any]) -> bool:
    """A run without a pulse (a replayed trace, a stepped load): judged by its collapses alone,
    its arrivals drawn, its alerts in a row of their own."""
    return not run.get("pulse") and ("collapses" in run or "burst" in run)


def run_collapses(run: Mapping[str, Any]) -> list[Collapse]:
    """A run's collapses from its summary entry's ground-truth record (every run written since
    runs record it; an older entry without ``collapses`` has none to draw); an entry of the wrong
    shape (collapses not a list, a collapse without its start or end) raises ``RunDirError``."""
    if "collapses" not in run and not is_trace_run(run):
        return []
    try:
        return list(collapses_of(run))
    except GroundTruthError as exc:
        raise RunDirError(str(exc)) from None


def collapse_marks(fig: go.Figure, collapses: Sequence[Collapse], *, legend: bool = True) -> go.Figure:
    """Mark a run's collapses on a time panel (seconds axis): each a grey band behind the
    lines, its metastable stretch (from ``metastable_at`` to its end) a reddish-purple band over
    it, and the burst that started it a bar along the plot's foot. With ``legend``, one entry
    each for what is drawn."""
    drawn: dict[str, str] = {}
    for c in collapses:
        fig.add_vrect(
            x0=c.start_s,
            x1=max(c.end_s, c.start_s),
            fillcolor=COLLAPSE_COLOUR,
            opacity=0.2,
            line_width=0,
            layer="below",
            name="collapse",
        )
        drawn["collapse"] = COLLAPSE_COLOUR
        if c.metastable_at_s is not None:
            fig.add_vrect(
                x0=c.metastable_at_s,
                x1=max(c.end_s, c.metastable_at_s),
                fillcolor=METASTABLE_COLOUR,
                opacity=0.22,
                line_width=0,
                layer="below",
                name="metastable",
            )
            drawn["metastable (retry loop)"] = METASTABLE_COLOUR
    for start, end in merge_spans(c.burst for c in collapses if c.burst is not None):
        fig.add_vrect(
            x0=start,
            x1=end,
            y0=BURST_ROW[0],
            y1=BURST_ROW[1],
            fillcolor=BURST_COLOUR,
            opacity=0.7,
            line_width=0,
            layer="above",  # over a stacked panel's fill: the foot of the plot, where it stays small
            name="burst",
        )
        drawn["burst behind a collapse"] = BURST_COLOUR
    if legend:
        for name, colour in drawn.items():
            fig.add_trace(
                go.Scatter(
                    x=[None],
                    y=[None],
                    mode="markers",
                    marker={"symbol": "square", "size": 12, "color": colour},
                    name=name,
                    hoverinfo="skip",
                )
            )
    return fig


def alert_row(fig: go.Figure, shades: Iterable[Shade], now: float | None) -> go.Figure:
    """The alerts fired over a run as bars along the top of a time panel (seconds axis), by
    severity, so they stay apart from the collapse bands behind the lines; a legend entry per
    severity, as the live panels' shading has."""
    shades = _newest(shades)
    for severity, spans in _severity_spans(shades, now):
        for start, end in spans:
            fig.add_vrect(
                x0=start,
                x1=end,
                y0=ALERT_ROW[0],
                y1=ALERT_ROW[1],
                fillcolor=SEVERITY_COLOURS.get(severity, GREY),
                opacity=0.8,
                line_width=0,
                layer="below",
                name=f"{severity} alert",
            )
    _severity_legend(fig, shades)
    return fig


def collapses_text(collapses: Sequence[Collapse]) -> str:
    """A run's collapses in words: how many (how many metastable), each's stretch, the
    burst behind it and when its loop held; ``no collapse`` for none."""
    if not collapses:
        return "no collapse"
    metastable = sum(1 for c in collapses if c.metastable)
    head = f"{len(collapses)} collapse{'s' if len(collapses) != 1 else ''} ({metastable} metastable)"
    parts = []
    for c in collapses:
        text = f"{c.start_s:.0f}–{c.end_s:.0f} s" if c.ended else f"{c.start_s:.0f} s to the end"
        if c.burst is not None:
            text += f" after the burst at {c.burst[0]:.0f}–{c.burst[1]:.0f} s"
        if c.metastable_at_s is not None:
            held = "" if c.metastable_for_s is None else f", held {c.metastable_for_s:.0f} s"
            text += f", metastable from {c.metastable_at_s:.0f} s{held}"
        elif c.metastable is None:
            text += ", metastable unknown"
        parts.append(text)
    return f"{head}: {'; '.join(parts)}"


# --- a what-if (``retrywatch reproduce whatif``'s whatif.json) -------------------------------

WHATIF_PARTS = (
    ("within_deadline", "within the deadline", BLUISH_GREEN),
    ("late", "late", ORANGE),
    ("failed", "failed", VERMILLION),
)


def whatif_rows(whatif: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per policy of a what-if, in its order: what it does, its point at the what-if's
    load (calls by fate, executions per call, loops, alerts) and its headroom (None if not
    searched). A row or field of the wrong shape raises ``RunDirError`` naming it."""
    policies = whatif.get("policies")
    if not isinstance(policies, Mapping):
        raise RunDirError("whatif.json: 'policies' must be an object")
    rows = []
    for name, body in policies.items():
        if not isinstance(body, Mapping) or not isinstance(body.get("at_load"), Mapping):
            raise RunDirError(f"whatif.json: policy {name!r} needs an 'at_load' object")
        head = body.get("headroom")
        rows.append({"policy": str(name), **body, "headroom": head if isinstance(head, Mapping) else None})
    return rows


def whatif_loops_text(point: Mapping[str, Any]) -> str:
    """Loops formed at a point: ``k/n runs`` and when the first formed, or ``none``."""
    loops, runs = int(point.get("loops") or 0), int(point.get("runs") or 0)
    if not loops:
        return f"none (0/{runs})"
    at = [float(t) for t in point.get("loop_at_s") or [] if t is not None]
    held = [float(t) for t in point.get("loop_for_s") or [] if t]
    when = f", from {min(at):.0f} s" if at else ""
    longest = f", held up to {max(held):.1f} s" if held else ""
    return f"{loops}/{runs} runs{when}{longest}"


def whatif_alerts_text(point: Mapping[str, Any]) -> str:
    """The alerts fired at a point, each with its first firing (run seconds), or ``none``."""
    alerts = point.get("alerts") or {}
    if not isinstance(alerts, Mapping) or not alerts:
        return "none"
    return ", ".join(
        f"{name} ({min(float(t) for t in times):.0f} s)" for name, times in alerts.items() if times
    )


def whatif_headroom_text(head: Mapping[str, Any] | None) -> str:
    """A policy's headroom in words: ``≥ 6x`` (a bound), ``2.15x ± 0.05`` or ``< 0.5x``."""
    if head is None:
        return "not searched"
    load, kind = head.get("headroom_load"), head.get("kind")
    if kind == "below" or load is None:
        return f"< {float(head.get('lower_limit') or 0):g}x Ĉ"
    if kind == "at-least":
        return f"≥ {float(load):g}x Ĉ (bound)"
    return f"{float(load):g}x Ĉ (within {float(head.get('precision_reached') or 0):g})"


def whatif_delivery_figure(whatif: Mapping[str, Any]) -> go.Figure:
    """Per policy, the share of calls delivered within the deadline, late and failed at the
    what-if's load (all its runs' calls)."""
    title = f"Calls by fate per policy at {whatif.get('load', '?')}x Ĉ"
    rows = whatif_rows(whatif)
    if not rows:
        return _empty_figure("no policies", title)
    fig = go.Figure()
    names = [r["policy"] for r in rows]
    for key, label, colour in WHATIF_PARTS:
        xs = [100.0 * float(r["at_load"].get(f"{key}_share") or 0.0) for r in rows]
        fig.add_trace(
            go.Bar(
                x=xs,
                y=names,
                orientation="h",
                name=label,
                marker={"color": colour},
                hovertemplate=f"%{{y}}<br>{label}: %{{x:.1f}}%<extra></extra>",
            )
        )
    fig.update_layout(
        title=title,
        barmode="stack",
        xaxis={"title": "% of calls", "range": [0, 100]},
        yaxis={"autorange": "reversed"},
        height=120 + 40 * len(rows),
        margin={"l": 120, "r": 20, "t": 50, "b": 40},
    )
    return fig


#: A what-if's criterion words when whatif.json names none (one written before it did).
_OLD_CRITERION = {"name": "metastable", "safe": "no metastable collapse", "unsafe": "a metastable collapse"}
#: The marks on a policy's curve: whatif.json's key, the label, its colour and dash.
WHATIF_MARKS = (
    ("headroom", "headroom", BLUE, "solid", "top left"),
    ("loop_onset", "loop onset", VERMILLION, "dash", "top right"),
    ("overload", "overload", ORANGE, "dot", "bottom right"),
)


def whatif_criterion(whatif: Mapping[str, Any]) -> dict[str, str]:
    """The criterion a what-if's headroom was searched by: ``name``, what a ``safe`` and an
    ``unsafe`` load are (whatif.json's ``criterion``)."""
    found = whatif.get("criterion")
    if not isinstance(found, Mapping):
        return dict(_OLD_CRITERION)
    return {k: str(found.get(k, v)) for k, v in _OLD_CRITERION.items()}


def whatif_mark_text(mark: Any) -> str:
    """A curve's mark (loop onset, overload) in words: ``at 2x Ĉ (not at 1.5x)`` or ``not seen``."""
    return str(mark.get("says", "–")) if isinstance(mark, Mapping) else "–"


def whatif_headroom_figure(whatif: Mapping[str, Any]) -> go.Figure:
    """Per policy, the loads its headroom search tried (safe by the criterion in force: green;
    unsafe: vermillion) and the headroom found (a bar; hatched where it is a bound)."""
    words = whatif_criterion(whatif)
    title = f"Headroom per policy: the largest load safe by '{words['name']}' ({words['safe']})"
    rows = [r for r in whatif_rows(whatif) if r["headroom"] is not None]
    if not rows:
        return _empty_figure("no headroom search (run whatif with --headroom)", title)
    fig = go.Figure()
    names = [r["policy"] for r in rows]
    fig.add_trace(
        go.Bar(
            x=[float(r["headroom"].get("headroom_load") or 0.0) for r in rows],
            y=names,
            orientation="h",
            name="headroom",
            marker={
                "color": SKY_BLUE,
                "pattern": {"shape": ["/" if r["headroom"].get("kind") != "bracketed" else "" for r in rows]},
            },
            text=[whatif_headroom_text(r["headroom"]) for r in rows],
            hovertemplate="%{y}: %{text}<extra></extra>",
        )
    )
    for safe, label, colour in ((True, words["safe"], BLUISH_GREEN), (False, words["unsafe"], VERMILLION)):
        xs, ys = [], []
        for r in rows:
            for t in r["headroom"].get("tried") or []:
                if bool(t.get("safe")) is safe:
                    xs.append(float(t["load"]))
                    ys.append(r["policy"])
        fig.add_trace(
            go.Scatter(x=xs, y=ys, mode="markers", name=f"tried: {label}", marker={"color": colour})
        )
    fig.update_layout(
        title=title,
        xaxis={"title": "load (× Ĉ)"},
        yaxis={"autorange": "reversed"},
        height=120 + 40 * len(rows),
        margin={"l": 120, "r": 20, "t": 50, "b": 40},
    )
    return fig


def whatif_curve_figure(whatif: Mapping[str, Any]) -> go.Figure:
    """Per policy (one panel each), the share of calls delivered within the deadline, late and
    failed against load, from every load run; the delivery objective drawn as a line, and the
    headroom, the loop's onset and the overload marked where they were found."""
    words = whatif_criterion(whatif)
    title = f"Calls by fate against load per policy (headroom by '{words['name']}')"
    rows = [r for r in whatif_rows(whatif) if isinstance(r.get("curve"), list) and r["curve"]]
    if not rows:
        return _empty_figure("no curve (a what-if written before it recorded one)", title)
    objective = whatif.get("objective")
    target = float(objective["target"]) if isinstance(objective, Mapping) and "target" in objective else None
    fig = make_subplots(
        rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.06,
        subplot_titles=[r["policy"] for r in rows],
    )  # fmt: skip
    fig.update_annotations(x=0.0, xanchor="left")  # the panels' titles, clear of the marks' labels
    for i, r in enumerate(rows, start=1):
        points = sorted(r["curve"], key=lambda q: float(q["load"]))
        loads = [float(q["load"]) for q in points]
        for key, label, colour in WHATIF_PARTS:
            fig.add_trace(
                go.Scatter(
                    x=loads,
                    y=[100.0 * float(q.get(f"{key}_share") or 0.0) for q in points],
                    mode="lines+markers",
                    name=label,
                    legendgroup=key,
                    showlegend=i == 1,
                    line={"color": colour},
                    hovertemplate=f"{r['policy']} at %{{x:g}}x Ĉ<br>{label}: %{{y:.1f}}%<extra></extra>",
                ),
                row=i,
                col=1,
            )
        if target is not None:
            fig.add_hline(
                y=100.0 * target, line={"color": GREY, "dash": "dash", "width": 1}, row=i, col=1,
                annotation_text=f"objective {100.0 * target:g}%", annotation_position="bottom right",
            )  # fmt: skip
        for key, label, colour, dash, where in WHATIF_MARKS:
            mark = r.get(key)
            at = (
                mark.get("headroom_load" if key == "headroom" else "load")
                if isinstance(mark, Mapping)
                else None
            )
            if at is None:
                continue
            fig.add_vline(
                x=float(at), line={"color": colour, "dash": dash, "width": 2}, row=i, col=1,
                annotation_text=f"{label} {float(at):g}x", annotation_position=where,
            )  # fmt: skip
    fig.update_yaxes(title_text="% of calls", range=[0, 105])
    fig.update_xaxes(title_text="load (× Ĉ)", row=len(rows), col=1)
    fig.update_layout(title=title, height=180 + 220 * len(rows), margin={"l": 60, "r": 20, "t": 80, "b": 40})
    return fig


# --- the daily what-if's headroom over the days (``retrywatch reproduce plan-daily``) --------


def headroom_history_figure(days: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Each day's headroom per policy (multiples of Ĉ, lines and markers), the policy in force's
    drawn thick and named, the day's observed peak marked, and the warning's margin line: the
    observed peak × (1 + margin), below which the policy in force warns (``VLLMHeadroomLow``).
    ``days``: oldest first, each with ``run_at`` (Unix s), ``headroom_load`` (policy -> load),
    ``observed_peak_load``, ``policy_in_force`` and ``margin`` (plan-daily's ``daily`` object)."""
    title = "Headroom per day and policy: the peak load each leaves before the delivery objective is missed"
    if not days:
        return _empty_figure("no daily run yet", title)
    fig = go.Figure()
    x = [1000.0 * float(d["run_at"]) for d in days]  # a date axis: milliseconds since the epoch
    policies = _ordered_unique(p for d in days for p in d["headroom_load"])
    for i, policy in enumerate(policies):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[d["headroom_load"].get(policy) for d in days],
                mode="lines+markers",
                name=policy,
                line={"color": PALETTE[i % len(PALETTE)], "width": 1.5, "dash": "dot"},
                marker={"size": 7},
                hovertemplate=f"{policy}: %{{y:.3g}}x Ĉ<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[d["headroom_load"].get(d["policy_in_force"]) for d in days],
            mode="lines+markers",
            name="policy in force",
            text=[d["policy_in_force"] for d in days],
            line={"color": BLACK, "width": 3.5},
            marker={"size": 11, "symbol": "diamond"},
            hovertemplate="in force: %{text}, %{y:.3g}x Ĉ<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[float(d["observed_peak_load"]) * (1 + float(d["margin"])) for d in days],
            mode="lines+markers",
            name="warning below: peak × (1 + margin)",
            line={"color": VERMILLION, "width": 2, "dash": "dash"},
            marker={"symbol": "line-ew-open", "size": 18},
            text=[f"{100 * float(d['margin']):g} %" for d in days],
            hovertemplate="warns below %{y:.3g}x Ĉ (margin %{text})<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[float(d["observed_peak_load"]) for d in days],
            mode="markers",
            name="observed peak",
            marker={"color": VERMILLION, "size": 12, "symbol": "x"},
            hovertemplate="observed peak %{y:.3g}x Ĉ<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis={"title": "daily run (UTC)", "type": "date"},
        yaxis={"title": "peak load (× Ĉ)", "rangemode": "tozero"},
        height=420,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        legend={"orientation": "h", "y": -0.2},
    )
    return fig
