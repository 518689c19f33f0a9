"""Processes the project starts itself: a free port, a server started, awaited on HTTP and stopped
by PID, its log kept. The one such utility: the demo, the reproduce harness (vLLM, the emulated
engine, the proxy, the detector), the rules harness (Prometheus), the tests and the benchmarks
all use it.

A process runs in its own process group, optionally under coreutils ``timeout`` (``bound_s``:
nothing outlives its bound, even if the starter dies); on Linux it is also sent SIGTERM when the
process that started it dies. ``stop`` signals that group by the PID we started (SIGTERM, then
SIGKILL after a grace period), which reaches children such as vLLM's engine core as well. Output
goes to a log file, kept after the process ends, whose tail is quoted when the process fails to
become ready.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

__all__ = ["ManagedProcess", "ProcessStartError", "free_port", "log_tail", "port_taken"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ProcessStartError(RuntimeError):
    """A server did not become ready; the message carries the tail of its log."""


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux).

    ``timeout`` then passes the signal on to the server, so a harness killed outright (no
    chance to run ``stop``) does not leave an engine running until its bound.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _before_exec(niceness: int) -> Callable[[], None] | None:
    """What the child runs before exec: parent-death signal (Linux) and the niceness increment."""
    linux = sys.platform == "linux"
    if not linux and niceness == 0:
        return None

    def prepare() -> None:
        if linux:
            _terminate_with_parent()
        if niceness:
            os.nice(niceness)
            # NOTE: with the kernel's autogroup scheduling (the default on many Linux systems) the
            # CPU is shared fairly between sessions whatever their processes' nice values, and
            # the child leads a session of its own: the niceness must be the session's too.
            with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as fh:
                fh.write(str(niceness))

    return prepare


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_taken(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` right now (the OS's reason), or None if it
    could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def log_tail(path: Path, max_chars: int = 3_000) -> str:
    """The last ``max_chars`` characters of a log file ('' if it does not exist)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_chars))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


class ManagedProcess:
    """One child server: ``start()``, ``wait_ready(url)``, ``stop()``; also a context manager.

    ``bound_s``: the longest it may run (under coreutils ``timeout``); None: no bound, and
    :attr:`pid` is the server's own."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        bound_s: float | None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        name: str = "server",
        niceness: int = 0,
    ) -> None:
        if bound_s is not None and bound_s <= 0:
            raise ValueError(f"bound_s must be > 0 seconds, got {bound_s}")
        if not 0 <= niceness <= 19:
            raise ValueError(f"niceness must be in 0..19, got {niceness}")
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = list(argv)
        self.log_path = log_path
        self.bound_s = bound_s
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.name = name
        self.niceness = niceness  # added to the harness's own; children (engine core) inherit it
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """PID of the process group's leader (the ``timeout`` wrapper when bounded); None before
        start."""
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        """The full argv run, ``timeout`` wrapper included."""
        if self.bound_s is None:
            return list(self.argv)
        # --kill-after: SIGKILL the group if it ignores SIGTERM at the bound.
        return ["timeout", "--kill-after=10", f"{self.bound_s:.0f}", *self.argv]

    def start(self) -> ManagedProcess:
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=_before_exec(self.niceness),
        )
        return self

    def poll(self) -> int | None:
        """Exit code if the process has ended, else None."""
        return None if self._proc is None else self._proc.poll()

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process we started (the group's leader) only."""
        if self._proc is not None:
            self._proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; its exit code (``subprocess.TimeoutExpired`` if it
        does not end within ``timeout`` seconds)."""
        if self._proc is None:
            raise RuntimeError(f"{self.name} not started")
        return self._proc.wait(timeout=timeout)

    def wait_ready(
        self,
        url: str,
        *,
        timeout_s: float,
        poll_s: float = 0.5,
        ready: Callable[[int], bool] = lambda status: status == 200,
    ) -> float:
        """Poll ``GET url`` until its status is ``ready`` (200 by default); return the seconds
        waited.

        Raises ``ProcessStartError`` (with the log tail) if the process exits or the wait
        exceeds ``timeout_s`` (then the process is stopped).
        """
        if self._proc is None:
            raise RuntimeError(f"{self.name} not started")
        start = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ProcessStartError(
                        f"{self.name} exited with code {code} before {url} was ready; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                try:
                    if ready(client.get(url).status_code):
                        return time.monotonic() - start
                except httpx.TransportError:
                    pass
                if time.monotonic() - start > timeout_s:
                    self.stop()
                    raise ProcessStartError(
                        f"{self.name} not ready at {url} within {timeout_s:.0f} s; "
                        f"log {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                time.sleep(poll_s)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group we started, SIGKILL it after ``grace_s``; return the exit code."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                self._signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    self._signal_group(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            # Children that outlived their leader (an engine core) still carry our group id.
            self._signal_group(proc.pid, signal.SIGKILL)
            return proc.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
