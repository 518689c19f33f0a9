"""Sweeps through one executor interface: the registry and its usage errors, one line where Ray is
missing, and a what-if on a real two-node Ray cluster bound to 127.0.0.1 that gives the local
executor's result file for file, whose driver killed mid-sweep loses no finished point, whose
Ray worker killed mid-run is run again, and whose rerun resumes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from foundation.rundir import RunDirError, read_summary
from reproduce.cli import reproduce
from reproduce.conditions import expand
from reproduce.executors import EXECUTORS, ExecutorError, get_executor
from reproduce.executors.local import LocalExecutor
from reproduce.executors.ray import RAY_MISSING
from reproduce.registry import Backend, RunJob
from reproduce.runner import run_many
from tests.reproduce.test_runner import SMALL

OPTIONS = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
# Three policies, two seeds: six short simulated runs (a second or two each on the small engine).
SWEEP = ["whatif", "--time-scale", "10", "--seed", "21", "--seeds", "2", "--no-progress", *OPTIONS,
         "--policies", "none,coalescing,budget"]  # fmt: skip
_BOUND_S = 90.0  # the longest a step of the tiny sweep may take on a busy machine


def invoke(*args: str) -> Any:
    return CliRunner().invoke(reproduce, list(args), catch_exceptions=False)


def test_executors_come_from_one_registry_and_options_that_do_not_fit_are_refused() -> None:
    assert sorted(EXECUTORS) == ["local", "ray"]
    assert isinstance(get_executor("local", jobs=1), LocalExecutor)
    with pytest.raises(ExecutorError, match="unknown executor 'slurm'"):
        get_executor("slurm")
    with pytest.raises(ExecutorError, match="needs --executor ray"):
        get_executor("local", address="127.0.0.1:6379")
    with pytest.raises(ExecutorError, match="--jobs counts local processes"):
        get_executor("ray", jobs=2)


@pytest.mark.parametrize("command", ["run", "whatif"])
def test_executor_options_that_do_not_fit_are_one_usage_line(command: str, tmp_path: Path) -> None:
    base = ["run", "--block", "diagnostic"] if command == "run" else ["whatif"]
    out = tmp_path / "out"
    for args, says in (
        (["--address", "127.0.0.1:1"], "needs --executor ray"),
        (["--executor", "ray", "--jobs", "2"], "--jobs counts local processes"),
        (["--executor", "slurm"], "'slurm' is not one of 'local', 'ray'"),
    ):
        result = invoke(*base, *args, "--out", str(out))
        assert result.exit_code == 2 and says in result.output, result.output
        assert "Traceback" not in result.output and not out.exists()


def test_without_ray_installed_executor_ray_is_one_line_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as where the ray extra is not installed
    out = tmp_path / "out"
    for base in (["run", "--block", "diagnostic"], ["whatif"]):
        result = invoke(*base, "--executor", "ray", "--out", str(out))
        assert result.exit_code == 2 and RAY_MISSING in result.output, result.output
        assert "Traceback" not in result.output and not out.exists()


class _InProcess(Backend):
    """A backend whose runs share this process (as the real engines' do)."""

    name = "in-process"

    def run(self, job: RunJob) -> dict[str, Any]:
        raise AssertionError("never run")


@pytest.mark.ray
def test_ray_needs_a_cluster_and_refuses_a_backend_that_runs_in_this_process_before_any_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "out"
    result = invoke("whatif", "--executor", "ray", "--out", str(out))
    assert result.exit_code == 2 and "--executor ray needs --address HOST:PORT" in result.output
    for address, says in (
        (f"127.0.0.1:{_free_port()}", "no Ray cluster answers at"),
        ("nowhere", "HOST:PORT"),
    ):
        result = invoke(
            "run", "--block", "diagnostic", "--executor", "ray", "--address", address, "--out", str(out)
        )
        assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1)
    with socket.socket() as listening:  # answers, as a cluster would; never asked to run anything
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        on_ray = get_executor("ray", address=f"127.0.0.1:{listening.getsockname()[1]}")
        with pytest.raises(ExecutorError, match="'in-process' runs one run at a time in this process"):
            run_many(_InProcess(), runs, out, executor=on_ray, progress=False)
    assert not out.exists()


