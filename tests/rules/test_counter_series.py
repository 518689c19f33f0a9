"""A counter summed over several series under one instance (a data-parallel vLLM's engines,
several proxies behind one ``instance`` label): the detector's rate agrees with Prometheus'
``sum by (instance) (rate(...))`` when one series resets or vanishes mid-window."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from detector.signals import WINDOWS, SignalEngine
from foundation import metricnames as mn
from foundation.timeseries import Sample, Snapshot
from rules.backfill import Prometheus, run_start, write_blocks

pytestmark = pytest.mark.promtool

STEP_S = 5.0
DURATION_S = 600.0
RESET_AT = 305.0  # engine 1 restarts: its counter starts again from zero
GONE_AT = 455.0  # engine 1 is gone: its series vanishes


def _run() -> list[Snapshot]:
    snaps: list[Snapshot] = []
    for i in range(int(DURATION_S / STEP_S) + 1):
        t = i * STEP_S
        vl = {"model_name": "m", "instance": "dp"}
        samples: list[Sample] = [
            (mn.VLLM_NUM_WAITING, {**vl, "engine": "0"}, 1.0),
            (mn.VLLM_PROMPT_TOKENS, {**vl, "engine": "0"}, 100.0 * t),
        ]
        if t < GONE_AT:
            e1 = 50.0 * (t - RESET_AT) if t >= RESET_AT else 50.0 * t
            samples += [
                (mn.VLLM_NUM_WAITING, {**vl, "engine": "1"}, 1.0),
                (mn.VLLM_PROMPT_TOKENS, {**vl, "engine": "1"}, e1),
            ]
        snaps.append(Snapshot(t=t, samples=samples))
    return snaps


def test_a_reset_or_vanished_series_among_several_is_rated_as_prometheus_rates_it(
    tmp_path: Path, promtool: str, prometheus_binary: str
) -> None:
    snaps = _run()
    start = run_start(DURATION_S, STEP_S, 0.0, now=time.time())
    assert start is not None
    write_blocks(snaps, tmp_path / "data", start_unix_s=start, promtool=promtool)
    engine = SignalEngine()
    window = f"{int(WINDOWS.prompt_gap_s)}s"
    expr = f"sum by (instance) (rate({mn.VLLM_PROMPT_TOKENS}[{window}]))"
    checked = 0
    with Prometheus(tmp_path / "data", binary=prometheus_binary, lookback_delta_s=300.0) as prom:
        for snap in snaps:
            engine.add(snap)
            if snap.t < WINDOWS.prompt_gap_s:
                continue
            (frame,) = engine.compute(snap.t)
            (answer,) = prom.query(expr, start + snap.t)
            expected = float(answer["value"][1])
            got = frame.values["prompt_tokens_counted_rate"]
            # Prometheus extrapolates a series that ends inside the window by half a step
            assert got == pytest.approx(expected, rel=0.02), (snap.t, got, expected)
            checked += 1
    assert checked == int((DURATION_S - WINDOWS.prompt_gap_s) / STEP_S) + 1
