"""`promtool check rules` and `promtool test rules` on the generated rules and their tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rules import generate, unittests
from rules.backfill import parse_duration

pytestmark = pytest.mark.promtool

TEST_FILES = sorted(unittests.TESTS_DIR.glob("*.test.yml"))


def _promtool(promtool: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def test_check_rules(promtool: str) -> None:
    proc = _promtool(promtool, "check", "rules", str(generate.RULES_PATH))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_rules = sum(
        1 for line in generate.render().splitlines() if line.lstrip().startswith(("- record:", "- alert:"))
    )
    assert f"SUCCESS: {n_rules} rules found" in proc.stdout


def test_a_test_file_per_alert() -> None:
    assert [p.name for p in TEST_FILES] == sorted(
        f"{s.alertname.lower()}.test.yml" for s in unittests.ALL_SCENARIOS
    )


def test_promtool_unit_tests_pass(promtool: str) -> None:
    proc = _promtool(promtool, "test", "rules", *(p.name for p in TEST_FILES), cwd=unittests.TESTS_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TEST_FILES)


def test_the_unit_tests_catch_a_for_window_one_evaluation_longer(promtool: str, tmp_path: Path) -> None:
    """The tests pin the `for` edges: with every `for` one evaluation longer, a test fails."""
    lines = []
    for line in generate.render().splitlines():
        key, _, value = line.partition("for: ")
        if value and key.strip() == "":
            line = f"{key}for: {generate.duration(parse_duration(value) + generate.EVALUATION_INTERVAL_S)}"
        lines.append(line)
    (tmp_path / "retrywatch.rules.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "tests").mkdir()
    target = unittests.TESTS_DIR / "vllmbacklogbeyonddeadline.test.yml"
    shutil.copy(target, tmp_path / "tests" / target.name)
    proc = _promtool(promtool, "test", "rules", target.name, cwd=tmp_path / "tests")
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout + proc.stderr
    assert "VLLMBacklogBeyondDeadline" in proc.stdout + proc.stderr


_EDGE_CASES = """\
rule_files: [{rules}]
evaluation_interval: 5s
tests:
  - interval: 5s
    input_series:
      # "dp": a data-parallel vLLM, two engines under one instance, 4 calls/s, Ĉ 2 given.
      - series: 'up{{job="retrywatch",instance="dp"}}'
        values: '1x200'
      - series: 'vllm:num_requests_waiting{{job="retrywatch",instance="dp",engine="0",model_name="m"}}'
        values: '3x200'
      - series: 'vllm:num_requests_waiting{{job="retrywatch",instance="dp",engine="1",model_name="m"}}'
        values: '4x200'
      - series: 'retrywatch_executions_created_total{{job="retrywatch",instance="dp"}}'
        values: '0+20x200'
      - series: 'retrywatch_capacity_calls_per_second{{job="retrywatch",instance="dp"}}'
        values: '2x200'
      - series: 'retrywatch_client_deadline_seconds{{job="retrywatch",instance="dp"}}'
        values: '120x200'
      - series: 'retrywatch_calls_missed_deadline_total{{job="retrywatch",instance="dp"}}'
        values: '0x200'
      # "hung": its queue never empties and nothing finishes: no Ĉ to estimate from.
      - series: 'up{{job="retrywatch",instance="hung"}}'
        values: '1x200'
      - series: 'vllm:num_requests_waiting{{job="retrywatch",instance="hung",engine="0",model_name="m"}}'
        values: '50x200'
      - series: 'retrywatch_executions_created_total{{job="retrywatch",instance="hung"}}'
        values: '0+1x200'
      - series: 'retrywatch_executions_finished_total{{job="retrywatch",instance="hung",fate="completed"}}'
        values: '0x200'
      - series: 'retrywatch_client_deadline_seconds{{job="retrywatch",instance="hung"}}'
        values: '120x200'
    promql_expr_test:
      - expr: instance:retrywatch_engine:info
        eval_time: 10m
        exp_samples:
          - {{labels: 'instance:retrywatch_engine:info{{instance="dp",engine="all",model="m"}}', value: 1}}
          - {{labels: 'instance:retrywatch_engine:info{{instance="hung",engine="0",model="m"}}', value: 1}}
      - expr: instance:retrywatch_creation_capacity:ratio1m{{instance="dp"}}
        eval_time: 10m
        exp_samples:
          - labels: 'instance:retrywatch_creation_capacity:ratio1m{{instance="dp",engine="all",model="m"}}'
            value: 2
      - expr: instance:retrywatch_vllm_waiting:sum{{instance="dp"}}
        eval_time: 10m
        exp_samples:
          - labels: 'instance:retrywatch_vllm_waiting:sum{{instance="dp",engine="all",model="m"}}'
            value: 7
      - expr: instance:retrywatch_capacity:calls_per_second{{instance="hung"}}
        eval_time: 10m
        exp_samples: []
      - expr: instance:retrywatch_data_missing:bool
        eval_time: 10m
        exp_samples:
          - {{labels: 'instance:retrywatch_data_missing:bool{{instance="dp"}}', value: 0}}
          - {{labels: 'instance:retrywatch_data_missing:bool{{instance="hung"}}', value: 1}}
