"""Headroom page (``/headroom``, the runbook's link for ``VLLMHeadroomLow``): the daily
what-if's answers, read from the state directory of ``retrywatch reproduce plan-daily --out DIR``
(the dashboard's ``--plan DIR``): one line saying which policy leaves the most, each day's headroom
per policy with the observed peak, the policy in force and the warning's margin line, and the
latest run's curves (calls delivered within the deadline, late and failed against load per policy,
the objective, headroom, loop onset and overload marked).

It reads what the command persists under DIR: each run's ``runs/<UTC time>-w<start>-<end>/
whatif.json`` (its ``daily`` answer, each policy's ``headroom`` search, and its ``curves`` with
their marks, judged by the planner's own ``curve`` and ``marks``); the SQL history holds the same
answers. A run it cannot read is a note on the page, never an error page. The dashboard does not
import the planner (it sits below ``reproduce``): the names it reads are checked against the
planner's by its tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dash
from dash import dcc, html

from dashboard import figures, style
from dashboard.context import Context
from dashboard.pages import Page
from foundation.rundir import WHATIF, RunDirError, read_json

PATH = "/headroom"
#: Where plan-daily keeps each run (``reproduce.planner.daily.RUNS_DIR``).
RUNS_DIR = "runs"
#: Runs read at most (the newest): over a year of daily runs.
MAX_DAYS = 400
#: What a hand-edited or corrupt run raises while it is read: a note, never a 500.
BROKEN = (RunDirError, ValueError, TypeError, KeyError, AttributeError, OSError)
#: The fields of a run's ``daily`` answer the page reads.
DAY_FIELDS = ("run_at", "headroom_load", "observed_peak_load", "policy_in_force", "margin")
#: The fates a curve's point gives as shares of its calls (``<fate>_share``).
SHARES = ("within_deadline", "late", "failed")


@dataclass
class Plan:
    """What the page shows: each day's answer (plan-daily's ``daily`` object, oldest first), the
    newest run's curves (shaped as ``figures.whatif_curve_figure`` reads a what-if), and a note
    for each thing that could not be read."""

    days: list[dict[str, Any]] = field(default_factory=list)
    curves: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def _day(body: Any, where: str) -> dict[str, Any]:
    """A run's ``daily`` answer, checked for what the page reads."""
    day = body.get("daily") if isinstance(body, Mapping) else None
    if not isinstance(day, Mapping):
        raise RunDirError(f"{where}: no 'daily' answer")
    missing = [k for k in DAY_FIELDS if k not in day]
    if missing:
        raise RunDirError(f"{where}: its 'daily' answer lacks {', '.join(missing)}")
    heads = day["headroom_load"]
    if not isinstance(heads, Mapping) or day["policy_in_force"] not in heads:
        raise RunDirError(f"{where}: 'headroom_load' must give the policy in force's headroom")
    return {
        **day,
        "run_at": float(day["run_at"]),
        "observed_peak_load": float(day["observed_peak_load"]),
        "margin": float(day["margin"]),
        "headroom_load": {str(p): float(h) for p, h in heads.items()},
    }


def load_plan(state: Path | None) -> Plan:
    """Every run plan-daily wrote under ``state`` (the newest :data:`MAX_DAYS`), and the newest
    readable run's curves."""
    plan = Plan()
    if state is None:
        plan.notes.append(
            "No daily what-if to show: start the dashboard with --plan DIR, the state directory of "
            "`retrywatch reproduce plan-daily --out DIR`."
        )
        return plan
    runs = state / RUNS_DIR
    try:
        dirs = sorted(d for d in runs.iterdir() if d.is_dir() and not d.is_symlink()) if runs.is_dir() else []
    except OSError as exc:
        plan.notes.append(f"{runs} cannot be listed: {exc}")
        return plan
    if not dirs:
        plan.notes.append(
            f"No daily run in {state} yet: plan-daily runs each day at its --at time (UTC), or now with "
            "--once or POST /run."
        )
        return plan
    if len(dirs) > MAX_DAYS:
        plan.notes.append(f"The newest {MAX_DAYS} of {len(dirs)} runs are shown.")
        dirs = dirs[-MAX_DAYS:]
    newest: tuple[Path, Any] | None = None
    for d in dirs:
        where = f"{RUNS_DIR}/{d.name}/{WHATIF}"
        if not (d / WHATIF).exists():
            plan.notes.append(f"{where}: not written (a run still under way, or one that failed); skipped.")
            continue
        try:
            body = read_json(d / WHATIF, state)
            plan.days.append({**_day(body, where), "dir": d})
            newest = (d, body)
        except BROKEN as exc:
            plan.notes.append(f"{exc}; skipped.")
    plan.days.sort(key=lambda day: day["run_at"])
    if newest is not None:
        try:
            plan.curves = whatif_curves(newest[0], newest[1])
        except BROKEN as exc:
            plan.notes.append(f"The newest run's curves cannot be drawn: {exc}")
    return plan


