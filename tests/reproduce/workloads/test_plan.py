"""The run plan: a run is planned once from its workload and judged on the phases it ran."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from reproduce.workloads.calls import WorkloadSpec, generate_trace
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import Phase, PlanError, RunClock, RunPlan, outline, plan_run
from retrywatch.cli import main


def test_a_run_with_custom_phases_is_judged_on_the_phases_it_ran(tmp_path: Path) -> None:
    # base 60 s, pulse 50 s at 2.7 Ĉ, hold 300 s, at K = 10: the pulse runs 6.0-11.0 s, the hold to 41 s.
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-on-cancel-off", "--runs", "1", "--time-scale", "10", "--no-progress",
        "--backend-option", 'workload={"phases":[[60,0.6],[50,2.7],[300,0.6]]}', "--out", str(tmp_path),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (entry,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert entry["pulse"] == {"start_s": pytest.approx(6.0), "end_s": pytest.approx(11.0)}
    assert entry["hold_end_s"] == pytest.approx(41.0)
    phases = entry["plan"]["phases"]
    assert [p["name"] for p in phases] == ["base", "pulse", "hold"]
    assert [b for p in phases for b in (p["start_s"], p["end_s"])] == pytest.approx([0, 6, 6, 11, 11, 41])
    assert entry["plan"]["deadline_s"] == pytest.approx(12.0) == entry["deadline_s"]

    # The cohorts are the calls the workload planned in each phase.
    lines = (tmp_path / "runs" / entry["slug"] / "attempts.jsonl").read_text().splitlines()
    calls = [json.loads(line) for line in lines]
    by_phase = {name: [c for c in calls if c["phase"] == name] for name in ("base", "pulse", "hold")}
    assert all(6.0 <= c["planned_at"] < 11.0 for c in by_phase["pulse"])
    assert all(11.0 <= c["planned_at"] < 41.0 for c in by_phase["hold"])
    assert entry["delivery"]["pulse"]["offered"] == len(by_phase["pulse"]) > 0
    assert entry["delivery"]["hold"]["offered"] == len(by_phase["hold"]) > 0

    # Recovery is judged on the hold that ran: five 6-s windows from the pulse's end, each
    # holding the calls planned in it, and `recovered` needs two consecutive good ones.
    windows = entry["recovery_windows"]
    assert [b for w in windows for b in (w["start_s"], w["end_s"])] == pytest.approx(
        [b for i in range(5) for b in (11.0 + 6 * i, 17.0 + 6 * i)]
    )
    for w in windows:
        assert w["calls"] == sum(w["start_s"] <= c["planned_at"] < w["end_s"] for c in calls) > 0
    good = [w["ok"] for w in windows]
    assert entry["recovered"] == any(a and b for a, b in itertools.pairwise(good))


def test_custom_phases_without_a_pulse_are_a_usage_error_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-on-cancel-off", "--runs", "1", "--no-progress",
        "--backend-option", 'workload={"phases":[[60,0.6],[50,2.7]]}', "--out", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "no phase named 'pulse'" in result.output and "phase_names" in result.output
    assert not out.exists()


def test_the_study_plan_at_two_time_scales() -> None:
    study = plan_run(WorkloadSpec(capacity=1.0), ClientConfig())
    timeline = study.timeline()
    assert (timeline.pulse_start, timeline.pulse_end, timeline.hold_end) == (120.0, 227.0, 947.0)
    assert (study.deadline_s, study.horizon_s, timeline.window_s) == (120.0, 840.0, 60.0)
    fast = plan_run(WorkloadSpec(capacity=1.0), ClientConfig(deadline_s=60.0), RunClock(10.0))
    # Every duration divided once: the client's deadline and backoff, the phases, the windows.
    assert fast.deadline_s == pytest.approx(6.0) == fast.timeline().deadline_s
    assert fast.client.backoff_max_s == pytest.approx(0.3)
    assert fast.timeline().pulse_end == pytest.approx(22.7) and fast.timeline().window_s == pytest.approx(6.0)
    assert [c.arrival_s for c in fast.calls] == pytest.approx([c.arrival_s / 10 for c in study.calls])
    # The detector's settings and the recovery rule's growth limit in the run's seconds, recorded
    # for the judges and the dashboard to read back.
    described = fast.describe()
    assert described["max_growth_per_s"] == pytest.approx(0.1)
    assert described["detector"]["windows"]["rate_s"] == pytest.approx(6.0)
    assert described["detector"]["assumed_deadline_s"] == pytest.approx(12.0)
    with pytest.raises(PlanError, match="time scale must be a finite number > 0"):
        RunClock(0.0)


def test_a_workload_without_a_pulse_plans_calls_but_has_no_pulse_to_judge() -> None:
    spec = WorkloadSpec(capacity=2.0, phases=((30.0, 0.5), (30.0, 1.0)), phase_names=("warm", "steady"))
    plan = plan_run(spec, ClientConfig())
    assert plan.pulse is None and [p.name for p in plan.phases] == ["warm", "steady"]
    with pytest.raises(PlanError, match="no phase named 'pulse'"):
        plan.timeline()
    # A replayed trace: calls without phases fit the same plan.
    replay = RunPlan(calls=tuple(generate_trace(spec)), client=ClientConfig())
    assert replay.phases == () and replay.describe()["calls"] == len(plan.calls)
    with pytest.raises(PlanError, match="phases: none"):
        replay.timeline()
    last = RunPlan(
        calls=(), client=ClientConfig(), phases=(Phase("base", 0, 10, 0.6), Phase("pulse", 10, 20, 2.7))
    )
    with pytest.raises(PlanError, match="after its pulse"):
        last.timeline()


def test_an_outline_is_the_runs_plan_without_its_calls_in_run_seconds() -> None:
    spec = WorkloadSpec(capacity=2.0, seed=3)
    planned, outlined = (
        plan_run(spec, ClientConfig(), RunClock(4.0)),
        outline(spec, ClientConfig(), RunClock(4.0)),
    )
    assert outlined.calls == () and planned.calls
    assert outlined.describe() == {**planned.describe(), "calls": 0}
    assert outlined.deadline_s == pytest.approx(ClientConfig().deadline_s / 4.0)
    assert outlined.run_s(60.0) == pytest.approx(15.0)
    assert outlined.run_rate(2.0) == pytest.approx(8.0)  # Ĉ per study second -> per run-second
    assert outlined.clock.plan_spec(spec, ClientConfig()) == planned  # the same clock, the same run


def test_the_clock_converts_both_ways_and_records_what_it_reads_back() -> None:
    clock = RunClock(4)
    assert clock.k == 4.0 and isinstance(clock.k, float)  # an int K is the same clock as its float
    assert clock.run_s(60.0) == 15.0 and clock.study_s(15.0) == 60.0
    assert clock.run_rate(2.0) == 8.0 and clock.study_rate(8.0) == 2.0
    assert clock.record() == {"time_scale": 4.0} and RunClock.of_record(clock.record()) == clock
    assert clock.argv() == ["--time-scale", "4.0"] and RunClock().argv() == []  # K = 1: every child's default
    third = RunClock(1 / 3)
    assert float(third.argv()[1]) == third.k  # exact: a child runs at the run's K, not a rounding of it
    for bad in (True, 0, -1.0, math.inf, math.nan, "4"):
        with pytest.raises(PlanError, match="time scale must be a finite number > 0"):
            RunClock(bad)  # type: ignore[arg-type]
