"""Time scale K: a scaled run divides every duration by K, and so must the detector (signal
windows, ``for`` and hysteresis). K = 1 is bit-identical to real time; a run simulated at K = 10
and replayed at K = 10 gives the alerts the same run gives at the study's scale."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from detector.cli import detect
from detector.evaluator import Evaluator
from detector.replay import ReplaySettings, replay_reproduce_run, replay_run
from detector.signals import (
    DEFAULT_DEADLINE_S,
    WINDOWS,
    EngineLabels,
    SignalConfig,
    SignalEngine,
    SignalFrame,
)
from detector.thresholds import ALERTS, NO_DATA, AlertRule, scale_rules
from detector.thresholds import tier_rules as _tier_rules
from foundation.processes import free_port
from foundation.timeseries import read_series, write_series
from reproduce.conditions import block
from reproduce.harness.detectorproc import DetectorProcess
from reproduce.judge.validate import RETRY_LOOP, RunInfo, replay_firings
from reproduce.sim import SimSpec, simulate
from reproduce.workloads.plan import RunClock, detector_settings
from tests.detector.conftest import wait_until
from tests.reproduce.small_engine import CAPACITY, ENGINE, WORKLOAD

PROXY = _tier_rules("proxy")  # these runs are the proxy tier's: a proxy's series

CONDITIONS = ("retries-on-cancel-off", "retries-off-cancel-off")


def at(k: float, rules: tuple[AlertRule, ...] = ALERTS) -> dict[str, Any]:
    """``replay_run``'s rules, windows and assumed deadline for a run at K (run seconds)."""
    return {
        "rules": scale_rules(rules, k),
        "windows": WINDOWS.scaled(k),
        "assumed_deadline": DEFAULT_DEADLINE_S / k,
    }


# The episodes of the study-scale run of retries-on-cancel-off, seed 1, as the engine model
# steps it today (values move when its mechanism does; times did not when it took in vLLM's
# asynchronous scheduling): (alertname, started_at, resolved_at, value).
EXPECTED_K1 = [
    ("VLLMBacklogBeyondDeadline", 200.0, 1435.0, 8.984988058683042),
    ("VLLMMetastableRetryLoop", 330.0, 1330.0, 1.0235414534288638),
    ("VLLMCallsNotDeliveredInTime", 345.0, 1190.0, 49.99999999999996),
    ("VLLMRetryAmplification", 385.0, 1070.0, 91.72727272727273),
    ("VLLMOrphanedExecutions", 385.0, None, 1.0),
    ("VLLMExecutionsAboveCapacity", 500.0, 1270.0, 1.0235414534288638),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[float, str], Path]:
    """``metrics.jsonl`` of each condition simulated at K = 1 and K = 10 (seed 1)."""
    base = tmp_path_factory.mktemp("runs")
    out: dict[tuple[float, str], Path] = {}
    for k in (1.0, 10.0):
        for key in CONDITIONS:
            cond = block("diagnostic").condition(key)
            spec = SimSpec(model="test", condition=cond, seed=1, capacity=CAPACITY, clock=RunClock(k),
                           engine_config=ENGINE, workload=WORKLOAD)  # fmt: skip
            path = base / f"diagnostic__{key}__k{k:g}__r1" / "metrics.jsonl"
            path.parent.mkdir()
            write_series(path, simulate(spec).snapshots)
            out[(k, key)] = path
    return out


def _summary(episodes) -> list[tuple[str, float, float | None, float | None]]:  # type: ignore[no-untyped-def]
    return [(e.alertname, e.started_at, e.resolved_at, e.value) for e in episodes]


def test_time_scale_1_is_bit_identical_to_real_time(runs: dict[tuple[float, str], Path]) -> None:
    path = runs[(1.0, "retries-on-cancel-off")]
    default = replay_run(path, rules=PROXY)
    assert _summary(default) == EXPECTED_K1
    assert {e.labels for e in default} == {EngineLabels("", "test", path.parent.name)}
    explicit = replay_run(path, **at(1.0, PROXY))
    assert [e.as_dict() for e in explicit] == [e.as_dict() for e in default]
    gridded = replay_run(path, interval=5.0, **at(1, PROXY))
    assert _summary(gridded) == EXPECTED_K1
    # K = 1 leaves every duration as it is (the same objects)
    assert WINDOWS.scaled(1.0) is WINDOWS and scale_rules(ALERTS, 1.0) == ALERTS
    assert all(a is b for a, b in zip(scale_rules(ALERTS, 1), ALERTS, strict=True))


