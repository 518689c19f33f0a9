"""``retrywatch detect`` run live against the proxy during an HTTP run, as a subprocess.

The detector scrapes the proxy's ``/metrics`` on its own clock, keeps its episodes in a SQLite
file in the run's folder, and is asked for them through its API when the run ends; they are
returned in seconds from the run's start, beside (not instead of) the replay that
``retrywatch reproduce validate`` does on the recorded series.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

from reproduce.backends.process import ManagedProcess, ProcessStartError, free_port

__all__ = ["DetectorProcess"]


class DetectorProcess:
    """The detector as a child process: ``start()``, ``episodes(t0_unix)``, ``stop()``."""

    def __init__(
        self,
        exporter_url: str,
        *,
        workdir: Path,
        capacity: float | None = None,
        deadline_s: float | None = None,
        interval_s: float = 1.0,
        time_scale: float = 1.0,
        host: str = "127.0.0.1",
        bound_s: float = 3_600.0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.exporter_url = exporter_url
        self.workdir = workdir
        self.capacity = capacity
        self.deadline_s = deadline_s
        self.interval_s = interval_s
        self.time_scale = time_scale  # a scaled run's K: the detector divides its windows by it
        self.host = host
        self.bound_s = bound_s
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self._process: ManagedProcess | None = None

    def command(self, port: int) -> list[str]:
        db = self.workdir / "detector.db"
        argv = [
            sys.executable,
            "-c",
            "from retrywatch.cli import main; main()",
            "detect",
            "--exporter",
            self.exporter_url,
            "--db",
            f"sqlite:///{db.resolve()}",
            "--interval",
            f"{self.interval_s:g}",
            "--host",
            self.host,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        if self.capacity is not None:
            argv += ["--capacity", f"{self.capacity:g}"]
        if self.deadline_s is not None:
            argv += ["--deadline", f"{self.deadline_s:g}"]
        if self.time_scale != 1.0:
            argv += ["--time-scale", repr(float(self.time_scale))]
        return argv

    def start(self) -> str:
        port = free_port(self.host)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._process = ManagedProcess(
            self.command(port), log_path=self.workdir / "detector.log", bound_s=self.bound_s, name="detector"
        ).start()
        url = f"http://{self.host}:{port}"
        try:
            self._process.wait_ready(f"{url}/healthz", timeout_s=self.startup_timeout_s, poll_s=0.2)
        except ProcessStartError:
            self.stop()
            raise
        self.url = url
        return url

    def episodes(self, t0_unix: float) -> list[dict[str, Any]]:
        """Every episode so far, times in seconds from ``t0_unix`` (the run's start)."""
        if self.url is None:
            return []
        response = httpx.get(f"{self.url}/episodes", params={"since": 0}, timeout=10)
        response.raise_for_status()
        out: list[dict[str, Any]] = []
        for episode in response.json().get("episodes", []):
            resolved = episode.get("resolved_at")
            out.append(
                {
                    "alertname": episode["alertname"],
                    "fired_at_s": round(float(episode["started_at"]) - t0_unix, 3),
                    "resolved_at_s": None if resolved is None else round(float(resolved) - t0_unix, 3),
                }
            )
        return sorted(out, key=lambda e: (e["fired_at_s"], e["alertname"]))

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
            self._process = None

    def __enter__(self) -> DetectorProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
