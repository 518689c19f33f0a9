"""Tiles: the four ratios, computed from parts when the detector lacks the ratio, coloured by
the detector's firing alerts only."""

from __future__ import annotations

import pytest

from dashboard.tiles import tile_value, tiles


def pts(v: float) -> list[list[float]]:
    return [[0.0, v / 2], [5.0, v]]


def test_tiles_prefer_the_detector_ratio_and_follow_alerts() -> None:
    signals = {"creation_capacity_ratio": pts(1.4), "execution_creation_rate": pts(1.0), "capacity": pts(2.0)}
    by_key = {t.key: t for t in tiles(signals, {"VLLMExecutionsAboveCapacity"})}
    assert by_key["creation_capacity_ratio"].text == "1.40"
    assert by_key["creation_capacity_ratio"].status == "alert"
    assert by_key["creation_capacity_ratio"].firing == ("VLLMExecutionsAboveCapacity",)
    assert by_key["prompt_token_gap"].status == "nodata"
    calm = {t.key: t for t in tiles(signals, set())}
    assert calm["creation_capacity_ratio"].status == "ok"


def test_tiles_compute_from_parts() -> None:
    signals = {
        "execution_creation_rate": pts(3.0),
        "capacity": pts(2.0),
        "vllm_waiting": pts(200.0),
        "proxy_queued": pts(40.0),
        "attempt_rate": pts(2.0),
        "deadline": pts(120.0),
        "prompt_tokens_counted_rate": pts(6000.0),
        "prompt_tokens_admitted_rate": pts(10000.0),
        "completion_rate_completed": pts(0.5),
        "completion_rate_orphaned": pts(1.5),
    }
    assert tile_value("creation_capacity_ratio", signals) == pytest.approx(1.5)
    # (200 waiting + 40 queued) / (3 created/s x 120 s); attempts do not wait where shed or attached
    assert tile_value("queue_littles_law_ratio", signals) == pytest.approx(240 / 360)
    assert tile_value("prompt_token_gap", signals) == pytest.approx(0.4)
    assert tile_value("delivered_share", signals) == pytest.approx(0.25)
    texts = {t.key: t.text for t in tiles(signals, set())}
    assert texts["prompt_token_gap"] == "40%" and texts["delivered_share"] == "25%"


def test_no_completions_is_no_data_not_zero() -> None:
    signals = {"completion_rate_completed": pts(0.0), "completion_rate_orphaned": pts(0.0)}
    assert tile_value("delivered_share", signals) is None
    assert tile_value("creation_capacity_ratio", {"execution_creation_rate": pts(1.0)}) is None


def test_delivery_within_the_deadline_is_shown_with_the_late_share_beside_it() -> None:
    signals = {"delivered_rate_within_deadline": pts(3.0), "delivered_rate_late": pts(1.0)}
    (tile,) = [t for t in tiles(signals, set()) if t.key == "delivered_within_deadline"]
    assert tile.value == pytest.approx(0.75) and (tile.text, tile.detail) == ("75%", "25% late")
    every = {"delivered_rate_within_deadline": pts(2.0), "delivered_rate_late": pts(0.0)}
    assert tile_value("delivered_within_deadline", every) == pytest.approx(1.0)
    assert tile_value("delivered_within_deadline", {}) is None
    # nothing delivered lately (the loop): said so, not "no data"
    stalled = {"delivered_rate_within_deadline": pts(0.0), "delivered_rate_late": pts(0.0)}
    (tile,) = [t for t in tiles(stalled, {"VLLMMetastableRetryLoop"}) if t.key == "delivered_within_deadline"]
    assert (tile.text, tile.status, tile.detail) == ("none", "alert", "")


def test_an_idle_engine_is_shown_idle_and_no_data_only_without_a_source() -> None:
    """An engine with no traffic showed "no data" in three tiles, as a source that is down does:
    idle and broken looked the same."""
    idle = {
        "attempt_rate": pts(0.0),
        "execution_creation_rate": pts(0.0),
        "capacity": pts(2.0),
        "deadline": pts(120.0),
        "vllm_waiting": pts(0.0),
        "proxy_queued": pts(0.0),
        "prompt_tokens_counted_rate": pts(0.0),
        "prompt_tokens_admitted_rate": pts(0.0),
        "completion_rate_completed": pts(0.0),
        "completion_rate_orphaned": pts(0.0),
        "delivered_rate_within_deadline": pts(0.0),
        "delivered_rate_late": pts(0.0),
    }
    by_key = {t.key: t for t in tiles(idle, set())}
    assert by_key["creation_capacity_ratio"].text == "0.00"
    for key in (
        "queue_littles_law_ratio",
        "prompt_token_gap",
        "delivered_share",
        "delivered_within_deadline",
    ):
        tile = by_key[key]
        assert (tile.text, tile.detail, tile.status) == ("idle", "no calls in the last minute", "ok"), key
    # The source down: the last minute holds no value at all.
    assert {t.text for t in tiles({}, set())} == {"no data"}
    assert {t.status for t in tiles({}, set())} == {"nodata"}
    # Up, but a series is missing (vLLM's waiting queue): no data for the tile that reads it.
    without_waiting = {k: v for k, v in idle.items() if k != "vllm_waiting"}
    assert {t.key: t.text for t in tiles(without_waiting, set())}["queue_littles_law_ratio"] == "no data"


def test_calls_arriving_with_nothing_to_divide_say_what_is_missing() -> None:
    """The loop's face: attempts keep arriving, nothing is completed or delivered in the window."""
    stalled = {
        "attempt_rate": pts(3.0),
        "execution_creation_rate": pts(0.0),
        "deadline": pts(120.0),
        "vllm_waiting": pts(300.0),
        "prompt_tokens_admitted_rate": pts(0.0),
        "completion_rate_completed": pts(0.0),
        "delivered_rate_within_deadline": pts(0.0),
        "delivered_rate_late": pts(0.0),
    }
    texts = {t.key: (t.text, t.status) for t in tiles(stalled, {"VLLMOrphanedExecutions"})}
    assert texts["queue_littles_law_ratio"] == ("none created", "ok")
    assert texts["prompt_token_gap"] == ("none admitted", "ok")
    assert texts["delivered_share"] == ("none completed", "alert")
    assert texts["delivered_within_deadline"] == ("none", "ok")


def test_no_tile_is_titled_with_a_formula() -> None:
    from dashboard.tiles import TILE_SPECS

    assert not [s.label for s in TILE_SPECS if any(c in s.label for c in "()×")]