@pytest.mark.parametrize("key", CONDITIONS)
def test_a_scaled_run_replayed_at_its_scale_alerts_like_the_study_scale_run(
    runs: dict[tuple[float, str], Path], key: str
) -> None:
    study = {e.alertname: e for e in replay_run(runs[(1.0, key)], rules=PROXY)}
    scaled = {e.alertname: e for e in replay_run(runs[(10.0, key)], **at(10.0, PROXY))}
    assert set(scaled) == set(study)
    for name, ep in scaled.items():
        # at the study's scale (x K), within a few evaluations of the study-scale run
        assert ep.started_at * 10 == pytest.approx(study[name].started_at, abs=40.0), name
        assert (ep.resolved_at is None) == (study[name].resolved_at is None), name
    assert ("VLLMMetastableRetryLoop" in scaled) == (key == "retries-on-cancel-off")


def test_validation_replays_a_scaled_run_at_its_scale(runs: dict[tuple[float, str], Path]) -> None:
    """``retrywatch reproduce validate`` (and the dashboard's runs page) replayed a scaled run
    with the study's windows and durations, ten times too long for it."""
    path = runs[(10.0, "retries-on-cancel-off")]
    info = RunInfo(
        block="diagnostic", condition="retries-on-cancel-off", model="test", run=1, recovered=False,
        recovery_time_s=None, pulse_start_s=12.0, pulse_end_s=22.7, duration_s=143.5, deadline_s=12.0,
        capacity=CAPACITY * 10, series=path, shed_or_attached=False,
        clock=RunClock(10.0), detector=detector_settings(10.0),
    )  # fmt: skip
    got = [(f.alertname, f.fired_at_s, f.resolved_at_s) for f in replay_firings(info)]
    want = [
        (e.alertname, round(e.started_at, 3), None if e.resolved_at is None else round(e.resolved_at, 3))
        for e in replay_run(path, **at(10.0))  # validation scores every rule
    ]
    assert got == want
    assert RETRY_LOOP in [name for name, _, _ in got]


def test_a_shorter_rate_window_names_the_loop_sooner(runs: dict[tuple[float, str], Path]) -> None:
    """``windows`` replays a run as a detector with other windows would have judged it (what
    ``bench/sim_fidelity.py window`` compares); the default is the detector's own."""
    path = runs[(1.0, "retries-on-cancel-off")]
    assert _summary(replay_run(path, windows=WINDOWS, rules=PROXY)) == EXPECTED_K1

    def loop_at(rate_s: float) -> float:
        episodes = replay_run(path, windows=dataclasses.replace(WINDOWS, rate_s=rate_s), rules=PROXY)
        (loop,) = [e for e in episodes if e.alertname == "VLLMMetastableRetryLoop"]
        return loop.started_at

    assert loop_at(30.0) < loop_at(60.0) == 330.0


def test_durations_scale_and_thresholds_stay() -> None:
    for rule, scaled in zip(ALERTS, scale_rules(ALERTS, 10.0), strict=True):
        assert scaled.name == rule.name and scaled.condition == rule.condition
        assert scaled.for_s == rule.for_s / 10 and scaled.keep_firing_for_s == rule.keep_firing_for_s / 10
    w = WINDOWS.scaled(4.0)
    assert (w.rate_s, w.prompt_gap_s, w.capacity_estimate_s, w.gauge_lookback_s) == (15.0, 75.0, 900.0, 75.0)
    assert (w.predict_s, w.predict_part_s) == (75.0, 1.25)
    assert SignalEngine(SignalConfig(windows=w)).windows == w
    for bad in (0.0, -1.0, math.nan, math.inf):  # K is checked once, where the plan applies it
        with pytest.raises(ValueError, match="time scale"):
            detector_settings(bad)


