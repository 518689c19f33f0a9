"""Blocks and conditions as data: slugs, run counts and the policy each condition maps to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from exporter.policy import BudgetOrder, Cancellation, QueueOrder
from reproduce.conditions import BLOCKS, PAPER, ConditionError, PulseWorkload, block, engine_cap_for, expand
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import RunClock, RunPlan


def test_paper_has_the_studys_137_runs() -> None:
    assert len(expand("paper")) == 137
    assert len({r.slug for r in expand("paper")}) == 137


@pytest.mark.parametrize(
    ("slug", "conditions"),
    [
        (
            "diagnostic",
            [
                "retries-off-cancel-off",
                "retries-on-cancel-off",
                "retries-off-cancel-on",
                "retries-on-cancel-on",
            ],
        ),
        ("tracing", ["steps-2k-cancel-off", "steps-2k-cancel-on", "steps-8k-cancel-on"]),
        ("composition", ["no-control", "retry-budget", "coalescing", "budget-first", "lookup-first"]),
        ("queue-policy", ["no-control", "proxy-cap", "deadline-check", "lifo"]),
        ("engine-cap", ["no-control", "engine-cap-338", "engine-cap-338-cancel-on", "engine-cap-100"]),
        ("deferral", ["no-control", "coalescing", "coalescing-cancel-on", "deferred-cancellation"]),
        (
            "budget-cancel",
            ["no-control", "cancellation", "retry-budget", "retry-budget-cancel-on", "deferred-cancellation"],
        ),
        (
            "mixed-prompts",
            [
                "retries-off-cancel-off",
                "retries-on-cancel-off",
                "retries-off-cancel-on",
                "retries-on-cancel-on",
            ],
        ),
    ],
)
def test_condition_slugs_match_the_issue(slug: str, conditions: list[str]) -> None:
    assert [c.slug for c in block(slug).conditions] == conditions


def test_trigger_sweep_cells() -> None:
    cells = {(c.slug, c.workload.pulse_multiple) for c in block("trigger-sweep").conditions}
    assert cells == {
        (s, p) for s in ("retries-on-cancel-off", "retries-off-cancel-off") for p in (1.5, 2.0, 2.7)
    }
    assert len(expand("trigger-sweep")) == 18


def _plan(time_scale: float = 1.0) -> RunPlan:
    return RunPlan(calls=(), client=ClientConfig().scaled(time_scale), clock=RunClock(time_scale))


def test_policy_mapping_of_key_conditions() -> None:
    lookup = block("composition").condition("lookup-first").policy.config(_plan())
    assert lookup.coalesce and lookup.retry_budget == 0.1 and lookup.budget_order is BudgetOrder.LOOKUP_FIRST
    assert lookup.cancellation is Cancellation.OFF
    plain = block("queue-policy").condition("no-control").policy.config(_plan())
    assert not plain.coalesce and plain.cancellation is Cancellation.ON and plain.max_outstanding is None
    lifo = block("queue-policy").condition("lifo").policy.config(_plan())
    assert lifo.max_outstanding == 100 and lifo.queue_order is QueueOrder.LIFO and lifo.lifo_threshold == 50
    check = block("queue-policy").condition("deadline-check").policy.config(_plan())
    assert check.deadline_check and check.deadline_s == 120.0
    deferred = block("deferral").condition("deferred-cancellation").policy.config(_plan(10.0))
    assert deferred.cancellation is Cancellation.DEFERRED and deferred.coalesce
    assert deferred.cancel_after_s == pytest.approx(1.0) and deferred.budget_window_s == pytest.approx(6.0)
    assert block("engine-cap").condition("engine-cap-100").engine.engine_queue_cap == 100
    assert block("diagnostic").condition("retries-off-cancel-on").client.retries == 0
    assert all(c.workload.mixed_prompts for c in block("mixed-prompts").conditions)
    assert all(c.engine.tokens_per_step == 2048 for c in block("tracing").conditions[:2])


def test_expand_overrides_and_errors() -> None:
    specs = expand("diagnostic", models="qwen3-14b-h100", runs=1, seed=5)
    assert len(specs) == 4 and {s.seed for s in specs} == {5}
    assert {s.model for s in specs} == {"qwen3-14b-h100"}
    with pytest.raises(ConditionError, match="unknown block"):
        expand("nope")
    with pytest.raises(ConditionError, match="no condition"):
        block("diagnostic").condition("nope")
    assert engine_cap_for(2.81) == 338
    assert set(BLOCKS) | {"paper"} == {
        "diagnostic",
        "trigger-sweep",
        "tracing",
        "composition",
        "queue-policy",
        "engine-cap",
        "deferral",
        "mixed-prompts",
        "budget-cancel",
        "paper",
    }


def test_a_real_engines_model_runs_as_often_as_the_study_ran_its_architecture() -> None:
    """A shipped model (what a real engine serves) runs each condition as often as the study ran
    the architecture its preset stands for; it ran twice, so the GPU diagnostic block was 8 runs
    where the study's is 12."""
    for served, preset_name in (
        ("qwen2.5-7b-instruct", "qwen2.5-7b-h100"),
        ("qwen3-14b", "qwen3-14b-h100"),
        ("llama-3.1-8b-instruct", "llama3.1-8b-h100"),
    ):
        for slug in ("diagnostic", PAPER):
            runs = [(s.condition, s.run) for s in expand(slug, models=served)]
            assert runs == [(s.condition, s.run) for s in expand(slug, models=preset_name)]
    assert len(expand("diagnostic", models="qwen2.5-7b-instruct")) == 12
    assert {s.run for s in expand("diagnostic", models="small")} == {0, 1}  # no study architecture


def test_a_condition_names_its_parts_and_describes_them_as_summary_json_did() -> None:
    c = block("engine-cap").condition("engine-cap-338-cancel-on")
    assert list(c.describe()) == [
        "retries",
        "client",
        "client_settings",
        "cancellation",
        "coalesce",
        "retry_budget",
        "budget_order",
        "proxy_cap",
        "queue_order",
        "deadline_check",
        "engine_queue_cap",
        "tokens_per_step",
        "pulse_multiple",
        "mixed_prompts",
        "tracing",
    ]
    assert (c.describe()["engine_queue_cap"], c.describe()["cancellation"]) == (338, "on")
    assert (c.describe()["retries"], c.describe()["client"]) == (3, "study")
    # A part changes alone: another workload leaves the policy, the client and the engine as they were.
    swapped = replace(c, workload=PulseWorkload(pulse_multiple=1.5))
    assert (swapped.policy, swapped.client, swapped.engine) == (c.policy, c.client, c.engine)
    assert swapped.describe() == {**c.describe(), "pulse_multiple": 1.5}
