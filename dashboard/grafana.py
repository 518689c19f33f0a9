"""The Grafana dashboard of a fleet, generated from the detector's signal catalogue and the live page.

``python -m dashboard.grafana`` writes ``deploy/grafana/retrywatch.json`` (and the copy that the
Kubernetes base's ConfigMap generator reads, ``deploy/kubernetes/base/grafana-dashboard.json``:
kustomize loads no file outside its directory); ``--check`` exits 1 when either differs from
what this module gives (``tests/dashboard/test_grafana.py`` asserts the same).

What it holds, each fact from its one place:

- a ``datasource`` variable (any Prometheus) and an ``instance`` variable (every replica scraped as
  job ``retrywatch``, ``detector.signals.PROMETHEUS_JOB``; several or all may be chosen);
- one row per chosen instance (Grafana repeats it), with the live page's tiles
  (``dashboard.tiles.TILE_SPECS``) and its panels (``dashboard.figures.LIVE_PANELS``): each
  panel's title, axis label and every trace's name, colour, stacking and dash are read from the
  Dash figure itself; each trace's query reads the recording rules of the signals it draws
  (``detector.signals``), so the panels show what Prometheus' rules record;
- annotations from Prometheus' ``ALERTS`` series, one per severity (``detector.thresholds``).

Plain dictionaries in Grafana's dashboard JSON model (schemaVersion 39); no Grafana library.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import plotly.graph_objects as go

from dashboard import figures
from dashboard.tiles import TILE_SPECS
from detector.signals import PROMETHEUS_JOB, SIGNALS_BY_NAME
from detector.thresholds import ALERTS, SEVERITIES

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OUTPUT_PATH = DEPLOY / "grafana" / "retrywatch.json"
KUSTOMIZE_COPY = DEPLOY / "kubernetes" / "base" / "grafana-dashboard.json"
UID = "retrywatch-fleet"
INSTANCE = "$instance"
_SEVERITY_COLOURS = {"critical": "red", "warning": "orange", "info": "blue"}


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
                "noValue": "no data",
            },
            "overrides": [],
        },
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "none", "graphMode": "none"},
    }


def alert_annotations() -> list[dict[str, Any]]:
    """Firing alerts from Prometheus' ALERTS series, one annotation query per severity."""
    names = "|".join(rule.name for rule in ALERTS)
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
    for severity in SEVERITIES:
        if not any(rule.severity == severity for rule in ALERTS):
            continue
        out.append(
            {
                "name": f"{severity} alerts",
                "datasource": _datasource(),
                "enable": True,
                "iconColor": _SEVERITY_COLOURS[severity],
                "expr": f'ALERTS{{alertstate="firing", severity="{severity}", alertname=~"{names}", '
                f'instance=~"{INSTANCE}"}}',
                "step": "5s",
                "titleFormat": "{{alertname}}",
                "textFormat": "{{instance}}",
                "tagKeys": "instance,severity",
                "useValueForTime": False,
            }
        )
    return out


def templating() -> list[dict[str, Any]]:
    up = f'up{{job="{PROMETHEUS_JOB}"}}'
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


def dashboard() -> dict[str, Any]:
    """The whole dashboard, as Grafana's JSON model."""
    panels: list[dict[str, Any]] = [
        {
            "id": 1,
            "type": "row",
            "title": "replica $instance",
            "repeat": "instance",
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
            "panels": [],
        }
    ]
    panel_id = 2
    width = 24 // len(TILE_SPECS)
    for i in range(len(TILE_SPECS)):
        panels.append(stat_panel(i, panel_id, {"h": 4, "w": width, "x": i * width, "y": 1}))
        panel_id += 1
    for i, build in enumerate(figures.LIVE_PANELS):
        grid = {"h": 9, "w": 12, "x": 12 * (i % 2), "y": 5 + 9 * (i // 2)}
        panels.append(timeseries_panel(build, panel_id, grid))
        panel_id += 1
    return {
        "title": "retrywatch fleet",
        "uid": UID,
        "description": "Per replica: the retrywatch live page's tiles and panels over Prometheus' "
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
        "templating": {"list": templating()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def panel_queries(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel query in a dashboard document."""
    return [
        (str(panel["title"]), str(target["expr"]))
        for panel in doc["panels"]
        for target in panel.get("targets", [])
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
