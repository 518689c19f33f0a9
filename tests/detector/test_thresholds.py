"""The one definition of every alert: complete, consistent, renderable to PromQL."""

from __future__ import annotations

import math
import re

import pytest

from detector.signals import RECORD_NAMES, RULES_ONLY_RECORDS, SIGNALS_BY_NAME, recording_rules, tier_signals
from detector.thresholds import (
    ALERTS,
    ALERTS_BY_NAME,
    CAUSES_TEMPLATE,
    TIERS,
    All,
    AnyOf,
    Cmp,
    Tier,
    alert_expr,
    holds,
    leaves,
    promql_template,
    tier_rules,
)
from foundation import metricnames as mn

EXPECTED = {
    "VLLMMetastableRetryLoop": ("critical", "cause", "proxy"),
    "VLLMBacklogBeyondDeadline": ("warning", "cause", "proxy"),
    "VLLMExecutionsAboveCapacity": ("warning", "cause", "proxy"),
    "VLLMRetryAmplification": ("warning", "cause", "proxy"),
    "VLLMOrphanedExecutions": ("warning", "cause", "proxy"),
    "VLLMPromptTokensUncounted": ("warning", "cause", "proxy"),
    "VLLMCallsNotDeliveredInTime": ("critical", "symptom", "proxy"),
    "VLLMRetrywatchNoData": ("warning", "data", "proxy"),
    "VLLMRetryLoopSuspected": ("critical", "cause", "vllm"),
    "VLLMAbandonedWorkSustained": ("critical", "cause", "vllm"),
    "VLLMRetryLoopAtQueueCap": ("critical", "cause", "vllm"),
    "VLLMQueueBeyondDeadline": ("warning", "cause", "vllm"),
    "VLLMRequestsNotAnsweredInTime": ("critical", "symptom", "vllm"),
    "VLLMTierNoData": ("warning", "data", "vllm"),
}


def test_every_alert_of_the_issue_is_defined_with_its_severity_kind_and_tier() -> None:
    assert {a.name: (a.severity, a.kind, a.tier) for a in ALERTS} == EXPECTED


@pytest.mark.parametrize("tier", TIERS)
def test_a_tier_evaluates_its_own_alerts_with_the_signals_of_its_tier(tier: Tier) -> None:
    rules = tier_rules(tier)
    assert {r.name for r in rules} == {n for n, e in EXPECTED.items() if e[2] == tier}
    assert sum(r.kind == "data" for r in rules) == 1 and sum(r.kind == "symptom" for r in rules) == 1
    for rule in ALERTS:
        if rule.tier == tier:
            assert {SIGNALS_BY_NAME[name].tier for name in rule.signals()} == {tier}, rule.name


def test_the_vllm_tiers_rules_read_vllms_series_and_the_stated_numbers_alone() -> None:
    """A Prometheus that scrapes only vLLM evaluates the vLLM tier's group: its rules read vLLM's
    series, its own records (those only the rules compute, ``RULES_ONLY_RECORDS``, included), and
    the two numbers the operator states, nothing of the proxy's."""
    own = {name for name, _ in recording_rules("vllm")} | set(RULES_ONLY_RECORDS)
    proxy_records = {name for name, _ in recording_rules("proxy")}
    stated = (mn.CAPACITY, mn.CLIENT_DEADLINE)
    for name, expr in recording_rules("vllm"):
        for series in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
            assert series not in proxy_records, (name, series)
            if series.startswith("retrywatch_"):
                assert series in stated, (name, series)
            if series.startswith("instance:"):
                assert series in own, (name, series)
    assert 'up{job="vllm"}' in dict(recording_rules("vllm"))[RECORD_NAMES["vllm_data_missing"]]


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r.name)
def test_rule_reads_only_known_signals_and_its_value_is_the_promql_value(rule) -> None:  # type: ignore[no-untyped-def]
    for name in rule.signals():
        assert name in SIGNALS_BY_NAME, name
    # PromQL's `a and b` keeps a's value: the first leaf is the alert's value in both evaluators.
    assert leaves(rule.condition)[0].signal == rule.value_signal
    assert rule.for_s >= 0 and rule.keep_firing_for_s >= 0
    assert rule.runbook_url() == f"http://127.0.0.1:8200/runbook#{rule.name}"
    assert (
        rule.runbook_url("https://wiki.example/rw/{anchor}") == f"https://wiki.example/rw/{rule.name.lower()}"
    )
    # no Python placeholder is left (the causes' query holds PromQL's own braces)
    template = promql_template(rule.description).replace(CAUSES_TEMPLATE, "")
    assert "{" not in template.replace("{{", "").replace("}}", "")


def test_holds_treats_unknown_signals_as_false_like_an_absent_series() -> None:
    cond = All((Cmp("a", ">=", 1.0), AnyOf((Cmp("b", "<", 0.5), Cmp("c", ">", 0.0)))))
    assert holds(cond, {"a": 1.0, "b": 0.1, "c": None})
    assert holds(cond, {"a": 2.0, "b": None, "c": 3.0})
    assert not holds(cond, {"a": 0.9, "b": 0.1, "c": 1.0})
    assert not holds(cond, {"a": None, "b": 0.1, "c": 1.0})
    assert not holds(cond, {"a": math.nan, "b": 0.1})
    assert not holds(cond, {"a": 1.0, "b": 0.5, "c": 0.0})


def test_alert_expressions_use_the_recorded_signals() -> None:
    expr = alert_expr(ALERTS_BY_NAME["VLLMMetastableRetryLoop"])
    assert expr.startswith("(instance:retrywatch_creation_capacity:ratio1m >= 1)")
    assert " or " in expr and " and " in expr
    records = [name for tier in TIERS for name, _ in recording_rules(tier)]
    assert len(records) == len(set(records))
    for rule in ALERTS:
        for leaf in leaves(rule.condition):
            assert RECORD_NAMES[leaf.signal] in alert_expr(rule)
    # each recording rule reads only raw series or rules recorded before it in its own group
    for tier in TIERS:
        seen: set[str] = set()
        for name, expr in recording_rules(tier):
            for other in records:
                if re.search(rf"{re.escape(other)}\b", expr) and other != name:
                    assert other in seen, f"{name} reads {other} before it is recorded"
            seen.add(name)


def test_what_a_tier_reads_is_declared_with_each_signal() -> None:
    vllm = tier_signals("vllm")
    assert vllm and {s.tier for s in vllm} == {"vllm"}
    assert set(tier_signals("proxy")) == set(SIGNALS_BY_NAME.values())
    assert {"vllm_queue_deadline_ratio", "vllm_delivery_burn_rate_short", "vllm_data_missing"} <= {
        s.name for s in vllm
    }
