"""Real runs beside the simulator (``reproduce.harness.compare``): the fit from probes, the
engine model of vLLM on CPU, its calibration, and the table, on synthetic summaries."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from reproduce.conditions import expand
from reproduce.harness.calibration import trace_mix
from reproduce.harness.compare import (
    COLUMNS,
    MeasuredEngine,
    StepProbe,
    comparison_rows,
    comparison_table,
    cpu_engine_config,
    sim_calibration,
    simulate_beside,
    simulate_runs,
    step_time_from_probe,
)
from reproduce.harness.models import model_info
from reproduce.harness.protocol import cpu_scaled
from reproduce.workloads.plan import RunClock
from reproduce.workloads.trace import TraceWorkload
from reproduce.workloads.tracecapacity import mix_stage_calls

#: About what the ``small`` configuration measures on a 2-core machine.
PROBE = StepProbe(256, 0.05, 2_048, 0.30, 0.012, 32, 0.040)
MOONCAKE = (
    Path(__file__).resolve().parents[3]
    / "reproduce"
    / "workloads"
    / "traces"
    / "data"
    / "mooncake_conversation_4min.jsonl"
)


def _entry(condition: str, *, recovered: bool, created: int, orphaned: int) -> dict[str, Any]:
    return {
        "condition": condition,
        "capacity": 6.5,
        "recovered": recovered,
        "rates_x_capacity": {
            "executions_created": 2.4 if not recovered else 0.6,
            "executions_completed": 0.97,
        },
        "delivery": {
            "pulse": {"within_deadline": 0.4},
            "hold": {"within_deadline": 0.0 if not recovered else 0.9},
        },
        "executions": {"created": created, "orphaned": orphaned},
    }


def test_step_time_from_probe_splits_prompt_and_sequence_costs() -> None:
    step = step_time_from_probe(PROBE)
    assert step.per_prompt_token_s == pytest.approx(0.25 / 1_792)
    assert step.per_running_s == pytest.approx(0.028 / 31)
    assert step.fixed_s == pytest.approx(0.012 - 0.028 / 31)
    # A lone full chunk costs what the probe measured, to within the fixed cost.
    assert step.fixed_s + 2_048 * step.per_prompt_token_s == pytest.approx(0.30, abs=0.05)
    with pytest.raises(ValueError, match="longer second prompt"):
        step_time_from_probe(StepProbe(256, 0.05, 256, 0.05, 0.01, 32, 0.04))


def test_cpu_engine_config_has_vllm_cpu_scheduler_settings() -> None:
    info = model_info("small")
    config = cpu_engine_config(info, step_time_from_probe(PROBE), kv_cache_gib=1)
    assert (config.block_size, config.max_num_batched_tokens, config.max_num_seqs) == (128, 2_048, 128)
    # 1 GiB of KV for 4 layers x 4 KV heads x 64 x 2 (K, V) x 2 bytes = 4 KiB per token.
    assert config.num_gpu_blocks == 1024**3 // (128 * 4_096)
    assert config.model_name == "small"


def test_simulated_calibration_and_runs_of_the_scaled_protocol() -> None:
    protocol = cpu_scaled(RunClock(10.0))
    config = cpu_engine_config(model_info("small"), step_time_from_probe(PROBE))
    result = sim_calibration(config, protocol, 3.0)
    assert result.capacity > 0
    saturated = [s for s in result.stages if s.saturated]
    assert saturated and result.capacity == max(s.completion_rate for s in saturated)
    (loop,) = expand("diagnostic", models="small", runs=1, conditions=["retries-on-cancel-off"])
    (retries_off,) = expand("diagnostic", models="small", runs=1, conditions=["retries-off-cancel-off"])
    entries = simulate_runs([loop, retries_off], config, protocol, result.capacity)
    assert [e["condition"] for e in entries] == ["retries-on-cancel-off", "retries-off-cancel-off"]
    assert all(e["capacity"] == result.capacity and e["time_scale"] == 10 for e in entries)
    assert all(e["deadline_s"] == pytest.approx(12.0) for e in entries)
    # Without retries an execution is created per call only: retries can only add executions.
    loop_e, off_e = entries
    assert off_e["retries"]["total"] == 0
    assert loop_e["executions"]["created"] >= off_e["executions"]["created"]


def test_comparison_rows_pair_each_real_run_with_its_simulation() -> None:
    real = [
        _entry("retries-on-cancel-off", recovered=False, created=900, orphaned=300),
        _entry("deferred-cancellation", recovered=True, created=400, orphaned=0),
    ]
    sim = [
        _entry("deferred-cancellation", recovered=True, created=380, orphaned=2),
        _entry("retries-on-cancel-off", recovered=False, created=1_000, orphaned=500),
    ]
    rows = comparison_rows(real, sim)
    assert [(r["condition"], r["world"]) for r in rows] == [
        ("retries-on-cancel-off", "vLLM CPU"),
        ("retries-on-cancel-off", "simulator"),
        ("deferred-cancellation", "vLLM CPU"),
        ("deferred-cancellation", "simulator"),
    ]
    assert rows[0]["orphaned share"] == pytest.approx(300 / 900)
    assert rows[1]["orphaned share"] == pytest.approx(0.5)
    table = comparison_table(rows).splitlines()
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(table) == 2 + len(rows)
    assert table[2].startswith(
        "| retries-on-cancel-off | vLLM CPU | 6.50 | no | 2.40 | 0.97 | 0.40 | 0.00 | 0.33 |"
    )
    with pytest.raises(ValueError, match="no simulated run of condition 'retries-on-cancel-off'"):
        comparison_rows(real, sim[:1])


def test_no_execution_created_gives_no_orphaned_share() -> None:
    entry = _entry("retries-off-cancel-off", recovered=True, created=0, orphaned=0)
    (row, _) = comparison_rows([entry], [entry])
    assert row["orphaned share"] is None
    assert "| – |" in comparison_table([row])


def test_a_trace_on_the_engine_model_at_the_protocols_token_scale() -> None:
    """A trace replayed beside a real vLLM (``reproduce.harness.tracecompare``): the engine
    model is calibrated on the trace's mix as the protocol sends it (lengths x its token scale)
    and replays the trace at its own Ĉ, judged on its collapses; the table takes a trace's columns."""
    protocol = cpu_scaled(RunClock(10.0))
    workload = TraceWorkload(str(MOONCAKE), None, 3.0, 0.0, 60.0)
    mix = trace_mix(workload, protocol)
    unscaled = workload.scaled_mix(1.0)
    assert len(mix) == len(unscaled)
    assert sum(p for p, _ in mix) < 0.2 * sum(p for p, _ in unscaled)  # x0.1, cut to the context
    assert all(p < protocol.max_context and p + o <= protocol.max_context for p, o in mix)
    config = cpu_engine_config(model_info("small"), step_time_from_probe(PROBE))
    stage_calls = mix_stage_calls(mix)
    # the engine as if it were its model: the simulator calibrates from its first stage again
    measured = MeasuredEngine(PROBE, sim_calibration(config, protocol, 2.0, stage_calls=stage_calls), config)
    (spec,) = expand("composition", models="small", runs=1, conditions=["no-control"])
    run = replace(spec, condition=replace(spec.condition, workload=workload, variant=workload.variant))
    lines: list[str] = []
    (entry,) = simulate_beside(measured, [run], protocol, log=lines.append, stage_calls=stage_calls)
    assert lines == [f"simulator: Ĉ = {measured.calibration.capacity:.3f} calls/s by the same calibration"]
    assert entry["capacity"] == measured.calibration.capacity
    assert entry["pulse"] is None and entry["calls"]["offered"] == len(mix)
    assert entry["collapses"], "3 Ĉ for a minute of trace, a deadline of 12 s: a collapse"
    table = comparison_table(comparison_rows([entry], [entry]))
    header = table.splitlines()[0]
    assert "collapses" in header and "pulse within deadline" not in header
    assert f"{entry['collapses'][0]['start_s']:.0f}→" in table


def test_tracecompare_refuses_bad_input_before_any_engine_starts(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from reproduce.harness.tracecompare import main

    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n")
    used = tmp_path / "used"
    used.mkdir()
    (used / "summary.json").write_text("{}")
    out = ["--out", str(tmp_path / "out")]
    for extra, option in (
        (["--trace", str(bad), *out], "'--trace'"),
        (["--trace", str(MOONCAKE), "--window", "5:1", *out], "'--window'"),
        (["--trace", str(MOONCAKE), "--condition", "nope", *out], "'--condition'"),
        (["--trace", str(MOONCAKE), "--out", str(used)], "'--out'"),
        (["--trace", str(MOONCAKE), "--load", "0", *out], "'--load'"),
    ):
        result = CliRunner().invoke(main, extra)
        assert result.exit_code == 2, (extra, result.output)
        assert option in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
