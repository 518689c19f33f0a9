"""``retrywatch reproduce validate DIR --rules FILE``: another rule file's alerts, evaluated by a real
Prometheus over the runs of a simulated DIR, scored as causes and as symptoms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from foundation.rundir import RULES_VALIDATION, RULES_VALIDATION_MD
from reproduce.conditions import expand
from reproduce.judge.validate import validate
from reproduce.judge.validation.foreign import reach_s, slot_s
from reproduce.registry import get_backend
from reproduce.runner import run_many
from reproduce.workloads.plan import RunClock
from rules.backfill import BLOCK_S, format_duration
from tests.reproduce.test_runner import SMALL

LOOP = "retries-on-cancel-off"  # collapses into the retry loop and never recovers
DRAIN = "retries-off-cancel-on"  # its overload drains: it recovers

# At time scale 10 the runs are scraped every 0.5 s; the loop run's queue passes 1,000 calls, the
# draining run's stays under 200.
RULES = """\
groups:
  - name: tiny
    interval: 1s
    rules:
      - alert: QueueAbove500
        expr: max(vllm:num_requests_waiting) > 500
        for: 2s
        labels:
          severity: page
      - alert: NeverMatches
        expr: rate(vllm:num_preemptions[5s]) > 0
      - alert: QueueOnTheJobGiven
        expr: max by (model_name) (vllm:num_requests_waiting{job="engine"}) > 500
      - alert: QueueOnTheDefaultJob
        expr: max by (model_name) (vllm:num_requests_waiting{job="vllm"}) > 500
      - alert: QueueAbove500
        expr: max(vllm:num_requests_waiting) > 5000
"""


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sim")
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1, seed=3, conditions=[LOOP, DRAIN])
    run_many(get_backend("sim", **SMALL), runs, out, jobs=1, clock=RunClock(10.0), progress=False)
    return out


@pytest.fixture(scope="module")
def scored(sim_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rules = tmp_path_factory.mktemp("rules") / "tiny.yml"
    rules.write_text(RULES, encoding="utf-8")
    result = CliRunner().invoke(
        validate, [str(sim_dir), "--rules", str(rules), "--rules-job", "engine"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert (sim_dir / RULES_VALIDATION_MD).is_file()
    report: dict[str, Any] = json.loads((sim_dir / RULES_VALIDATION).read_text(encoding="utf-8"))
    report["stdout"] = result.output
    return report


@pytest.mark.promtool
def test_an_alert_that_fires_in_the_loop_is_scored_as_cause_and_symptom(scored: dict[str, Any]) -> None:
    s = scored["alerts"]["QueueAbove500"]
    assert (s["runs_not_recovered"], s["runs_recovered"]) == (1, 1)
    assert s["recall"] == 1.0 and s["fired_in_loop_runs"] == 1
    assert s["fired_in_recovered_runs"] == 0 and s["false_positive_runs"] == 0
    # the queue passes 500 after the pulse began; the lead is counted from the pulse's end
    assert s["lead_time_s"]["median"] is not None and -10.7 < s["lead_time_s"]["median"] < 60
    # both runs collapsed for a while (ground truth); only the loop's collapse is covered
    assert (s["collapses"], s["collapses_detected"], s["collapses_silent"]) == (2, 1, 1)
    assert s["as_symptom"]["kind"] == "symptom" and s["as_symptom"]["recall"] == 0.5
    assert s["rule"] == {
        "group": "tiny",
        "expr": "max(vllm:num_requests_waiting) > 500",
        "interval_s": 1.0,
        "for_s": 2.0,
        "severity": "page",
    }
    loop_run = next(r for r in scored["runs"] if r["condition"] == LOOP)
    drain_run = next(r for r in scored["runs"] if r["condition"] == DRAIN)
    fired = [a for a in loop_run["alerts"] if a["alertname"] == "QueueAbove500"]
    assert fired and fired[0]["fired_at_s"] >= loop_run["pulse"]["start_s"]
    assert not [a for a in drain_run["alerts"] if a["alertname"] == "QueueAbove500"]


@pytest.mark.promtool
def test_an_alert_that_never_fires_misses_every_loop_and_collapse(scored: dict[str, Any]) -> None:
    s = scored["alerts"]["NeverMatches"]
    assert s["recall"] == 0.0 and s["fired_in_recovered_runs"] == 0 and s["false_positive_runs"] == 0
    assert s["lead_time_s"] == {"median": None, "max": None}
    assert (s["collapses"], s["collapses_detected"], s["collapses_silent"]) == (2, 0, 2)


@pytest.mark.promtool
def test_the_series_carry_the_job_label_given(scored: dict[str, Any]) -> None:
    assert scored["job"] == "engine"
    assert scored["alerts"]["QueueOnTheJobGiven"]["recall"] == 1.0
    assert scored["alerts"]["QueueOnTheDefaultJob"]["recall"] == 0.0
    loop_run = next(r for r in scored["runs"] if r["condition"] == LOOP)
    labels = {a["labels"] for a in loop_run["alerts"] if a["alertname"] == "QueueOnTheJobGiven"}
    assert labels == {"model_name=qwen2.5-7b-h100"}


@pytest.mark.promtool
def test_a_second_rule_of_one_name_is_scored_apart(scored: dict[str, Any]) -> None:
    second = scored["alerts"]["QueueAbove500#2"]
    assert second["rule"]["expr"] == "max(vllm:num_requests_waiting) > 5000"
    assert second["recall"] == 0.0 and scored["alerts"]["QueueAbove500"]["recall"] == 1.0


@pytest.mark.promtool
def test_the_markdown_table_has_a_row_per_alert(scored: dict[str, Any]) -> None:
    assert "| QueueAbove500 | 1/1 | 0/1 | 0 |" in scored["stdout"]
    assert "| NeverMatches | 0/1 | 0/1 | 0 | — | 0/2 | 2 | — |" in scored["stdout"]


@pytest.mark.promtool
def test_an_invalid_rule_file_is_a_usage_error(sim_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    broken = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: rate(x[5m]\n"
    bad.write_text(broken, encoding="utf-8")
    result = CliRunner().invoke(validate, [str(sim_dir), "--rules", str(bad)])
    assert result.exit_code == 2
    assert "promtool check rules" in result.output and "Traceback" not in result.output
    assert not (tmp_path / RULES_VALIDATION).exists()


def test_a_missing_dir_or_rule_file_is_a_usage_error(tmp_path: Path) -> None:
    rules = tmp_path / "r.yml"
    rules.write_text(RULES, encoding="utf-8")
    result = CliRunner().invoke(validate, [str(tmp_path / "nowhere"), "--rules", str(rules)])
    assert result.exit_code == 2 and "DIR" in result.output
    result = CliRunner().invoke(validate, [str(tmp_path), "--rules", str(tmp_path / "none.yml")])
    assert result.exit_code == 2 and "--rules" in result.output


def test_each_run_gets_whole_blocks_and_a_gap_wider_than_the_rules_read() -> None:
    assert reach_s(["rate(x[5m])", "avg_over_time(rate(y[5m])[1h:5m]) offset 1d"]) == 3600 + 86400
    assert slot_s(975.0, 300.0, 5.0) == BLOCK_S
    assert slot_s(975.0, 3600.0 * 2, 5.0) == 2 * BLOCK_S


def test_durations_are_written_in_whole_units() -> None:
    assert [format_duration(s) for s in (5.0, 0.5, 60.0, 1.25)] == ["5s", "500ms", "60s", "1250ms"]