"""


def test_a_data_parallel_vllm_is_one_engine_and_a_hung_one_has_no_capacity_estimate(
    promtool: str, tmp_path: Path
) -> None:
    """A data-parallel vLLM labels its series with one ``engine`` per engine under one instance:
    the engine-info record had one series per engine, every ``group_left`` join failed (many to
    many), and no alert but NoData could be evaluated for it; it is now one engine named
    ``all``, as the Python detector names it. And an engine whose queue never empties while
    nothing finishes had a Ĉ estimate of 0 (its backlog +Inf deadlines, the backlog alert
    firing) where the Python detector has none (NoData): now neither has one."""
    test = tmp_path / "edges.test.yml"
    test.write_text(_EDGE_CASES.format(rules=generate.RULES_PATH), encoding="utf-8")
    proc = _promtool(promtool, "test", "rules", str(test))
    assert proc.returncode == 0, proc.stdout + proc.stderr


_TARGETS_ABSENT = """\
rule_files: [{rules}]
evaluation_interval: 5s
tests:
  - interval: 15s
    input_series:
      - series: 'up{{job="retrywatch",instance="a"}}'
        values: '1x40 _x100'
      - series: 'up{{job="node",instance="n"}}'
        values: '1x140'
    alert_rule_test:
      - alertname: VLLMRetrywatchTargetsAbsent
        eval_time: 9m
      - alertname: VLLMRetrywatchTargetsAbsent
        eval_time: 25m
      - alertname: VLLMRetrywatchTargetsAbsent
        eval_time: 31m
        exp_alerts:
          - exp_labels: {{severity: warning, job: retrywatch}}
            exp_annotations:
              summary: "{summary}"
              description: '{description}'
              runbook_url: "{runbook}"
"""


def test_no_retrywatch_target_at_all_fires_after_ten_minutes(promtool: str, tmp_path: Path) -> None:
    """NoData fires per target: with no target of job retrywatch left (every proxy gone, a
    ServiceMonitor not selected) nothing could fire. A target of another job does not count; the
    last one gone at 10 min (its samples stale 5 min later), the alert fires 10 min after that."""
    from detector.thresholds import TARGETS_ABSENT

    test = tmp_path / "absent.test.yml"
    test.write_text(
        _TARGETS_ABSENT.format(
            rules=generate.RULES_PATH,
            summary=TARGETS_ABSENT.summary,
            description=TARGETS_ABSENT.description,
            runbook=TARGETS_ABSENT.runbook_url(),
        ),
        encoding="utf-8",
    )
    proc = _promtool(promtool, "test", "rules", str(test))
    assert proc.returncode == 0, proc.stdout + proc.stderr
