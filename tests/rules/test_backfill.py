"""The pieces of the Prometheus backfill pipeline: the alerting state machine (Prometheus'
rules/alerting.go), rule layering and the grid, which need no Prometheus; loading a series and
backfilling a rule across a TSDB block boundary, with a real one."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from foundation.timeseries import Snapshot
from rules.backfill import (
    BLOCK_S,
    BackfillError,
    Prometheus,
    alert_episodes,
    backfill_recording_rules,
    evaluation_offset,
    place_run,
    recording_layers,
    run_start,
    skipped_evaluations,
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


BOUNDARY = 250_000 * BLOCK_S  # a TSDB block boundary (blocks are aligned to the epoch)


def test_the_evaluation_in_the_last_second_before_a_block_is_the_one_skipped() -> None:
    assert skipped_evaluations(BOUNDARY - 30 + 4.5, 120.0, 5.0) == [BOUNDARY - 0.5]
    # the whole second before the boundary is the previous block's query's end, and is evaluated
    assert skipped_evaluations(BOUNDARY - 30 + 4.0, 120.0, 5.0) == []
    assert skipped_evaluations(BOUNDARY - 30 + 3.2, 120.0, 5.0) == []
    assert skipped_evaluations(BOUNDARY + 0.5, 3000.0, 5.0) == []  # inside one block
    across_two = skipped_evaluations(BOUNDARY - 30 + 4.5, BLOCK_S + 60, 5.0)
    assert across_two == [BOUNDARY - 0.5, BOUNDARY + BLOCK_S - 0.5]


def test_a_run_starts_with_a_block_on_its_grid_hours_in_the_past() -> None:
    now = BOUNDARY + 5 * 3600 + 3
    start = run_start(1800.0, 5.0, 4.5, now=now)
    assert start is not None and start - BOUNDARY == 4.5
    assert now - start - 1800.0 >= 4 * 3600
    assert skipped_evaluations(start, 1800.0, 5.0) == []
    # longer than a block: it crosses a boundary, which this offset's grid falls just before
    assert run_start(3 * 3600.0, 5.0, 4.5, now=now) is None
    assert run_start(3 * 3600.0, 5.0, 3.2, now=now) is not None


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
    start = run_start(120.0, 5.0, 0.0)
    assert start is not None
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


def _recorded_times(prom: Prometheus, name: str, start: float, duration: float) -> list[float]:
    (series,) = prom.query_range(name, start, start + duration, 5.0)
    return [round(float(t), 3) for t, _ in series["values"]]


@pytest.mark.promtool
def test_promtool_skips_the_evaluation_before_a_block_and_a_placed_run_loses_none(
    promtool: str, prometheus_binary: str, tmp_path: Path
) -> None:
    """The gap ``skipped_evaluations`` names is the one promtool's rule backfill leaves, and a run
    placed by ``place_run`` (longer than a block, so it crosses boundaries) has no evaluation
    missing: a hole there made the equivalence test flaky."""
    rule = [{"record": "retrywatch_backfill:across", "expr": "vector(1)"}]
    first = tmp_path / "retrywatch-0.rules.yml"  # the name place_run tries first
    # a lookback under a second: an evaluation time either has its own sample or none
    with Prometheus(tmp_path / "data", binary=prometheus_binary, lookback_delta_s=1) as prom:
        for i in range(60):  # the grid's offset is a hash: find a group whose grid falls in the gap
            group = f"group-{i}"
            offset = evaluation_offset(prom, rule_file=first, group_name=group, step_s=5.0, promtool=promtool)
            if offset > 4.0:
                break
        else:
            pytest.fail("no group name gave an offset in the last second of the step")
        boundary = math.floor((time.time() - 5 * 3600) / BLOCK_S) * BLOCK_S
        start = boundary - 60 + offset
        backfill_recording_rules(
            prom,
            rule,
            rule_file=first,
            group_name=group,
            start_unix_s=start,
            end_unix_s=start + 120,
            step_s=5.0,
            promtool=promtool,
        )
        grid = [round(start + 5 * k, 3) for k in range(25)]
        assert skipped_evaluations(start, 120.0, 5.0) == [boundary - 60 + 55 + offset]
        assert _recorded_times(prom, "retrywatch_backfill:across", start, 120.0) == [
            t for t in grid if t not in skipped_evaluations(start, 120.0, 5.0)
        ]

        duration = BLOCK_S + 600
        rule_file, placed = place_run(
            prom, rule_dir=tmp_path, group_name=group, duration_s=duration, step_s=5.0, promtool=promtool
        )
        backfill_recording_rules(
            prom,
            [{"record": "retrywatch_backfill:placed", "expr": "vector(1)"}],
            rule_file=rule_file,
            group_name=group,
            start_unix_s=placed,
            end_unix_s=placed + duration,
            step_s=5.0,
            promtool=promtool,
        )
        assert _recorded_times(prom, "retrywatch_backfill:placed", placed, duration) == [
            round(placed + 5 * k, 3) for k in range(int(duration / 5) + 1)
        ]
        assert rule_file != first  # its grid falls in the gap before every boundary
