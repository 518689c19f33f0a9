"""``retrywatch detect`` run live against the proxy during an HTTP run, as a subprocess.

The detector scrapes the proxy's ``/metrics`` on its own clock, keeps its episodes in a SQLite
file in the run's folder, and is asked for them through its API when the run ends; they are
returned in seconds from the run's start, beside (not instead of) the replay that
``retrywatch reproduce validate`` does on the recorded series. With ``tier="vllm"`` it reads
vLLM's own ``/metrics`` (``retrywatch detect --tier vllm``); ``name`` tells two detectors of one
run apart (their log and database files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from reproduce.harness.childserver import ChildServer, retrywatch_argv
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = ["DetectorProcess"]


class DetectorProcess(ChildServer):
    """The detector as a child process: ``start()``, ``episodes(t0_unix)``, ``stop()``."""

    name = "detector"
    ready_path = "/healthz"

    def __init__(
        self,
        exporter_url: str,
        *,
        workdir: Path,
        capacity: float | None = None,
        deadline_s: float | None = None,
        interval_s: float = 1.0,
        clock: RunClock = STUDY_CLOCK,
        host: str = "127.0.0.1",
        bound_s: float = 3_600.0,
        startup_timeout_s: float = 60.0,
        tier: str = "proxy",
        name: str = "detector",
    ) -> None:
        super().__init__(workdir=workdir, host=host, bound_s=bound_s, startup_timeout_s=startup_timeout_s)
        self.name = name
        self.tier = tier
        self.exporter_url = exporter_url
        self.capacity = capacity
        self.deadline_s = deadline_s
        self.interval_s = interval_s
        self.clock = clock  # a scaled run's, for `detect --time-scale`

    def command(self, port: int) -> list[str]:
        db = self.workdir / f"{self.name}.db"
        argv = retrywatch_argv(
            "detect",
            "--tier",
            self.tier,
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
        )
        if self.capacity is not None:
            argv += ["--capacity", f"{self.capacity:g}"]
        if self.deadline_s is not None:
            argv += ["--deadline", f"{self.deadline_s:g}"]
        return argv + self.clock.argv()

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

    def __enter__(self) -> DetectorProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
