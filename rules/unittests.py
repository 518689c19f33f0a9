"""promtool unit tests for every alert, rendered into ``rules/tests/*.yml``.

Each alert gets a scenario: raw series as a scrape of one proxy (retrywatch_* and vLLM's
passthrough, with ``job`` and ``instance``) in which the alert's condition starts to hold at a
known evaluation ``onset`` and stops at a known evaluation ``clear``, both worked out by hand
from the raw series (rates over 60 s or 5 min of counters whose slope changes, or a gauge that
flips). The tests check the four edges of the alert's windows:

- ``onset + for - 5s``: still pending, no firing alert;
- ``onset + for``: firing, with its labels and rendered annotations;
- ``clear + keep_firing_for - 5s``: still firing (hysteresis);
- ``clear + keep_firing_for``: resolved.

``for`` and ``keep_firing_for`` come from ``detector/thresholds.py``; the onsets do not: they
follow from the series below and the thresholds' values, so a change of threshold that moves an
onset makes these tests fail until the scenario is revisited. ``python -m rules.generate``
writes them; tests/rules/test_generate.py checks the committed files are current.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detector.runbook import DEFAULT_PATTERN
from detector.signals import PROMETHEUS_JOBS, Tier
from foundation.timeseries import Snapshot

TESTS_DIR = Path(__file__).resolve().parent / "tests"
STEP_S = 5
END_S = 1000
CHANGE_S = 300  # the scenario's trigger
REVERT_S = 600  # the trigger's end

INSTANCE = "10.0.0.7:8100"
JOB = "retrywatch"
ENGINE = "0"
MODEL = "qwen2.5-7b-instruct"

# A series' value at time t (seconds); counters are given by their slope per second.
Curve = Callable[[float], float]


def gauge(before: float, during: float | None = None) -> Curve:
    """``before``, then ``during`` on [CHANGE_S, REVERT_S), then ``before`` again."""
    if during is None:
        return lambda t: before
    return lambda t: during if CHANGE_S <= t < REVERT_S else before


def counter(slope: float, slope_during: float | None = None) -> Curve:
    """A counter from 0 growing at ``slope``/s, at ``slope_during``/s on [CHANGE_S, REVERT_S)."""
    during = slope if slope_during is None else slope_during

    def value(t: float) -> float:
        head = min(t, CHANGE_S)
        mid = max(0.0, min(t, REVERT_S) - CHANGE_S)
        tail = max(0.0, t - REVERT_S)
        return slope * head + during * mid + slope * tail

    return value


def baseline(tier: Tier = "proxy") -> dict[str, Curve]:
    """A healthy engine at 1 call/s with Ĉ = 2 calls/s and a 120-s deadline, as a scrape of its
    proxy; for the vLLM tier, a scrape of vLLM alone (:func:`vllm_baseline`)."""
    if tier == "vllm":
        return vllm_baseline()
    return {
        'up{job="retrywatch"}': gauge(1),
        'retrywatch_attempts_total{kind="first"}': counter(1),
        'retrywatch_attempts_total{kind="retry"}': counter(0),
        "retrywatch_executions_created_total": counter(1),
        'retrywatch_executions_finished_total{fate="completed"}': counter(1),
        'retrywatch_executions_finished_total{fate="orphaned"}': counter(0),
        'retrywatch_executions_finished_total{fate="cancelled"}': counter(0),
        'retrywatch_calls_delivered_total{within_deadline="true"}': counter(1),
        'retrywatch_calls_delivered_total{within_deadline="false"}': counter(0),
        "retrywatch_calls_missed_deadline_total": counter(0),
        "retrywatch_executions_queued": gauge(0),
        "retrywatch_capacity_calls_per_second": gauge(2),
        "retrywatch_client_deadline_seconds": gauge(120),
        "vllm:num_requests_waiting": gauge(2),
        "vllm:num_requests_running": gauge(20),
        "vllm:prompt_tokens_total": counter(12000),
        "vllm:prefix_cache_queries_total": counter(12000),
        # the rest of vLLM's /metrics that the proxy passes through (the vLLM tier's): 1 finish/s,
        # within the deadline
        'vllm:request_success_total{finished_reason="length"}': counter(1),
        'vllm:e2e_request_latency_seconds_bucket{le="120.0"}': counter(1),
        "vllm:e2e_request_latency_seconds_count": counter(1),
    }


def vllm_baseline() -> dict[str, Curve]:
    """A healthy vLLM scraped alone (job ``vllm``, no proxy): it finishes 2 requests/s, each queued
    1 s and answered within the deadline, with 1000-token prompts, and two requests always
    waiting, so its queue never empties and Ĉ is estimated from its finish rate. The clients'
    deadline, 120 s, is stated as a series (as ``rules.stated`` records it): the rules assume none."""
    return {
        'up{job="vllm"}': gauge(1),
        "retrywatch_client_deadline_seconds": gauge(120),
        "vllm:num_requests_waiting": gauge(2),
        "vllm:num_requests_running": gauge(20),
        'vllm:request_success_total{finished_reason="length"}': counter(2),
        'vllm:e2e_request_latency_seconds_bucket{le="120.0"}': counter(2),
        "vllm:e2e_request_latency_seconds_count": counter(2),
        "vllm:request_queue_time_seconds_sum": counter(2),
        "vllm:request_queue_time_seconds_count": counter(2),
        "vllm:request_prompt_tokens_sum": counter(2000),
        "vllm:prefix_cache_queries_total": counter(2000),
        "vllm:prompt_tokens_total": counter(2000),
    }


@dataclass(frozen=True)
class Case:
    """One promtool test: series overrides, and the hand-worked edges of the condition."""

    name: str
    series: Mapping[str, Curve]
    onset_s: int  # first evaluation at which the condition holds
    clear_s: int  # first evaluation at which it no longer holds
    value_at_fire: float  # the alert's value at onset + for
    value_at_last: float  # its value at the last evaluation before clear_s
    engine_labels: bool = True  # NoData has only `instance`
    causes: tuple[str, ...] = ()  # a symptom alert's: the cause alerts firing beside it


@dataclass(frozen=True)
class AlertScenarios:
    alertname: str
    cases: tuple[Case, ...] = field(default_factory=tuple)

    @property
    def tier(self) -> Tier:
        """The alert's tier: its scenarios start from that tier's :func:`baseline`."""
        from detector.thresholds import ALERTS_BY_NAME

        return ALERTS_BY_NAME[self.alertname].tier


# --- the scenarios, worked by hand --------------------------------------------------------
# NOTE: Prometheus 2.42's rate() over [t-W, t] with samples every 5 s on the window's edges is
# exactly (v(t) - v(t-W)) / W, so a counter whose slope goes from a to b at T has, at T + x
# (0 <= x <= W), rate (a (W - x) + b x) / W.

SCENARIOS: tuple[AlertScenarios, ...] = (
    AlertScenarios(
        "VLLMMetastableRetryLoop",
        (
            # Cancellation on: executions at 3/s, all cancelled, nothing delivered, the waiting
            # queue at 400 >= 0.5 x 3/s x 120 s (with the 20 running, 1.75 deadlines at Ĉ = 2).
            # Ĉ drops from 10 to 2 at 300 s (creation/Ĉ from 0.3 to 1.5) and returns at 600 s:
            # a gauge, so onset 300 and clear 600 exactly.
            Case(
                "cancellation on: waiting at attempt rate x deadline, completions collapsed",
                {
                    'retrywatch_attempts_total{kind="retry"}': counter(2),
                    "retrywatch_executions_created_total": counter(3),
                    'retrywatch_executions_finished_total{fate="completed"}': counter(0),
                    'retrywatch_executions_finished_total{fate="cancelled"}': counter(3),
                    'retrywatch_calls_delivered_total{within_deadline="true"}': counter(0),
                    "vllm:num_requests_waiting": gauge(400),
                    "retrywatch_capacity_calls_per_second": gauge(10, 2),
                },
                onset_s=300,
                clear_s=600,
                value_at_fire=1.5,
                value_at_last=1.5,
            ),
            # Cancellation on behind a proxy cap (FIFO): the engine holds 80 waiting, the proxy's
            # queue 300 more; (80 + 300) / (3/s x 120 s) = 1.06 executions per deadline's worth,
            # and the engine cancels all it finishes. The same Ĉ flip.
            Case(
                "cancellation on behind a proxy cap: the queue held in the proxy",
                {
                    'retrywatch_attempts_total{kind="retry"}': counter(2),
                    "retrywatch_executions_created_total": counter(3),
                    'retrywatch_executions_finished_total{fate="completed"}': counter(0),
                    'retrywatch_executions_finished_total{fate="cancelled"}': counter(3),
                    'retrywatch_calls_delivered_total{within_deadline="true"}': counter(0),
                    "vllm:num_requests_waiting": gauge(80),
                    "retrywatch_executions_queued": gauge(300),
                    "retrywatch_capacity_calls_per_second": gauge(10, 2),
                },
                onset_s=300,
                clear_s=600,
                value_at_fire=1.5,
                value_at_last=1.5,
            ),
            # Cancellation off: completions continue (2.2/s, 2 of them orphaned), goodput 0.2,
            # the queue (over 300 executions, beyond one deadline at Ĉ = 2) grows by 0.2 per
            # second. The same Ĉ flip.
            Case(
                "cancellation off: completions orphaned, queue growing",
                {
                    'retrywatch_attempts_total{kind="retry"}': counter(2),
                    "retrywatch_executions_created_total": counter(3),
                    'retrywatch_executions_finished_total{fate="completed"}': counter(0.2),
                    'retrywatch_executions_finished_total{fate="orphaned"}': counter(2),
                    'retrywatch_calls_delivered_total{within_deadline="true"}': counter(0.2),
                    "vllm:num_requests_waiting": lambda t: 250 + 0.2 * t,
                    "retrywatch_capacity_calls_per_second": gauge(10, 2),
                },
                onset_s=300,
                clear_s=600,
                value_at_fire=1.5,
                value_at_last=1.5,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMBacklogBeyondDeadline",
        (
            # The waiting queue jumps from 2 to 280 executions at 300 s: with the 20 running,
            # 300 executions / 2 per s = 150 s of work, 1.25 deadlines, while first attempts keep
            # arriving.
            Case(
                "the pulse queues 1.25 deadlines of work",
                {"vllm:num_requests_waiting": gauge(2, 280)},
                onset_s=300,
                clear_s=600,
                value_at_fire=1.25,
                value_at_last=1.25,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMExecutionsAboveCapacity",
        (
            # Executions at 3/s; Ĉ from 10 to 2 at 300 s: creation/Ĉ 0.3 -> 1.5.
            Case(
                "executions created at 1.5 x capacity",
                {
                    "retrywatch_executions_created_total": counter(3),
                    "retrywatch_capacity_calls_per_second": gauge(10, 2),
                },
                onset_s=300,
                clear_s=600,
                value_at_fire=1.5,
                value_at_last=1.5,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMRetryAmplification",
        (
            # First attempts at 1/s throughout; executions from 1/s to 3.5/s at 300 s. Over 60 s,
            # executions per first attempt at 300 + x is 1 + 2.5 x / 60 >= 2 from x = 24: onset
            # 325. After 600 it is (3.5 (60 - y) + y) / 60 < 2 from y = 36: clear 640, and the last
            # value before it (y = 35) is 122.5 / 60.
            Case(
                "3.5 executions per first attempt",
                {"retrywatch_executions_created_total": counter(1, 3.5)},
                onset_s=325,
                clear_s=640,
                value_at_fire=3.5,
                value_at_last=122.5 / 60,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMOrphanedExecutions",
        (
            # Completions with a subscriber at 2/s; orphaned completions from 0 to 2.4/s at 300 s.
            # At 300 + x the orphaned rate is a = 2.4 x / 60 and the share a / (2 + a) >= 0.25 once
            # a >= 2/3, x >= 16.7: onset 320. After 600, a = 2.4 (60 - y) / 60 >= 2/3 up to y = 43.3:
            # clear 645, last value (y = 40) 0.8 / 2.8.
            Case(
                "2.4 of 4.4 completions per second orphaned",
                {
                    'retrywatch_executions_finished_total{fate="completed"}': counter(2),
                    'retrywatch_executions_finished_total{fate="orphaned"}': counter(0, 2.4),
                },
                onset_s=320,
                clear_s=645,
                value_at_fire=2.4 / 4.4,
                value_at_last=0.8 / 2.8,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMPromptTokensUncounted",
        (
            # Admitted prompt tokens at 12,000/s; counted ones drop to 5,400/s at 300 s (prompts
            # aborted before their first token). Over 5 min the gap at 300 + x is 6600 x / (300 *
            # 12000) >= 0.2 from x = 109.1: onset 410; after 600 it is 6600 (300 - y) / 3.6e6 < 0.2
            # from y = 190.9: clear 795, last value (y = 190) 6600 * 110 / 3.6e6.
            Case(
                "prompt tokens counted fall 55% short of admitted",
                {"vllm:prompt_tokens_total": counter(12000, 5400)},
                onset_s=410,
                clear_s=795,
                value_at_fire=6600 * 170 / 3.6e6,
                value_at_last=6600 * 110 / 3.6e6,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMCallsNotDeliveredInTime",
        (
            # Calls judged stay at 1/s; from 300 s 0.8/s of them miss the deadline (0.2/s delivered
            # in time). The error ratio over W at 300 + x (x <= W) is 0.8 x / W: >= 0.06 (3 budgets
            # at 98 %) over 60 s from x = 4.5 and over 300 s from x = 22.5: onset 325, and at the
            # firing (x = 55) 0.8 x 55 / 60. After 600 the 60-s ratio is 0.8 (60 - y) / 60 < 0.06
            # from y = 55.5: clear 660, last value (y = 55) 0.8 x 5 / 60. The alert's value is the
            # 60-s burn rate: the ratio over 1 - 0.98.
            Case(
                "80% of the calls miss the deadline, no cause alert firing",
                {
                    'retrywatch_calls_delivered_total{within_deadline="true"}': counter(1, 0.2),
                    "retrywatch_calls_missed_deadline_total": counter(0, 0.8),
                },
                onset_s=325,
                clear_s=660,
                value_at_fire=0.8 * 55 / 60 / (1 - 0.98),
                value_at_last=0.8 * 5 / 60 / (1 - 0.98),
            ),
            # The same, with the waiting queue at 280 (1.25 deadlines of work at Ĉ, as in the
            # backlog's scenario; 1.17 of them waiting): the description names the backlog alerts
            # of both tiers firing beside it.
            Case(
                "80% of the calls miss the deadline behind a backlog",
                {
                    'retrywatch_calls_delivered_total{within_deadline="true"}': counter(1, 0.2),
                    "retrywatch_calls_missed_deadline_total": counter(0, 0.8),
                    "vllm:num_requests_waiting": gauge(2, 280),
                },
                onset_s=325,
                clear_s=660,
                value_at_fire=0.8 * 55 / 60 / (1 - 0.98),
                value_at_last=0.8 * 5 / 60 / (1 - 0.98),
                causes=("VLLMBacklogBeyondDeadline", "VLLMQueueBeyondDeadline"),
            ),
        ),
    ),
    AlertScenarios(
        "VLLMRetrywatchNoData",
        (
            # The scrape of the proxy fails from 300 s to 600 s (up == 0).
            Case(
                "the target is down",
                {'up{job="retrywatch"}': gauge(1, 0)},
                onset_s=300,
                clear_s=600,
                value_at_fire=1.0,
                value_at_last=1.0,
                engine_labels=False,
            ),
        ),
    ),
)


# The vLLM tier's: vLLM scraped alone, from :func:`vllm_baseline`. The alerts that read Ĉ are
# given it as the operator states it to Prometheus (a series of the proxy's gauge's name, 2/s):
# the online estimate averages rate() over an hour, and Prometheus' rate() of a series younger
# than its range is extrapolated, so the estimate of a 1000-s test is no round number.
_STATED_CAPACITY: dict[str, Curve] = {"retrywatch_capacity_calls_per_second": gauge(2)}
VLLM_SCENARIOS: tuple[AlertScenarios, ...] = (
    AlertScenarios(
        "VLLMRetryLoopSuspected",
        (
            # Cancellation off: the waiting queue at 400 (400 / (2/s x 120 s) = 1.67 deadlines,
            # a gauge: from 300 to 600 exactly); finishes stay at Ĉ but none is in time (the
            # deadline's bucket stops growing) and each queued 100 s. At 300 + x the late share
            # over 60 s is x/60 (>= 0.8 from x = 48) and the mean queue time (60 + 99x)/60 s
            # (>= 60 s, half the deadline, from x = 35.8): onset 350.
            Case(
                "cancellation off: finishes at capacity, all late, behind a queue of 1.67 deadlines",
                {
                    **_STATED_CAPACITY,
                    "vllm:num_requests_waiting": gauge(2, 400),
                    'vllm:e2e_request_latency_seconds_bucket{le="120.0"}': counter(2, 0),
                    "vllm:request_queue_time_seconds_sum": counter(2, 200),
                },
                onset_s=350,
                clear_s=600,
                value_at_fire=400 / 240,
                value_at_last=400 / 240,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMAbandonedWorkSustained",
        (
            # Cancellation on, the loop held in front of vLLM: from 300 to 600 s it admits prompt
            # tokens as before (2000/s) while it finishes a tenth of Ĉ (0.2/s, 200 prompt tokens/s),
            # its queue never empty. At 300 + x the finishes over 60 s are 2 - 0.03x per second
            # (<= 0.3 Ĉ = 0.6 from x = 46.7) and the unfinished share 30x/2000 (>= 0.5 from
            # x = 33.3): onset 350, firing 240 s later. After 600 + y the finishes are 0.2 + 0.03y
            # (above 0.6 from y = 13.3): clear 615; the unfinished share at 610 is 1 - 500/2000.
            Case(
                "cancellation on: admitting at capacity, finishing a tenth of it, for minutes",
                {
                    **_STATED_CAPACITY,
                    'vllm:request_success_total{finished_reason="length"}': counter(2, 0.2),
                    'vllm:e2e_request_latency_seconds_bucket{le="120.0"}': counter(2, 0.2),
                    "vllm:e2e_request_latency_seconds_count": counter(2, 0.2),
                    "vllm:request_queue_time_seconds_sum": counter(2, 0.2),
                    "vllm:request_queue_time_seconds_count": counter(2, 0.2),
                    "vllm:request_prompt_tokens_sum": counter(2000, 200),
                },
                onset_s=350,
                clear_s=615,
                value_at_fire=0.9,
                value_at_last=0.75,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMRetryLoopAtQueueCap",
        (
            # The queue pinned at a cap: vLLM refuses 1 request/s from 300 to 400 s (a refusal in
            # the last hour from 305 on: the counter first grows between 300 and 305), and holds
            # 200 waiting and 20 running from 100 to 850 s: (200 + 20) / (2/s x 120 s) = 0.917
            # deadlines of work unfinished. Onset 305, firing 420 s later (725); clear 850.
            Case(
                "refusals at the cap, then the queue held near it for minutes",
                {
                    **_STATED_CAPACITY,
                    "vllm:num_requests_waiting": lambda t: 200.0 if 100 <= t < 850 else 2.0,
                    'vllm:admission_rejections_total{reason="max_num_queued_reqs"}': (
                        lambda t: min(max(t - 300.0, 0.0), 100.0)
                    ),
                },
                onset_s=305,
                clear_s=850,
                value_at_fire=220 / 240,
                value_at_last=220 / 240,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMQueueBeyondDeadline",
        (
            # The waiting queue at 300 from 300 to 600 s: 300 / (2/s x 120 s) = 1.25 deadlines.
            Case(
                "the waiting queue holds 1.25 deadlines of work while vLLM admits",
                {**_STATED_CAPACITY, "vllm:num_requests_waiting": gauge(2, 300)},
                onset_s=300,
                clear_s=600,
                value_at_fire=1.25,
                value_at_last=1.25,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMRequestsNotAnsweredInTime",
        (
            # Half of the finishes late from 300 to 600 s (the deadline's bucket grows 1/s of
            # the 2/s finished; admitted prompt tokens all finish). At 300 + x the error over a
            # window W is x/(2W), a burn of 25x/W: >= 3 over 300 s from x = 36 (and over 60 s
            # from x = 7.2), so onset 340, firing at 370 with the short window's burn at 25.
            # After 600 + y the short window's burn is (60 - y)/2.4: below 3 from y = 52.8,
            # so clear 655 (the last evaluation before it, y = 50: 10/2.4).
            Case(
                "half of vLLM's finishes come after the deadline",
                {'vllm:e2e_request_latency_seconds_bucket{le="120.0"}': counter(2, 1)},
                onset_s=340,
                clear_s=655,
                value_at_fire=0.5 / (1 - 0.98),
                value_at_last=10 / 2.4,
            ),
            # vLLM's queue cap refuses 2 requests/s from 300 to 600 s while it finishes 2/s in
            # time: refused over finished + refused. At 300 + x the refusals over a window W are
            # 2x/W per second, the error x/(W + x), a burn of 50x/(W + x): >= 3 over 300 s from
            # x = 19.1 (over 60 s from x = 3.8), so onset 320, firing at 350 with the short
            # window's burn at 50 x 50 / 110. After 600 + y the short window's refusals are
            # r = 2(60 - y)/60 per second, a burn of 50r/(2 + r): below 3 from y = 56.2, so clear
            # 660 (at y = 55: r = 1/6, a burn of 50/13).
            Case(
                "vLLM's queue cap refuses half of the requests",
                {'vllm:admission_rejections_total{reason="max_num_queued_reqs"}': counter(0, 2)},
                onset_s=320,
                clear_s=660,
                value_at_fire=2500 / 110,
                value_at_last=50 / 13,
            ),
        ),
    ),
    AlertScenarios(
        "VLLMTierNoData",
        (
            # The scrape of vLLM fails from 300 s to 600 s (up == 0 for job "vllm").
            Case(
                "vLLM's target is down",
                {'up{job="vllm"}': gauge(1, 0)},
                onset_s=300,
                clear_s=600,
                value_at_fire=1.0,
                value_at_last=1.0,
                engine_labels=False,
            ),
        ),
    ),
)

ALL_SCENARIOS: tuple[AlertScenarios, ...] = (*SCENARIOS, *VLLM_SCENARIOS)


# --- rendering ------------------------------------------------------------------------------


def _with_target_labels(selector: str, job: str = JOB) -> str:
    name, _, rest = selector.partition("{")
    labels = rest.rstrip("}")
    extra = [f'instance="{INSTANCE}"']
    if 'job="' not in labels:
        extra.append(f'job="{job}"')
    if name.startswith("vllm:"):
        extra += [f'engine="{ENGINE}"', f'model_name="{MODEL}"']
    inner = ",".join([p for p in (labels,) if p] + extra)
    return f"{name}{{{inner}}}"


def _parse_selector(selector: str) -> tuple[str, dict[str, str]]:
    name, _, rest = selector.partition("{")
    labels: dict[str, str] = {}
    for part in filter(None, rest.rstrip("}").split(",")):
        key, _, value = part.partition("=")
        labels[key] = value.strip('"')
    return name, labels


def case_snapshots(
    case: Case, *, step_s: int = STEP_S, end_s: int = END_S, tier: Tier = "proxy"
) -> list[Snapshot]:
    """The scenario as the scrapes of the proxy's ``/metrics`` (what a reproduce run's series
    holds; vLLM's own for the vLLM tier's): every series but ``up``, which is the scraper's own,
    with vLLM's engine labels."""
    curves = {sel: c for sel, c in {**baseline(tier), **case.series}.items() if not sel.startswith("up{")}
    out: list[Snapshot] = []
    for t in range(0, end_s + 1, step_s):
        samples: list[tuple[str, dict[str, str], float]] = []
        for selector, curve in curves.items():
            name, labels = _parse_selector(selector)
            if name.startswith("vllm:"):
                labels = {**labels, "engine": ENGINE, "model_name": MODEL}
            samples.append((name, labels, float(curve(float(t)))))
        out.append(Snapshot(float(t), samples))
    return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(round(x, 6))


