"""The vLLM tier's documented path, as the README runs it: ``retrywatch detect --tier vllm
--exporter http://ENGINE/metrics --capacity --deadline``, a real process, against a real
``retrywatch emulate`` engine under light steady load: nothing fires (NoData included), and the
signals read off vLLM's histograms (the e2e latency, the queue time, the prompt tokens of
finished requests) arrive. The scrape once dropped those histograms: within 40 s the healthy
engine raised VLLMTierNoData and paged VLLMRequestsNotAnsweredInTime at a burn of 50.

Both run at time scale K = 10 (the emulated engine ten times faster than the H100 it models, the
detector's windows and ``for`` durations divided by 10), so the longest window (300 s) and the
longest ``for`` (VLLMAbandonedWorkSustained's 240 s) pass within the test's 45 s of load.
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from foundation.processes import ManagedProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

K = 10.0
PRESET = "qwen2.5-7b-h100"
# The README's numbers for this preset (Ĉ 2.78 calls/s, a 120-s deadline), in the scaled run's wall
# time, as a scaled reproduce run gives them to its detector: Ĉ x K, the deadline / K.
CAPACITY = 2.78 * K
DEADLINE_S = 120.0 / K
RATE = 0.4 * K  # calls per wall second: 0.4 calls/s of the engine's time, well under its Ĉ
LOAD_S = 45.0
# Signals the vLLM tier reads off vLLM's histograms: None while the scrape drops them.
FROM_HISTOGRAMS = ("vllm_late_fraction", "vllm_queue_time_deadline_ratio", "vllm_unfinished_fraction")


def _steady_load(url: str, rate: float, for_s: float) -> list[int]:
    """A short completion every ``1 / rate`` s for ``for_s`` s (open loop); their status codes."""
    body = {"model": PRESET, "max_tokens": 16}
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(max_workers=8) as pool:
        started = time.monotonic()
        sent = []
        i = 0
        while time.monotonic() - started < for_s:
            prompt = {"prompt": f"call {i}: say something about the weather in a few words"}
            sent.append(pool.submit(client.post, f"{url}/v1/completions", json={**body, **prompt}))
            i += 1
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
        return [future.result().status_code for future in sent]


def test_the_readme_command_on_a_healthy_engine_fires_nothing(tmp_path: Path) -> None:
    engine_port, detector_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    api = f"http://127.0.0.1:{detector_port}"
    emulate = [sys.executable, "-m", "retrywatch", "emulate", "--model", PRESET,
               "--time-scale", f"{K:g}", "--port", str(engine_port)]  # fmt: skip
    # the README's command; then what a test needs: the time scale, its own database and port
    # fmt: off
    detect = [sys.executable, "-m", "retrywatch", "detect", "--tier", "vllm",
              "--exporter", f"{engine}/metrics",
              "--capacity", f"{CAPACITY:g}", "--deadline", f"{DEADLINE_S:g}", "--time-scale", f"{K:g}",
              "--db", f"sqlite:///{tmp_path / 'd.db'}", "--port", str(detector_port)]
    # fmt: on
    with (
        ManagedProcess(emulate, log_path=tmp_path / "emulate.log", bound_s=180, name="emulate") as emulator,
        ManagedProcess(detect, log_path=tmp_path / "detector.log", bound_s=180, name="detector") as detector,
    ):
        emulator.wait_ready(f"{engine}/health", timeout_s=60, poll_s=0.2)
        detector.wait_ready(f"{api}/healthz", timeout_s=60, poll_s=0.2)
        codes = _steady_load(engine, RATE, LOAD_S)
        episodes = httpx.get(f"{api}/episodes", timeout=10).json()["episodes"]
        firing = httpx.get(f"{api}/alerts", timeout=10).json()["alerts"]
        latest = {
            name: httpx.get(f"{api}/signals", params={"name": name}, timeout=10).json()["series"][0][
                "points"
            ][-1]
            for name in FROM_HISTOGRAMS
        }
        health = httpx.get(f"{api}/healthz", timeout=10).json()
        metrics = httpx.get(f"{api}/metrics", timeout=10).text
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert len(codes) >= 0.9 * RATE * LOAD_S  # the load was sent, not starved by a busy machine
    assert health["status"] == "ok", health
    assert [(e["alertname"], e["value"]) for e in episodes] == [], episodes
    assert firing == []
    for name, (_, value) in latest.items():
        assert value is not None and math.isfinite(value), (name, value)
    assert "retrywatch_detector_scrapes_refused_total" in metrics
    assert 'retrywatch_detector_scrapes_refused_total{reason="series_limit"} 0.0' in metrics
