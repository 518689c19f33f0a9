"""Reproduce outputs: loading a runs directory and computing a run's signals from its series."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dashboard.app import create_app
from dashboard.context import DashboardConfig
from dashboard.runs import (
    MAX_SERIES_BYTES,
    STEP_SIGNALS,
    load_runs,
    run_key,
    run_label,
    run_signals,
    series_signals,
)
from foundation import metricnames as mn
from foundation.rundir import MAX_JSON_BYTES, RunDirError, read_whatif
from foundation.timeseries import Snapshot, read_series, write_series
from reproduce.workloads.plan import detector_settings
from tests.dashboard.conftest import summary_run, write_run_series


def test_load_runs_reads_summary_and_validation(runs_dir: Path) -> None:
    loaded = load_runs(runs_dir)
    keys = [run_key(r) for r in loaded.runs]
    assert keys == ["diagnostic__retries-off__qwen2.5-7b__r1", "diagnostic__retries-on__qwen2.5-7b__r1"]
    assert [a["alertname"] for a in loaded.alerts[keys[1]]] == [
        "VLLMBacklogBeyondDeadline",
        "VLLMMetastableRetryLoop",
    ]
    assert loaded.alerts[keys[0]] == []


def test_run_signals_follow_the_counters(runs_dir: Path) -> None:
    loaded = load_runs(runs_dir)
    collapsed = run_signals(loaded, loaded.run("diagnostic__retries-on__qwen2.5-7b__r1"))
    t = collapsed["execution_creation_rate"][:, 0]
    created = collapsed["execution_creation_rate"][:, 1]
    late = t >= 300.0
    # first attempts at 0.6 Ĉ plus retries at 1.8 Ĉ: 2.4 Ĉ = 6.72 executions/s
    assert np.allclose(created[late], 6.72)
    assert np.allclose(collapsed["capacity"][:, 1], 2.8)
    assert np.allclose(collapsed["completion_rate_orphaned"][late, 1], 2.8)
    assert np.allclose(collapsed["prompt_token_gap"][late, 1], 0.4)
    assert np.isnan(created[0])  # no rate before two snapshots exist
    healthy = run_signals(loaded, loaded.run("diagnostic__retries-off__qwen2.5-7b__r1"))
    assert np.nanmax(healthy["attempt_rate_retry"][:, 1]) == 0.0
    assert "completion_rate_failed" not in healthy  # not in the series: no invented zeros


def test_a_scaled_run_is_drawn_and_replayed_at_its_scale(tmp_path: Path) -> None:
    """A run at time scale K = 10 (every duration divided by 10, every rate times 10) gets the
    same charts and alerts as the study-scale run, at a tenth of its times: both the rates'
    window and the detector's replay are the run's own, as its plan recorded them."""
    study, scaled = tmp_path / "study", tmp_path / "scaled"
    run = summary_run("retries-on", 1, recovered=False)
    write_run_series(study / run["series"], collapse=True)
    (study / "summary.json").write_text(json.dumps({"runs": [run]}))
    per_run_second = {mn.CAPACITY: 10.0, mn.CLIENT_DEADLINE: 0.1}  # Ĉ and the deadline in run time
    snaps = [
        Snapshot(s.t / 10, [(n, lb, v * per_run_second.get(n, 1.0)) for n, lb, v in s.samples])
        for s in read_series(study / run["series"])
    ]
    (scaled / run["series"]).parent.mkdir(parents=True)
    write_series(scaled / run["series"], snaps)
    recorded = {"detector": detector_settings(10.0).record()}  # what the run's plan wrote
    fast = {**run, "time_scale": 10.0, "capacity": 28.0, "duration_s": 60.0, "plan": recorded}
    (scaled / "summary.json").write_text(json.dumps({"runs": [fast]}))
    a, b = load_runs(study), load_runs(scaled)
    key = run_key(run)
    rate = run_signals(a, a.run(key))["execution_creation_rate"]
    fast_rate = run_signals(b, b.run(key))["execution_creation_rate"]
    assert np.allclose(fast_rate[:, 0] * 10, rate[:, 0])
    assert np.allclose(fast_rate[:, 1], rate[:, 1] * 10, equal_nan=True)
    alerts, source = a.run_alerts(a.run(key))
    fast_alerts, fast_source = b.run_alerts(b.run(key))
    assert source == fast_source == "the detector's replay"
    assert "VLLMMetastableRetryLoop" in [x["alertname"] for x in alerts]
    assert [x["alertname"] for x in fast_alerts] == [x["alertname"] for x in alerts]
    fired = [x["fired_at_s"] for x in alerts]
    assert [x["fired_at_s"] * 10 for x in fast_alerts] == pytest.approx(fired)
    # A scaled run that recorded no settings is refused, never replayed at the study's.
    with pytest.raises(ValueError, match="run it again"):
        run_signals(b, {k: v for k, v in fast.items() if k != "plan"})


def test_counter_reset_gives_nan_not_a_negative_rate() -> None:
    snaps = [
        Snapshot(t=5.0 * i, samples=[("retrywatch_executions_created_total", {}, v)])
        for i, v in enumerate([0, 10, 20, 2, 12])
    ]
    rate = series_signals(snaps, window_s=5.0)["execution_creation_rate"][:, 1]
    assert rate[1] == 2.0 and np.isnan(rate[3]) and rate[4] == 2.0


def test_a_runs_burn_rates_are_the_detectors_over_its_two_windows() -> None:
    # calls judged at 1/s, all in time until 300 s, then 30 % missed
    def snap(t: float) -> Snapshot:
        missed = 0.3 * max(0.0, t - 300)
        return Snapshot(t=t, samples=[
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, t - missed),
            (mn.CALLS_MISSED_DEADLINE, {}, missed),
        ])  # fmt: skip

    signals = series_signals([snap(5.0 * i) for i in range(121)])
    t, short = signals["delivery_burn_rate_short"].T
    long = signals["delivery_burn_rate_long"][:, 1]
    at = int(np.searchsorted(t, 420.0))
    assert short[at] == pytest.approx(0.3 / 0.02)  # 60 s, all in the misses
    assert long[at] == pytest.approx(0.3 * 120 / 300 / 0.02)  # 300 s, 120 of them with misses
    assert short[int(np.searchsorted(t, 200.0))] == 0.0
    # a series without the miss counter (no deadline at the proxy) draws no burn: no data
    bare = [
        Snapshot(s.t, [x for x in s.samples if x[0] != mn.CALLS_MISSED_DEADLINE])
        for s in map(snap, (0.0, 5.0))
    ]
    assert "delivery_burn_rate_short" not in series_signals(bare)


def test_bad_runs_dirs_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        load_runs(tmp_path / "nope")
    with pytest.raises(RunDirError, match=r"summary\.json does not exist"):
        load_runs(tmp_path)
    (tmp_path / "summary.json").write_text("{")
    with pytest.raises(RunDirError, match="not valid JSON"):
        load_runs(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"runs": [{"series": "../../etc/x"}]}))
    loaded = load_runs(tmp_path)
    with pytest.raises(RunDirError, match="leaves the runs directory"):
        loaded.series_path(loaded.runs[0])


def test_calls_arriving_and_delivered_in_time_keep_a_bursts_shape() -> None:
    """At the series' own step, not smoothed over the 30-s rate window: a 10-s burst of 50
    calls/s on 5/s stands as a 10-s plateau, with the calls delivered in time beside it."""

    def arrived(t: float) -> float:
        return 5.0 * t + 45.0 * min(max(t - 100.0, 0.0), 10.0)

    def in_time(t: float) -> float:  # from the burst on, served at 8/s until the backlog is gone
        return min(arrived(t), 5.0 * t + 3.0 * max(t - 100.0, 0.0))

    snaps = [
        Snapshot(t=5.0 * i, samples=[
            (mn.ATTEMPTS, {"kind": "first"}, arrived(5.0 * i)),
            (mn.ATTEMPTS, {"kind": "retry"}, 0.0),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, in_time(5.0 * i)),
        ])
        for i in range(61)
    ]  # fmt: skip
    signals = series_signals(snaps)
    arriving, delivered = STEP_SIGNALS
    t, rate = signals[arriving].T
    assert list(rate[(t > 100.0) & (t <= 110.0)]) == [50.0, 50.0]
    assert set(rate[(t > 0.0) & (t <= 100.0)]) == {5.0} and set(rate[t > 115.0]) == {5.0}
    smoothed = signals["attempt_rate_first"][:, 1]
    assert np.nanmax(smoothed) < 50.0  # the 30-s rate would have flattened it
    assert np.nanmax(signals[delivered][:, 1]) == pytest.approx(8.0)  # a backlog served at 8/s


def test_runs_of_one_condition_at_two_loads_keep_their_own_alerts(runs_dir: Path) -> None:
    """A trace replayed at two loads: block, condition, model and run alike, the variant apart."""
    summary = json.loads((runs_dir / "summary.json").read_text())
    validation = json.loads((runs_dir / "validation.json").read_text())
    for run, entry, variant in zip(
        summary["runs"], validation["runs"][::-1], ("t-load1", "t-load3"), strict=True
    ):
        run.update(condition="no-control", variant=variant)
        entry.update(condition="no-control", variant=variant)
    (runs_dir / "summary.json").write_text(json.dumps(summary))
    (runs_dir / "validation.json").write_text(json.dumps(validation))
    loaded = load_runs(runs_dir)
    first, second = loaded.runs
    assert loaded.alerts[run_key(first)] == [] and len(loaded.alerts[run_key(second)]) == 2
    assert "no-control (t-load1)" in run_label(first) and "no-control (t-load3)" in run_label(second)


RETRIES_ON = "diagnostic__retries-on__qwen2.5-7b__r1"
PROMPT_S = 10.0  # a read that waits (a FIFO with no writer) would still be waiting


def _promptly(call: Callable[[], Any]) -> Any:
    """``call()``'s result or raised error, failing (not hanging) the test if it blocks."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except Exception as exc:  # handed to the test
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(PROMPT_S)
    assert not worker.is_alive(), "blocked reading the runs directory"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (os.mkfifo, r"not a regular file \(a FIFO\)"),
        (Path.mkdir, r"not a regular file \(a directory\)"),
        (lambda p: os.truncate(p.open("w").name, MAX_SERIES_BYTES + 1), "over the .*-byte bound"),
        (lambda p: p.symlink_to("/dev/zero"), "leaves the runs directory"),
    ],
    ids=["fifo", "directory", "too-large", "symlink-outside"],
)
def test_a_series_that_is_not_a_bounded_regular_file_is_never_read(
    runs_dir: Path, make: Callable[[Path], None], said: str
) -> None:
    """A FIFO as a run's metrics.jsonl used to hold the page's callback (and SIGTERM) forever."""
    loaded = load_runs(runs_dir)
    run = loaded.run(RETRIES_ON)
    path = runs_dir / run["series"]
    path.unlink()
    make(path)
    with pytest.raises(RunDirError, match=said):
        _promptly(lambda: run_signals(loaded, run))
    loaded.alerts.clear()  # not validated: the detector's replay would read it
    with pytest.raises(RunDirError, match=said):
        _promptly(lambda: loaded.run_alerts(run))


