"""The Grafana dashboard of a fleet, generated from the detector's signal catalogue and the live page.

``python -m dashboard.grafana`` writes ``deploy/grafana/retrywatch.json`` (and the copy that the
Kubernetes base's ConfigMap generator reads, ``deploy/kubernetes/base/grafana-dashboard.json``:
kustomize loads no file outside its directory); ``--check`` exits 1 when either differs from
what this module gives (``tests/dashboard/test_grafana.py`` asserts the same).

What it holds, each fact from its one place:

- a ``datasource`` variable (any Prometheus); ``vllm_job`` and ``vllm_instance`` (vLLM's scrape
  job, whichever job holds vLLM's series, and its targets); ``deadline`` and ``capacity`` (the two
  numbers the operator states: vLLM exports neither); and ``instance`` (every replica scraped as
  job ``retrywatch``, ``detector.signals.PROMETHEUS_JOB``; several or all may be chosen);
- one row per chosen vLLM instance with the panels that need only vLLM's own series
  (``dashboard.vllmpanels``): a dashboard that works before the proxy;
- one row per chosen proxy instance (Grafana repeats it), with the live page's tiles
  (``dashboard.tiles.TILE_SPECS``) and its panels (``dashboard.figures.LIVE_PANELS``): each
  panel's title, axis label and every trace's name, colour, stacking and dash are read from the
  Dash figure itself; each trace's query reads the recording rules of the signals it draws
  (``detector.signals``), so the panels show what Prometheus' rules record; each says "needs the
  retrywatch proxy" where it has no data (Grafana's ``noValue``);
- annotations from Prometheus' ``ALERTS`` series, one per tier and severity (``detector.thresholds``),
  each over its tier's instances.

Plain dictionaries in Grafana's dashboard JSON model (schemaVersion 39); no Grafana library.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import plotly.graph_objects as go

from dashboard import figures, vllmpanels
from dashboard.tiles import TILE_SPECS
from detector.signals import DEFAULT_DEADLINE_S, PROMETHEUS_JOB, PROMETHEUS_JOBS, SIGNALS_BY_NAME
from detector.thresholds import ALERTS, SEVERITIES, TIERS, Tier
from foundation import metricnames as mn

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OUTPUT_PATH = DEPLOY / "grafana" / "retrywatch.json"
KUSTOMIZE_COPY = DEPLOY / "kubernetes" / "base" / "grafana-dashboard.json"
UID = "retrywatch-fleet"
INSTANCE = "$instance"
_SEVERITY_COLOURS = {"critical": "red", "warning": "orange", "info": "blue"}
#: What a panel that reads the proxy's series shows where it has none.
NEEDS_PROXY = "needs the retrywatch proxy"
#: The scrape job of vLLM's own targets the dashboard opens on (any job holding vLLM's series can
#: be chosen in Grafana): the vLLM tier's.
DEFAULT_VLLM_JOB = PROMETHEUS_JOBS["vllm"]


@dataclass(frozen=True)
class Options:
    """What the operator states for the vLLM-only panels: vLLM's scrape job, the clients'
    deadline (seconds) and Ĉ (calls/s; None: not stated, so no Ĉ line is drawn)."""

    vllm_job: str = DEFAULT_VLLM_JOB
    deadline_s: float = DEFAULT_DEADLINE_S
    capacity: float | None = None

    def __post_init__(self) -> None:
        if not self.vllm_job or any(c in self.vllm_job for c in '"\\\n{}$'):
            raise ValueError(f"not a usable scrape job name: {self.vllm_job!r}")
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"the deadline must be a number of seconds > 0, got {self.deadline_s!r}")
        if self.capacity is not None and not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ValueError(f"Ĉ must be a number of calls per second > 0, got {self.capacity!r}")


@dataclass(frozen=True)
class Trace:
    """One line of a live panel: the signals it draws and how they combine."""

    name: str  # the Dash trace's name
    signals: tuple[str, ...]
    combine: str = "one"  # "one", "sum" (several signals added), "product" (two multiplied)


# The signals behind each trace of each live panel (the Dash figures draw them by these names;
# generation fails if a figure has a trace this table lacks, or lacks one it lists).
PANEL_TRACES: dict[Callable[..., go.Figure], tuple[Trace, ...]] = {
    figures.attempts_figure: (
        Trace("first attempts", ("attempt_rate_first",)),
        Trace("retries", ("attempt_rate_retry",)),
        Trace("executions created", ("execution_creation_rate",)),
        Trace("capacity Ĉ", ("capacity",)),
    ),
    figures.fates_figure: tuple(
        Trace(name, names, "sum" if len(names) > 1 else "one")
        for name, names, _ in (*figures.FATE_TRACES, *figures.ATTEMPT_FATE_TRACES)
    ),
    figures.queue_figure: (
        Trace("vLLM waiting", ("vllm_waiting",)),
        Trace("proxy queue", ("proxy_queued",)),
        Trace("created × deadline", ("execution_creation_rate", "deadline"), "product"),
    ),
    figures.prompt_tokens_figure: (
        Trace("admitted", ("prompt_tokens_admitted_rate",)),
        Trace("counted", ("prompt_tokens_counted_rate",)),
    ),
    figures.delivery_figure: tuple(Trace(name, (signal,)) for name, signal, _ in figures.BURN_TRACES),
}


def _selector(record: str) -> str:
    return f'{record}{{instance=~"{INSTANCE}"}}'


def trace_expr(trace: Trace) -> str:
    """The PromQL of one trace over the signals' recording rules, for the chosen instance."""
    records = [SIGNALS_BY_NAME[name].record for name in trace.signals]
    if trace.combine == "one":
        (record,) = records
        return _selector(record)
    if trace.combine == "sum":
        names = "|".join(records)
        return f'sum by (instance) ({{__name__=~"{names}", instance=~"{INSTANCE}"}})'
    if trace.combine == "product":
        first, second = records
        return f"{_selector(first)} * on (instance) {_selector(second)}"
    raise ValueError(f"unknown combination {trace.combine!r}")


