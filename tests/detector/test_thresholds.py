"""The one definition of every alert: complete, consistent, renderable to PromQL."""

from __future__ import annotations

import math

import pytest

from detector.signals import RECORD_NAMES, SIGNALS_BY_NAME, recording_rules
from detector.thresholds import (
    ALERTS,
    ALERTS_BY_NAME,
    CAUSES_TEMPLATE,
    All,
    AnyOf,
    Cmp,
    alert_expr,
    holds,
    leaves,
    promql_template,
)

EXPECTED = {
    "VLLMMetastableRetryLoop": "critical",
    "VLLMBacklogBeyondDeadline": "warning",
    "VLLMExecutionsAboveCapacity": "warning",
    "VLLMRetryAmplification": "warning",
    "VLLMOrphanedExecutions": "warning",
    "VLLMPromptTokensUncounted": "warning",
    "VLLMCallsNotDeliveredInTime": "critical",
    "VLLMRetrywatchNoData": "warning",
}


def test_every_alert_of_the_issue_is_defined_with_its_severity() -> None:
    assert {a.name: a.severity for a in ALERTS} == EXPECTED


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
    records = [name for name, _ in recording_rules()]
    assert len(records) == len(set(records))
    for rule in ALERTS:
        for leaf in leaves(rule.condition):
            assert RECORD_NAMES[leaf.signal] in alert_expr(rule)
    # each recording rule reads only raw series or rules recorded before it
    seen: set[str] = set()
    for name, expr in recording_rules():
        for other in records:
            if other in expr and other != name:
                assert other in seen, f"{name} reads {other} before it is recorded"
        seen.add(name)
