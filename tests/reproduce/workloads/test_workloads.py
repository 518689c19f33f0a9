"""The workload seam: every registered kind plans, runs and is judged through one interface, and
the stepped load (``--steps``) runs end to end: plan, run, summary with its ground truth, validate,
the what-if, the dashboard's reading, and on the emulated engine through the real proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from dashboard.figures import run_collapses
from foundation.groundtruth import GroundTruth
from reproduce.conditions import RunSpec, block
from reproduce.judge.summary import run_entry
from reproduce.judge.validate import load_runs
from reproduce.sim.world import SimSpec, simulate
from reproduce.workloads.base import Shaping, Workload
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import RunClock
from reproduce.workloads.pulse import PulseWorkload
from reproduce.workloads.registry import WORKLOADS
from reproduce.workloads.steps import STEP_S, SteppedWorkload, StepsError, parse_steps
from reproduce.workloads.trace import TraceWorkload
from retrywatch.cli import main
from tests.reproduce.test_runner import SMALL

MODEL = "qwen2.5-7b-h100"
EXAMPLE = (
    Path(__file__).resolve().parents[3]
    / "reproduce"
    / "workloads"
    / "traces"
    / "data"
    / "retrywatch_example.csv"
)
#: One of each kind, at a load that collapses the small engine for a while.
SAMPLES: dict[str, Workload] = {
    "pulse": PulseWorkload(2.7),
    "trace": TraceWorkload(str(EXAMPLE), load=3.0),
    "steps": SteppedWorkload((0.5, 2.5), step_s=240.0),
}


def test_every_registered_kind_has_a_sample_here() -> None:
    assert set(WORKLOADS) == set(SAMPLES)  # a new kind: its module, its registration, a sample
    for kind, workload in SAMPLES.items():
        assert isinstance(workload, WORKLOADS[kind]) and isinstance(workload, Workload)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_kind_runs_and_is_judged_through_the_one_interface(kind: str) -> None:
    workload = SAMPLES[kind]
    assert workload.at_load(1.0).load == pytest.approx(1.0) and workload.at_load(1.0).kind == kind
    json.dumps(workload.describe())
    condition = block("composition").condition("no-control").with_workload(workload)
    assert condition.variant == workload.variant != ""
    spec = SimSpec(
        MODEL,
        condition,
        seed=3,
        capacity=SMALL["capacity"],
        clock=RunClock(10.0),
        workload={**SMALL["workload"], "max_context": 4096},
        engine=SMALL["engine"],
    )
    result = simulate(spec)
    entry = run_entry(
        run=RunSpec("b", condition, MODEL, 0, 3),
        backend="sim",
        capacity=result.capacity,
        plan=result.plan,
        calls=result.calls,
        snapshots=result.snapshots,
        series="runs/x/metrics.jsonl",
        duration_s=result.end_s,
    )
    truth = GroundTruth.from_entry(json.loads(json.dumps(entry)))
    assert truth.span.window_s == result.plan.window_s  # the plan's window, never K re-applied
    assert truth.collapses, f"{kind} at its load collapses the small engine"
    assert truth.overload is not None and entry["workload"] == {"kind": kind, "label": workload.label()}
    assert (entry["pulse"] is None) is (result.plan.pulse is None)


def test_a_trace_at_another_load_keeps_its_first_pass_and_pickles_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep over loads streams the trace once for its facts: ``at_load`` carries them, and so
    does the spec a worker is sent; a copy made before any pass streams its own."""
    import pickle

    scans: list[float] = []
    scan = TraceWorkload.scan

    def counted(self: TraceWorkload, *args: Any, **kwargs: Any) -> Any:
        scans.append(self.load)
        return scan(self, *args, **kwargs)

    monkeypatch.setattr(TraceWorkload, "scan", counted)
    base = TraceWorkload(str(EXAMPLE), load=1.0)
    early = base.at_load(2.0)
    facts = base.facts
    moved = base.at_load(3.0)
    assert moved.load == 3.0 and moved.facts is facts and moved.identity() == base.identity()
    sent = pickle.loads(pickle.dumps(moved))
    assert sent.facts == facts and sent == moved
    assert early.facts == facts and scans == [1.0, 2.0]  # the early copy streamed its own


def test_steps_parse_and_refuse_what_cannot_be_a_load() -> None:
    assert parse_steps(" 0.5, 1,1.5 ,2") == (0.5, 1.0, 1.5, 2.0)
    for bad in ("", "a,b", "1,0", "1,-2", "1,inf", "nan"):
        with pytest.raises(StepsError):
            parse_steps(bad)
    with pytest.raises(StepsError, match="seconds"):
        SteppedWorkload((1.0,), step_s=0.0)


