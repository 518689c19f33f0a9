"""The runner: parallel runs, summary.json's contract, series files, reruns into one folder, one
writer per folder at a time, and jobs capped at the cores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from foundation.rundir import RunDirError, read_summary
from foundation.timeseries import read_series
from reproduce.conditions import expand
from reproduce.dirlock import LOCK_FILE
from reproduce.registry import BackendNotFound, backend_names, get_backend
from reproduce.runner import cap_jobs, run_many, usable_cores
from reproduce.workloads.plan import RunClock

# A small engine and short prompts so a scaled run takes a fraction of a second: Ĉ = 9.77 calls/s
# by the simulator's own calibration; its KV cache holds about 50 prompts, as the study's engine
# held a few dozen of its 12,000-token prompts (a cache holding every retried prompt would make
# retries nearly free).
SMALL: dict[str, Any] = {
    "capacity": 9.77,
    "engine": {
        "step_time": {
            "fixed_s": 0.002,
            "per_prompt_token_s": 1e-4,
            "per_running_s": 0.0,
            "per_context_token_s": 0.0,
        },
        "max_model_len": 4096,
        "num_gpu_blocks": 4000,
    },
    "workload": {"prompt_mean": 1200, "prompt_std": 0, "shared_prefix_len": 200, "response_median": 20},
}

CLOCK = RunClock(10.0)  # every run here at K = 10

CONTRACT = {
    "block", "condition", "model", "run", "seed", "capacity", "pulse_multiple", "recovered",
    "recovery_time_s", "delivery", "rates_x_capacity", "retries", "executions",
    "waiting_over_littles_law", "prompt_token_gap_hold", "series", "pulse", "deadline_s",
    "duration_s", "time_scale", "backend",
}  # fmt: skip


def test_parallel_runs_write_the_summary_contract(tmp_path: Path) -> None:
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1, seed=2)
    entries = run_many(get_backend("sim", **SMALL), runs, tmp_path, jobs=2, clock=CLOCK, progress=False)
    assert [e["condition"] for e in entries] == [r.condition.slug for r in runs]
    summary = read_summary(tmp_path)
    assert len(summary["runs"]) == 4 and summary["meta"]["backend"] == "sim"
    for entry in summary["runs"]:
        assert set(entry) >= CONTRACT, CONTRACT - set(entry)
        assert set(entry["delivery"]) == {"pulse", "hold", "primary"}
        assert {"within_deadline", "by_horizon"} <= set(entry["delivery"]["pulse"])
        assert set(entry["rates_x_capacity"]) == {
            "attempts", "executions_created", "executions_accepted", "executions_completed",
        }  # fmt: skip
        assert {"total", "refused", "attached"} == set(entry["retries"])
        assert {
            "created",
            "accepted",
            "refused_by_engine",
            "dropped_at_proxy",
            "cancelled",
            "completed",
            "orphaned",
        } <= set(entry["executions"])
        assert entry["deadline_s"] == pytest.approx(12.0) and entry["time_scale"] == 10
        assert entry["pulse"] == {"start_s": pytest.approx(12.0), "end_s": pytest.approx(22.7)}
        series = list(read_series(tmp_path / entry["series"]))
        assert series[-1].t == pytest.approx(entry["duration_s"])
        assert (tmp_path / entry["series"]).parent.name == entry["slug"]
    by_condition = {e["condition"]: e for e in summary["runs"]}
    assert by_condition["retries-off-cancel-off"]["recovered"]
    assert not by_condition["retries-on-cancel-off"]["recovered"]


def test_parallel_and_serial_agree_and_reruns_replace_by_slug(tmp_path: Path) -> None:
    runs = expand("composition", models="qwen2.5-7b-h100", runs=1, conditions=["no-control", "coalescing"])
    serial = run_many(get_backend("sim", **SMALL), runs, tmp_path / "a", jobs=1, clock=CLOCK, progress=False)
    parallel = run_many(
        get_backend("sim", **SMALL), runs, tmp_path / "a", jobs=2, clock=CLOCK, progress=False
    )

    def strip(e: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in e.items() if k not in ("wall_s", "cpu_s")}

    assert [strip(e) for e in serial] == [strip(e) for e in parallel]
    assert len(read_summary(tmp_path / "a")["runs"]) == 2  # replaced, not appended
    other = expand("deferral", models="qwen2.5-7b-h100", runs=1, conditions=["deferred-cancellation"])
    run_many(get_backend("sim", **SMALL), other, tmp_path / "a", clock=CLOCK, progress=False)
    assert len(read_summary(tmp_path / "a")["runs"]) == 3  # another block's run is added


def test_backend_registry_and_errors(tmp_path: Path) -> None:
    assert "sim" in backend_names()
    with pytest.raises(BackendNotFound, match="unknown backend"):
        get_backend("nope")
    with pytest.raises(ValueError, match="jobs"):
        run_many(get_backend("sim"), expand("diagnostic", runs=1)[:1], tmp_path, jobs=0)
    with pytest.raises(RunDirError, match="does not exist"):
        read_summary(tmp_path / "missing")
    (tmp_path / "summary.json").write_text(json.dumps({"nope": 1}))
    with pytest.raises(RunDirError, match="runs"):
        read_summary(tmp_path)


def test_a_summary_that_cannot_be_read_stops_the_runs_and_stays(tmp_path: Path) -> None:
    # It was taken for no summary and replaced: every run it listed was lost.
    (tmp_path / "summary.json").write_text('{"runs": [{"slug": "earlier"}]')  # cut short
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1)[:1]
    with pytest.raises(RunDirError, match="not valid JSON"):
        run_many(get_backend("sim", **SMALL), runs, tmp_path, clock=CLOCK, progress=False)
    assert (tmp_path / "summary.json").read_text() == '{"runs": [{"slug": "earlier"}]'
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_FILE) == ["summary.json"]


def test_nothing_is_created_before_the_backend_accepts_the_runs(tmp_path: Path) -> None:
    from reproduce.engine.presets import PresetError

    runs = expand("diagnostic", models="gpt-9", runs=1)[:1]
    with pytest.raises(PresetError, match="gpt-9"):
        run_many(get_backend("sim"), runs, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_validation_and_a_report_of_earlier_runs_are_removed_with_them(tmp_path: Path) -> None:
    # They described the runs before, and the dashboard's Experiments page showed them beside the new.
    from foundation.rundir import DERIVED

    for name in DERIVED:
        (tmp_path / name).write_text("of the runs before\n")
    (tmp_path / "notes.txt").write_text("the operator's\n")
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1)[:1]
    run_many(get_backend("sim", **SMALL), runs, tmp_path, clock=CLOCK, progress=False)
    assert not any((tmp_path / name).exists() for name in DERIVED)
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "summary.json").exists()


# Holds DIR's lock, as a sweep writing it does, until killed.
_HOLDER = (
    "import sys, time; from pathlib import Path; from reproduce.dirlock import hold\n"
    "with hold(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)\n"
)


def test_a_dir_being_written_is_refused_at_once_and_free_again_when_its_writer_dies(tmp_path: Path) -> None:
    # Two invocations into one DIR each rewrote the summary from what it read first: runs lost.
    from click.testing import CliRunner

    from reproduce.cli import reproduce

    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1)
    run_many(get_backend("sim", **SMALL), runs[:1], tmp_path, clock=CLOCK, progress=False)
    before = (tmp_path / "summary.json").read_text()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        options = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
        result = CliRunner().invoke(
            reproduce,
            ["run", "--block", "diagnostic", "--model", "qwen2.5-7b-h100", "--runs", "1",
             "--time-scale", "10", "--no-progress", *options, "--out", str(tmp_path)],
        )  # fmt: skip
        assert result.exit_code == 2 and f"pid {holder.pid}" in result.output, result.output
        assert (tmp_path / "summary.json").read_text() == before  # nothing run, nothing lost
        holder.send_signal(signal.SIGKILL)  # the kernel releases its lock
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait()
    run_many(get_backend("sim", **SMALL), runs[1:2], tmp_path, clock=CLOCK, progress=False)
    assert [r["slug"] for r in read_summary(tmp_path)["runs"]] == [r.slug for r in runs[:2]]


def test_jobs_are_capped_at_the_usable_cores() -> None:
    notes: list[str] = []
    cores = usable_cores()
    assert cap_jobs(cores, notes.append) == cores and not notes
    assert cap_jobs(cores + 7, notes.append) == cores
    assert notes == [f"--jobs {cores + 7} capped to {cores}: the cores this process may use"]
