"""Helpers for the proxy's end-to-end tests: ports, processes, scrapes and the counter balance."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from exporter.proxy import Proxy
from exporter.testing.soak import Samples, balance_problems, scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


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
    proc: subprocess.Popen[bytes]

    def peak_rss_kib(self) -> int:
        """The process's peak resident memory so far (Linux: ``VmHWM``)."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmHWM in /proc/PID/status")


@contextlib.contextmanager
def proxy_process(
    upstream_url: str, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[ProxyProcess]:
    """Run ``retrywatch proxy --upstream URL ARGS...`` until the block ends (then SIGTERM); its
    output goes to ``log`` if given (see ``errors_logged``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", upstream_url, "--port", str(port)]
    cmd += args
    full_env = env_without_retrywatch() | (env or {})
    with open(log, "ab") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as out:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/metrics", proc=proc)
        yield ProxyProcess(url, port, proc)
    finally:
        if proc.poll() is None:
            stop_process(proc)
