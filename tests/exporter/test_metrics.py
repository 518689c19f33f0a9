"""The metrics module: the collector on a fresh registry, the window, the vLLM scan (the learned
deadline: test_deadlines)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from exporter.metrics import ProxyMetrics, SlidingWindow, WindowSample
from exporter.policy import Attempt, Created, Policy, PolicyConfig
from exporter.upstreamtext import (
    SLICE_CHARS,
    digest,
    digest_sliced,
    is_exposition,
    scan_vllm,
    scan_vllm_sliced,
)
from foundation.timeseries import parse_exposition

T = TypeVar("T")

VLLM_TEXT = """# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a b"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:prompt_tokens_total{model_name="m"} 1000 1700000000000
vllm:prompt_tokens_created{model_name="m"} 17.0
vllm:prefix_cache_queries_total 4000
"""


def test_scan_sums_label_sets_and_ignores_other_families() -> None:
    got = scan_vllm(VLLM_TEXT)
    assert got == {
        "vllm:num_requests_waiting": 7.0,
        "vllm:prompt_tokens_total": 1000.0,
        "vllm:prefix_cache_queries_total": 4000.0,
    }
    # A wanted line first in the text, CRLF line ends, a brace in a label value; lines the format
    # refuses and families that only begin with a wanted name are not counted.
    odd = (
        "vllm:num_requests_waiting 2\r\n"
        'vllm:num_requests_waiting{model_name="a}b",x="\\"q\\""} 1e1 1700000000000\r\n'
        'vllm:num_requests_waiting{engine="0"} seven\n'
        "vllm:num_requests_waiting_by_reason 100\n"
        " vllm:prompt_tokens_total 5\n"
        "vllm:prompt_tokens_total +Inf"
    )
    assert scan_vllm(odd) == {"vllm:num_requests_waiting": 12.0, "vllm:prompt_tokens_total": math.inf}


def _sample(
    t: float, created: float, prompt: float | None = None, queries: float | None = None
) -> WindowSample:
    return WindowSample(
        t=t, attempts=2 * created, created=created, prompt_tokens=prompt, prefix_queries=queries, waiting=5.0
    )


def test_window_rates_and_the_prompt_token_gap() -> None:
    w = SlidingWindow(window_s=10.0)
    assert math.isnan(w.rate("created"))
    w.add(_sample(0.0, 0, 0, 0))
    w.add(_sample(5.0, 10, 100, 400))
    assert w.rate("created") == 2.0 and w.rate("attempts") == 4.0
    assert w.prompt_token_gap() == 0.75
    w.add(_sample(20.0, 10, 100, 400))  # nothing admitted within the last window
    assert w.rate("created") == 0.0
    assert math.isnan(w.prompt_token_gap())
    assert len(w.samples) == 2


def test_collector_reads_the_policy_fresh_with_every_label_up_front() -> None:
    policy = Policy(PolicyConfig(deadline_s=30.0))
    metrics = ProxyMetrics(policy, window_s=60.0, capacity=2.0)
    reg = metrics.registry
    assert reg.get_sample_value("retrywatch_executions_finished_total", {"fate": "dropped"}) == 0
    assert reg.get_sample_value("retrywatch_attempts_shed_total", {"reason": "deadline"}) == 0
    policy.on_attempt(0.0, Attempt(key="k", identified=True))
    policy.on_attempt(1.0, Attempt(key="k", identified=True))
    assert reg.get_sample_value("retrywatch_attempts_total", {"kind": "first"}) == 1
    assert reg.get_sample_value("retrywatch_attempts_total", {"kind": "retry"}) == 1
    assert reg.get_sample_value("retrywatch_attempts_attached_total") == 1
    assert reg.get_sample_value("retrywatch_executions_live") == 1
    assert reg.get_sample_value("retrywatch_client_deadline_seconds") == 30.0
    assert reg.get_sample_value("retrywatch_upstream_up") == 0
    metrics.sample(0.0)
    metrics.sample(2.0)
    assert reg.get_sample_value("retrywatch_execution_creation_rate") == 0.0
    metrics.observe_attempt("disconnected", 3.0)
    assert reg.get_sample_value("retrywatch_attempt_duration_seconds_count", {"outcome": "disconnected"}) == 1
    assert reg.get_sample_value("retrywatch_attempt_duration_seconds_count", {"outcome": "shed"}) == 0
    text = metrics.exposition(passthrough=True, now=0.0).decode()
    assert "vllm:" not in text  # upstream never answered: nothing passed through
    metrics.upstream_fetched(10.0, VLLM_TEXT)
    assert metrics.exposition(passthrough=True, now=10.0).decode().endswith(VLLM_TEXT)
    assert "vllm:" not in metrics.exposition(passthrough=False, now=10.0).decode()


def test_calls_missed_deadline_are_counted_at_a_sample_and_served_only_with_a_deadline() -> None:
    policy = Policy(PolicyConfig())
    metrics = ProxyMetrics(policy, window_s=60.0, capacity=2.0)
    reg = metrics.registry
    policy.on_attempt(0.0, Attempt(key="k", identified=True))
    metrics.sample(1000.0)
    # no deadline: no call can miss it, and a zero would claim every call was in time
    assert reg.get_sample_value("retrywatch_calls_missed_deadline_total") is None
    policy.set_deadline(30.0)
    policy.on_attempt(1000.0, Attempt(key="j", identified=True))
    assert reg.get_sample_value("retrywatch_calls_missed_deadline_total") == 0
    metrics.sample(1030.5)  # a scrape's sample sweeps: the deadline passed with no event since
    assert reg.get_sample_value("retrywatch_calls_missed_deadline_total") == 1


def test_the_retry_memory_at_its_bounds_counts_what_it_forgets_on_metrics() -> None:
    config = PolicyConfig(max_remembered_calls=3, max_remembered_departures=2, deadline_s=30.0)
    policy = Policy(config)
    metrics = ProxyMetrics(policy, window_s=60.0, capacity=2.0)
    reg = metrics.registry
    # created up front, at zero
    assert reg.get_sample_value("retrywatch_calls_forgotten_total") == 0
    assert reg.get_sample_value("retrywatch_departures_evicted_total") == 0
    for i in range(5):  # five calls awaiting delivery where three may: the two oldest forgotten
        policy.on_attempt(float(i), Attempt(key=f"call-{i}", identified=True))
    assert reg.get_sample_value("retrywatch_calls_forgotten_total") == 2
    # three calls without a call id, each the newest awaiting (the three before it forgotten),
    # whose attempts leave where two departures are kept
    for i in range(3):
        a = policy.on_attempt(10.0 + i, Attempt(key=f"body-{i}", identified=False)).decision
        assert isinstance(a, Created)
        policy.on_subscriber_left(10.5 + i, a.subscriber_id)
    assert reg.get_sample_value("retrywatch_departures_evicted_total") == 1
    assert reg.get_sample_value("retrywatch_calls_forgotten_total") == 2 + 3
    metrics.sample(1000.0)  # the three remembered miss their deadline; the forgotten do not
    assert reg.get_sample_value("retrywatch_calls_missed_deadline_total") == 3
    assert reg.get_sample_value("retrywatch_calls_forgotten_total") == 5


def test_the_last_good_upstream_text_is_served_until_it_is_too_stale() -> None:
    metrics = ProxyMetrics(Policy(), window_s=60.0, capacity=None, max_staleness_s=15.0)
    metrics.upstream_fetched(100.0, VLLM_TEXT)
    metrics.upstream_failed(103.0)  # a refresh failed (or timed out): keep serving the last good one
    assert metrics.registry.get_sample_value("retrywatch_upstream_up") == 0
    assert metrics.exposition(passthrough=True, now=115.0).decode().endswith(VLLM_TEXT)
    metrics.sample(115.0)
    assert metrics.window.latest_waiting() == 7.0
    assert "vllm:" not in metrics.exposition(passthrough=True, now=115.1).decode()  # too stale: dropped
    metrics.sample(115.1)
    assert metrics.window.latest_waiting() is None
    metrics.upstream_fetched(116.0, VLLM_TEXT)
    assert metrics.registry.get_sample_value("retrywatch_upstream_up") == 1
    assert metrics.exposition(passthrough=True, now=116.0).decode().endswith(VLLM_TEXT)


def test_only_an_exposition_is_passed_through_and_checking_one_is_linear() -> None:
    """Every line the detector's parser and Prometheus read passes; a text one of them would
    refuse does not (``test_proxy_upstream.py`` holds a real proxy to it), and a hostile text of
    blanks or one endless name is refused in one pass, not by backtracking."""
    from tests.exporter.upstream import Counters, metrics_text

    assert is_exposition(VLLM_TEXT) and is_exposition(metrics_text(Counters()))
    for text in ("", "\n", "a 1", 'a{b="c\\"d",} +Inf -12\n', "a NaN\r\n# EOF\n", "# TYPE a gauge\na 1\n"):
        assert is_exposition(text), text
    refused = ("<html>\n", '{"a": 1}\n', "a seven\n", "# TYPE a gauges\n", 'a{b="c" d="e"} 1\n', "a 1 2 3\n")
    for text in refused:
        assert not is_exposition(text), text
    metrics = ProxyMetrics(Policy(), window_s=60.0, capacity=None)
    metrics.upstream_fetched(1.0, VLLM_TEXT + "<html>\n")
    assert "vllm:" not in metrics.exposition(passthrough=True, now=1.0).decode()
    metrics.upstream_fetched(2.0, VLLM_TEXT)
    assert metrics.exposition(passthrough=True, now=2.0).decode().endswith(VLLM_TEXT)
    started = time.perf_counter()
    for hostile in (" " * (4 << 20) + "x", "a" * (4 << 20), 'a{b="' + "c" * (4 << 20)):
        assert not is_exposition(hostile)
    assert time.perf_counter() - started < 5.0


def test_the_prompt_token_gap_skips_samples_without_the_upstream_counters() -> None:
    w = SlidingWindow(window_s=60.0)
    w.add(_sample(0.0, 0))  # taken before the first upstream scrape arrived
    w.add(_sample(1.0, 1, 100, 200))
    assert math.isnan(w.prompt_token_gap())
    w.add(_sample(2.0, 2, 150, 400))
    assert w.prompt_token_gap() == 0.75


def test_a_huge_exposition_is_scanned_and_checked_right_in_slices_the_loop_runs_between() -> None:
    """80k series of the families the window reads (a vLLM with many adapters): the sums are
    right, the upstream's own retrywatch_ families are left out, and the work is cut into slices
    with a turn of the event loop between each (a task beside it runs once a slice)."""
    from tests.exporter.oddengine import PROMPT_TOKENS_PER_SERIES, WAITING_PER_SERIES, big_exposition

    series = 80_000
    text = big_exposition(series, own_families=True)
    expected = {
        "vllm:num_requests_waiting": WAITING_PER_SERIES * (series // 2),
        "vllm:prompt_tokens_total": PROMPT_TOKENS_PER_SERIES * (series - series // 2),
    }
    assert scan_vllm(text) == expected
    small = big_exposition(200, own_families=True)  # the same sums as prometheus_client's parser
    parsed: dict[str, float] = {}
    for name, _, value in parse_exposition(small):
        parsed[name] = parsed.get(name, 0.0) + value
    assert scan_vllm(small) == {k: v for k, v in parsed.items() if k.startswith("vllm:")}

    async def beside(work: Coroutine[Any, Any, T]) -> tuple[T, int]:
        turns = 0
        done = False

        async def count() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        counter = asyncio.ensure_future(count())
        result = await work
        done = True
        await counter
        return result, turns

    slices = len(text) // SLICE_CHARS
    scanned, turns = asyncio.run(beside(scan_vllm_sliced(text)))
    assert scanned == expected and turns >= slices
    found, turns = asyncio.run(beside(digest_sliced(text)))
    assert turns >= slices
    assert found.usable and found.own_lines_dropped == 7 and "retrywatch_" not in found.passthrough
    assert found.passthrough.count("\n") == text.count("\n") - 7
    assert digest(text) == found