# --- a real Ray cluster: a head and a worker node on this machine, both on 127.0.0.1 ------------

# NOTE: Ray swaps 127.0.0.1 for the machine's interface address (and then listens on every
# interface) unless the head is told it is a single-machine Ray (this variable, Ray's name for
# it); a worker node refuses that setting, so it joins with Ray's swap turned off instead.
_HEAD_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Every process of the cluster and its drivers: no usage report, and no token (a stale
# ~/.ray/auth_token left by an earlier Ray on this machine would keep the worker node out).
_ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
_KEEP_LOOPBACK = (
    "import ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; main()"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[3])


def _processes(sessions: set[int]) -> set[int]:
    """The living processes of ``sessions`` (each node's processes keep the session its
    ``ray start`` opened)."""
    return {
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _session_of(int(p.name)) in sessions
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _stop(sessions: set[int]) -> None:
    for sig, grace_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 10.0)):
        for pid in _processes(sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while _processes(sessions) and time.monotonic() < deadline:
            time.sleep(0.1)


_LOOPBACK = ("127.0.0.1:", "[::ffff:127.0.0.1]:")


def _off_loopback(pids: set[int]) -> list[str]:
    """The sockets of ``pids`` (TCP and UDP, listening or connected, by ``ss``) with an end that
    is not on 127.0.0.1 (a listener's wildcard peer aside), as ``ss`` prints them."""
    done = subprocess.run(["ss", "-Htuanp"], capture_output=True, text=True, timeout=30, check=True)
    mine = [line.split() for line in done.stdout.splitlines() if any(f"pid={p}," in line for p in pids)]
    assert mine, "no socket of Ray's processes found"
    return [
        " ".join(fields)
        for fields in mine
        if not (fields[4].startswith(_LOOPBACK) and (fields[5].startswith(_LOOPBACK) or "*" in fields[5]))
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, set[int]]]:
    with ray_cluster() as found:
        yield found


