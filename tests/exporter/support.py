"""Helpers for the proxy's end-to-end tests: the test upstream and proxy processes, scrapes and the
counter balance. Processes and ports come from ``foundation.processes``."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from exporter.proxy import Proxy
from foundation.processes import ManagedProcess, free_port
from tests.exporter.soak import Samples, balance_problems, scrape

__all__ = [
    "BadUpstream",
    "ProxyProcess",
    "RunningProxy",
    "Samples",
    "Upstream",
    "balance",
    "endless_head",
    "env_without_retrywatch",
    "errors_logged",
    "free_port",
    "proxy_process",
    "scrape",
    "start_bad_upstream",
    "start_upstream",
]


@dataclass
class Upstream:
    url: str

    def release(self, name: str) -> None:
        """Let the requests sent with ``x-test-hold: name`` go on to their first token."""
        httpx.post(f"{self.url}/test/release", params={"name": name}, timeout=5).raise_for_status()

    def set_metrics_delay(self, seconds: float) -> None:
        """Make the upstream answer ``GET /metrics`` that many seconds late."""
        r = httpx.post(f"{self.url}/test/metrics-delay", params={"seconds": seconds}, timeout=5)
        r.raise_for_status()

    def metrics_scrapes(self) -> int:
        return int(httpx.get(f"{self.url}/test/metrics-scrapes", timeout=5).json()["scrapes"])

    def requests(self, call_id: str | None = None, tag: str | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("call_id", call_id), ("tag", tag)) if v is not None}
        return list(httpx.get(f"{self.url}/test/requests", params=params, timeout=5).json()["requests"])


@dataclass
class RunningProxy:
    url: str
    proxy: Proxy

    def metrics(self) -> Samples:
        """Samples of ``/metrics`` keyed by (name, sorted labels)."""
        return scrape(self.url)


def balance(m: Samples) -> None:
    """Assert the counter balance (``exporter.policy``'s docstring) on one scrape."""
    problems = balance_problems(m)
    assert not problems, problems


def errors_logged(log: Path) -> list[str]:
    """The lines of a process's output that tell of an error inside it: a traceback, or an
    exception uvicorn caught in the app."""
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines() if "Traceback" in line or "Exception in ASGI" in line]


def env_without_retrywatch() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RETRYWATCH_")}


@dataclass
class ProxyProcess:
    """A ``retrywatch proxy`` process on a free loopback port."""

    url: str
    port: int
    proc: ManagedProcess

    def peak_rss_kib(self) -> int:
        """The process's peak resident memory so far (Linux: ``VmHWM``)."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmHWM in /proc/PID/status")


# Runs argv[3:] under the open-file limits argv[1] (soft) and argv[2] (hard).
_UNDER_LIMIT = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)


@contextlib.contextmanager
def proxy_process(
    upstream_url: str,
    *args: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    open_files: tuple[int, int] | None = None,
) -> Iterator[ProxyProcess]:
    """Run ``retrywatch proxy --upstream URL ARGS...`` until the block ends (then SIGTERM); its
    output goes to ``log`` if given (see ``errors_logged``). ``open_files``: the (soft, hard)
    limit on open descriptors it starts under."""
    port = free_port()
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", upstream_url, "--port", str(port)]
    cmd += args
    if open_files is not None:
        cmd = [sys.executable, "-c", _UNDER_LIMIT, str(open_files[0]), str(open_files[1]), *cmd]
    full_env = env_without_retrywatch() | (env or {})
    with tempfile.TemporaryDirectory(prefix="rw-proxy-") as tmp:
        log_path = log if log is not None else Path(tmp) / "proxy.log"
        proc = ManagedProcess(cmd, log_path=log_path, bound_s=None, env=full_env, name="proxy")
        with proc:
            url = f"http://127.0.0.1:{port}"
            proc.wait_ready(f"{url}/metrics", timeout_s=20, poll_s=0.05, ready=lambda status: status < 500)
            yield ProxyProcess(url, port, proc)


@contextlib.contextmanager
def start_upstream(log_dir: Path) -> Iterator[Upstream]:
    """The test upstream (``tests.exporter.upstream``) as a process on a free loopback port."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.exporter.upstream", "--port", str(port)]
    proc = ManagedProcess(
        cmd, log_path=log_dir / "upstream.log", bound_s=None, cwd=ROOT, name="test upstream"
    )
    with proc:  # its crashes log tracebacks
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/health", timeout_s=20, poll_s=0.05)
        yield Upstream(url)


@dataclass
class BadUpstream:
    """The misbehaving upstream (``tests.exporter.badupstream``): ``x-bad: MODE`` on a request
    picks how it misbehaves."""

    url: str

    def log(self, path: str | None = None) -> list[dict[str, Any]]:
        """What it served (path, mode, call id, bytes written, ``cut_short``), oldest first."""
        served = httpx.get(f"{self.url}/bad/log", timeout=5).json()["requests"]
        return [r for r in served if path is None or r["path"] == path]


@contextlib.contextmanager
def start_bad_upstream(log_dir: Path, *path_modes: str) -> Iterator[BadUpstream]:
    """The misbehaving upstream as a process on a free loopback port; ``path_modes`` are its
    ``--path-mode PATH=MODE`` arguments (the mode of every request to a path)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.exporter.badupstream", "--port", str(port)]
    for path_mode in path_modes:
        cmd += ["--path-mode", path_mode]
    proc = ManagedProcess(
        cmd, log_path=log_dir / "badupstream.log", bound_s=None, cwd=ROOT, name="misbehaving upstream"
    )
    with proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/bad/log", timeout_s=20, poll_s=0.05)
        yield BadUpstream(url)


ROOT = Path(__file__).resolve().parents[2]  # the repository: ``python -m tests...`` runs from it


def endless_head(port: int, path: str) -> bytes:
    """Send a GET whose one header never ends (up to 64 MiB) to a server of ours on ``port``
    and return its first answer: a bounded server answers 431 and closes early."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET %b HTTP/1.1\r\nhost: x\r\nx-junk: " % path.encode())
        with contextlib.suppress(OSError):  # the server closes once it has answered
            for _ in range(1024):
                s.sendall(b"a" * 65536)
        return s.recv(4096)


def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``condition`` became true within ``timeout_s`` (polled every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
