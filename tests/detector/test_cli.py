"""``retrywatch detect`` as a real process: replay, serve, notify; episodes survive ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from detector.cli import detect
from detector.store import EpisodeStore
from retrywatch.timeseries import write_series
from tests.detector.conftest import TestServer, free_port, wait_until
from tests.detector.minisim import MiniSim


@pytest.mark.slow
def test_fired_episodes_survive_kill_9(tmp_path: Path, http_server: TestServer) -> None:
    series = tmp_path / "runs" / "diag__off__mini__r1" / "metrics.jsonl"
    series.parent.mkdir(parents=True)
    write_series(series, MiniSim(seed=3).run())
    db = f"sqlite:///{tmp_path / 'detector.db'}"
    port = free_port()
    env = {**os.environ, "RETRYWATCH_DB": db}
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--replay", str(series), "--port", str(port),
         "--webhook", http_server.url, "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.log").open("wb"),
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"

        def loop_episode() -> bool:
            eps = httpx.get(f"{base}/episodes", timeout=2).json()["episodes"]
            return any(e["alertname"] == "VLLMMetastableRetryLoop" for e in eps)

        wait_until(loop_episode, 90, "the detector to replay the run")
        wait_until(lambda: len(http_server.posts) >= 2, 20, "the webhook notifications")
        served = httpx.get(f"{base}/episodes", timeout=2).json()["episodes"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    store = EpisodeStore(db)
    kept = {(e.alertname, e.started_at, e.resolved_at) for e in store.episodes()}
    assert {(e["alertname"], e["started_at"], e["resolved_at"]) for e in served} <= kept
    loop = [e for e in store.episodes() if e.alertname == "VLLMMetastableRetryLoop"]
    assert len(loop) == 1 and loop[0].labels.instance == "diag__off__mini__r1"
    store.close()


def test_usage_errors_are_clear(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(detect, [])
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = runner.invoke(detect, ["--exporter", "http://a/metrics", "--prometheus", "http://p"])
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = runner.invoke(detect, ["--exporter", "a:8000"])
    assert res.exit_code == 2 and "http" in res.output
    res = runner.invoke(detect, ["--exporter", "http://a/metrics"], env={"RETRYWATCH_CAPACITY": "-1"})
    assert res.exit_code == 2 and "capacity" in res.output.lower()
