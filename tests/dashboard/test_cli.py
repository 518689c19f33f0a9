"""``retrywatch dashboard``: options, environment variables and clear errors (the served app
itself is exercised as a real process in test_real_detector.py)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from retrywatch.cli import main


def test_help_lists_the_options() -> None:
    result = CliRunner().invoke(main, ["dashboard", "--help"])
    assert result.exit_code == 0
    for option in ("--detector", "--prometheus", "--runs", "--host", "--port", "--refresh"):
        assert option in result.output
    assert "127.0.0.1" in result.output  # loopback by default


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["dashboard", "--runs", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    bad_url = runner.invoke(main, ["dashboard", "--detector", "localhost:8200"])
    assert bad_url.exit_code == 2 and "http://" in bad_url.output
    env = runner.invoke(main, ["dashboard", "--refresh", "0.5"], env={"RETRYWATCH_DETECTOR_URL": "http://x"})
    assert env.exit_code == 2 and "0.5" in env.output
