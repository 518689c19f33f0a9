"""``retrywatch reproduce validate DIR --nothing-stated``: every run replayed with neither Ĉ nor the
deadline given to the detector, both learned from the series; the report beside the stated one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from foundation import metricnames as mn
from foundation.rundir import SUMMARY, VALIDATION, VALIDATION_NOTHING_STATED, VALIDATION_NOTHING_STATED_MD
from foundation.timeseries import Snapshot
from reproduce.conditions import expand
from reproduce.judge.validate import validate, validate_dir
from reproduce.judge.validation.nothingstated import unstated_snapshots
from reproduce.registry import get_backend
from reproduce.runner import run_many
from reproduce.workloads.plan import RunClock
from tests.reproduce.test_runner import SMALL

LEARNED_KEYS = {"known_at_s", "value", "source", "at_overload", "true_value"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two scaled diagnostic runs (one collapses and does not recover, one recovers), stated
    validation written."""
    out = tmp_path_factory.mktemp("tiny")
    runs = expand(
        "diagnostic",
        models="qwen2.5-7b-h100",
        runs=1,
        seed=2,
        conditions=["retries-on-cancel-off", "retries-off-cancel-off"],
    )
    run_many(get_backend("sim", **SMALL), runs, out, jobs=1, clock=RunClock(10.0), progress=False)
    validate_dir(out)
    return out


def test_nothing_stated_writes_its_own_report_and_leaves_the_stated_one(tiny: Path) -> None:
    stated = (tiny / VALIDATION).read_bytes()
    result = CliRunner().invoke(validate, [str(tiny), "--nothing-stated"])
    assert result.exit_code == 0, result.output
    assert "nothing stated" in result.output and VALIDATION_NOTHING_STATED in result.output
    assert (tiny / VALIDATION).read_bytes() == stated  # untouched
    assert "nothing_stated" not in json.loads(stated) and "learned" not in json.loads(stated)["runs"][0]

    report = json.loads((tiny / VALIDATION_NOTHING_STATED).read_text(encoding="utf-8"))
    assert next(iter(report)) == "nothing_stated" and report["nothing_stated"] is True
    assert set(json.loads(stated)) <= set(report)  # the same validation.json, plus what was learned
    assert "## Learned, nothing stated" in (tiny / VALIDATION_NOTHING_STATED_MD).read_text(encoding="utf-8")
    for run in report["runs"]:
        learned: dict[str, Any] = run["learned"]
        assert set(learned) == {"capacity", "deadline"}
        for number in learned.values():
            assert set(number) == LEARNED_KEYS
        capacity, deadline = learned["capacity"], learned["deadline"]
        assert capacity["true_value"] == pytest.approx(9.77, rel=0.01)  # the summary's Ĉ
        assert deadline["true_value"] == pytest.approx(12.0)  # 120 s at K = 10
        # Ĉ: predicted from vLLM's series below saturation, before the pulse (12 s at K = 10)
        assert capacity["source"] == "predicted" and capacity["known_at_s"] < run["pulse"]["start_s"]
        assert capacity["value"] == pytest.approx(capacity["true_value"], rel=0.25)
        # the deadline: from abandons, which only the overload brings (none before the pulse)
        assert deadline["known_at_s"] > run["pulse"]["start_s"] and deadline["at_overload"] is None
        assert deadline["value"] == pytest.approx(deadline["true_value"], rel=0.05)
    summary = report["learned"]
    assert summary["capacity"]["learned_in"] == summary["deadline"]["learned_in"] == 2


def test_a_run_without_call_records_never_learns_its_deadline(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    shutil.copytree(tiny, out)
    for calls in out.glob("runs/*/attempts.jsonl"):
        calls.unlink()
    # the true deadline is the one the client gave attempts up at (its plan's), not the judged one
    summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    summary["runs"][0]["plan"]["client"]["attempt_timeout_s"] = 6.0
    (out / SUMMARY).write_text(json.dumps(summary), encoding="utf-8")
    report = validate_dir(out, nothing_stated=True)
    assert [r["learned"]["deadline"]["true_value"] for r in report["runs"]] == [6.0, 12.0]
    for run in report["runs"]:
        assert run["learned"]["deadline"]["known_at_s"] is None
        assert run["learned"]["deadline"]["value"] is None
        assert run["learned"]["capacity"]["known_at_s"] is not None
    assert report["learned"]["deadline"]["learned_in"] == 0


def _snap(t: float, deadline: float = 12.0) -> Snapshot:
    labels = {"instance": "r"}
    return Snapshot(
        t,
        [
            (mn.CAPACITY, dict(labels), 9.77),
            (mn.CLIENT_DEADLINE, dict(labels), deadline),
            (mn.CLIENT_DEADLINE_SOURCE, {**labels, "source": mn.DEADLINE_STATED}, 1.0),
            (mn.CALLS_MISSED_DEADLINE, dict(labels), 3.0),
            (mn.EXECUTIONS_CREATED, dict(labels), 5.0),
        ],
    )


def _values(snap: Snapshot, name: str) -> list[tuple[dict[str, str], float]]:
    return [(lb, v) for n, lb, v in snap.samples if n == name]


def test_the_rewrite_exports_what_a_learning_proxy_would() -> None:
    # twelve abandons at 12 s, the first ten ended by t = 20, the rest by t = 40
    abandons = [(10.0 + i, 12.0) for i in range(10)] + [(30.0, 12.0), (31.0, 12.0)]
    before, after = unstated_snapshots([_snap(5.0), _snap(20.0)], abandons, "r")
    for snap in (before, after):
        assert all(math.isnan(v) for _, v in _values(snap, mn.CAPACITY))  # no --capacity: NaN
        assert _values(snap, mn.EXECUTIONS_CREATED) == [({"instance": "r"}, 5.0)]  # the rest as it was
        assert len(_values(snap, mn.CLIENT_DEADLINE)) == 1  # the stated one replaced, not doubled
    sources = {lb["source"]: v for lb, v in _values(before, mn.CLIENT_DEADLINE_SOURCE)}
    assert sources == {mn.DEADLINE_STATED: 0.0, mn.DEADLINE_LEARNED: 0.0, mn.DEADLINE_UNKNOWN: 1.0}
    assert math.isnan(_values(before, mn.CLIENT_DEADLINE)[0][1])
    assert _values(before, mn.CALLS_MISSED_DEADLINE) == []  # no deadline known: no such series
    sources = {lb["source"]: v for lb, v in _values(after, mn.CLIENT_DEADLINE_SOURCE)}
    assert sources[mn.DEADLINE_LEARNED] == 1.0
    assert _values(after, mn.CLIENT_DEADLINE)[0][1] == pytest.approx(12.0)
    assert _values(after, mn.CALLS_MISSED_DEADLINE) == [({"instance": "r"}, 3.0)]
    learned = {lb["class"]: v for lb, v in _values(after, mn.CLIENT_DEADLINE_ABANDONS)}
    assert learned["1"] == 10.0  # the ten that ended by t = 20, not the two after


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(validate, [str(tmp_path), "--nothing-stated"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / VALIDATION_NOTHING_STATED).exists()