@contextmanager
def ray_cluster() -> Iterator[tuple[str, set[int]]]:
    """A head and a worker node of one CPU each, in a temp dir of their own; their address and
    sessions. Stopped by their processes' ids, never by ``ray stop`` (which ends every Ray here)."""
    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="rw-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = _ENV
    common = ["--num-cpus=1", f"--temp-dir={temp}", "--disable-usage-stats"]
    commands = (
        ([ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
          "--include-dashboard=false", *common], env | _HEAD_ENV),
        ([sys.executable, "-c", _KEEP_LOOPBACK, "start", f"--address={address}",
          "--node-ip-address=127.0.0.1", *common], env),
    )  # fmt: skip
    sessions: set[int] = set()
    try:
        for argv, node_env in commands:
            start = subprocess.Popen(
                argv, env=node_env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            sessions.add(start.pid)
            output = start.communicate(timeout=120)[0].decode()
            assert start.returncode == 0, output[-3000:]
        yield address, sessions
    finally:
        _stop(sessions)
        subprocess.run(["rm", "-rf", temp], check=False)


def _sweep(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "retrywatch", "reproduce", *SWEEP, *args, "--out", str(out)]


def _wait_for(what: Any, process: subprocess.Popen[bytes], bound_s: float = _BOUND_S) -> Any:
    """``what()``'s first true value while ``process`` runs (fails the test otherwise)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and process.poll() is None:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    process.kill()
    pytest.fail(f"the sweep ended or stalled: {process.communicate()[1].decode()[-3000:]}")


def _entries(out: Path) -> dict[str, dict[str, Any]]:
    try:
        return {r["slug"]: r for r in read_summary(out / "points")["runs"]}
    except RunDirError:  # not written yet
        return {}


def _timeless(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s: {k: v for k, v in e.items() if k not in ("wall_s", "cpu_s")} for s, e in entries.items()}


def _files(out: Path) -> dict[str, bytes]:
    runs = out / "points" / "runs"
    return {p.relative_to(runs).as_posix(): p.read_bytes() for p in sorted(runs.rglob("*")) if p.is_file()}


def _tasks(sessions: set[int]) -> set[int]:
    """The cluster's workers now running a run."""
    return {pid for pid in _processes(sessions) if _cmdline(pid).startswith("ray::_run_shipped")}


def _ended(sessions: set[int]) -> set[int]:
    """Waits (bounded) for the cluster's runs to end; those still running."""
    deadline = time.monotonic() + 30.0
    while _tasks(sessions) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _tasks(sessions)


@pytest.mark.slow
@pytest.mark.ray
def test_a_sweep_on_ray_gives_the_local_result_and_resumes_after_its_driver_is_stopped_or_killed(
    cluster: tuple[str, set[int]], tmp_path: Path
) -> None:
    address, sessions = cluster
    # Every Ray process listens and connects on 127.0.0.1 alone (never the machine's interfaces).
    assert not _off_loopback(_processes(sessions))

    local = tmp_path / "local"
    done = subprocess.run(_sweep(local, "--jobs", "2"), env=_ENV, capture_output=True, timeout=_BOUND_S)
    assert done.returncode == 0, done.stderr.decode()[-3000:]

    # A SIGTERM stops the driver at once, and its runs on the cluster with it.
    out = tmp_path / "ray"
    on_ray = ["--executor", "ray", "--address", address]
    driver = subprocess.Popen(
        _sweep(out, *on_ray), env=_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        _wait_for(lambda: _tasks(sessions), driver)
        driver.send_signal(signal.SIGTERM)
        stopped = driver.wait(timeout=15.0)
        assert stopped == 128 + signal.SIGTERM, driver.communicate()[1].decode()[-3000:]
    finally:
        driver.kill()
    assert not _ended(sessions), "runs of a stopped driver went on on the cluster"

    # The driver killed outright once a point is in DIR: the points finished stay, its tasks end.
    before = len(_entries(out))
    driver = subprocess.Popen(
        _sweep(out, *on_ray), env=_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        seen = _wait_for(lambda: len(e := _entries(out)) > before and e, driver)
        assert not _off_loopback({driver.pid})  # the driver too stays on 127.0.0.1
        assert driver.poll() is None and len(seen) < 6  # killed mid-sweep
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=_BOUND_S)
    finally:
        driver.kill()
    assert not _ended(sessions), "runs of a killed driver went on on the cluster"
    # What it left: every point seen before the kill, unchanged, and any that finished between
    # that look and the kill (a point may land in that instant), each whole.
    finished = _entries(out)
    assert all(finished.get(slug) == entry for slug, entry in seen.items()) and len(finished) < 6

    # The rerun resumes; a Ray worker killed mid-run costs that run a retry, nothing else.
    rerun = subprocess.Popen(
        _sweep(out, *on_ray), env=_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        worker = min(_wait_for(lambda: _tasks(sessions), rerun))
        os.kill(worker, signal.SIGKILL)
        stderr = rerun.communicate(timeout=_BOUND_S)[1]
    finally:
        rerun.kill()
    assert rerun.returncode == 0, stderr.decode()[-3000:]
    after = _entries(out)
    assert all(after[slug] == entry for slug, entry in finished.items())  # kept, not run again
    # The same entries, run files and verdicts as the local executor's.
    assert _timeless(after) == _timeless(_entries(local)) and len(after) == 6
    assert _files(out) == _files(local)
    body, reference = (json.loads((d / "whatif.json").read_text())["policies"] for d in (out, local))
    assert body == reference
