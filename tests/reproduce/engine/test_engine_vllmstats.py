"""vLLM's histograms in the engine model: which executions land in which family, and when
(``reproduce.engine.vllmstats``), on a unit-time engine (every step takes 1 s)."""

from __future__ import annotations

import pytest

from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from foundation.vllmbuckets import SERIES_HISTOGRAMS, bucket_bounds, le_label, request_tokens_buckets
from reproduce.engine import EngineModel, EventKind
from reproduce.engine.vllmstats import Histogram
from tests.reproduce.engine.test_engine_model import Driver, create_engine, request

#: The families observed when an execution finishes in the engine (and only then).
AT_FINISH = (
    mn.VLLM_E2E_LATENCY,
    mn.VLLM_QUEUE_TIME,
    mn.VLLM_PREFILL_TIME,
    mn.VLLM_DECODE_TIME,
    mn.VLLM_REQUEST_PROMPT_TOKENS,
    mn.VLLM_REQUEST_GENERATION_TOKENS,
)
LABELS = {"engine": "0", "model_name": "m"}


def snap(engine: EngineModel) -> Snapshot:
    return Snapshot(0.0, engine.metrics_samples(LABELS))


def count(engine: EngineModel, family: str) -> float:
    value = snap(engine).value(family + "_count")
    assert value is not None, family
    return value


def total(engine: EngineModel, family: str) -> float:
    value = snap(engine).value(family + "_sum")
    assert value is not None, family
    return value


def finished(engine: EngineModel) -> float:
    return snap(engine).value(mn.VLLM_REQUEST_SUCCESS) or 0.0


def test_a_completed_execution_is_in_every_family_with_vllms_intervals() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 20)], max_tokens=3), 0.0)
    drv.run()  # step 1 (0-1 s): prefill and first token; steps 2, 3: one token each
    assert drv.kinds("x") == [EventKind.FIRST_TOKEN, EventKind.FINISHED]
    expected_sums = {
        mn.VLLM_TTFT: 1.0,  # first token - arrival
        mn.VLLM_E2E_LATENCY: 3.0,  # finish - arrival
        mn.VLLM_QUEUE_TIME: 0.0,  # first scheduled - queued
        mn.VLLM_PREFILL_TIME: 1.0,  # first token - first scheduled
        mn.VLLM_DECODE_TIME: 2.0,  # last token - first token
        mn.VLLM_INTER_TOKEN_LATENCY: 2.0,  # tokens 2 and 3, 1 s each
        mn.VLLM_REQUEST_PROMPT_TOKENS: 20.0,
        mn.VLLM_REQUEST_GENERATION_TOKENS: 3.0,
    }
    assert {family: total(engine, family) for family in expected_sums} == expected_sums
    assert count(engine, mn.VLLM_INTER_TOKEN_LATENCY) == 2
    for family in (mn.VLLM_TTFT, *AT_FINISH):
        assert count(engine, family) == 1, family
    assert snap(engine).value(mn.VLLM_REQUEST_SUCCESS, finished_reason="length") == 1
    # cumulative buckets with Prometheus' le (a value equal to a bound is in that bucket)
    e2e = snap(engine)
    assert e2e.value(mn.VLLM_E2E_LATENCY + "_bucket", le="2.5") == 0
    assert e2e.value(mn.VLLM_E2E_LATENCY + "_bucket", le="5.0") == 1
    assert e2e.value(mn.VLLM_TTFT + "_bucket", le="1.0") == 1
    assert e2e.value(mn.VLLM_E2E_LATENCY + "_bucket", le="+Inf") == 1
    # every delivered token is a first token or a later one
    assert engine.generation_tokens_total == count(engine, mn.VLLM_TTFT) + count(
        engine, mn.VLLM_INTER_TOKEN_LATENCY
    )


def test_queue_time_runs_from_arrival_to_first_scheduling() -> None:
    engine = create_engine(max_num_seqs=1)
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 20)], max_tokens=3), 0.0)
    engine.add_request(request("b", [("b", 20)], max_tokens=3), 0.0)
    drv.run()
    assert count(engine, mn.VLLM_QUEUE_TIME) == 2
    # b waited while a ran its three steps (vLLM scheduled b's first step as a's last began)
    assert total(engine, mn.VLLM_QUEUE_TIME) == pytest.approx(engine.traces["b"].scheduled_at[0])
    assert total(engine, mn.VLLM_QUEUE_TIME) >= 2.0


def test_an_execution_aborted_while_waiting_is_in_no_family() -> None:
    engine = create_engine(max_num_seqs=1)
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 20)], max_tokens=10), 0.0)
    engine.add_request(request("w", [("w", 40)], max_tokens=10), 0.0)
    drv.step()
    drv.step()
    assert engine.num_waiting == 1
    drv.events.extend(engine.abort_request("w", drv.now))
    drv.run()
    assert drv.kinds("w") == [EventKind.ABORTED]
    # exactly what a alone leaves: w is in nothing, not even the prefix-cache queries
    assert engine.prefix_cache_queries_total == 20
    for family in (mn.VLLM_TTFT, *AT_FINISH):
        assert count(engine, family) == 1, family
    assert finished(engine) == 1