def tile_expr(key: str) -> str:
    """The PromQL of a live-page tile (its ratio's recording rule)."""
    if key in SIGNALS_BY_NAME:
        return _selector(SIGNALS_BY_NAME[key].record)
    if key == "delivered_share":  # completed / (completed + orphaned) = 1 - orphaned share
        return f"1 - {_selector(SIGNALS_BY_NAME['orphaned_fraction'].record)}"
    if key == "delivered_within_deadline":  # within / (within + late), as dashboard.tiles
        within = _selector(SIGNALS_BY_NAME["delivered_rate_within_deadline"].record)
        late = _selector(SIGNALS_BY_NAME["delivered_rate_late"].record)
        return f"{within} / ({within} + {late})"
    raise KeyError(f"no query for the tile {key!r}")


def _dash_figure(build: Callable[..., go.Figure]) -> go.Figure:
    """The Dash figure drawn over two points of every live signal: every trace present."""
    points = [(0.0, 1.0), (5.0, 1.0)]
    return build(dict.fromkeys(figures.LIVE_SIGNALS, points), x_kind="seconds")


def _datasource() -> dict[str, str]:
    return {"type": "prometheus", "uid": "${datasource}"}


def _override(name: str, properties: list[dict[str, Any]]) -> dict[str, Any]:
    return {"matcher": {"id": "byName", "options": name}, "properties": properties}


