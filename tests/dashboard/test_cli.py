"""``retrywatch dashboard``: options, environment variables and clear errors (the served app
itself is exercised as a real process in test_real_detector.py)."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from foundation.processes import free_port
from retrywatch.cli import main
from tests.exporter.support import endless_head


def test_help_lists_the_options() -> None:
    result = CliRunner().invoke(main, ["dashboard", "--help"])
    assert result.exit_code == 0
    for option in ("--detector", "--prometheus", "--runs", "--plan", "--host", "--port", "--refresh"):
        assert option in result.output
    assert "127.0.0.1" in result.output  # loopback by default


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(main, ["dashboard", "--runs", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    missing = runner.invoke(main, ["dashboard", "--plan", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "'--plan'" in missing.output and "does not exist" in missing.output
    bad_url = runner.invoke(main, ["dashboard", "--detector", "ops:s3cretpw@localhost:8200"])
    assert bad_url.exit_code == 2 and "http://" in bad_url.output and "s3cretpw" not in bad_url.output
    env = runner.invoke(main, ["dashboard", "--refresh", "0.5"], env={"RETRYWATCH_DETECTOR_URL": "http://x"})
    assert env.exit_code == 2 and "0.5" in env.output


def test_bad_values_name_their_option() -> None:
    runner = CliRunner()
    for args, error in (
        # the URLs' errors named no option ("Invalid value: detector URL must ...")
        (["--detector", ""], "Error: Invalid value for '--detector': must start with http:// or "
         "https://, got ''"),
        (["--prometheus", "ftp://x"], "Error: Invalid value for '--prometheus': must start with http:// or "
         "https://, got 'ftp://x'"),
        # a refresh of 1e308 s was accepted
        (["--refresh", "1e308"], "Error: Invalid value for '--refresh': 1e+308 is not in the range "
         "1.0<=x<=3600.0."),
    ):  # fmt: skip
        result = runner.invoke(main, ["dashboard", "--port", "1", *args])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines()[-1] == error


def test_a_refresh_that_is_not_a_number_is_a_usage_error() -> None:
    # NaN passes click.FloatRange's bound: the dashboard used to start with a NaN refresh.
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "retrywatch", "dashboard", "--port", str(port), "--refresh", "nan"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        result.stderr.strip().splitlines()[-1]
        == "Error: Invalid value for '--refresh': nan is not a finite number."
    )
    assert result.stdout == ""


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


def test_it_is_served_by_a_production_server_quietly(tmp_path: Path) -> None:
    port, detector = free_port(), free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "dashboard", "--port", str(port),
         "--detector", f"http://127.0.0.1:{detector}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                page = httpx.get(url + "/", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        layout = httpx.get(url + "/_dash-layout", timeout=10)
    finally:
        proc.terminate()
        proc.wait(10)
    assert page.status_code == 200 and layout.status_code == 200
    assert page.headers["server"] == "uvicorn"  # the bounded server; never Werkzeug's development one
    # One start line; no development-server warning, no Dash banner, no line per request.
    assert log.read_text().splitlines() == [
        f"retrywatch dashboard on {url}/ (detector http://127.0.0.1:{detector}); state: none of its own"
    ]


def test_a_taken_port_is_one_line_before_the_app_is_announced() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "retrywatch", "dashboard", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): pick another with --port"
    ]


def test_it_bounds_its_clients_and_sigterm_ends_it_cleanly(tmp_path: Path) -> None:
    """On waitress a head sent a byte at a time held its connection as long as it kept coming."""
    port = free_port()
    log = tmp_path / "dashboard.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "dashboard", "--port", str(port), "--detector", "http://127.0.0.1:9"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not _answers(url + "/"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert endless_head(port, "/").split(b" ", 2)[1] == b"431"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
            slow.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: ")
            started, answer = time.monotonic(), b""
            while not answer and time.monotonic() - started < 25:
                slow.sendall(b"a")  # a byte a second: never idle, never complete
                readable, _, _ = select.select([slow], [], [], 1.0)
                answer = slow.recv(4096) if readable else b""
            assert answer.split(b" ", 2)[1:2] == [b"408"], answer[:200]
        # a callback's body past the bound: 413 (Flask's MAX_CONTENT_LENGTH), not read whole
        json_type = {"content-type": "application/json"}
        callback = f"{url}/_dash-update-component"
        big = httpx.post(callback, content=b"x" * (5 << 20), headers=json_type, timeout=30)
        assert big.status_code == 413
        assert _answers(url + "/")  # and it goes on serving
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