def test_the_experiments_page_shows_a_fifo_series_as_a_note(runs_dir: Path) -> None:
    """Through the page's own callback, as a browser asks for the run."""
    series = runs_dir / load_runs(runs_dir).run(RETRIES_ON)["series"]
    series.unlink()
    os.mkfifo(series)
    app = create_app(DashboardConfig(detector_url="http://127.0.0.1:9", runs_dir=runs_dir))
    client = app.server.test_client()
    (spec,) = [
        c for c in client.get("/_dash-dependencies").get_json() if "experiments-run-summary" in c["output"]
    ]
    outputs = [_prop(o) for o in spec["output"].strip(".").split("...")]
    body = {
        "output": spec["output"],
        "outputs": outputs,
        "inputs": [_prop("experiments-run.value", RETRIES_ON)],
        "changedPropIds": ["experiments-run.value"],
    }
    got = _promptly(lambda: client.post("/_dash-update-component", json=body))
    assert got.status_code == 200
    summary = got.get_json()["response"]["experiments-run-summary"]["children"]
    assert summary == f"cannot read run: {series} is not a regular file (a FIFO); it is not read"


def _prop(key: str, value: object = None) -> dict[str, object]:
    ident, prop = key.rsplit(".", 1)
    return {"id": ident, "property": prop, "value": value}


@pytest.mark.parametrize("name", ["summary.json", "validation.json", "whatif.json"])
def test_a_fifo_or_an_outside_link_for_a_runs_json_file_is_refused_not_read(
    runs_dir: Path, name: str
) -> None:
    def read() -> Any:
        return read_whatif(runs_dir) if name == "whatif.json" else load_runs(runs_dir)

    path = runs_dir / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    with pytest.raises(RunDirError, match=rf"{name} is not a regular file \(a FIFO\)"):
        _promptly(read)
    path.unlink()
    outside = runs_dir.parent / f"outside-{name}"
    outside.write_text(json.dumps({"runs": [], "policies": {}}))
    path.symlink_to(outside)
    with pytest.raises(RunDirError, match="leads outside the runs directory"):
        _promptly(read)
    path.unlink()
    os.truncate(path.open("w").name, MAX_JSON_BYTES + 1)
    with pytest.raises(RunDirError, match="-byte bound"):
        _promptly(read)
