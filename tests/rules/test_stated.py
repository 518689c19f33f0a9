"""The rules for what an operator states (vLLM's job, the deadline, Ĉ), evaluated by promtool over
vLLM's series alone: the vLLM tier reads the stated numbers, the job's ``up`` and the deadline's
bucket; anything the rules cannot use is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from detector.signals import SIGNALS_BY_NAME
from rules import generate, stated
from tests.systemtools import require

INSTANCE = "vllm-0:8000"


def _series(job: str) -> list[dict[str, str]]:
    """vLLM's series as Prometheus scraped them as ``job``, 5 s apart for 5 minutes: a queue of 10,
    finishes at 0.8/s of which 0.2/s within 40 s and 0.4/s within 120 s."""
    labels = f'job="{job}", instance="{INSTANCE}", model_name="m"'
    return [
        {"series": f'up{{job="{job}", instance="{INSTANCE}"}}', "values": "1+0x60"},
        {"series": f"vllm:num_requests_waiting{{{labels}}}", "values": "10+0x60"},
        {"series": f'vllm:request_success_total{{{labels}, finished_reason="stop"}}', "values": "0+4x60"},
        {"series": f"vllm:e2e_request_latency_seconds_count{{{labels}}}", "values": "0+4x60"},
        {"series": f'vllm:e2e_request_latency_seconds_bucket{{{labels}, le="40.0"}}', "values": "0+1x60"},
        {"series": f'vllm:e2e_request_latency_seconds_bucket{{{labels}, le="120.0"}}', "values": "0+2x60"},
    ]


def _per_instance(signal: str) -> str:
    return f"sum by (instance) ({SIGNALS_BY_NAME[signal].record})"


def _promtool_test(tmp_path: Path, rules_text: str, job: str, checks: list[dict[str, Any]]) -> None:
    promtool = require("promtool")
    (tmp_path / "rules.yml").write_text(rules_text, encoding="utf-8")
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "5s",
        "tests": [{"interval": "5s", "input_series": _series(job), "promql_expr_test": checks}],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test), encoding="utf-8")
    done = subprocess.run(
        [promtool, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _at(expr: str, value: float | None) -> dict[str, Any]:
    samples = [] if value is None else [{"labels": f'{{instance="{INSTANCE}"}}', "value": value}]
    return {"expr": expr, "eval_time": "4m", "exp_samples": samples}


@pytest.mark.promtool
def test_the_vllm_tier_reads_the_stated_job_deadline_and_capacity(tmp_path: Path) -> None:
    text = stated.render(vllm_job="engines", deadline_s=45.0, capacity=2.5)
    _promtool_test(
        tmp_path,
        text,
        "engines",
        [
            _at(_per_instance("vllm_deadline"), 45.0),
            _at(_per_instance("vllm_capacity"), 2.5),
            # 45 s is between vLLM's bounds 40 and 60: the finishes within 40 s are in time
            _at(_per_instance("vllm_in_time_rate"), 0.2),
            _at(_per_instance("vllm_data_missing"), 0.0),
        ],
    )


@pytest.mark.promtool
def test_the_repositorys_rules_know_neither_the_job_nor_the_numbers(tmp_path: Path) -> None:
    """The same series under the job "engines" and the rules as rendered at the defaults: no
    NoData (its job has no target) and no deadline (none is assumed): why the bundle takes
    them."""
    _promtool_test(
        tmp_path,
        generate.render(),
        "engines",
        [
            _at(_per_instance("vllm_data_missing"), None),
            # no deadline series: none assumed, so nothing counts as in time
            _at(_per_instance("vllm_deadline"), None),
            _at(_per_instance("vllm_in_time_rate"), None),
        ],
    )


@pytest.mark.promtool
def test_without_a_stated_deadline_the_tier_says_it_is_missing(tmp_path: Path) -> None:
    """Ĉ stated, the deadline not (and no proxy): no default deadline, and NoData says so."""
    text = stated.render(vllm_job="engines", deadline_s=None, capacity=2.5)
    records = [r.get("record") for r in yaml.safe_load(text)["groups"][0]["rules"]]
    assert (
        "retrywatch_client_deadline_seconds" not in records
        and "retrywatch_capacity_calls_per_second" in records
    )
    _promtool_test(
        tmp_path,
        text,
        "engines",
        [
            _at(_per_instance("vllm_capacity"), 2.5),
            _at(_per_instance("vllm_deadline"), None),
            _at(_per_instance("vllm_queue_deadline_ratio"), None),
            _at(_per_instance("vllm_data_missing"), 1.0),
        ],
    )


def test_the_defaults_change_nothing_but_the_recorded_deadline() -> None:
    default = yaml.safe_load(stated.render())
    repo = yaml.safe_load(generate.render())
    (head, *rest) = default["groups"][0]["rules"]
    assert head["record"] == "retrywatch_client_deadline_seconds" and head["expr"].endswith("+ 120.0")
    assert rest == repo["groups"][0]["rules"]
    assert default["groups"][1:] == repo["groups"][1:]


@pytest.mark.parametrize(
    "stated_kwargs",
    [
        {"vllm_job": ""},
        {"vllm_job": 'v"'},
        {"deadline_s": 0.1},
        {"deadline_s": float("nan")},
        {"capacity": 0.0},
    ],
)
def test_what_the_rules_cannot_use_is_refused(stated_kwargs: dict[str, Any]) -> None:
    with pytest.raises(stated.StatedError):
        stated.render(**stated_kwargs)


def test_before_the_proxy_the_proxy_tiers_group_can_be_left_out() -> None:
    alone = yaml.safe_load(stated.render(proxy_tier=False))
    full = yaml.safe_load(stated.render())
    assert [g["name"] for g in alone["groups"]] == [generate.GROUP_NAMES["vllm"]]
    assert alone["groups"] == full["groups"][:1]
    names = {r.get("alert") for g in alone["groups"] for r in g["rules"]}
    assert "VLLMRetrywatchTargetsAbsent" not in names and "VLLMRetryLoopSuspected" in names