def timeseries_panel(build: Callable[..., go.Figure], panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    fig = _dash_figure(build)
    traces = {t.name: t for t in PANEL_TRACES[build]}
    drawn = [str(t.name) for t in fig.data if t.name]
    if sorted(drawn) != sorted(traces):
        raise ValueError(f"{build.__name__} draws {drawn}, the Grafana table has {sorted(traces)}")
    targets, overrides = [], []
    for ref, trace in zip("ABCDEFGHIJ", fig.data, strict=False):
        name = str(trace.name)
        targets.append(
            {
                "datasource": _datasource(),
                "refId": ref,
                "expr": trace_expr(traces[name]),
                "legendFormat": name,
            }
        )
        props: list[dict[str, Any]] = [
            {"id": "color", "value": {"mode": "fixed", "fixedColor": str(trace.line.color)}}
        ]
        if trace.stackgroup:
            props.append(
                {"id": "custom.stacking", "value": {"mode": "normal", "group": str(trace.stackgroup)}}
            )
            props.append({"id": "custom.fillOpacity", "value": 30})
        if trace.line.dash:
            props.append({"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}})
        if trace.line.width and trace.line.width > 2:
            props.append({"id": "custom.lineWidth", "value": int(trace.line.width)})
        overrides.append(_override(name, props))
    defaults: dict[str, Any] = {
        "unit": "short",
        "min": 0,
        "noValue": NEEDS_PROXY,
        "custom": {"axisLabel": str(fig.layout.yaxis.title.text), "lineWidth": 2, "fillOpacity": 0},
    }
    # A horizontal line of the Dash figure (an alert's threshold) is a Grafana threshold line.
    levels = [float(sh.y0) for sh in fig.layout.shapes if sh.type == "line" and sh.y0 == sh.y1]
    if levels:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [
                {"color": "transparent", "value": None},
                *({"color": "red", "value": y} for y in levels),
            ],
        }
        defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": str(fig.layout.title.text),
        "description": " ".join((build.__doc__ or "").strip().split("\n\n")[0].split()),
        "datasource": _datasource(),
        "gridPos": grid,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }


def stat_panel(spec_index: int, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    spec = TILE_SPECS[spec_index]
    return {
        "id": panel_id,
        "type": "stat",
        "title": spec.label,
        "description": f"{spec.explanation} (alerts reading it: {', '.join(spec.alerts)})",
        "datasource": _datasource(),
        "gridPos": grid,
        "targets": [
            {"datasource": _datasource(), "refId": "A", "expr": tile_expr(spec.key), "instant": True}
        ],
        "fieldConfig": {
            "defaults": {
                "unit": "percentunit" if spec.percent else "none",
                "decimals": 2,
                "noValue": NEEDS_PROXY,
            },
            "overrides": [],
        },
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "none", "graphMode": "none"},
    }


def vllm_panel(panel: vllmpanels.Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    """A vLLM-only panel (``dashboard.vllmpanels``) as a Grafana time series."""
    targets, overrides = [], []
    for ref, query in zip("ABCDEFGHIJ", panel.queries, strict=False):
        targets.append(
            {"datasource": _datasource(), "refId": ref, "expr": query.expr, "legendFormat": query.legend}
        )
        props: list[dict[str, Any]] = []
        if query.colour:
            props.append({"id": "color", "value": {"mode": "fixed", "fixedColor": query.colour}})
        if query.dashed:
            props.append({"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}})
        if query.right_unit:
            props += [
                {"id": "custom.axisPlacement", "value": "right"},
                {"id": "unit", "value": query.right_unit},
            ]
        if props:
            overrides.append(_override(query.legend, props))
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _datasource(),
        "gridPos": grid,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "min": 0,
                "noValue": panel.no_value,
                "custom": {"axisLabel": panel.axis_label, "lineWidth": 2, "fillOpacity": 0},
            },
            "overrides": overrides,
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }


def _text_panel(panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "text",
        "title": "Before and with the proxy",
        "gridPos": grid,
        "options": {
            "mode": "markdown",
            "content": "The **vLLM** rows need only vLLM's own series, as any Prometheus scraping vLLM "
            "holds them (choose its job above). The **retrywatch proxy** rows count what vLLM cannot "
            "see (attempts and retries, executions created, orphaned and cancelled work, calls "
            f'delivered within the deadline): without the proxy each panel there says "{NEEDS_PROXY}".',
        },
    }


#: The instance variable each tier's alerts are shown for: the vLLM targets, or the proxies.
_TIER_INSTANCE: dict[Tier, str] = {"vllm": f"${vllmpanels.INSTANCE_VAR}", "proxy": INSTANCE}


def alert_annotations() -> list[dict[str, Any]]:
    """Firing alerts from Prometheus' ALERTS series, one annotation query per tier and severity,
    each for its tier's chosen instances."""
    out: list[dict[str, Any]] = [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        }
    ]
    for tier in TIERS:
        for severity in SEVERITIES:
            names = "|".join(rule.name for rule in ALERTS if rule.severity == severity and rule.tier == tier)
            if not names:
                continue
            out.append(
                {
                    "name": f"{severity} alerts ({tier} tier)",
                    "datasource": _datasource(),
                    "enable": True,
                    "iconColor": _SEVERITY_COLOURS[severity],
                    "expr": f'ALERTS{{alertstate="firing", severity="{severity}", alertname=~"{names}", '
                    f'instance=~"{_TIER_INSTANCE[tier]}"}}',
                    "step": "5s",
                    "titleFormat": "{{alertname}}",
                    "textFormat": "{{instance}}",
                    "tagKeys": "instance,severity",
                    "useValueForTime": False,
                }
            )
    return out


def _textbox(name: str, label: str, value: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "textbox",
        "query": value,
        "current": {"text": value, "value": value},
        "options": [{"selected": True, "text": value, "value": value}],
        "hide": 0,
    }


def _number(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


def templating(options: Options = Options()) -> list[dict[str, Any]]:
    up = f'up{{job="{PROMETHEUS_JOB}"}}'
    waiting = mn.VLLM_NUM_WAITING
    job, instance = vllmpanels.JOB_VAR, vllmpanels.INSTANCE_VAR
    stated = [
        _textbox(
            vllmpanels.DEADLINE_VAR, "deadline (s)", _number(options.deadline_s), "The clients' deadline."
        ),
    ]
    if options.capacity is not None:
        stated.append(
            _textbox(
                vllmpanels.CAPACITY_VAR, "Ĉ (calls/s)", _number(options.capacity), "The engine's capacity."
            )
        )
    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        {
            "name": job,
            "label": "vLLM job",
            "type": "query",
            "datasource": _datasource(),
            "query": {"query": f"label_values({waiting}, job)", "refId": job},
            "definition": f"label_values({waiting}, job)",
            "refresh": 2,
            "multi": False,
            "includeAll": False,
            "current": {"text": options.vllm_job, "value": options.vllm_job},
            "sort": 1,
            "hide": 0,
        },
        {
            "name": instance,
            "label": "vLLM",
            "type": "query",
            "datasource": _datasource(),
            "query": {"query": f'label_values({waiting}{{job="${job}"}}, instance)', "refId": instance},
            "definition": f'label_values({waiting}{{job="${job}"}}, instance)',
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "allValue": ".+",
            "current": {},
            "sort": 1,
            "hide": 0,
        },
        *stated,
        {
            "name": "instance",
            "label": "replica",
            "type": "query",
            "datasource": _datasource(),
            "query": {"query": f"label_values({up}, instance)", "refId": "instance"},
            "definition": f"label_values({up}, instance)",
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "allValue": ".+",
            "current": {},
            "sort": 1,
            "hide": 0,
        },
    ]


def _row(panel_id: int, title: str, repeat: str, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "row",
        "title": title,
        "repeat": repeat,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": [],
    }


def dashboard(options: Options = Options()) -> dict[str, Any]:
    """The whole dashboard, as Grafana's JSON model."""
    panels: list[dict[str, Any]] = [_text_panel(1, {"h": 3, "w": 24, "x": 0, "y": 0})]
    panels.append(_row(2, f"vLLM ${vllmpanels.INSTANCE_VAR}", vllmpanels.INSTANCE_VAR, 3))
    panel_id, y = 3, 4
    for i, panel in enumerate(vllmpanels.panels(capacity_stated=options.capacity is not None)):
        grid = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
        panels.append(vllm_panel(panel, panel_id, grid))
        panel_id += 1
    y = panels[-1]["gridPos"]["y"] + 8
    panels.append(_row(panel_id, "retrywatch proxy: replica $instance", "instance", y))
    panel_id, y = panel_id + 1, y + 1
    width = 24 // len(TILE_SPECS)
    for i in range(len(TILE_SPECS)):
        panels.append(stat_panel(i, panel_id, {"h": 4, "w": width, "x": i * width, "y": y}))
        panel_id += 1
    for i, build in enumerate(figures.LIVE_PANELS):
        grid = {"h": 9, "w": 12, "x": 12 * (i % 2), "y": y + 4 + 9 * (i // 2)}
        panels.append(timeseries_panel(build, panel_id, grid))
        panel_id += 1
    return {
        "title": "retrywatch fleet",
        "uid": UID,
        "description": "Per vLLM engine: the loop's shape from vLLM's own series (no proxy needed). "
        "Per replica: the retrywatch live page's tiles and panels over Prometheus' "
        "recording rules (rules/retrywatch.rules.yml), with firing alerts as annotations. "
        "GENERATED by `python -m dashboard.grafana`.",
        "tags": ["retrywatch", "vllm"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": alert_annotations()},
        "templating": {"list": templating(options)},
        "panels": panels,
    }


def render(options: Options = Options()) -> str:
    """The dashboard's JSON text."""
    return json.dumps(dashboard(options), indent=2, ensure_ascii=False) + "\n"


def row_panels(doc: Mapping[str, Any], repeat: str) -> list[dict[str, Any]]:
    """The panels of the row that Grafana repeats over the variable ``repeat``."""
    out: list[dict[str, Any]] = []
    current = None
    for panel in doc["panels"]:
        if panel["type"] == "row":
            current = panel.get("repeat")
        elif current == repeat:
            out.append(panel)
    return out


def panel_queries(doc: Mapping[str, Any], repeat: str | None = None) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel query in a dashboard document (of one row: the row
    repeated over the variable ``repeat``)."""
    panels = doc["panels"] if repeat is None else row_panels(doc, repeat)
    return [
        (str(panel["title"]), str(target["expr"])) for panel in panels for target in panel.get("targets", [])
    ]


def stale_files(paths: Sequence[Path] = (OUTPUT_PATH, KUSTOMIZE_COPY)) -> list[Path]:
    """The committed dashboard files that differ from what this module gives."""
    text = render()
    return [p for p in paths if not p.exists() or p.read_text(encoding="utf-8") != text]


@click.command()
@click.option("--check", is_flag=True, help="Exit 1 if a committed file differs; write nothing.")
def main(check: bool) -> None:
    """Write (or --check) deploy/grafana/retrywatch.json and the Kubernetes base's copy."""
    if check:
        stale = stale_files()
        if stale:
            names = ", ".join(str(p) for p in stale)
            click.echo(f"out of date: {names}: run `python -m dashboard.grafana`", err=True)
            sys.exit(1)
        click.echo("the Grafana dashboard is up to date")
        return
    if not DEPLOY.is_dir():
        raise click.ClickException(f"{DEPLOY} does not exist: run this from a source checkout")
    text = render()
    for path in (OUTPUT_PATH, KUSTOMIZE_COPY):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        click.echo(f"wrote {path}")


def run(argv: Sequence[str] | None = None) -> None:
    main.main(args=list(argv) if argv is not None else None, prog_name="python -m dashboard.grafana")


if __name__ == "__main__":
    run()