def test_a_stepped_plan_holds_each_step_for_its_time_at_its_multiple() -> None:
    steps = SteppedWorkload((0.5, 1.0, 2.0), step_s=STEP_S)
    plan = steps.plan(3.0, ClientConfig(), seed=1, clock=RunClock(10.0), shaping=Shaping())
    assert [(p.name, p.start_s, p.end_s, p.multiple) for p in plan.phases] == [
        ("step1", 0.0, 30.0, 0.5),
        ("step2", 30.0, 60.0, 1.0),
        ("step3", 60.0, 90.0, 2.0),
    ]
    assert plan.pulse is None and plan.window_s == 6.0 and plan.tail_s > 0
    for phase in plan.phases:  # arrivals at the step's multiple of Ĉ (3 calls per run-second)
        n = sum(1 for c in plan.calls if c.phase == phase.name)
        assert n / (phase.end_s - phase.start_s) == pytest.approx(phase.multiple * 3.0, rel=0.25)
    assert steps.at_load(4.0).steps == (1.0, 2.0, 4.0)  # the shape kept, the top step at the load


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("steps")
    result = CliRunner().invoke(
        main,
        ["reproduce", "run", "--steps", "0.5,1,2", "--model", MODEL, "--runs", "1", "--seed", "5",
         "--time-scale", "4", "--out", str(out), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_a_stepped_run_records_its_ground_truth_and_validates(stepped: Path) -> None:
    (run,) = json.loads((stepped / "summary.json").read_text())["runs"]
    assert run["slug"] == f"composition__no-control-steps-0.5-1-2__{MODEL}__r0"
    assert run["settings"]["steps"] == [0.5, 1.0, 2.0] and run["settings"]["step_s"] == STEP_S
    assert [p["name"] for p in run["plan"]["phases"]] == ["step1", "step2", "step3"]
    assert run["pulse"] is None and run["collapses"], "2 Ĉ for 300 s collapses the engine"
    assert all(c["burst"]["start_s"] <= c["start_s"] for c in run["collapses"])
    assert run["judged"]["window_s"] == 15.0 and run["judged"]["pulse"] is None
    (info,) = load_runs(stepped)
    assert info.truth is not None and info.truth.collapses == GroundTruth.from_entry(run).collapses
    result = CliRunner().invoke(main, ["reproduce", "validate", str(stepped)])
    assert result.exit_code == 0, result.output
    report = json.loads((stepped / "validation.json").read_text())
    assert report["runs"][0]["collapses"] == run["collapses"]  # read, not recomputed
    assert report["alerts"]["VLLMCallsNotDeliveredInTime"]["collapses"] == len(run["collapses"])
    assert report["runs"][0]["trace"] is True  # no pulse: aligned on the burst behind its collapse
    assert "1 of the runs have no pulse" in (stepped / "validation.md").read_text()
    drawn = run_collapses(run)  # the dashboard shades the same collapses
    assert [(c.start_s, c.end_s) for c in drawn] == [(c["start_s"], c["end_s"]) for c in run["collapses"]]


def test_a_whatif_steps_the_load_under_each_policy(tmp_path: Path) -> None:
    options = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
    result = CliRunner().invoke(
        main,
        ["reproduce", "whatif", "--steps", "0.5,1", "--step-s", "240", "--load", "3", "--policies",
         "none,coalescing", "--time-scale", "10", "--out", str(tmp_path), "--no-progress", *options],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "whatif.json").read_text())
    assert body["load"] == 3.0 and body["workload"] == {"steps": [1.5, 3.0], "step_s": 240.0}
    assert body["setup"]["workload"]["kind"] == "steps"
    at = {p: body["policies"][p]["at_load"] for p in body["policies"]}
    assert at["none"]["collapses"] >= 1 and at["none"]["calls"] > 0


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--steps", "1,x"], "--steps"),
        (["--steps", "1,0"], "--steps"),
        (["--step-s", "60", "--block", "diagnostic"], "--step-s"),
        (["--steps", "1", "--trace", str(EXAMPLE)], "--trace"),
        (["--steps", "1", "--pulse-multiple", "2"], "--pulse-multiple"),
        (["--steps", "1", "--step-s", "0"], "--step-s"),
    ],
)
def test_usage_mistakes_of_steps_exit_2_naming_the_option(
    args: list[str], option: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(main, ["reproduce", "run", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and option in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_emulated_engine_steps_through_the_real_proxy(tmp_path: Path) -> None:
    """Two short steps on the emulated engine through the real proxy and client at K = 20: the
    same plan, the same ground truth record (~20 s)."""
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--backend", "emulated",
        "--steps", "0.3,0.6", "--step-s", "60", "--time-scale", "20",
        "--model", MODEL, "--runs", "1", "--seed", "101", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr
    (run,) = json.loads((out / "summary.json").read_text())["runs"]
    assert run["backend"] == "emulated" and run["pulse"] is None
    assert [p["name"] for p in run["plan"]["phases"]] == ["step1", "step2"]
    assert run["calls"]["offered"] > 20 and run["calls"]["delivered"] == run["calls"]["offered"]
    assert run["collapses"] == [] and run["recovered"] is True  # below Ĉ: nothing to collapse
    assert GroundTruth.from_entry(run).span.window_s == 3.0