def whatif_curves(run: Path, body: Mapping[str, Any]) -> dict[str, Any]:
    """A run's curves as ``figures.whatif_curve_figure`` reads a what-if, from what plan-daily
    wrote in its ``whatif.json``: per policy its ``curves`` entry (every load its search ran,
    judged by the planner's ``curve``, and the loop onset and overload its ``marks`` found) and its
    ``headroom`` search, against the ``objective`` and ``criterion`` it recorded. A run written
    before plan-daily recorded its curves raises ``RunDirError`` saying so."""
    where = f"{RUNS_DIR}/{run.name}/{WHATIF}"
    curves, searches = body.get("curves"), body.get("headroom")
    if curves is None:
        raise RunDirError(
            f"{where} was written before plan-daily recorded its curves; the next run draws them"
        )
    if not isinstance(curves, Mapping) or not isinstance(searches, Mapping):
        raise RunDirError(f"{where}: 'curves' and 'headroom' must be objects")
    policies: dict[str, Any] = {}
    for policy, drawn in curves.items():
        if not isinstance(drawn, Mapping) or not isinstance(drawn.get("curve"), list):
            raise RunDirError(f"{where}: policy {policy!r} has no curve")
        points = [
            {**q, "load": float(q["load"]), **{f"{k}_share": float(q[f"{k}_share"] or 0.0) for k in SHARES}}
            for q in drawn["curve"]
        ]
        search = searches.get(policy)
        policies[str(policy)] = {
            "at_load": {},
            "curve": points,
            "headroom": dict(search) if isinstance(search, Mapping) else None,
            "loop_onset": _mark(drawn.get("loop_onset")),
            "overload": _mark(drawn.get("overload")),
        }
    objective = body.get("objective")
    if not isinstance(objective, Mapping) or "target" not in objective:
        raise RunDirError(f"{where}: no 'objective' with its target")
    criterion = body.get("criterion")
    return {
        "policies": policies,
        "objective": {"target": float(objective["target"])},
        "criterion": dict(criterion) if isinstance(criterion, Mapping) else None,
    }


def _mark(mark: Any) -> dict[str, Any]:
    """A curve's mark (its ``load``, None where not seen), checked for what the figure reads."""
    at = mark.get("load") if isinstance(mark, Mapping) else None
    return {**(mark if isinstance(mark, Mapping) else {}), "load": None if at is None else float(at)}


def answer(day: Mapping[str, Any]) -> str:
    """The newest day in one line: the policy that leaves the most, how much more than the policy
    in force, and the policy in force against the observed peak and the warning's margin."""
    heads: Mapping[str, float] = day["headroom_load"]
    in_force = str(day["policy_in_force"])
    peak, margin = float(day["observed_peak_load"]), float(day["margin"])
    best = max(heads, key=lambda p: (heads[p], p == in_force))
    mine = heads[in_force]
    against = (
        f"{in_force} leaves {mine / peak:.2f}x the observed peak ({peak:.3g}x Ĉ)"
        if peak > 0
        else f"{in_force} leaves {mine:.3g}x Ĉ (no peak observed)"
    )
    warns = peak > 0 and mine / peak < 1 + margin
    against += f"; the warning fires below {1 + margin:.2f}x" + (" (it does)" if warns else "")
    if best == in_force or heads[best] <= mine:
        return f"The policy in force, {in_force}, leaves the most headroom: {mine:.3g}x Ĉ. {against}."
    if mine <= 0:
        return (
            f"Policy {best} leaves {heads[best]:.3g}x Ĉ where the policy in force, {in_force}, leaves "
            f"none that meets the objective. {against}."
        )
    more = 100.0 * (heads[best] / mine - 1.0)
    return f"Policy {best} leaves {more:.0f} % more than the policy in force ({in_force}). {against}."


def layout(ctx: Context, query: dict[str, str] | None = None) -> html.Div:
    plan = load_plan(ctx.config.plan_dir)
    children: list[Any] = []
    if plan.days:
        newest = plan.days[-1]
        children.append(
            html.P(answer(newest), id="headroom-answer", style={"fontSize": "16px", "fontWeight": "600"})
        )
        children.append(
            html.P(
                f"Newest run: {newest.get('says', '')}; {len(plan.days)} run(s) under "
                f"{ctx.config.plan_dir}. Headroom: the peak load, in multiples of Ĉ, that traffic of the "
                "day's shape may reach under each policy and still meet the delivery objective.",
                style=style.STATUS,
            )
        )
    if plan.notes:
        children.append(html.Ul([html.Li(n) for n in plan.notes], id="headroom-notes", style=style.NOTE))
    if plan.days:
        children.append(
            dcc.Graph(
                id="graph-headroom-history",
                figure=figures.headroom_history_figure(plan.days),
                config=style.GRAPH_CONFIG,
            )
        )
    if plan.curves is not None:
        ratio = _peak_to_mean(plan.days[-1])
        children.append(
            html.P(
                "The newest run's curves: loads are the replay's mean load in multiples of Ĉ; its headroom "
                f"above is that mean load × the day's peak-to-mean ratio ({ratio}).",
                style=style.STATUS,
            )
        )
        children.append(
            dcc.Graph(
                id="graph-headroom-curves",
                figure=figures.whatif_curve_figure(plan.curves),
                config=style.GRAPH_CONFIG,
            )
        )
    return html.Div(children, id="headroom-page")


def _peak_to_mean(day: Mapping[str, Any]) -> str:
    window = day.get("window")
    if isinstance(window, Mapping) and window.get("mean_rate"):
        return f"{float(window['peak_rate']) / float(window['mean_rate']):.3g}"
    return "not recorded"


def register(app: dash.Dash, ctx: Context) -> None:
    """No callbacks: the page is read afresh at each visit (the runs change once a day)."""


PAGE = Page(key="headroom", path=PATH, name="Headroom", layout=layout, register=register)
