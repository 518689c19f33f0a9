"""The pieces of the Prometheus backfill pipeline that need no Prometheus: the alerting state
machine (Prometheus' rules/alerting.go), rule layering and the grid."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from exporter.timeseries import Snapshot
from rules.backfill import (
    BackfillError,
    Prometheus,
    alert_episodes,
    aligned_start,
    recording_layers,
    write_blocks,
)

L = (("instance", "a"),)
GRID = [float(t) for t in range(0, 200, 5)]


def _episodes(active: list[float], for_s: float, keep_s: float = 0.0) -> list[tuple[float, float | None]]:
    return [
        (e.fired_at, e.resolved_at)
        for e in alert_episodes({L: active}, GRID, for_s=for_s, keep_firing_for_s=keep_s)
    ]


def test_fires_once_active_for_the_whole_for_window() -> None:
    active = [float(t) for t in range(50, 100, 5)]  # 50..95
    assert _episodes(active, for_s=30) == [(80.0, 100.0)]
    assert _episodes(active, for_s=45) == [(95.0, 100.0)]
    assert _episodes(active, for_s=50) == []  # pending from 50, gone at 100 before it could fire


def test_zero_for_fires_on_the_first_active_evaluation() -> None:
    assert _episodes([20.0, 25.0], for_s=0) == [(20.0, 30.0)]


def test_a_gap_while_pending_restarts_the_for_window() -> None:
    active = [50.0, 55.0, 60.0, 70.0, 75.0, 80.0, 85.0, 90.0]  # empty at 65
    assert _episodes(active, for_s=15) == [(85.0, 95.0)]


def test_keep_firing_for_counts_from_the_first_empty_evaluation() -> None:
    active = [float(t) for t in range(50, 100, 5)]  # last active 95, first empty 100
    assert _episodes(active, for_s=10, keep_s=30) == [(60.0, 130.0)]
    # active again inside the hysteresis window: the same episode goes on
    again = [*active, 110.0, 115.0]
    assert _episodes(again, for_s=10, keep_s=30) == [(60.0, 150.0)]


def test_still_firing_at_the_end_has_no_resolution() -> None:
    assert _episodes([float(t) for t in range(100, 200, 5)], for_s=10) == [(110.0, None)]


def test_label_sets_are_independent() -> None:
    other = (("instance", "b"),)
    eps = alert_episodes({L: [10.0, 15.0], other: [100.0, 105.0]}, GRID, for_s=5)
    assert [(e.labels, e.fired_at) for e in eps] == [(L, 15.0), (other, 105.0)]


def test_recording_layers_follow_dependencies() -> None:
    rules = [
        {"record": "instance:c:ratio", "expr": "instance:a:rate1m / instance:b:rate1m"},
        {"record": "instance:a:rate1m", "expr": "sum by (instance) (rate(x_total[1m]))"},
        {"record": "instance:b:rate1m", "expr": "sum by (instance) (rate(y_total[1m]))"},
        {"record": "instance:d:ratio", "expr": "instance:c:ratio > 1"},
    ]
    layers = [[r["record"] for r in layer] for layer in recording_layers(rules)]
    assert layers == [["instance:a:rate1m", "instance:b:rate1m"], ["instance:c:ratio"], ["instance:d:ratio"]]


def test_recording_layers_reject_cycles() -> None:
    rules = [{"record": "a:x:y", "expr": "b:x:y"}, {"record": "b:x:y", "expr": "a:x:y + 1"}]
    with pytest.raises(BackfillError, match="depends on itself"):
        recording_layers(rules)


def test_aligned_start_is_on_the_grid_and_hours_in_the_past() -> None:
    start = aligned_start(1800.0, 5.0, now=1_800_000_003.0)
    assert start % 5 == 0
    assert 1_800_000_003.0 - start - 1800.0 >= 4 * 3600


@pytest.mark.promtool
def test_a_series_loads_into_a_real_prometheus(promtool: str, prometheus_binary: str, tmp_path: Path) -> None:
    """OpenMetrics -> promtool blocks -> prometheus on 127.0.0.1: colons, labels and values survive."""
    snaps = [
        Snapshot(
            float(t),
            [
                ("vllm:num_requests_waiting", {"model_name": "m"}, float(t)),
                ("retrywatch_attempts_total", {"kind": "first"}, 2.0 * t),
                ("retrywatch_capacity_calls_per_second", {}, math.nan if t == 30 else 2.78),
            ],
        )
        for t in range(0, 125, 5)
    ]
    start = aligned_start(120.0, 5.0)
    data = tmp_path / "data"
    labels = {"instance": "run-1", "job": "retrywatch"}
    write_blocks(snaps, data, start_unix_s=start, extra_labels=labels, promtool=promtool)
    with Prometheus(data, binary=prometheus_binary, lookback_delta_s=4) as prom:
        assert prom.url.startswith("http://127.0.0.1:")
        waiting = prom.query("vllm:num_requests_waiting", start + 30)
        assert waiting[0]["metric"] == {"__name__": "vllm:num_requests_waiting", "model_name": "m", **labels}
        assert float(waiting[0]["value"][1]) == 30.0
        rate = prom.query('rate(retrywatch_attempts_total{kind="first"}[1m])', start + 120)
        assert float(rate[0]["value"][1]) == pytest.approx(2.0)
        # a NaN sample is left out: with a lookback under one scrape, the series is absent then
        assert prom.query("retrywatch_capacity_calls_per_second", start + 30) == []
        assert prom.query("retrywatch_capacity_calls_per_second", start + 35) != []