def encode(values: list[float]) -> str:
    """promtool's expanding notation: runs of equal steps become ``a+bxn`` (n + 1 values)."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        if i + 1 < len(values):
            step = round(values[i + 1] - values[i], 9)
            while j + 1 < len(values) and abs(round(values[j + 1] - values[j], 9) - step) < 1e-9:
                j += 1
        if j == i:
            parts.append(_num(values[i]))
        else:
            step = round(values[i + 1] - values[i], 9)
            sign = "+" if step >= 0 else "-"
            parts.append(f"{_num(values[i])}{sign}{_num(abs(step))}x{j - i}")
        i = j + 1
    return " ".join(parts)


def _go_percent(x: float) -> str:
    # Prometheus' humanizePercentage: fmt.Sprintf("%.4g%%", v*100)
    return f"{x * 100:.4g}%"


def _annotations(
    alertname: str, value: float, engine_labels: bool, runbook_pattern: str, causes: tuple[str, ...] = ()
) -> dict[str, str]:
    from detector.thresholds import ALERTS_BY_NAME, causes_text, engine_model

    rule = ALERTS_BY_NAME[alertname]
    text = rule.description
    text = text.replace("{value:.2f}", f"{value:.2f}").replace("{value:.0%}", _go_percent(value))
    text = text.replace("{missing}", "a needed series or the scrape target")
    text = text.replace("{causes}", causes_text(causes))
    text = text.replace("{instance}", INSTANCE)
    text = text.replace("{engine_model}", engine_model(ENGINE, MODEL) if engine_labels else "")
    return {"summary": rule.summary, "description": text, "runbook_url": rule.runbook_url(runbook_pattern)}


def _labels(alertname: str, engine_labels: bool) -> dict[str, str]:
    from detector.thresholds import ALERTS_BY_NAME

    labels = {"severity": ALERTS_BY_NAME[alertname].severity, "instance": INSTANCE}
    if engine_labels:
        labels.update({"engine": ENGINE, "model": MODEL})
    return labels


def _duration(seconds: int) -> str:
    return f"{seconds}s"


def unit_test_document(scenarios: AlertScenarios, runbook_pattern: str = DEFAULT_PATTERN) -> dict[str, Any]:
    from detector.thresholds import ALERTS_BY_NAME

    rule = ALERTS_BY_NAME[scenarios.alertname]
    for_s, keep_s = int(rule.for_s), int(rule.keep_firing_for_s)
    tests: list[dict[str, Any]] = []
    times = [float(t) for t in range(0, END_S + 1, STEP_S)]
    job = PROMETHEUS_JOBS[scenarios.tier]
    for case in scenarios.cases:
        curves = {**baseline(scenarios.tier), **case.series}
        input_series = [
            {"series": _with_target_labels(sel, job), "values": encode([curve(t) for t in times])}
            for sel, curve in curves.items()
        ]
        fire = case.onset_s + for_s
        resolve = case.clear_s + keep_s
        if not case.onset_s + for_s < case.clear_s:
            raise ValueError(f"{scenarios.alertname}: {case.name}: the trigger ends before the alert fires")
        labels = _labels(scenarios.alertname, case.engine_labels)

        def firing(value: float, labels: dict[str, str] = labels, case: Case = case) -> list[dict[str, Any]]:
            return [
                {
                    "exp_labels": labels,
                    "exp_annotations": _annotations(
                        scenarios.alertname, value, case.engine_labels, runbook_pattern, case.causes
                    ),
                }
            ]

        alert_tests = [
            {"eval_time": _duration(fire - STEP_S), "alertname": scenarios.alertname, "exp_alerts": []},
            {
                "eval_time": _duration(fire),
                "alertname": scenarios.alertname,
                "exp_alerts": firing(case.value_at_fire),
            },
            {
                "eval_time": _duration(resolve - STEP_S),
                "alertname": scenarios.alertname,
                "exp_alerts": firing(case.value_at_last),
            },
            {"eval_time": _duration(resolve), "alertname": scenarios.alertname, "exp_alerts": []},
        ]
        tests.append(
            {
                "name": case.name,
                "interval": _duration(STEP_S),
                "input_series": input_series,
                "alert_rule_test": alert_tests,
            }
        )
    return {
        "rule_files": ["../retrywatch.rules.yml"],
        "evaluation_interval": _duration(STEP_S),
        "tests": tests,
    }


HEADER = (
    "# promtool unit tests for {alertname}: just before and just after its `for` and\n"
    "# `keep_firing_for` windows. GENERATED by `python -m rules.generate` from rules/unittests.py\n"
    "# (scenarios worked by hand) and detector/thresholds.py. Run: promtool test rules {path}\n"
)


def unit_test_files(runbook_pattern: str = DEFAULT_PATTERN) -> dict[Path, str]:
    """{path: text} of every promtool test file (the rules' runbook links from ``runbook_pattern``)."""
    out: dict[Path, str] = {}
    for scenarios in ALL_SCENARIOS:
        path = TESTS_DIR / f"{scenarios.alertname.lower()}.test.yml"
        body = yaml.safe_dump(
            unit_test_document(scenarios, runbook_pattern), sort_keys=False, width=1000, allow_unicode=True
        )
        out[path] = HEADER.format(alertname=scenarios.alertname, path=f"rules/tests/{path.name}") + body
    return out
