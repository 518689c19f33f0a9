"""A ``retrywatch`` subcommand run as a child server of the harness: on a free port, awaited on
HTTP, stopped by PID. The proxy and the live detector of an HTTP run are both one of these."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from pathlib import Path

from foundation.processes import ManagedProcess, ProcessStartError, free_port

__all__ = ["ChildServer", "retrywatch_argv"]


def retrywatch_argv(*args: str) -> list[str]:
    """argv running ``retrywatch ARGS`` with this Python (no console script needed on PATH)."""
    return [sys.executable, "-c", "from retrywatch.cli import main; main()", *args]


class ChildServer(ABC):
    """``start()`` picks a free port, runs ``command(port)`` and waits until ``ready_path`` answers
    200 (stopping it again if it never does); ``stop()`` stops it by PID. Its log is
    ``workdir/<name>.log``."""

    name: str  # also the log's name
    ready_path: str

    def __init__(self, *, workdir: Path, host: str, bound_s: float, startup_timeout_s: float) -> None:
        self.workdir = workdir
        self.host = host
        self.bound_s = bound_s
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self._process: ManagedProcess | None = None

    @abstractmethod
    def command(self, port: int) -> list[str]:
        """The argv that serves on ``port``."""

    def start(self) -> str:
        """Start the server; return its base URL once it answers."""
        if self._process is not None:
            raise RuntimeError(f"{self.name} already started")
        port = free_port(self.host)
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{self.name}.log"
        self._process = ManagedProcess(self.command(port), log_path=log, bound_s=self.bound_s, name=self.name)
        self._process.start()
        url = f"http://{self.host}:{port}"
        try:
            self._process.wait_ready(f"{url}{self.ready_path}", timeout_s=self.startup_timeout_s, poll_s=0.2)
        except ProcessStartError:
            self.stop()
            raise
        self.url = url
        return url

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None
        self.url = None
