"""``retrywatch reproduce``: run, report, validate wiring and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from retrywatch.cli import main
from tests.reproduce.test_runner import SMALL

TRACE = (
    Path(__file__).resolve().parents[2]
    / "reproduce"
    / "workloads"
    / "traces"
    / "data"
    / "mooncake_conversation_4min.jsonl"
)


def small_options() -> list[str]:
    out: list[str] = []
    for key, value in SMALL.items():
        out += ["--backend-option", f"{key}={json.dumps(value)}"]
    return out


def test_run_then_report(tmp_path: Path) -> None:
    runner = CliRunner()
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-off-cancel-off", "--condition", "retries-on-cancel-off",
        "--runs", "1", "--seed", "3", "--jobs", "2", "--out", str(tmp_path), "--time-scale", "10",
        "--no-progress", *small_options(),
    ]  # fmt: skip
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 runs (1 recovered)" in result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {r["seed"] for r in summary["runs"]} == {3}
    assert all((tmp_path / r["series"]).is_file() for r in summary["runs"])
    result = runner.invoke(main, ["reproduce", "report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report.html").is_file()
    # Run again into the same DIR: the report of the earlier runs was deleted without a word.
    report = (tmp_path / "report.md").read_text()
    again = subprocess.run(
        [sys.executable, "-m", "retrywatch", *args], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"Error: Invalid value for '--out': {tmp_path} holds report.md, report.html of its earlier runs, "
        "which a new run removes: pass --force to run into it anyway, or pick another DIR"
    )
    assert (tmp_path / "report.md").read_text() == report
    result = runner.invoke(main, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "report.html").exists()


def test_pulse_multiple_overrides_every_runs_pulse(tmp_path: Path) -> None:
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-off-cancel-off", "--runs", "1", "--out", str(tmp_path), "--time-scale", "10",
        "--pulse-multiple", "4.5", "--no-progress", *small_options(),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (entry,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert (entry["condition"], entry["variant"]) == ("retries-off-cancel-off", "pulse-4.5")
    assert entry["pulse_multiple"] == 4.5
    result = CliRunner().invoke(main, [*args[: -len(small_options()) - 3], "--pulse-multiple", "0"])
    assert result.exit_code != 0 and "--pulse-multiple" in result.output


def test_lazy_subcommands_are_wired() -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["reproduce", "--help"])
    assert result.exit_code == 0
    for name in ("calibrate", "run", "report", "validate", "setup-vllm-cpu"):
        assert name in result.output
    result = runner.invoke(main, ["reproduce", "validate", "--help"])
    assert result.exit_code == 0, result.output
    assert "DIR" in result.output


def test_clear_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["reproduce", "run", "--out", str(tmp_path), "--no-progress"]
    result = runner.invoke(main, [*base, "--block", "nope"])
    assert result.exit_code != 0 and "nope" in result.output
    result = runner.invoke(main, [*base, "--block", "diagnostic", "--condition", "nope"])
    assert result.exit_code != 0 and "no condition 'nope'" in result.output
    result = runner.invoke(main, [*base, "--block", "diagnostic", "--backend", "nope"])
    assert result.exit_code != 0 and "unknown backend" in result.output
    result = runner.invoke(main, [*base, "--block", "diagnostic", "--backend-option", "novalue"])
    assert result.exit_code != 0 and "KEY=VALUE" in result.output
    result = runner.invoke(main, [*base, "--block", "diagnostic", "--backend-option", "bogus=1"])
    assert result.exit_code != 0 and "bogus" in result.output
    result = runner.invoke(main, ["reproduce", "report", str(tmp_path)])
    # A directory no run wrote is a usage mistake (exit 2, as validate's), and nothing is written.
    assert result.exit_code == 2 and "Invalid value for 'DIR'" in result.output, result.output
    assert "summary.json" in result.output and not (tmp_path / "report.md").exists()


def test_numbers_that_are_not_finite_are_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["reproduce", "run", "--out", str(tmp_path / "out"), "--no-progress", "--block", "diagnostic"]
    for extra, why in (
        (["--time-scale", "nan"], "nan is not a finite number."),
        (["--time-scale", "inf"], "inf is not in the range 0.001<=x<=1000.0."),
        (["--pulse-multiple", "nan"], "nan is not a finite number."),
    ):
        result = runner.invoke(main, [*base, *extra])
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{extra[0]}': {why}" in result.output
    result = runner.invoke(main, ["reproduce", "calibrate", "--start-rate", "nan"])
    assert result.exit_code == 2 and "'--start-rate': nan is not a finite number." in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(main, ["emulate", "--time-scale", "nan"])  # it named --model
    assert result.exit_code == 2 and "'--time-scale': nan is not a finite number." in result.output


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    runner = CliRunner()
    args = [
        "reproduce",
        "run",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--block",
        "diagnostic",
        "--model",
        "gpt-9",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code != 0 and "gpt-9" in result.output and "Traceback" not in result.output
    result = runner.invoke(main, ["reproduce", "calibrate", "--model", "gpt-9"])
    assert result.exit_code != 0 and "gpt-9" in result.output


def _one_line_usage_error(result: Any, option: str) -> None:
    """Exit 2, no traceback, and the error's one line naming ``option``."""
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and f"Invalid value for '{option}'" in error[0], result.output


