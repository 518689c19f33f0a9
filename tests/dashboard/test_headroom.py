"""The Headroom page against what the real ``retrywatch reproduce plan-daily`` writes: two tiny
daily runs on a synthetic recording (the planner's own test's), read back as the SQL history
holds them, the newest run's curves as the planner's own ``curve`` judges them, the one-line
answer, the layout, and bad or missing inputs as notes on the page."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dashboard import figures
from dashboard.context import Context, DashboardConfig
from dashboard.pages import PAGES, headroom
from detector.runbook import runbook_html
from reproduce.planner import daily
from reproduce.planner.whatif import WhatIf, curve, marks
from reproduce.workloads.plan import RunClock
from tests.reproduce.test_runner import SMALL


@pytest.fixture
def state(plan_dir: Path) -> Path:
    return plan_dir


def test_the_page_reads_the_planners_names() -> None:
    assert headroom.RUNS_DIR == daily.RUNS_DIR


def test_each_run_is_read_as_the_sql_history_holds_it(state: Path) -> None:
    plan = headroom.load_plan(state)
    assert plan.notes == []
    history = daily.History(f"sqlite:///{state / daily.HISTORY_FILE}")
    stored = list(reversed(history.days()))  # oldest first, as the page
    history.close()
    assert len(plan.days) == len(stored) == 2
    for got, want in zip(plan.days, stored, strict=True):
        assert got["run_at"] == pytest.approx(want.run_at)
        assert got["headroom_load"] == want.headroom
        assert got["policy_in_force"] == want.policy_in_force and got["margin"] == want.margin
        assert got["observed_peak_load"] == pytest.approx(want.observed_peak_load)
    assert [d["policy_in_force"] for d in plan.days] == ["default", "none"]


def test_the_newest_curves_are_the_planners_own(state: Path) -> None:
    """The curves drawn are what ``reproduce whatif``'s own ``curve`` and ``marks`` judge on the
    newest run's points (run nothing: every load is already there), as plan-daily recorded them."""
    plan = headroom.load_plan(state)
    assert plan.curves is not None
    newest = plan.days[-1]["dir"]
    body = json.loads((newest / "whatif.json").read_text())
    window = body["daily"]["window"]
    setup = _setup(state.parent / "rec", window["start_s"], window["end_s"])
    judged = curve(setup, ["none", "default"], newest)
    for policy, points in judged.items():
        mine = plan.curves["policies"][policy]
        assert [p["load"] for p in mine["curve"]] == [p["load"] for p in points]
        for got, want in zip(mine["curve"], points, strict=True):
            for key in ("within_deadline_share", "late_share", "failed_share", "state"):
                assert got[key] == want[key], (policy, got["load"], key)
        found = marks(points)
        assert mine["loop_onset"] == found["loop_onset"] and mine["overload"] == found["overload"]
        assert mine["headroom"]["headroom_load"] == body["headroom"][policy]["headroom_load"]
    fig = figures.whatif_curve_figure(plan.curves)
    assert {t.name for t in fig.data} == {"within the deadline", "late", "failed"}
    assert any("objective 98%" in a.text for a in fig.layout.annotations)
    assert any(a.text.startswith("headroom ") for a in fig.layout.annotations)


def _setup(recording: Path, start_s: float, end_s: float) -> WhatIf:
    """The what-if plan-daily ran (``dailycli``'s defaults, the test's options), on its window."""
    from reproduce.conditions import MODELS, ClientProfile, PulseWorkload
    from reproduce.registry import get_backend
    from reproduce.workloads.clients import parse_client
    from reproduce.workloads.trace import TraceWorkload

    spec = parse_client("study")
    setup = WhatIf(
        get_backend("sim", **SMALL), "sim", SMALL, MODELS[0], ClientProfile(name=spec.name, base=spec.config),
        PulseWorkload(), clock=RunClock(10.0), progress=False,
    )  # fmt: skip
    return replace(setup, workload=TraceWorkload(str(recording), "recording", 1.0, start_s, end_s + 1e-6))


def _day(heads: dict[str, float], in_force: str, peak: float = 1.0, margin: float = 0.25) -> dict[str, Any]:
    return {"headroom_load": heads, "policy_in_force": in_force, "observed_peak_load": peak, "margin": margin}


