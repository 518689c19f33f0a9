"""Processes the project starts itself (``foundation.processes``): bounded by ``timeout``, awaited on
HTTP, stopped by PID with their children, their log quoted when they fail."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundation.processes import ManagedProcess, ProcessStartError, free_port

# A server that also starts a grandchild (as vLLM starts its engine core), writing its PID.
SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_start_wait_ready_and_stop_kills_the_whole_group(tmp_path: Path) -> None:
    port = free_port()
    child_pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", SERVER, str(port), str(child_pid_file)]
    proc = ManagedProcess(argv, log_path=tmp_path / "server.log", bound_s=60, name="test server")
    assert proc.command()[:3] == ["timeout", "--kill-after=10", "60"]
    with proc:
        waited = proc.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=30, poll_s=0.1)
        assert waited < 30
        assert proc.poll() is None
        child = int(child_pid_file.read_text())
        assert _alive(child)
    assert proc.poll() is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[16])  # field 19, after "pid (comm)"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_niceness_reaches_the_server_and_its_children(tmp_path: Path) -> None:
    port = free_port()
    child_pid_file = tmp_path / "child.pid"
    argv = [sys.executable, "-c", SERVER, str(port), str(child_pid_file)]
    own = os.nice(0)
    proc = ManagedProcess(argv, log_path=tmp_path / "server.log", bound_s=60, name="niced", niceness=7)
    with proc:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", timeout_s=30, poll_s=0.1)
        child = int(child_pid_file.read_text())
        assert _niceness(child) == min(19, own + 7)  # the engine core of a vLLM inherits it too
        autogroup = Path(f"/proc/{child}/autogroup")
        if autogroup.exists():  # autogroup scheduling: the session's niceness is what counts
            assert autogroup.read_text().split()[-1] == "7"
    with pytest.raises(ValueError, match="niceness"):
        ManagedProcess(argv, log_path=tmp_path / "x.log", bound_s=60, niceness=-5)
    with pytest.raises(ValueError, match="niceness"):
        ManagedProcess(argv, log_path=tmp_path / "x.log", bound_s=60, niceness=20)


def test_a_server_that_dies_reports_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    proc = ManagedProcess(argv, log_path=tmp_path / "dead.log", bound_s=30, name="dying")
    with proc, pytest.raises(ProcessStartError, match="exited with code 3") as info:
        proc.wait_ready(f"http://127.0.0.1:{free_port()}/health", timeout_s=20, poll_s=0.1)
    assert "no model here" in str(info.value)


def test_a_server_never_ready_is_stopped_at_the_startup_timeout(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    proc = ManagedProcess(argv, log_path=tmp_path / "slow.log", bound_s=60, name="slow")
    proc.start()
    with pytest.raises(ProcessStartError, match="not ready"):
        proc.wait_ready(f"http://127.0.0.1:{free_port()}/health", timeout_s=0.5, poll_s=0.1)
    assert proc.poll() is not None


def test_the_bound_stops_a_process_that_outlives_it(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    proc = ManagedProcess(argv, log_path=tmp_path / "bounded.log", bound_s=1, name="bounded").start()
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() == 124  # coreutils timeout's exit code
    proc.stop()


HARNESS = """
import sys, time
from pathlib import Path
from foundation.processes import ManagedProcess
server = [sys.executable, "-c", "import time; time.sleep(300)"]
proc = ManagedProcess(server, log_path=Path(sys.argv[1]), bound_s=300).start()
print(proc.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
def test_a_harness_killed_outright_takes_its_servers_down(tmp_path: Path) -> None:
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path / "orphan.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert harness.stdout is not None
        server_pid = int(harness.stdout.readline())
        assert _alive(server_pid)
        harness.kill()  # SIGKILL: the harness cannot stop anything itself
        harness.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(timeout=10)