def test_an_execution_aborted_in_prefill_is_only_in_the_prefix_cache_queries() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 150)], max_tokens=5), 0.0)
    engine.start_step(drv.now)  # the first 100 prompt tokens
    engine.abort_request("x", drv.now + 0.5)
    drv.now += 1
    drv.events.extend(engine.finish_step(drv.now))
    drv.run()  # the last 50 were in flight: computed, no token reaches anyone
    assert drv.kinds("x") == [EventKind.ABORTED]
    assert engine.prefix_cache_queries_total == 150
    assert engine.prompt_tokens_total == 0 and engine.generation_tokens_total == 0
    for family in SERIES_HISTOGRAMS:
        assert count(engine, family) == 0, family
    assert finished(engine) == 0


def test_an_execution_aborted_in_decode_keeps_its_tokens_but_is_never_finished() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 20)], max_tokens=100), 0.0)
    drv.step()  # first token at 1 s
    drv.step()
    drv.step()  # tokens 2 and 3
    engine.start_step(drv.now)
    engine.abort_request("x", drv.now + 0.5)  # step 4's and step 5's tokens are dropped
    drv.now += 1
    engine.finish_step(drv.now)
    drv.run()
    assert drv.kinds("x") == [EventKind.FIRST_TOKEN, EventKind.ABORTED]
    assert count(engine, mn.VLLM_TTFT) == 1 and total(engine, mn.VLLM_TTFT) == 1.0
    assert count(engine, mn.VLLM_INTER_TOKEN_LATENCY) == 2
    assert engine.prompt_tokens_total == 20 and engine.generation_tokens_total == 3
    for family in AT_FINISH:
        assert count(engine, family) == 0, family
    assert finished(engine) == 0  # not even finished_reason="abort"


def test_a_refused_execution_is_only_an_admission_rejection() -> None:
    engine = create_engine(max_num_queued_reqs=1)
    assert engine.add_request(request("a", [("a", 20)], max_tokens=2), 0.0)
    assert not engine.add_request(request("b", [("b", 20)], max_tokens=2), 0.0)
    Driver(engine).run()
    samples = engine.metrics_samples(LABELS)
    rejections = [lb for n, lb, v in samples if n == mn.VLLM_ADMISSION_REJECTIONS and v == 1]
    # vLLM labels this family by model_name and reason only (no engine label)
    assert rejections == [{"model_name": "m", "reason": "max_num_queued_reqs"}]
    assert count(engine, mn.VLLM_E2E_LATENCY) == 1


def test_a_preempted_executions_resumed_token_is_a_later_one() -> None:
    # Two executions that together outgrow 12 KV blocks of 4 tokens: the newer one is preempted.
    engine = create_engine(num_gpu_blocks=12, max_num_batched_tokens=100)
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 16)], max_tokens=24), 0.0)
    engine.add_request(request("b", [("b", 16)], max_tokens=24), 0.0)
    drv.run()
    assert engine.num_preemptions_total >= 1
    assert engine.generation_tokens_total == 48
    assert count(engine, mn.VLLM_TTFT) + count(engine, mn.VLLM_INTER_TOKEN_LATENCY) == 48


def test_bucket_boundaries_are_vllms() -> None:
    # vllm/v1/metrics/buckets.py: build_1_2_5_buckets(max_model_len) for the token counts
    assert request_tokens_buckets(8_192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
    assert bucket_bounds(mn.VLLM_E2E_LATENCY, 8_192)[:3] == (0.3, 0.5, 0.8)
    assert bucket_bounds(mn.VLLM_TTFT, 8_192)[-1] == 2560.0
    assert [le_label(b) for b in (0.3, 1.0, 5000.0, float("inf"))] == ["0.3", "1.0", "5000.0", "+Inf"]
    engine = create_engine(max_model_len=2_000)
    les = [
        lb["le"]
        for n, lb, _ in engine.metrics_samples(LABELS)
        if n == mn.VLLM_REQUEST_PROMPT_TOKENS + "_bucket"
    ]
    assert les == [
        "1.0",
        "2.0",
        "5.0",
        "10.0",
        "20.0",
        "50.0",
        "100.0",
        "200.0",
        "500.0",
        "1000.0",
        "2000.0",
        "+Inf",
    ]


def test_histogram_exports_are_cumulative_and_reuse_unchanged_samples() -> None:
    histogram = Histogram((1.0, 2.0))
    histogram.observe(1.0)
    histogram.observe(1.5, n=2)
    histogram.observe(9.0)
    first = histogram.samples("h", {"a": "b"})
    assert first == [
        ("h_bucket", {"a": "b", "le": "1.0"}, 1.0),
        ("h_bucket", {"a": "b", "le": "2.0"}, 3.0),
        ("h_bucket", {"a": "b", "le": "+Inf"}, 4.0),
        ("h_count", {"a": "b"}, 4.0),
        ("h_sum", {"a": "b"}, 13.0),
    ]
    assert histogram.samples("h", {"a": "b"}) is first  # nothing changed: the same export
    histogram.observe(5.0)
    second = histogram.samples("h", {"a": "b"})
    assert second[0] is first[0] and second[2] == ("h_bucket", {"a": "b", "le": "+Inf"}, 5.0)
    assert second[4] == ("h_sum", {"a": "b"}, 18.0)
