"""replay_run: a run's series through the detector, checked against an independent model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detector.replay import replay_run
from detector.thresholds import NO_CAUSE_TEXT
from detector.thresholds import tier_rules as _tier_rules
from foundation.timeseries import write_series
from tests.detector.factories import steady
from tests.detector.minisim import MiniSim

PROXY = _tier_rules("proxy")  # these runs are the proxy tier's: a proxy's series


def _series(tmp_path: Path, sim: MiniSim) -> Path:
    run_dir = tmp_path / "runs" / "diagnostic__x__mini__r1"
    run_dir.mkdir(parents=True)
    path = run_dir / "metrics.jsonl"
    write_series(path, sim.run())
    return path


def _fired(episodes, name):  # type: ignore[no-untyped-def]
    return [e for e in episodes if e.alertname == name]


def test_collapse_with_cancellation_off_fires_the_loop_after_the_pulse(tmp_path: Path) -> None:
    sim = MiniSim(retries=3, cancellation=False, seed=3)
    episodes = replay_run(_series(tmp_path, sim), rules=PROXY)
    assert {e.labels.instance for e in episodes} == {"diagnostic__x__mini__r1"}
    loop = _fired(episodes, "VLLMMetastableRetryLoop")
    assert len(loop) == 1 and loop[0].severity == "critical"
    assert sim.pulse_end < loop[0].started_at < sim.pulse_end + 180
    backlog = _fired(episodes, "VLLMBacklogBeyondDeadline")
    assert backlog and sim.t_base < backlog[0].started_at < sim.pulse_end  # the early warning
    assert _fired(episodes, "VLLMOrphanedExecutions")
    assert not _fired(episodes, "VLLMRetrywatchNoData")


@pytest.mark.parametrize(
    "kwargs", [{"retries": 0}, {"pulse": 1.5}, {"pulse": 2.0}], ids=["retries-off", "pulse-1.5", "pulse-2"]
)
def test_recovering_runs_never_fire_the_loop(tmp_path: Path, kwargs: dict[str, float]) -> None:
    episodes = replay_run(_series(tmp_path, MiniSim(seed=3, **kwargs)))  # type: ignore[arg-type]
    assert not _fired(episodes, "VLLMMetastableRetryLoop")
    assert not _fired(episodes, "VLLMRetryAmplification")


SYMPTOM = "VLLMCallsNotDeliveredInTime"


def test_the_symptom_pages_through_a_collapse_naming_its_causes(tmp_path: Path) -> None:
    sim = MiniSim(retries=3, cancellation=False, seed=3)
    episodes = replay_run(_series(tmp_path, sim), rules=PROXY)
    (symptom,) = _fired(episodes, SYMPTOM)
    assert symptom.severity == "critical"
    # the first misses are judged one deadline after the calls that miss arrived, in the pulse
    assert sim.t_base + sim.deadline < symptom.started_at < sim.pulse_end + sim.deadline + 120
    hold_end = sim.pulse_end + sim.t_hold
    assert symptom.resolved_at is None or symptom.resolved_at > hold_end  # firing to the hold's end
    assert "Cause alerts firing on it: " in symptom.description
    assert "VLLMBacklogBeyondDeadline" in symptom.description


def test_the_symptom_stays_quiet_while_calls_are_delivered_in_time(tmp_path: Path) -> None:
    # a pulse the engine absorbs within the deadline: every call delivered in time
    sim = MiniSim(seed=3, pulse=1.5)
    assert not _fired(replay_run(_series(tmp_path, sim), rules=PROXY), SYMPTOM)


def test_the_symptom_fires_whatever_the_cause_and_says_when_no_cause_alert_does(tmp_path: Path) -> None:
    # an engine that answers 9 calls in 10 too late, with no backlog, no retries, nothing orphaned
    path = tmp_path / "metrics.jsonl"
    write_series(path, steady(600, first=1.0, completed=1.0, within=0.1, missed=0.9))
    episodes = replay_run(path, rules=PROXY)
    assert [e.alertname for e in episodes] == [SYMPTOM]
    assert episodes[0].started_at == pytest.approx(5.0 + 30.0)  # a rate from the second scrape, then `for`
    assert NO_CAUSE_TEXT in episodes[0].description


def test_cancellation_on_signature_waiting_at_littles_law_with_no_completions(tmp_path: Path) -> None:
    # attempts at 2.4 Ĉ (0.6 Ĉ of calls x 4 attempts), every execution waits out its deadline:
    # waiting = attempt rate x deadline, the engine completes nothing, everything is cancelled.
    series = steady(600, first=1.2, retry=3.6, cancelled=4.8, waiting=4.8 * 120, capacity=2.0, deadline=120.0)
    path = tmp_path / "metrics.jsonl"
    write_series(path, series)
    loop = _fired(replay_run(path, rules=PROXY), "VLLMMetastableRetryLoop")
    assert len(loop) == 1 and loop[0].resolved_at is None
    assert loop[0].value == pytest.approx(2.4)
    # the same series with a configured capacity twice as large is no longer a loop
    assert not _fired(replay_run(path, capacity=5.0, rules=PROXY), "VLLMMetastableRetryLoop")


def test_replay_on_an_interval_and_bad_inputs(tmp_path: Path) -> None:
    path = _series(tmp_path, MiniSim(seed=3))
    every5 = replay_run(path, rules=PROXY)
    every10 = replay_run(path, interval=10.0, rules=PROXY)
    assert [e.alertname for e in every10] == [e.alertname for e in every5]
    with pytest.raises(ValueError, match="capacity"):
        replay_run(path, capacity=0.0)
    with pytest.raises(FileNotFoundError):
        replay_run(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"t": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        replay_run(bad)


@pytest.mark.parametrize(("waiting", "loop_expected"), [(180.0, False), (300.0, True)])
def test_no_loop_while_the_engine_holds_well_under_a_deadline_of_work(
    tmp_path: Path, waiting: float, loop_expected: bool
) -> None:
    # Cancellation-on signature (waiting >= half of executions x deadline, 5 in 6 of the engine's
    # executions cancelled, executions created at 1.5 Ĉ) but, at 180 waiting, only 90 s of work
    # at Ĉ = 2 (0.75 deadlines): new attempts complete within their 120-s deadline (an engine
    # queue cap can do this), no loop. At 300 waiting (1.25 deadlines) it is the loop.
    series = steady(600, first=1.0, retry=2.0, completed=0.5, cancelled=2.5, waiting=waiting)
    path = tmp_path / "metrics.jsonl"
    write_series(path, series)
    assert bool(_fired(replay_run(path, rules=PROXY), "VLLMMetastableRetryLoop")) is loop_expected