def test_usage_mistakes_of_run_exit_2_naming_the_option_and_create_nothing(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    base = ["reproduce", "run", "--out", str(out), "--no-progress", "--block", "diagnostic"]
    one = ["--condition", "retries-off-cancel-off"]
    # unbounded: ten million runs' specs were built before the first ran
    _one_line_usage_error(runner.invoke(main, [*base, *one, "--runs", "10000000"]), "--runs")
    base += ["--runs", "1"]
    for extra, option in (
        (["--model", "gpt-9"], "--model"),  # it created DIR, then exited 1
        (["--model", "gpt-9", "--backend-option", "capacity=2"], "--model"),  # a worker's failure
        (["--condition", "nope"], "--condition"),
        (["--backend", "nope"], "--backend"),
        (["--backend-option", "bogus=1"], "--backend-option"),
        (["--backend", "vllm", "--backend-option", "python=x"], "--backend-option"),  # needs capacity=
        (["--gpu"], "--gpu"),
        (["--engine-url", "http://127.0.0.1:9"], "--engine-url"),
        (["--seed", "-1"], "--seed"),  # it exited 1 after creating DIR
        (["--jobs", "100000"], "--jobs"),  # unbounded: a process per run
        (["--time-scale", "1e308"], "--time-scale"),  # it ran, with overflows, to 0 recoveries
        (["--time-scale", "1e-300"], "--time-scale"),
        (["--pulse-multiple", "1e308"], "--pulse-multiple"),  # a traceback
        # the simulator's options failed only in a run: exit 1, or a worker's traceback
        (["--backend-option", "capacity=NaN"], "--backend-option"),
        (["--backend-option", "capacity=0"], "--backend-option"),
        (["--backend-option", 'capacity="abc"'], "--backend-option"),
        (["--backend-option", 'workload={"bogus": 1}'], "--backend-option"),
        (["--backend-option", "workload=3"], "--backend-option"),
        (["--backend-option", 'engine={"bogus": 1}'], "--backend-option"),
        (["--backend-option", "client=3"], "--backend-option"),
        (["--client", "gpt"], "--client"),
        (["--client", "retries=-1"], "--client"),
        (["--client", "openai-sdk,backoff=fast"], "--client"),
    ):
        result = runner.invoke(main, [*base, *one, *extra])
        _one_line_usage_error(result, option)
        assert not out.exists(), extra


def test_an_empty_or_unusable_out_is_a_usage_error(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    base = ["reproduce", "run", "--no-progress", "--block", "diagnostic", "--runs", "1"]
    for out in ("", str(a_file / "out"), str(a_file)):
        # "" used to mean the current directory: the runs were written into it
        result = runner.invoke(main, [*base, "--condition", "retries-off-cancel-off", "--out", out])
        _one_line_usage_error(result, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_summary_that_cannot_be_read_is_never_replaced(tmp_path: Path) -> None:
    # It was replaced by the new run's summary: every run it listed was lost.
    (tmp_path / "summary.json").write_text('{"runs": [{"slug": "earlier"}]')  # cut short
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-off-cancel-off", "--runs", "1", "--out", str(tmp_path), "--time-scale", "10",
        "--no-progress", *small_options(),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    _one_line_usage_error(result, "--out")
    assert "summary.json" in result.output and "move it away" in result.output
    assert (tmp_path / "summary.json").read_text() == '{"runs": [{"slug": "earlier"}]'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_calibrate_saves_c_and_says_how_run_takes_it(tmp_path: Path, monkeypatch: Any) -> None:
    """Ĉ was printed, never saved, and nothing said that `run` ignores it (it runs at the study's
    Ĉ of the preset): the hint it prints is taken by `run` as it is written."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["reproduce", "calibrate", "--model", "qwen2.5-7b-h100"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "out" / "calibration-qwen2.5-7b-h100.json").read_text())
    assert saved["model"] == "qwen2.5-7b-h100" and saved["stages"]
    capacity = f"{saved['capacity']:.3f}"
    assert f"C = {capacity} calls/s" in result.output
    hint = result.output.strip().splitlines()[-1]
    assert hint == (
        "saved to out/calibration-qwen2.5-7b-h100.json; `reproduce run` runs at the study's Ĉ of "
        "qwen2.5-7b-h100, 2.78 calls/s, unless given this one: retrywatch reproduce run --model "
        f"qwen2.5-7b-h100 --backend-option capacity={capacity} ..."
    )
    args = hint.split("retrywatch ", 1)[1].removesuffix(" ...").split()
    args += ["--block", "diagnostic", "--condition", "retries-off-cancel-off", "--runs", "1", "--out", "runs"]
    small: list[str] = []  # SMALL's engine, at the hint's Ĉ (not SMALL's)
    for key, value in SMALL.items():
        small += ["--backend-option", f"{key}={json.dumps(value)}"] if key != "capacity" else []
    result = CliRunner().invoke(main, [*args, "--time-scale", "10", "--no-progress", *small])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads((tmp_path / "runs" / "summary.json").read_text())["runs"]
    assert entry["capacity"] == float(capacity)


def test_usage_mistakes_of_calibrate_exit_2_naming_the_option() -> None:
    runner = CliRunner()
    for extra, option in (
        (["--model", "gpt-9"], "--model"),
        (["--backend", "emulated"], "--backend"),
        (["--tokens-per-step", "0"], "--tokens-per-step"),
        (["--tokens-per-step", "16"], "--tokens-per-step"),  # below the preset's sequences
        (["--seed", "-1"], "--seed"),
        (["--start-rate", "1e308"], "--start-rate"),  # a traceback
    ):
        _one_line_usage_error(runner.invoke(main, ["reproduce", "calibrate", *extra]), option)


def test_usage_mistakes_of_calibrate_http_exit_2_before_any_engine_starts(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["reproduce", "calibrate-http", "--workdir", str(tmp_path / "work")]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for extra, option in (
        (["--time-scale", "nan"], "--time-scale"),  # accepted
        (["--start-rate", "nan"], "--start-rate"),
        (["--start-rate", "inf"], "--start-rate"),
        (["--backend", "emulated", "--engine-url", "http://127.0.0.1:9"], "--engine-url"),  # ignored
        (["--backend", "emulated", "--gpu"], "--gpu"),
        (["--backend", "external", "--engine-url", "http://127.0.0.1:9", "--nice", "5"], "--nice"),
        (["--out", ""], "--out"),
        (["--out", str(a_file / "c.json")], "--out"),  # found only after the whole calibration
        (["--window", "0:60"], "--window"),  # needs --trace
        (["--trace", str(a_file)], "--trace"),  # not a trace
        (["--trace", str(TRACE), "--window", "60:0"], "--window"),
    ):
        _one_line_usage_error(runner.invoke(main, [*base, *extra]), option)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_emulate_and_run_share_the_time_scale_bounds(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    for command in (["emulate"], ["reproduce", "run", "--block", "diagnostic", "--out", str(out)]):
        _one_line_usage_error(runner.invoke(main, [*command, "--time-scale", "0.0001"]), "--time-scale")
        _one_line_usage_error(runner.invoke(main, [*command, "--time-scale", "1001"]), "--time-scale")
    assert not out.exists()


def test_emulate_names_the_option_its_value_is_wrong_for() -> None:
    from foundation.processes import free_port

    runner = CliRunner()
    port = ["--port", str(free_port())]  # checked free before the preset is built
    # A budget below the preset's sequences was reported as "Invalid value for --model".
    result = runner.invoke(main, ["emulate", *port, "--max-num-batched-tokens", "1"])
    _one_line_usage_error(result, "--max-num-batched-tokens")
    _one_line_usage_error(runner.invoke(main, ["emulate", *port, "--model", "gpt-9"]), "--model")
    # An empty served name was taken for none: the engine answered to the preset's name instead.
    result = runner.invoke(main, ["emulate", *port, "--served-model-name", ""])
    _one_line_usage_error(result, "--served-model-name")


def test_a_condition_named_twice_runs_once(tmp_path: Path) -> None:
    # It ran twice, both runs writing the same files, and summary.json listed it twice.
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "diagnostic",
        "--condition", "retries-on-cancel-off", "--condition", "retries-off-cancel-off",
        "--condition", "retries-on-cancel-off", "--runs", "1", "--jobs", "2", "--out", str(tmp_path),
        "--time-scale", "10", "--no-progress", *small_options(),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2 runs" in result.output
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [r["condition"] for r in runs] == ["retries-on-cancel-off", "retries-off-cancel-off"]


def test_setup_vllm_cpu_refuses_bad_values_before_installing_anything(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, option in (
        ([""], "VENV"),  # the current directory: a venv made inside it
        ([str(tmp_path / "v"), "--timeout", "nan"], "--timeout"),
        ([str(tmp_path / "v"), "--timeout", "-1"], "--timeout"),
    ):
        _one_line_usage_error(runner.invoke(main, ["reproduce", "setup-vllm-cpu", *args]), option)
    assert not any(tmp_path.iterdir())