def test_the_evaluator_divides_for_and_keep_firing_for() -> None:
    labels = EngineLabels("0", "m", "a")

    def transitions(k: float, missing_until: float, end: float) -> list[tuple[str, float]]:
        ev = Evaluator(scale_rules([NO_DATA], k))
        out = []
        t = 0.0
        while t <= end:
            frame = SignalFrame(t, labels, {"data_missing": 1.0 if t < missing_until else 0.0})
            out += [(tr.kind, tr.at) for tr in ev.evaluate(t, [frame])]
            t = round(t + 0.5, 6)
        return out

    assert transitions(10.0, 3.0, 5.0) == [("firing", 1.5), ("resolved", 3.0)]  # for 15 s / 10
    assert transitions(1.0, 3.0, 5.0) == []  # at real time 3 s of missing data is not enough


def test_replay_reproduce_run_replays_at_the_settings_the_plan_recorded(
    runs: dict[tuple[float, str], Path],
) -> None:
    """A scaled run's settings, recorded by its plan and read back (never re-derived from K),
    replay it as :func:`at` does; a record that does not fit is one clear error."""
    path = runs[(10.0, CONDITIONS[0])]
    settings = ReplaySettings.of_record(detector_settings(10.0).record())
    assert settings == detector_settings(10.0)
    assert settings.windows == WINDOWS.scaled(10.0) and settings.windows != WINDOWS
    assert settings.assumed_deadline == pytest.approx(DEFAULT_DEADLINE_S / 10.0)
    assert ReplaySettings.of_record(None) == ReplaySettings() == detector_settings(1.0)
    assert replay_reproduce_run(path, None, None, settings) == replay_run(path, **at(10.0))
    with pytest.raises(ValueError, match="recorded detector settings"):
        ReplaySettings.of_record({"windows": {"nope": 1.0}, "alerts": {}, "assumed_deadline_s": 1.0})


def test_cli_time_scale_option_and_the_http_runs_detector_process(tmp_path: Path) -> None:
    res = CliRunner().invoke(detect, ["--exporter", "http://a/metrics", "--time-scale", "0"])
    assert res.exit_code == 2 and "--time-scale" in res.output
    # reproduce's HTTP driver starts the live detector with the run's K, which the CLI accepts
    proc = DetectorProcess("http://127.0.0.1:9/metrics", workdir=tmp_path, clock=RunClock(10.0))
    argv = proc.command(8200)
    assert argv[argv.index("--time-scale") + 1] == "10.0"
    ctx = detect.make_context("detect", argv[argv.index("detect") + 1 :])
    assert ctx.params["time_scale"] == 10.0 and ctx.params["interval"] == 1.0
    plain = DetectorProcess("http://127.0.0.1:9/metrics", workdir=tmp_path).command(8200)
    assert "--time-scale" not in plain


@pytest.mark.slow
def test_detect_replays_a_scaled_run_with_the_env_var(
    tmp_path: Path, runs: dict[tuple[float, str], Path]
) -> None:
    series = runs[(10.0, "retries-off-cancel-off")]
    expected = replay_run(series, **at(10.0, PROXY))
    port = free_port()
    env = {**os.environ, "RETRYWATCH_TIME_SCALE": "10", "RETRYWATCH_DB": f"sqlite:///{tmp_path / 'd.db'}"}
    proc = subprocess.Popen(
        ["timeout", "120", sys.executable, "-m", "retrywatch", "detect", "--replay", str(series),
         "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.log").open("wb"),
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/healthz", timeout=2).status_code == 200, 60, "the detector")
        served = httpx.get(f"{base}/episodes", params={"since": 0}, timeout=5).json()["episodes"]
        waiting = httpx.get(f"{base}/signals", params={"name": "vllm_waiting"}, timeout=5).json()
    finally:
        proc.terminate()
        proc.wait(10)
    # the replay is shifted to end now: undo the shift with the last evaluation's time
    (series_doc,) = waiting["series"]
    last_t = max(snap.t for snap in read_series(series))
    offset = series_doc["points"][-1][0] - last_t
    got = sorted(
        (
            e["alertname"],
            e["started_at"] - offset,
            None if e["resolved_at"] is None else e["resolved_at"] - offset,
        )
        for e in served
    )
    want = sorted((e.alertname, e.started_at, e.resolved_at) for e in expected)
    assert [g[0] for g in got] == [w[0] for w in want] and "VLLMMetastableRetryLoop" not in [
        g[0] for g in got
    ]
    for g, w in zip(got, want, strict=True):
        assert g[1] == pytest.approx(w[1], abs=1e-3)
        assert (g[2] is None and w[2] is None) or g[2] == pytest.approx(w[2], abs=1e-3)
