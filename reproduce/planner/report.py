"""A what-if's report: ``DIR/report.md`` (tables) and ``DIR/report.html`` (the same tables under
plotly figures) from ``DIR/whatif.json`` (``reproduce.planner.whatif``).

The tables and figures are the dashboard's (``dashboard.figures``' what-if rows, texts and
figures), rendered as reproduce's report renders its own (``reproduce.judge.report``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import plotly.io as pio

from dashboard.figures import (
    whatif_alerts_text,
    whatif_criterion,
    whatif_curve_figure,
    whatif_delivery_figure,
    whatif_headroom_figure,
    whatif_headroom_text,
    whatif_loops_text,
    whatif_mark_text,
    whatif_rows,
)
from foundation.rundir import REPORT_HTML, REPORT_MD
from reproduce.judge.report import STYLE, demote, markdown_renderer

__all__ = ["render_markdown", "write_whatif_report"]


def _pct(share: Any) -> str:
    return "–" if share is None else f"{100.0 * float(share):.1f}"


def _pulse(point: Mapping[str, Any]) -> str:
    pulse = point.get("pulse")
    if not isinstance(pulse, Mapping) or not pulse.get("calls"):
        return "–"
    n = float(pulse["calls"])
    return " / ".join(f"{100.0 * float(pulse[k]) / n:.1f}" for k in ("within_deadline", "late", "failed"))


def render_markdown(whatif: Mapping[str, Any]) -> str:
    """The what-if's tables: the policies side by side at its load, and each one's headroom."""
    rows = whatif_rows(whatif)
    setup = whatif.get("setup") or {}
    lines = [
        "# What-if: the proxy's policies on one workload",
        "",
        f"Workload: {whatif.get('workload_text', '?')}, at {whatif.get('load', '?')}x Ĉ; "
        f"model {setup.get('model', '?')}, backend {setup.get('backend', '?')}, "
        f"time scale {setup.get('time_scale', '?')}, seeds {whatif.get('seeds', '?')}.",
        "",
        "| policy | does | calls | within deadline % | late % | failed % | pulse: within / late / failed % "
        "| executions per call | recovered | collapses | loop formed | alerts fired (first) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["at_load"]
        lines.append(
            f"| {r['policy']} | {r.get('does', '')} | {p.get('calls')} "
            f"| {_pct(p.get('within_deadline_share'))} "
            f"| {_pct(p.get('late_share'))} | {_pct(p.get('failed_share'))} | {_pulse(p)} "
            f"| {p.get('executions_per_call')} | {p.get('recovered')}/{p.get('runs')} | {p.get('collapses')} "
            f"| {whatif_loops_text(p)} "
            f"| {whatif_alerts_text(p)} |"
        )
    lines += [
        "",
        "- Late: delivered after the first attempt's deadline; failed: never delivered. Executions "
        "per call: executions the proxy created / calls offered. Loop formed: runs with a metastable "
        "collapse (first attempts below Ĉ while executions were created at or above Ĉ), and when the "
        "first formed and how long it held (run seconds): a control that breaks the loop holds it "
        "briefly. Recovered: runs that met docs/protocol.md §6's recovery rule. Alerts: the "
        "detector's replay over the runs' series.",
    ]
    searched = [r for r in rows if r["headroom"] is not None]
    words = whatif_criterion(whatif)
    if searched:
        lines += [
            "",
            f"## Headroom (criterion: {words['name']})",
            "",
            f"| policy | headroom | loop onset | overload | loads tried ({words['safe']} ✓, "
            f"{words['unsafe']} ✗) |",
            "|---|---|---|---|---|",
        ]
        for r in searched:
            head = r["headroom"]
            tried = ", ".join(
                f"{float(t['load']):g}{'✓' if t.get('safe') else '✗'}" for t in head.get("tried") or []
            )
            lines.append(
                f"| {r['policy']} | {whatif_headroom_text(head)} | {whatif_mark_text(r.get('loop_onset'))} "
                f"| {whatif_mark_text(r.get('overload'))} | {tried} |"
            )
        lines += [
            "",
            f"- {whatif.get('safe_rule', '')}",
            "- Loop onset: the smallest load run at which a retry loop formed (a metastable "
            "collapse); overload: the smallest at which the objective was missed without one (the "
            "engine simply overloaded). Each is bracketed by the loads run, not searched.",
        ]
    curves = [r for r in rows if isinstance(r.get("curve"), list) and r["curve"]]
    if curves:
        lines += ["", "## The curve: calls by fate against load", ""]
        lines += [
            "| policy | load (x Ĉ) | within deadline % | late % | failed % | runs meeting the objective "
            "| what happened |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in curves:
            for q in sorted(r["curve"], key=lambda q: float(q["load"])):
                lines.append(
                    f"| {r['policy']} | {float(q['load']):g} | {_pct(q.get('within_deadline_share'))} "
                    f"| {_pct(q.get('late_share'))} | {_pct(q.get('failed_share'))} "
                    f"| {q.get('runs_meeting_objective')}/{q.get('runs')} "
                    f"| {_STATES.get(str(q.get('state')), '?')} |"
                )
    return "\n".join(lines) + "\n"


_STATES = {
    "meets": "served",
    "loop": "retry loop",
    "overload": "overloaded (no loop)",
}


def render_html(whatif: Mapping[str, Any], markdown: str) -> str:
    figures = [whatif_delivery_figure(whatif)]
    rows = whatif_rows(whatif)
    if any(r["headroom"] is not None for r in rows):
        figures.append(whatif_headroom_figure(whatif))
    if any(r.get("curve") for r in rows):
        figures.append(whatif_curve_figure(whatif))
    parts = [
        pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), default_width="100%")
        for i, fig in enumerate(figures)
    ]
    body = "".join(f"<section>{p}</section>" for p in parts)
    body += "<section>" + markdown_renderer().render(demote(markdown)) + "</section>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>retrywatch what-if</title>"
        f"<style>{STYLE}</style></head><body><h1>retrywatch what-if</h1>{body}</body></html>"
    )


def write_whatif_report(out: Path, whatif: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``out/report.md`` and ``out/report.html`` of ``whatif``."""
    markdown = render_markdown(whatif)
    md_path, html_path = out / REPORT_MD, out / REPORT_HTML
    md_path.write_text(markdown, encoding="utf-8")
    html_path.write_text(render_html(whatif, markdown), encoding="utf-8")
    return md_path, html_path