def test_the_answer_in_one_line() -> None:
    line = headroom.answer(_day({"default": 1.0, "coalescing": 1.5, "none": 0.5}, "default"))
    assert line.startswith("Policy coalescing leaves 50 % more than the policy in force (default).")
    assert "default leaves 1.00x the observed peak" in line and "fires below 1.25x (it does)" in line
    line = headroom.answer(_day({"default": 2.0, "none": 2.0}, "default"))
    assert line.startswith("The policy in force, default, leaves the most headroom: 2x Ĉ.")
    assert "(it does)" not in line
    line = headroom.answer(_day({"default": 0.0, "budget": 1.2}, "default"))
    assert line.startswith("Policy budget leaves 1.2x Ĉ where the policy in force, default, leaves none")


def test_the_history_figure_marks_the_peak_the_policy_in_force_and_the_margin(state: Path) -> None:
    days = headroom.load_plan(state).days
    fig = figures.headroom_history_figure(days)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {
        "none",
        "default",
        "policy in force",
        "observed peak",
        "warning below: peak × (1 + margin)",
    }
    assert list(by_name["policy in force"].text) == ["default", "none"]
    assert list(by_name["policy in force"].y) == [
        days[0]["headroom_load"]["default"],
        days[1]["headroom_load"]["none"],
    ]
    peaks = [d["observed_peak_load"] for d in days]
    assert list(by_name["observed peak"].y) == pytest.approx(peaks)
    assert list(by_name["warning below: peak × (1 + margin)"].y) == pytest.approx(
        [peaks[0] * 1.25, peaks[1] * 1.5]
    )
    assert "no daily run yet" in str(figures.headroom_history_figure([]).layout.annotations)


def _layout_text(plan_dir: Path | None) -> tuple[str, Any]:
    ctx = Context(DashboardConfig(detector_url="http://127.0.0.1:9", plan_dir=plan_dir))
    page = headroom.layout(ctx, {})
    ctx.detector.close()
    return str(page), page


def test_the_page_renders_with_a_stable_url_the_runbook_links(state: Path) -> None:
    assert next(p for p in PAGES if p.key == "headroom").path == headroom.PATH == "/headroom"
    text, _ = _layout_text(state)
    assert "graph-headroom-history" in text and "graph-headroom-curves" in text
    assert "The policy in force, none" in text or "more than the policy in force (none)" in text
    runbook = runbook_html(frozenset({daily.ALERT}))
    section = runbook[runbook.index(f'id="{daily.ALERT}"') :]
    end = section.find("<h2", 10)
    assert f"{headroom.PATH}</a>" in section[: end if end > 0 else None]  # in this section, linked


def test_missing_and_broken_inputs_are_notes_not_errors(state: Path, tmp_path: Path) -> None:
    text, _ = _layout_text(None)
    assert "start the dashboard with --plan DIR" in text and "graph-headroom" not in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No daily run in" in _layout_text(empty)[0]
    # a copy of the real state with one run corrupt, one a FIFO, one unfinished, the newest written
    # before plan-daily recorded its curves (and its points gone: the page never reads them)
    copy = tmp_path / "copy"
    shutil.copytree(state, copy, ignore=shutil.ignore_patterns("*.lock"))
    runs = sorted((copy / daily.RUNS_DIR).iterdir())
    (runs[0] / "whatif.json").write_text("{not json", encoding="utf-8")
    fifo_run = copy / daily.RUNS_DIR / "20990101T000000Z-w0-1"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "whatif.json")
    (copy / daily.RUNS_DIR / "20990102T000000Z-w0-1").mkdir()
    shutil.rmtree(runs[1] / "points")
    old = json.loads((runs[1] / "whatif.json").read_text())
    old = {k: v for k, v in old.items() if k in ("daily", "headroom")}  # what it wrote before
    (runs[1] / "whatif.json").write_text(json.dumps(old), encoding="utf-8")
    plan = headroom.load_plan(copy)
    assert len(plan.days) == 1 and plan.curves is None
    notes = "\n".join(plan.notes)
    assert "is not valid JSON" in notes and "not a regular file (a FIFO)" in notes
    assert "not written (a run still under way" in notes
    assert "curves cannot be drawn" in notes and "written before plan-daily recorded its curves" in notes
    text, _ = _layout_text(copy)
    assert (
        "headroom-notes" in text and "graph-headroom-history" in text and "graph-headroom-curves" not in text
    )
