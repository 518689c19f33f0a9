"""The ground truth over time: collapses from call records and the series, which are metastable,
and its agreement with the recovery rule's verdict on simulated runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundation import metricnames as mn
from foundation.groundtruth import GroundTruth
from foundation.rundir import RunDirError, read_summary, series_path
from foundation.timeseries import Snapshot
from reproduce.conditions import expand
from reproduce.judge.groundtruth import (
    CALLS_FILE,
    CallTimes,
    JudgedSpan,
    agrees_with_recovery,
    ground_truth,
    legacy_truth,
    read_calls,
    span_of,
)
from reproduce.registry import get_backend
from reproduce.runner import run_many
from reproduce.workloads.plan import RunClock
from tests.reproduce.test_runner import SMALL

CAPACITY = 2.0
SPAN = JudgedSpan(
    start_s=0.0,
    end_s=600.0,
    align_s=150.0,
    window_s=60.0,
    deadline_s=120.0,
    capacity=CAPACITY,
    pulse_start_s=100.0,
    pulse_end_s=150.0,
)


def _calls(missed: list[tuple[float, float]]) -> list[CallTimes]:
    """One call a second from 0 to 599 s, delivered in 10 s, but in the ``missed`` stretches of
    planned arrival, where no call is delivered."""
    out = []
    for t in range(600):
        late = any(a <= t < b for a, b in missed)
        out.append(CallTimes(float(t), float(t), None if late else t + 10.0))
    return out


def _snapshots(
    waiting: dict[tuple[float, float], float] | None = None,
    first_rate: float = 1.0,
    created_rate: float = 1.0,
    loop: tuple[float, float] = (0.0, 0.0),
    proxy: bool = True,
) -> list[Snapshot]:
    """A scrape every 5 s: the engine's waiting queue (``waiting`` per stretch, else 0), and the
    proxy's counters of first attempts and executions created, at ``created_rate`` x Ĉ (only
    inside ``loop``: elsewhere as many executions as first attempts)."""
    snaps, first, created = [], 0.0, 0.0
    for i in range(121):
        t = 5.0 * i
        in_loop = loop[0] <= t < loop[1]
        first += 5 * first_rate * (0.5 if in_loop else 1.0)
        created += 5 * (created_rate * CAPACITY if in_loop else first_rate)
        queue = next((v for (a, b), v in (waiting or {}).items() if a <= t <= b), 0.0)
        samples = [(mn.VLLM_NUM_WAITING, {}, queue)]
        if proxy:
            samples += [(mn.ATTEMPTS, {"kind": "first"}, first), (mn.EXECUTIONS_CREATED, {}, created)]
        snaps.append(Snapshot(t, samples))
    return snaps


def test_windows_are_aligned_to_the_pulse_end_and_cut_to_the_span() -> None:
    assert SPAN.windows()[:4] == [(0.0, 30.0), (30.0, 90.0), (90.0, 150.0), (150.0, 210.0)]
    assert SPAN.windows()[-1] == (570.0, 600.0)
    assert JudgedSpan(0.0, 130.0, 0.0, 60.0, 12.0, 1.0).windows() == [(0, 60), (60, 120), (120, 130)]


def test_a_collapse_starts_at_the_first_missed_call_and_ends_before_two_good_windows() -> None:
    truth = ground_truth(_calls([(140.0, 300.0)]), _snapshots(), SPAN)
    (collapse,) = truth.collapses
    # the window [270, 330) is bad; [330, 390) and [390, 450) are good
    assert (collapse.start_s, collapse.end_s, collapse.ended) == (140.0, 330.0, True)
    assert collapse.metastable is False
    assert agrees_with_recovery(truth, recovered=True)
    assert not agrees_with_recovery(truth, recovered=False)


def test_one_good_window_between_bad_ones_does_not_end_a_collapse() -> None:
    truth = ground_truth(_calls([(150.0, 200.0), (280.0, 300.0)]), _snapshots(), SPAN)
    assert [(c.start_s, c.end_s) for c in truth.collapses] == [(150.0, 330.0)]


def test_a_queue_holds_a_collapse_open_but_never_starts_one() -> None:
    # every call delivered, but a queue of 30 over [0, 200]: no collapse
    quiet = ground_truth(_calls([]), _snapshots({(0.0, 200.0): 30.0}), SPAN)
    assert quiet.collapses == []
    # calls missed over [150, 210) and the queue drains only after 385 s: the collapse runs to the
    # window [390, 450), the first of two whose queue is empty
    held = ground_truth(_calls([(150.0, 210.0)]), _snapshots({(0.0, 389.0): 30.0}), SPAN)
    assert [(c.start_s, c.end_s) for c in held.collapses] == [(150.0, 390.0)]


def test_a_collapse_without_two_good_windows_runs_to_the_end_of_the_hold() -> None:
    truth = ground_truth(_calls([(160.0, 600.0)]), _snapshots(), SPAN)
    (collapse,) = truth.collapses
    assert (collapse.start_s, collapse.end_s, collapse.ended) == (160.0, 600.0, False)
    assert agrees_with_recovery(truth, recovered=False)
    # a last good window alone does not end it: the recovery rule needs two
    truth = ground_truth(_calls([(160.0, 560.0)]), _snapshots(), SPAN)
    assert [(c.end_s, c.ended) for c in truth.collapses] == [(600.0, False)]


def test_metastable_when_executions_are_created_at_capacity_while_first_attempts_fall_below() -> None:
    calls = _calls([(160.0, 600.0)])
    # first attempts at 1/s (half Ĉ), and from 300 s on 0.5/s while executions are created at 1.2 Ĉ
    loop = _snapshots(first_rate=1.0, created_rate=1.2, loop=(300.0, 600.0))
    (collapse,) = ground_truth(calls, loop, SPAN).collapses
    assert collapse.metastable is True
    # created over the 60 s before 340 s: 15 s at 1/s and 45 s of the loop at 2.4/s = 123 >= 120
    assert (collapse.metastable_at_s, collapse.metastable_for_s) == (340.0, 260.0)  # to the end
    brief = _snapshots(first_rate=1.0, created_rate=1.2, loop=(300.0, 360.0))
    assert ground_truth(calls, brief, SPAN).collapses[0].metastable_for_s == 35.0  # 340 to 375
    drain = _snapshots(first_rate=1.0, created_rate=0.9, loop=(300.0, 600.0))
    assert ground_truth(calls, drain, SPAN).collapses[0].metastable is False
    unknown = ground_truth(calls, _snapshots(proxy=False), SPAN).collapses[0]
    assert (unknown.metastable, unknown.metastable_at_s, unknown.metastable_for_s) == (None, None, None)


def test_bad_call_records_get_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / CALLS_FILE
    path.write_text('{"planned_at": 1.0, "attempts": [], "delivered_at": null}\n{"planned_at": "x"}\n')
    with pytest.raises(RunDirError, match=rf"{CALLS_FILE}:2: not a call record"):
        read_calls(path)
    path.write_text('{"planned_at": 1' + "0" * 400 + ', "attempts": [], "delivered_at": null}\n')
    with pytest.raises(RunDirError, match=rf"{CALLS_FILE}:1: not a call record"):
        read_calls(path)


def test_span_of_a_summary_entry_reads_its_times() -> None:
    entry = {
        "time_scale": 10.0,
        "pulse": {"start_s": 12.0, "end_s": 22.7},
        "hold_end_s": 94.7,
        "deadline_s": 12.0,
        "capacity": 97.7,
        "duration_s": 180.0,
        "plan": {"window_s": 6.0, "max_growth_per_s": 0.1},
    }
    span = span_of(entry)
    assert (span.end_s, span.align_s, span.window_s, span.deadline_s) == (94.7, 22.7, 6.0, 12.0)
    assert span.max_growth_per_s == 0.1  # the plan's, as recorded: never re-derived from K
    assert span_of({**entry, "hold_end_s": None}).end_s == 180.0
    with pytest.raises(RunDirError, match="needs 'hold_end_s' or 'duration_s'"):
        span_of({k: v for k, v in entry.items() if k not in ("hold_end_s", "duration_s")})
    with pytest.raises(RunDirError, match=r"'plan\.window_s'"):  # never a window re-derived from K
        span_of({k: v for k, v in entry.items() if k != "plan"})
    with pytest.raises(RunDirError, match=r"'plan\.max_growth_per_s'"):
        span_of({**entry, "plan": {"window_s": 6.0}})


@pytest.fixture(scope="module")
def scaled_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("groundtruth")
    runs = [
        *expand(
            "diagnostic",
            models="qwen2.5-7b-h100",
            runs=1,
            conditions=["retries-off-cancel-off", "retries-on-cancel-off", "retries-on-cancel-on"],
        ),
        *expand("composition", models="qwen2.5-7b-h100", runs=1, conditions=["coalescing"]),
    ]
    run_many(get_backend("sim", **SMALL), runs, folder, jobs=2, clock=RunClock(10.0), progress=False)
    return folder


def test_it_agrees_with_the_recovery_verdict_on_simulated_runs(scaled_runs: Path) -> None:
    verdicts, drained = [], 0
    for run in read_summary(scaled_runs)["runs"]:
        truth = GroundTruth.from_entry(run)  # recorded when the run ended, every run
        series = series_path(scaled_runs, run, must_exist=True)
        legacy = {k: v for k, v in run.items() if k not in ("judged", "collapses")}
        # an entry written before the record is computed once on read, to the same record
        again = legacy_truth(legacy, series.parent / CALLS_FILE, series)
        assert again is not None and again.entry_fields() == truth.entry_fields()
        assert agrees_with_recovery(truth, run["recovered"]), (run["slug"], truth.collapses)
        if run["recovered"] and truth.collapses:
            # the recovery time is the end of the two good windows after the collapse
            drained += 1
            last = truth.collapses[-1]
            assert last.end_s + 2 * truth.span.window_s == pytest.approx(
                run["pulse"]["end_s"] + run["recovery_time_s"]
            )
        if not run["recovered"]:
            assert any(c.metastable for c in truth.collapses), run["slug"]  # the retry loop
        verdicts.append(run["recovered"])
    assert True in verdicts and False in verdicts
    assert drained  # a pulse's backlog that missed deadlines, then drained
