"""``retrywatch reproduce``: run, report, validate wiring and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from retrywatch.cli import main
from tests.reproduce.test_runner import SMALL


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
    assert result.exit_code != 0 and "summary.json" in result.output


def test_numbers_that_are_not_finite_are_usage_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["reproduce", "run", "--out", str(tmp_path / "out"), "--no-progress", "--block", "diagnostic"]
    for extra in (["--time-scale", "nan"], ["--time-scale", "inf"], ["--pulse-multiple", "nan"]):
        result = runner.invoke(main, [*base, *extra])
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{extra[0]}': {extra[1]} is not a finite number." in result.output
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
