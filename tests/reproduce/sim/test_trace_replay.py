"""A request trace replayed as a run: the plan, Ĉ on the trace's mix, the ground truth, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from foundation import metricnames as mn
from foundation.timeseries import read_series
from reproduce.calibrate import CalibrationError
from reproduce.cli import TRACE_BLOCK, TRACE_CONDITION
from reproduce.conditions import block, expand
from reproduce.harness.protocol import cpu_scaled, study
from reproduce.judge.groundtruth import JudgedSpan, burst_before
from reproduce.judge.validate import load_runs
from reproduce.sim.backend import SimBackend, trace_mix_capacity
from reproduce.sim.engine_link import Engine
from reproduce.workloads.calls import segment_token_ids
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import RunClock
from reproduce.workloads.trace import MAX_REPLAY_S, TraceWorkload, plan_trace
from reproduce.workloads.tracecapacity import CACHE_ENV, trace_capacity
from reproduce.workloads.traces import TraceError, mean_rate, read_trace, to_trace_calls, window
from retrywatch.cli import main

DATA = Path(__file__).resolve().parents[3] / "reproduce" / "workloads" / "traces" / "data"
AZURE = DATA / "azure_code_2023_30min.csv.gz"
MOONCAKE = DATA / "mooncake_conversation_4min.jsonl"
EXAMPLE = DATA / "retrywatch_example.csv"
MODEL = "qwen2.5-7b-h100"


def test_a_window_is_planned_at_its_load_with_its_burst_shape() -> None:
    workload = TraceWorkload(str(AZURE), load=2.0, start_s=600.0, end_s=1200.0)
    plan = plan_trace(workload, 10.0, ClientConfig())
    raw = [r.arrival_s for r in window(read_trace(AZURE), 600.0, 1200.0)]
    times = [c.arrival_s for c in plan.calls]
    assert len(times) == len(raw) == workload.facts.calls
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(20.0)  # 2 x Ĉ
    factor = times[-1] / raw[-1]
    assert all(t == pytest.approx(r * factor) for t, r in zip(times, raw, strict=True))  # shape kept
    assert workload.facts.source_rate == pytest.approx(mean_rate(window(read_trace(AZURE), 600.0, 1200.0)))
    assert [p.name for p in plan.phases] == ["trace"] and plan.pulse is None
    assert plan.tail_s > 0


def test_prefix_blocks_reach_the_engine_as_shared_segments() -> None:
    plan = plan_trace(TraceWorkload(str(MOONCAKE)), 3.0, ClientConfig())
    expected = {
        c.planned.call_id: c.segments for c in to_trace_calls(read_trace(MOONCAKE), max_context=32_768)
    }
    assert plan.segments  # Mooncake's hash_ids
    assert all(plan.prompt_segments(c) == expected[c.call_id] for c in plan.calls)
    first_blocks = [plan.prompt_segments(c)[0][0] for c in plan.calls]
    assert len(set(first_blocks)) < len(first_blocks)  # calls share their leading block


def test_a_scaled_protocol_scales_a_traces_lengths_and_blocks_and_keeps_them_shared() -> None:
    """On a CPU engine (``cpu_scaled``) a replay's lengths are divided by K as the study's are,
    prefix blocks too, so calls still share the leading blocks the trace says they share, and
    the HTTP client sends them as the same token IDs (what vLLM's prefix cache matches)."""
    k = 10.0
    workload = TraceWorkload(str(MOONCAKE), end_s=60.0)
    condition = block(TRACE_BLOCK).condition(TRACE_CONDITION)
    condition = replace(condition, workload=workload)
    study_plan = study(RunClock(k)).plan(3.0, condition, seed=1)
    cpu_plan = cpu_scaled(RunClock(k)).plan(3.0, condition, seed=1)
    assert [c.arrival_s for c in cpu_plan.calls] == [c.arrival_s for c in study_plan.calls]
    assert cpu_plan.client.deadline_s == pytest.approx(120.0 / k)
    for full, scaled in zip(study_plan.calls, cpu_plan.calls, strict=True):
        assert scaled.prompt_len == sum(n for _, n in cpu_plan.prompt_segments(scaled))
        if full.prompt_len + full.response_len < 8_192:  # neither cut to its engine's context
            blocks = len(cpu_plan.prompt_segments(scaled))  # each rounded on its own
            assert scaled.prompt_len == pytest.approx(full.prompt_len / k, abs=blocks)
            assert scaled.response_len == max(1, round(full.response_len / k))
    a, b = cpu_plan.calls[0], cpu_plan.calls[1]
    seg_a, seg_b = cpu_plan.prompt_segments(a), cpu_plan.prompt_segments(b)
    assert seg_a[0] == seg_b[0] and seg_a[1] != seg_b[1]  # the trace's first block, and only it
    ids_a = segment_token_ids(seg_a, 32_000, seed=1)
    ids_b = segment_token_ids(seg_b, 32_000, seed=1)
    shared = seg_a[0][1]
    assert len(ids_a) == a.prompt_len and ids_a[:shared] == ids_b[:shared] and ids_a[shared] != ids_b[shared]
    assert segment_token_ids(seg_a, 32_000, seed=1) == ids_a  # a retry sends the same prompt
    # prompts are cut to the protocol's context (8,192 tokens on the CPU engine)
    assert max(c.prompt_len + c.response_len for c in study_plan.calls) > 8_192 // 2
    tiny = replace(cpu_scaled(RunClock(k)), max_context=64)
    assert all(c.prompt_len + c.response_len <= 64 for c in tiny.plan(3.0, condition, seed=1).calls)


def test_the_token_mix_is_digested_and_sampled_whatever_the_load() -> None:
    a = TraceWorkload(str(AZURE), load=1.0).facts
    b = TraceWorkload(str(AZURE), load=3.0).facts
    c = TraceWorkload(str(AZURE), load=1.0, end_s=600.0).facts
    assert a.mix_digest == b.mix_digest != c.mix_digest
    assert len(a.mix) == a.calls == 5_740 and a.mean_prompt_tokens < 3_000
    small = TraceWorkload(str(AZURE)).scan(sample=100)
    assert len(small.mix) == 100 and small.mix_digest == a.mix_digest


def test_a_window_without_two_calls_is_a_clear_error() -> None:
    with pytest.raises(TraceError, match=r"window 100000:200000 holds 0 call\(s\)"):
        _ = TraceWorkload(str(AZURE), start_s=100_000, end_s=200_000).facts
    with pytest.raises(TraceError, match="load"):
        TraceWorkload(str(AZURE), load=0.0)


def test_capacity_is_calibrated_on_the_trace_mix_and_cached(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    config = Engine.for_preset(MODEL).model.config
    facts = TraceWorkload(str(EXAMPLE)).facts
    first = trace_capacity(MODEL, config, facts)
    again = trace_capacity(MODEL, config, facts)
    assert not first.cached and again.cached and again.capacity == first.capacity
    assert "token mix" in first.method and "§5" in first.method
    # Shorter prompts than the study's 12,000 tokens: a higher Ĉ than the preset's 2.78.
    assert first.capacity > 2.78
    assert facts.mix_digest in first.key and MODEL in first.key
    (tmp_path / "capacity.json").write_text("{not json")
    assert not trace_capacity(MODEL, config, facts).cached  # an unreadable cache: recalibrated


def test_a_traces_capacity_stated_beforehand_is_the_one_its_sim_run_runs_at(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    workload = TraceWorkload(str(EXAMPLE))
    spec = expand(TRACE_BLOCK, models=MODEL, runs=1, conditions=[TRACE_CONDITION])[0]
    run = replace(spec, condition=spec.condition.with_workload(workload))
    tokens_per_step = run.condition.engine.tokens_per_step
    stated, how = trace_mix_capacity(MODEL, workload.facts, tokens_per_step=tokens_per_step)
    ran, ran_how = SimBackend().capacity_of(run)
    assert ran == stated and not how.get("cached") and ran_how.get("cached")  # one calibration, one entry


def test_a_mix_too_short_to_calibrate_names_the_option_that_gives_capacity(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    short = tmp_path / "short.csv"
    short.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i},8,1\n" for i in range(50)))
    config = Engine.for_preset(MODEL).model.config
    with pytest.raises(CalibrationError) as info:
        trace_capacity(MODEL, config, TraceWorkload(str(short)).facts)
    message = str(info.value)
    assert "(mean prompt 8, mean output 1 tokens) did not saturate" in message
    assert message.endswith("give Ĉ with --backend-option capacity=C (calls/s)")


def test_a_load_may_not_stretch_a_replay_past_its_bound() -> None:
    workload = TraceWorkload(str(EXAMPLE), load=1e-9)
    assert workload.replay_span_s(10.0) == pytest.approx(119 / 1e-8)
    with pytest.raises(TraceError, match=r"at load 1e-09 x Ĉ \(10 calls/s\) its 120 calls would replay over"):
        workload.calls(10.0)
    slowest = 119 / MAX_REPLAY_S / 10.0  # the lowest load that fits at Ĉ = 10
    TraceWorkload(str(EXAMPLE), load=slowest * 1.01).check_capacity(10.0)
    with pytest.raises(TraceError, match="raise --load or take a shorter --window"):
        TraceWorkload(str(EXAMPLE), load=slowest * 0.99).check_capacity(10.0)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_pipe_is_refused_as_a_replays_trace_without_waiting_for_it(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.pipe"
    os.mkfifo(fifo)  # no writer: opening it would wait
    with pytest.raises(
        TraceError, match=r"not a regular file \(a pipe or a device\): a replay reads its trace twice"
    ):
        _ = TraceWorkload(str(fifo)).facts


def _span(deadline: float = 120.0, window: float = 60.0) -> JudgedSpan:
    return JudgedSpan(0.0, 2_000.0, 0.0, window, deadline, 1.0)


def test_the_burst_is_the_busiest_stretch_within_a_deadline_and_a_window_before() -> None:
    steady = [float(t) for t in range(0, 1_000)]
    early = [100.0 + i / 100 for i in range(500)]  # out of reach of a collapse at 600
    burst = [450.0 + i / 20 for i in range(300)]  # 450-465
    planned = sorted(steady + early + burst)
    start, end = burst_before(planned, 600.0, _span())
    assert 405.0 <= start <= 450.0 and end == start + 60.0  # holds the whole burst
    # A collapse at 160 reaches back to 0: the early cluster is its burst.
    start, _ = burst_before(planned, 160.0, _span())
    assert 40.0 <= start <= 100.0
    # Nothing planned in reach: the stretch ending at the collapse's start.
    assert burst_before([], 600.0, _span()) == (540.0, 600.0)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Azure slice at 3 Ĉ: the study's client through a plain proxy (one run, ~4 s)."""
    out = tmp_path_factory.mktemp("replay")
    args = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--trace", str(AZURE), "--load", "3",
        "--model", MODEL, "--runs", "1", "--seed", "101", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, CACHE_ENV: str(out / "cache")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return out


def test_a_replay_has_no_pulse_and_names_the_burst_behind_each_collapse(replayed: Path) -> None:
    (run,) = json.loads((replayed / "summary.json").read_text())["runs"]
    assert run["slug"] == "composition__no-control-azure_code_2023_30min-load3__qwen2.5-7b-h100__r0"
    assert run["pulse"] is None and run["hold_end_s"] is None
    assert run["settings"]["load"] == 3.0 and run["settings"]["trace"] == "azure_code_2023_30min"
    source = run["capacity_source"]
    assert source["capacity"] == run["capacity"] and "token mix" in source["method"]
    assert run["calls"]["offered"] == 5_740
    collapses = run["collapses"]
    assert collapses, "3 Ĉ over the slice's busiest minutes collapses the engine"
    for c in collapses:
        assert c["burst"]["start_s"] <= c["start_s"]
        assert c["burst"]["end_s"] - c["burst"]["start_s"] == pytest.approx(60.0)
    assert run["burst"]["start_s"] == pytest.approx(collapses[0]["burst"]["start_s"], abs=1e-3)
    assert any(c["metastable"] for c in collapses)  # retries on, cancellation off: the loop
    assert run["recovered"] is all(c["ended"] for c in collapses)
    assert 0 < run["delivery"]["trace"]["within_deadline"] < 1


def test_validate_scores_a_replay_against_its_collapses(replayed: Path) -> None:
    (info,) = load_runs(replayed)
    (run,) = json.loads((replayed / "summary.json").read_text())["runs"]
    assert info.trace and info.pulse_start_s == pytest.approx(run["burst"]["start_s"])
    assert info.truth is not None and info.truth.span.align_s == 0.0 and info.truth.span.pulse_end_s is None
    result = CliRunner().invoke(main, ["reproduce", "validate", str(replayed)])
    assert result.exit_code == 0, result.output
    report = json.loads((replayed / "validation.json").read_text())
    assert report["ground_truth"]["collapses"] == len(run["collapses"])
    assert report["ground_truth"]["agrees_with_recovered"] == 1
    assert [c["start_s"] for c in report["runs"][0]["collapses"]] == [c["start_s"] for c in run["collapses"]]
    symptom = report["alerts"]["VLLMCallsNotDeliveredInTime"]
    assert symptom["collapses"] == len(run["collapses"]) and symptom["recall"] is not None
    assert report["alerts"]["VLLMMetastableRetryLoop"]["runs_metastable"] == 1
    # The pulse's figures say how to read them on a trace, which has none.
    assert report["runs"][0]["trace"] is True
    assert (
        '1 of the runs have no pulse (a replayed trace, a stepped load): for them, read every "pulse"'
        in (replayed / "validation.md").read_text()
    )


def test_a_bad_trace_is_one_line_naming_row_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0.1,10,5\n0.2,x,5\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrywatch",
            "reproduce",
            "run",
            "--trace",
            str(bad),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: Invalid value for '--trace': {bad}: line 3, column 'prompt_tokens': not a number: 'x'"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "arrival_s,prompt_tokens,output_tokens,call_id\n"
            + "".join(f"{i},10,5,same\n" for i in range(200)),
            "line 3, column 'call_id': 'same' is also the call id of line 2; a trace has one row per call",
        ),
        (
            '{"arrival_s": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
            "line 1: not JSON that can be read (nested too deeply)",
        ),
    ],
)
def test_a_trace_the_replay_cannot_take_is_a_usage_error(tmp_path: Path, text: str, expected: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    result = CliRunner().invoke(main, ["reproduce", "run", "--trace", str(bad), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Invalid value for '--trace': {bad}: {expected}" in result.output
    assert not (tmp_path / "o").exists()


def test_a_load_that_stretches_the_replay_too_far_is_refused_before_any_run(tmp_path: Path) -> None:
    args = ["reproduce", "run", "--trace", str(EXAMPLE), "--load", "1e-9", "--backend-option", "capacity=1"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    assert (
        result.output.strip()
        .splitlines()[-1]
        .startswith(
            f"Error: TraceError: {EXAMPLE}: at load 1e-09 x Ĉ (1 calls/s) its 120 calls would replay over"
        )
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("extra", "hint"),
    [
        (["--block", "diagnostic", "--load", "2"], "'--load': needs --trace FILE"),
        (["--trace", str(AZURE), "--window", "5:1"], "'--window': a window needs 0 <= START < END"),
        (["--trace", str(AZURE), "--pulse-multiple", "2"], "'--pulse-multiple': a trace replay has no pulse"),
        (
            ["--trace", str(AZURE), "--backend", "vllm", "--backend-option", "python=x"],
            "on a trace's own mix with --trace FILE",
        ),
        ([], "'--block': give a block to run"),
    ],
)
def test_usage_mistakes_of_a_replay_exit_2_naming_the_option(
    tmp_path: Path, extra: list[str], hint: str
) -> None:
    result = CliRunner().invoke(main, ["reproduce", "run", "--out", str(tmp_path / "o"), *extra])
    assert result.exit_code == 2, result.output
    assert hint in result.output
    assert not (tmp_path / "o").exists()


def test_the_report_of_a_replay_shows_its_one_cohort(replayed: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    out.mkdir()
    (out / "summary.json").write_text((replayed / "summary.json").read_text())
    for path in (replayed / "runs").rglob("*.jsonl"):
        target = out / path.relative_to(replayed)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    result = CliRunner().invoke(main, ["reproduce", "report", str(out)])
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "| trace delivery |" in report and "pulse delivery" not in report
    assert (out / "report.html").is_file()


@pytest.mark.slow
def test_the_emulated_engine_replays_a_trace_through_the_real_proxy(tmp_path: Path) -> None:
    """A minute of the Mooncake slice at half of Ĉ on the emulated engine, through the real proxy
    and client at K = 20 (~25 s): Ĉ is the simulator's on the trace's mix x K, every call is
    delivered, and the trace's shared prefix blocks reach the engine's prefix cache."""
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--backend", "emulated",
        "--trace", str(MOONCAKE), "--window", "0:60", "--load", "0.5", "--time-scale", "20",
        "--model", MODEL, "--runs", "1", "--seed", "101", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    (run,) = json.loads((out / "summary.json").read_text())["runs"]
    assert run["backend"] == "emulated" and run["pulse"] is None
    assert run["capacity_source"]["method"].startswith("the simulator's Ĉ of")
    offered = run["calls"]["offered"]
    assert offered > 50 and run["calls"]["delivered"] == offered
    last = list(read_series(out / run["series"]))[-1]
    assert (last.value(mn.VLLM_PREFIX_CACHE_HITS) or 0.0) > 0
