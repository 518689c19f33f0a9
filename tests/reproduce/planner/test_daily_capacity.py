"""plan-daily's Ĉ: the one stated wins; else the detector's, read from a real detector API
serving what it predicted from an engine's own vLLM series; with neither, a usage error; a
detector that does not answer, or does not know the engine, is one line."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from detector.api import create_app
from detector.service import Detector
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from detector.thresholds import tier_rules
from foundation.processes import free_port
from foundation.timeseries import write_series
from reproduce.planner import daily
from reproduce.planner.daily import DailyError, History, detector_capacity
from tests.detector.conftest import wait_until
from tests.detector.test_capacity import LOW_LOAD, _vllm_only

from .test_daily import invoke, write_recording

CAPACITY = "retrywatch_detector_capacity_calls_per_second"


@pytest.fixture(scope="module")
def detector_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, float]]:
    """A detector that has followed four simulated minutes of one engine's vLLM series (no stated
    Ĉ: it predicts one), its API served on a free port; its URL and the Ĉ it publishes."""
    tmp = tmp_path_factory.mktemp("detector")
    write_series(tmp / "metrics.jsonl", _vllm_only("llama3.1-8b-h100", 15, LOW_LOAD))
    source = ReplaySource(tmp / "metrics.jsonl", instance="vllm-a")
    det = Detector(source, EpisodeStore(f"sqlite:///{tmp / 'd.db'}"), rules=tier_rules("vllm"))
    for t in [s.t for s in source.snapshots if s.t <= 240.0]:
        det.tick(t)
    published = det.metrics.registry.get_sample_value(
        CAPACITY, {"instance": "vllm-a", "tier": "vllm", "source": "predicted"}
    )
    assert published is not None and published > 0
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(det), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the detector API")
    try:
        yield f"http://127.0.0.1:{port}", published
    finally:
        server.should_exit = True
        thread.join(10)
        det.stop()


def test_without_capacity_the_detectors_is_taken(tmp_path: Path, detector_url: tuple[str, float]) -> None:
    url, published = detector_url
    write_recording(tmp_path / "rec", seconds=200.0, burst=(100.0, 130.0))
    state = tmp_path / "state"
    args = ["--recording", str(tmp_path / "rec"), "--out", str(state), "--once", "--policies", "none,default"]
    result = invoke(*args, "--detector", url)
    assert result.exit_code == 0, result.output
    history = History(f"sqlite:///{state / daily.HISTORY_FILE}")
    (day,) = history.days()
    assert day.capacity == published
    assert day.capacity_source == f"the detector's ({url}): vllm-a, tier proxy, predicted"
    # a stated Ĉ still wins over the detector's
    result = invoke(*args, "--detector", url, "--engine", "vllm-a", "--capacity", "3")
    assert result.exit_code == 0, result.output
    assert history.days()[0].capacity == 3.0 and history.days()[0].capacity_source == "given"
    history.close()


def test_the_detector_is_asked_for_this_engine(detector_url: tuple[str, float]) -> None:
    url, published = detector_url
    assert detector_capacity(url, "vllm-a")[0] == published
    with pytest.raises(DailyError, match=r"no Ĉ for engine 'vllm-b'; it has vllm-a"):
        detector_capacity(url, "vllm-b")


def test_a_detector_exposition_over_the_bound_is_one_line(
    detector_url: tuple[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = detector_url
    monkeypatch.setattr(daily, "DETECTOR_MAX_BYTES", 64)
    with pytest.raises(DailyError, match="over the 64-byte bound"):
        detector_capacity(url, "vllm-a")


def test_without_capacity_or_detector_is_a_usage_error(tmp_path: Path) -> None:
    write_recording(tmp_path / "rec", seconds=20.0, burst=(0.0, 0.0))
    result = invoke("--recording", str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--once")
    assert result.exit_code == 2 and "give --capacity" in result.output and "--detector URL" in result.output
    assert not (tmp_path / "state").exists()  # refused before anything is written


def test_a_detector_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    write_recording(tmp_path / "rec", seconds=20.0, burst=(0.0, 0.0))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    result = invoke("--recording", str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--once",
                    "--detector", url)  # fmt: skip
    assert result.exit_code == 1 and f"the detector at {url} does not answer" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "state" / "runs").exists()
