"""Ĉ and the deadline on the live page, stated, learned or missing: a real detector (its API's
``/inputs``) fed a simulated vLLM that states nothing, with a proxy's learned deadline appearing
part way, read by the dashboard's client and rendered as the live page's first tiles."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dashboard.context import Context, DashboardConfig
from dashboard.data import EngineInputs, parse_inputs
from dashboard.pages import live
from dashboard.tiles import CAPACITY_NEEDS, DEADLINE_NEEDS, input_tiles
from detector.api import create_app
from detector.service import Detector
from detector.signals import SignalConfig
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from detector.thresholds import tier_rules
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, write_series
from reproduce.engine.presets import STUDY_CAPACITY
from tests.dashboard.staticapi import StaticDetectorAPI
from tests.detector.test_capacity import LOW_LOAD, _vllm_only

MODEL = "llama3.1-8b-h100"
LEARNED_AT = 100.0  # when the proxy has learned the clients' deadline
LEARNED_S = 93.0


def _proxy_deadline(snap: Snapshot) -> Snapshot:
    """A snapshot as the detector reads it through the proxy (which passes vLLM's series
    through): from LEARNED_AT on, the deadline the proxy learned and its source."""
    if snap.t < LEARNED_AT:
        return snap
    learned = [
        (mn.CLIENT_DEADLINE, {}, LEARNED_S),
        (mn.CLIENT_DEADLINE_SOURCE, {"source": mn.DEADLINE_LEARNED}, 1.0),
        (mn.CLIENT_DEADLINE_SOURCE, {"source": mn.DEADLINE_STATED}, 0.0),
        (mn.CLIENT_DEADLINE_ABANDONS, {"class": mn.DEADLINE_CLASSES[0]}, 57.0),
    ]
    return Snapshot(t=snap.t, samples=[*snap.samples, *learned])


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "metrics.jsonl"
    workload: dict[str, object] = dict(LOW_LOAD)
    write_series(path, [_proxy_deadline(s) for s in _vllm_only(MODEL, 15, workload)])
    return path


@contextmanager
def _detector(series: Path, tmp_path: Path, until: float, config: SignalConfig) -> Iterator[TestClient]:
    """A real detector's API after evaluating the series up to ``until`` (replay seconds)."""
    source = ReplaySource(series, instance="vllm-a")
    det = Detector(
        source, EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}"), config=config, rules=tier_rules("vllm")
    )
    try:
        for t in [s.t for s in source.snapshots if s.t <= until]:
            det.tick(t)
        yield TestClient(create_app(det))
    finally:
        det.stop()


def _inputs(
    series: Path, tmp_path: Path, until: float, capacity: float | None = None, deadline: float | None = None
) -> list[EngineInputs]:
    """``/inputs`` as the dashboard's client parses it; nothing assumed (as ``retrywatch detect``)."""
    config = SignalConfig(capacity=capacity, deadline=deadline, assumed_deadline=None)
    with _detector(series, tmp_path, until, config) as client:
        answer = client.get("/inputs")
    assert answer.status_code == 200, answer.text
    return parse_inputs(answer.json())


def test_nothing_stated_both_are_learned_with_the_range_and_since_when(series: Path, tmp_path: Path) -> None:
    (engine,) = _inputs(series, tmp_path, 240.0)
    assert engine.engine == "vllm-a"
    cap, deadline = engine.capacity["vllm"], engine.deadline["vllm"]
    assert cap.source == "predicted" and cap.value == pytest.approx(STUDY_CAPACITY[MODEL], rel=0.2)
    assert engine.predicted is not None
    value, low, high = engine.predicted
    assert cap.value == value and low <= value <= high and low < high
    assert cap.since is not None and 0.0 < cap.since < 240.0  # predicted once enough sub-windows were in
    assert deadline.source == "learned" and deadline.value == LEARNED_S and deadline.since == LEARNED_AT
    capacity_tile, deadline_tile = input_tiles(engine)
    assert capacity_tile.status == "ok" and capacity_tile.text == f"{cap.value:.3g} calls/s"
    assert capacity_tile.detail == f"learned (predicted, {low:.3g} to {high:.3g})"
    assert "predicted below saturation" in capacity_tile.explanation and "since" in capacity_tile.explanation
    assert deadline_tile.text == "93 s" and deadline_tile.detail == "learned"
    assert "1970-01-01 00:01 UTC" in deadline_tile.explanation  # learned at 100 s of the replay


def test_too_early_to_know_either_says_missing_and_what_it_needs(series: Path, tmp_path: Path) -> None:
    (engine,) = _inputs(series, tmp_path, 40.0)
    assert engine.capacity["vllm"].value is None and engine.deadline["vllm"].value is None
    capacity_tile, deadline_tile = input_tiles(engine)
    assert (capacity_tile.text, capacity_tile.status, capacity_tile.explanation) == (
        "missing",
        "nodata",
        CAPACITY_NEEDS,
    )
    assert (deadline_tile.text, deadline_tile.status, deadline_tile.explanation) == (
        "missing",
        "nodata",
        DEADLINE_NEEDS,
    )
    assert "--capacity" in CAPACITY_NEEDS and "--deadline" in DEADLINE_NEEDS


def test_a_stated_value_wins(series: Path, tmp_path: Path) -> None:
    (engine,) = _inputs(series, tmp_path, 240.0, capacity=2.5, deadline=60.0)
    assert engine.capacity["vllm"].value == 2.5 and engine.capacity["vllm"].source == "stated"
    assert engine.deadline["vllm"].value == 60.0 and engine.deadline["vllm"].source == "stated"
    assert engine.predicted is not None  # predicted all the same, though not in force
    capacity_tile, deadline_tile = input_tiles(engine)
    assert (capacity_tile.text, capacity_tile.detail) == ("2.5 calls/s", "stated")
    assert (deadline_tile.text, deadline_tile.detail) == ("60 s", "stated")


def test_the_live_page_shows_them_first_and_an_older_detector_is_a_note(series: Path, tmp_path: Path) -> None:
    with _detector(series, tmp_path, 240.0, SignalConfig(assumed_deadline=None)) as client:
        answer = client.get("/inputs").json()
    with StaticDetectorAPI() as api:
        api.set_signals("vllm-a", {"attempt_rate": [[230.0, 1.0], [240.0, 1.0]]}, model=MODEL)
        ctx = Context(DashboardConfig(detector_url=api.url))
        ctx_tiles = live.update(ctx, "vllm-a", 300)[3]
        text = str(ctx_tiles)
        assert "the detector does not say where Ĉ and the deadline come from" in text  # no /inputs
        api.set_inputs(answer["engines"])
        ctx_tiles = live.update(ctx, "vllm-a", 300)[3]
        ids = [tile.id for tile in ctx_tiles]
        assert ids[:2] == ["tile-input_capacity", "tile-input_deadline"]
        text = str(ctx_tiles)
        assert "learned (predicted, " in text and "93 s" in text and "learned by the proxy" in text
        ctx.detector.close()
