"""``retrywatch dashboard``: options, environment variables and clear errors (the served app
itself is exercised as a real process in test_real_detector.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from exporter.processes import free_port
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
    bad_url = runner.invoke(main, ["dashboard", "--detector", "ops:s3cretpw@localhost:8200"])
    assert bad_url.exit_code == 2 and "http://" in bad_url.output and "s3cretpw" not in bad_url.output
    env = runner.invoke(main, ["dashboard", "--refresh", "0.5"], env={"RETRYWATCH_DETECTOR_URL": "http://x"})
    assert env.exit_code == 2 and "0.5" in env.output


def test_the_startup_line_masks_credentials(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "dashboard", "--port", str(port),
         "--detector", "http://ops:s3cretpw@127.0.0.1:9", "--prometheus", "http://127.0.0.1:9?token=TOKEN123"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "retrywatch dashboard on" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
    out = log.read_text()
    assert "(detector http://ops:***@127.0.0.1:9, Prometheus http://127.0.0.1:9?token=***)" in out
    assert "s3cretpw" not in out and "TOKEN123" not in out
