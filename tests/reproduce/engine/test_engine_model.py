"""The engine model's rules one by one, driven step by step as the simulator drives it."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import pytest

from reproduce.engine import (
    EngineConfig,
    EngineConfigError,
    EngineEvent,
    EngineModel,
    EngineRequest,
    EngineRequestError,
    EngineStateError,
    EventKind,
    StepTimeModel,
)

UNIT_STEP = StepTimeModel(fixed_s=1.0, per_prompt_token_s=0.0, per_running_s=0.0, per_context_token_s=0.0)


def create_engine(trace: bool = True, **overrides: object) -> EngineModel:
    options: dict[str, object] = {
        "num_gpu_blocks": 1_000,
        "step_time": UNIT_STEP,
        "block_size": 4,
        "max_num_batched_tokens": 100,
        "max_num_seqs": 8,
        "max_model_len": 2_000,
    }
    options.update(overrides)
    return EngineModel(EngineConfig(**options), trace=trace)  # type: ignore[arg-type]


def request(rid: str, segments: Iterable[tuple[Hashable, int]], max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(rid, tuple(segments), max_tokens)


class Driver:
    """Runs the engine step by step in unit time, like ``EngineProcess`` without simenv."""

    def __init__(self, engine: EngineModel) -> None:
        self.engine = engine
        self.now = 0.0
        self.events: list[EngineEvent] = []

    def step(self) -> list[EngineEvent]:
        duration = self.engine.start_step(self.now)
        if duration is None:
            return []
        self.now += duration
        out = self.engine.finish_step(self.now)
        self.events.extend(out)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work:
                return
            self.step()
        raise AssertionError("engine did not drain")

    def kinds(self, rid: str) -> list[EventKind]:
        return [e.kind for e in self.events if e.request_id == rid]


def metric(engine: EngineModel, name: str, **labels: str) -> float:
    values = [
        v
        for n, lb, v in engine.metrics_samples({"engine": "0"})
        if n == name and labels.items() <= lb.items()
    ]
    assert len(values) == 1, (name, labels)
    return values[0]


def test_chunked_prefill_under_the_token_budget() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 250)], max_tokens=2), 0.0)
    drv.step()
    drv.step()
    assert drv.kinds("a") == []
    drv.step()
    assert drv.kinds("a") == [EventKind.FIRST_TOKEN]
    trace = engine.traces["a"]
    assert [n for _, _, n in trace.prefill_steps] == [100, 100, 50]
    drv.step()
    assert drv.kinds("a") == [EventKind.FIRST_TOKEN, EventKind.FINISHED]


def test_decodes_take_one_token_each_and_prefill_gets_the_rest() -> None:
    # synchronous scheduling: requests added between steps are admitted by the next one
    engine = create_engine(async_scheduling=False)
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 40)], max_tokens=10), 0.0)
    drv.step()  # a: prefill 40, first token
    engine.add_request(request("b", [("b", 300)], max_tokens=2), drv.now)
    engine.add_request(request("c", [("c", 300)], max_tokens=2), drv.now)
    drv.step()  # a decodes (1 token), b gets 99
    assert engine.steps[-1].num_decode == 1
    assert engine.traces["b"].prefill_steps[-1][2] == 99
    assert engine.steps[-1].prompt_tokens == 99
    assert engine.output_tokens("a") == 2
    drv.step()
    assert engine.traces["b"].prefill_steps[-1][2] == 99
    assert not engine.traces["c"].prefill_steps  # the budget went to b and the decode
    drv.run()
    assert engine.generation_tokens_total == 14
    assert metric(engine, "vllm:request_success_total", finished_reason="length") == 3


def test_max_num_seqs_limits_the_running_batch() -> None:
    engine = create_engine(max_num_seqs=2)
    drv = Driver(engine)
    for rid in "abc":
        engine.add_request(request(rid, [(rid, 8)], max_tokens=5), 0.0)
    drv.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    drv.run()
    assert engine.request_success_total["length"] == 3


def test_shared_prefix_hits_at_block_granularity() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("a", [("p", 30), ("a", 10)]), 0.0)
    drv.run()
    engine.add_request(request("b", [("p", 30), ("b", 10)]), drv.now)
    drv.step()
    # 30 shared tokens = 7 full blocks of 4 (28 tokens); block 8 straddles into b's own tokens
    assert engine.traces["b"].cache_hit_tokens == [28]
    assert engine.traces["b"].prefill_steps[0][2] == 40 - 28
    assert engine.prefix_cache_hits_total == 28
    assert engine.prefix_cache_queries_total == 80


def test_identical_prompt_recomputes_at_least_one_token() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("a1", [("p", 16), ("a", 16)]), 0.0)
    drv.run()
    engine.add_request(request("a2", [("p", 16), ("a", 16)]), drv.now)
    drv.step()
    assert engine.traces["a2"].cache_hit_tokens == [28]  # (32 - 1) // 4 blocks
    assert engine.traces["a2"].prefill_steps[0][2] == 4


def test_finished_blocks_stay_cached_and_are_evicted_lru() -> None:
    # 10 blocks: each 16-token prompt (one output token, sampled by the prefill) needs 4
    engine = create_engine(num_gpu_blocks=10)
    drv = Driver(engine)
    for rid in ("a", "b"):
        engine.add_request(request(rid, [(rid, 16)], max_tokens=1), drv.now)
        drv.run()
    pool = engine.block_pool
    assert pool.cached_blocks("a") == 4 and pool.cached_blocks("b") == 4
    engine.add_request(request("c", [("c", 16)], max_tokens=1), drv.now)
    drv.run()
    pool.check()
    # c needed 4 blocks, 2 were empty: the least recently released (a) lost its tail
    assert pool.cached_blocks("a") == 2 and pool.cached_blocks("b") == 4
    assert pool.cached_blocks("c") == 4


def test_preemption_recomputes_the_newest_running_execution() -> None:
    # 10 blocks of 4 tokens; two executions of 12 prompt + 12 output tokens need 6 blocks each
    engine = create_engine(num_gpu_blocks=10, enable_prefix_caching=False)
    drv = Driver(engine)
    engine.add_request(request("old", [("old", 12)], max_tokens=12), 0.0)
    engine.add_request(request("new", [("new", 12)], max_tokens=12), 0.0)
    drv.run()
    assert engine.num_preemptions_total >= 1
    assert engine.traces["new"].preemptions >= 1
    assert engine.traces["old"].preemptions == 0
    assert len(engine.traces["new"].admitted_at) == 1 + engine.traces["new"].preemptions
    assert engine.traces["old"].finished_at is not None and engine.traces["new"].finished_at is not None
    assert engine.traces["old"].finished_at < engine.traces["new"].finished_at
    # the recompute includes the tokens output before the preemption, all delivered once
    assert engine.traces["new"].output_tokens == 12
    assert engine.generation_tokens_total == 24
    # counted once per execution despite the requeue
    assert engine.prefix_cache_queries_total == 24
    assert metric(engine, "vllm:num_preemptions_total") == engine.num_preemptions_total


def test_abort_takes_effect_after_two_steps_in_flight() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("p", 40), ("x", 500)], max_tokens=5), 0.0)
    drv.step()  # step 0: 100 tokens
    engine.start_step(drv.now)  # step 1 in progress
    assert engine.abort_request("x", drv.now + 0.5) == []
    drv.now += 1.0
    assert engine.finish_step(drv.now) == []  # step 1 done, step 2 already in flight
    drv.step()  # step 2 computes x's tokens, then the abort takes effect
    (event,) = [e for e in drv.events if e.request_id == "x"]
    assert event.kind == EventKind.ABORTED
    assert event.in_flight_steps == (1, 2)
    assert event.computed_prompt_tokens == 300
    assert event.in_flight_prompt_tokens == 200
    assert not engine.has_request("x")
    tr = engine.traces["x"]
    assert tr.in_flight_steps == (1, 2) and tr.prompt_tokens_in_flight() == 200
    # admitted, so queried; aborted before its first token, so never a prompt token
    assert metric(engine, "vllm:prefix_cache_queries_total") == 540
    assert metric(engine, "vllm:prompt_tokens_total") == 0
    assert metric(engine, "vllm:request_success_total", finished_reason="abort") == 0
    # blocks computed by the in-flight steps stay cached: a retry of the call hits them
    engine.add_request(request("x-retry", [("p", 40), ("x", 500)], max_tokens=5), drv.now)
    drv.step()
    assert engine.traces["x-retry"].cache_hit_tokens == [300]


def test_abort_without_async_scheduling_waits_only_for_the_current_step() -> None:
    engine = create_engine(async_scheduling=False)
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 500)]), 0.0)
    engine.start_step(0.0)
    engine.abort_request("x", 0.5)
    (event,) = engine.finish_step(1.0)
    assert event.kind == EventKind.ABORTED and event.in_flight_steps == (0,)
    assert event.computed_prompt_tokens == 100
    assert not drv.engine.has_work


def test_abort_of_a_waiting_execution_is_immediate_and_invisible() -> None:
    engine = create_engine(max_num_seqs=1)
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 8)], max_tokens=50), 0.0)
    engine.add_request(request("b", [("b", 8)]), 0.0)
    drv.step()
    assert engine.num_waiting == 1
    (event,) = engine.abort_request("b", drv.now)
    assert event.kind == EventKind.ABORTED and event.computed_prompt_tokens == 0
    assert engine.num_waiting == 0 and not engine.has_request("b")
    assert engine.abort_request("b", drv.now) == []
    assert engine.abort_request("never-seen", drv.now) == []
    drv.run()
    assert engine.prefix_cache_queries_total == 8
    assert drv.kinds("b") == []


def test_abort_after_first_token_counts_the_prompt_once() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 20)], max_tokens=100), 0.0)
    drv.step()
    assert drv.kinds("x") == [EventKind.FIRST_TOKEN]
    drv.step()
    drv.step()
    assert engine.output_tokens("x") == 3
    engine.start_step(drv.now)
    engine.abort_request("x", drv.now)
    drv.now += 1
    # step 3 was running when the abort arrived: vLLM processes aborts before a step's outputs
    # (EngineCore.step_with_batch_queue), so its token is dropped
    engine.finish_step(drv.now)
    assert engine.output_tokens("x") == 3
    (event,) = drv.step()  # step 4 was in flight behind it: computed, output dropped
    assert event.kind == EventKind.ABORTED and event.output_tokens == 3
    assert event.in_flight_steps == (3, 4)
    assert engine.prompt_tokens_total == 20
    assert engine.generation_tokens_total == 3
    assert set(engine.request_success_total.values()) == {0}


def test_abort_during_the_last_prefill_step_discards_the_first_token() -> None:
    # The prompt's last chunk runs when the client leaves: the step completes (its blocks are
    # cached), the step behind it is in flight, but no token reaches anyone, so neither
    # vllm:prompt_tokens_total nor the driver ever sees a first token.
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 150)], max_tokens=5), 0.0)
    drv.step()  # 100 prompt tokens
    engine.start_step(drv.now)  # the last 50
    engine.abort_request("x", drv.now + 0.5)
    drv.now += 1
    assert engine.finish_step(drv.now) == []
    (event,) = drv.step()  # its first decode was in flight
    assert event.kind == EventKind.ABORTED and event.output_tokens == 0
    assert event.in_flight_steps == (1, 2) and event.in_flight_prompt_tokens == 50
    assert drv.kinds("x") == [EventKind.ABORTED]
    assert engine.prompt_tokens_total == 0 and engine.generation_tokens_total == 0
    assert engine.prefix_cache_queries_total == 150
    assert engine.traces["x"].first_token_at is None
    engine.check()


def test_abort_during_the_last_decode_step_is_an_abort_not_a_completion() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("x", [("x", 20)], max_tokens=3), 0.0)
    drv.step()
    drv.step()
    engine.start_step(drv.now)  # the step that would output the last token
    engine.abort_request("x", drv.now + 0.5)
    drv.now += 1
    assert engine.finish_step(drv.now) == []
    (event,) = drv.step()
    assert event.kind == EventKind.ABORTED and event.output_tokens == 2
    assert metric(engine, "vllm:request_success_total", finished_reason="length") == 0
    assert engine.generation_tokens_total == 2
    assert not engine.has_work


def test_queue_cap_refuses_beyond_q_waiting_or_running() -> None:
    engine = create_engine(max_num_queued_reqs=2, max_num_seqs=1)
    drv = Driver(engine)
    assert engine.add_request(request("a", [("a", 8)], max_tokens=2), 0.0)
    assert engine.add_request(request("b", [("b", 8)], max_tokens=2), 0.0)
    assert not engine.add_request(request("c", [("c", 8)], max_tokens=2), 0.0)
    assert not engine.has_request("c")
    assert metric(engine, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
    assert metric(engine, "vllm:admission_rejections_total", reason="max_num_queued_tokens") == 0
    drv.run()
    assert engine.add_request(request("c", [("c", 8)], max_tokens=2), drv.now)


def test_an_aborted_execution_leaves_the_queue_cap_count_at_once() -> None:
    # vLLM's API server stops counting a request when the client aborts it, even while the
    # engine core still runs its in-flight steps
    engine = create_engine(max_num_queued_reqs=1)
    engine.add_request(request("a", [("a", 500)], max_tokens=2), 0.0)
    engine.start_step(0.0)
    engine.abort_request("a", 0.5)
    assert engine.has_request("a")
    assert engine.add_request(request("b", [("b", 8)], max_tokens=2), 0.5)
    assert not engine.add_request(request("c", [("c", 8)], max_tokens=2), 0.5)
    engine.finish_step(1.0)
    drv = Driver(engine)
    drv.now = 1.0
    drv.run()
    engine.check()
    assert drv.kinds("a") == [EventKind.ABORTED] and drv.kinds("b")[-1] == EventKind.FINISHED


def test_gauges_refresh_once_per_step() -> None:
    engine = create_engine()
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 8)], max_tokens=3), 0.0)
    assert engine.num_waiting == 1
    assert metric(engine, "vllm:num_requests_waiting") == 0  # stale until a step
    drv.step()
    assert metric(engine, "vllm:num_requests_running") == 1
    assert 0 < metric(engine, "vllm:kv_cache_usage_perc") < 1


def test_gauges_show_the_queue_the_scheduler_left_behind() -> None:
    # vLLM makes its stats after scheduling the next step: an execution that arrived after that
    # scheduling is not counted as waiting yet; one the budget left behind is; an execution
    # whose abort arrived no longer counts as running.
    engine = create_engine(max_num_batched_tokens=100)
    engine.add_request(request("a", [("a", 150)], max_tokens=5), 0.0)
    engine.start_step(0.0)  # a's first 100
    engine.add_request(request("b", [("b", 20)], max_tokens=5), 0.5)
    engine.add_request(request("c", [("c", 150)], max_tokens=5), 0.5)
    engine.finish_step(1.0)
    assert metric(engine, "vllm:num_requests_waiting") == 0  # not refreshed at a step's end
    engine.start_step(1.0)  # a's last 50: step 1 was scheduled before b and c arrived
    assert engine.num_waiting == 2
    assert metric(engine, "vllm:num_requests_waiting") == 0
    engine.finish_step(2.0)
    engine.start_step(2.0)  # a decodes, b's 20, c's first 79
    assert metric(engine, "vllm:num_requests_running") == 3
    assert metric(engine, "vllm:num_requests_waiting") == 0
    engine.add_request(request("d", [("d", 150)], max_tokens=5), 2.5)
    engine.add_request(request("e", [("e", 150)], max_tokens=5), 2.5)
    engine.abort_request("b", 2.5)
    engine.finish_step(3.0)
    engine.start_step(3.0)  # b's decode in flight, a's decode, c's last 71: no room for d or e
    engine.finish_step(4.0)
    engine.start_step(4.0)  # a and c decode, d's first 98; e is left behind
    assert engine.num_waiting == 1
    assert metric(engine, "vllm:num_requests_waiting") == 1
    assert metric(engine, "vllm:num_requests_running") == 3
    engine.abort_request("a", 4.5)
    engine.finish_step(5.0)
    engine.start_step(5.0)  # a's decode in flight, c decodes, d's last 52, e's first 46
    assert engine.num_running == 4
    assert metric(engine, "vllm:num_requests_running") == 3  # a's abort is processed


def test_asynchronous_scheduling_admits_one_step_late() -> None:
    # vLLM schedules step k+1 when step k starts: an arrival during step k waits for step k+2,
    # and a waiting execution aborted during step k is still admitted by step k+1, computes one
    # chunk there and leaves; its prompt is queried, never counted.
    engine = create_engine()
    engine.add_request(request("a", [("a", 20)], max_tokens=50), 0.0)
    engine.start_step(0.0)
    engine.add_request(request("b", [("b", 200)], max_tokens=5), 0.5)
    engine.finish_step(1.0)
    engine.start_step(1.0)
    assert engine.steps[-1].num_prefill == 0  # b arrived after step 1 was scheduled
    engine.finish_step(2.0)
    engine.start_step(2.0)
    assert engine.traces["b"].admitted_at == [2.0]
    assert engine.traces["b"].scheduled_at == [1.0]  # decided when step 1 started
    engine.add_request(request("c", [("c", 300)], max_tokens=5), 2.5)
    engine.finish_step(3.0)
    engine.start_step(3.0)  # c arrived after step 3 was scheduled
    engine.add_request(request("d", [("d", 300)], max_tokens=5), 3.5)
    assert engine.abort_request("c", 3.6) == []  # step 4 was scheduled with c in it
    assert engine.abort_request("d", 3.6)[0].kind == EventKind.ABORTED  # d: never scheduled
    engine.finish_step(4.0)
    engine.start_step(4.0)
    assert engine.traces["c"].prefill_steps == [(4, 4.0, 97)]  # a decodes, b's last 2
    (event,) = [e for e in engine.finish_step(5.0) if e.request_id == "c"]
    assert event.kind == EventKind.ABORTED
    assert event.in_flight_steps == (4,) and event.in_flight_prompt_tokens == 97
    assert engine.prefix_cache_queries_total == 20 + 200 + 300
    assert engine.traces["d"].admitted_at == []
    engine.check()


def test_step_time_model_terms() -> None:
    st = StepTimeModel(fixed_s=0.01, per_prompt_token_s=1e-4, per_running_s=1e-3, per_context_token_s=1e-6)
    engine = create_engine(step_time=st)
    engine.add_request(request("a", [("a", 100)], max_tokens=3), 0.0)
    assert engine.start_step(0.0) == pytest.approx(0.01 + 100 * 1e-4 + 1e-3 + 100 * 1e-6)
    engine.finish_step(1.0)
    # one decode attending 101 tokens of context
    assert engine.start_step(1.0) == pytest.approx(0.01 + 1e-3 + 101 * 1e-6)


def test_prefill_attention_pairs_grow_with_the_context_before_a_chunk() -> None:
    st = StepTimeModel(
        fixed_s=1.0,
        per_prompt_token_s=0.0,
        per_running_s=0.0,
        per_context_token_s=0.0,
        per_attention_pair_s=1e-6,
    )
    engine = create_engine(step_time=st)
    engine.add_request(request("a", [("a", 150)], max_tokens=2), 0.0)
    # chunk 1: 100 tokens from 0: 100*101/2 pairs; chunk 2: 50 tokens after 100: 50*100 + 50*51/2
    assert engine.start_step(0.0) == pytest.approx(1.0 + 5_050e-6)
    engine.finish_step(1.0)
    assert engine.start_step(1.0) == pytest.approx(1.0 + 6_275e-6)


def test_bad_requests_and_out_of_order_calls_raise() -> None:
    engine = create_engine()
    engine.add_request(request("a", [("a", 8)]), 0.0)
    with pytest.raises(EngineRequestError, match="already live"):
        engine.add_request(request("a", [("a", 8)]), 0.0)
    with pytest.raises(EngineRequestError, match="max_model_len"):
        engine.add_request(request("big", [("big", 1_999)], max_tokens=2), 0.0)
    with pytest.raises(EngineRequestError, match="max_tokens"):
        engine.add_request(request("z", [("z", 8)], max_tokens=0), 0.0)
    with pytest.raises(EngineStateError):
        engine.finish_step(0.0)
    engine.start_step(0.0)
    with pytest.raises(EngineStateError):
        engine.start_step(0.0)
    with pytest.raises(EngineConfigError):
        EngineConfig(num_gpu_blocks=10, step_time=UNIT_STEP, max_num_batched_tokens=8, max_num_seqs=16)


def test_same_inputs_same_events() -> None:
    def run() -> list[EngineEvent]:
        engine = create_engine(num_gpu_blocks=60, max_num_seqs=4)
        drv = Driver(engine)
        for i in range(30):
            engine.add_request(
                request(f"r{i}", [("p", 20), (f"r{i}", 7 * i % 50 + 1)], max_tokens=i % 9 + 1), drv.now
            )
            drv.step()
            if i % 7 == 3:
                engine.start_step(drv.now)
                drv.events.extend(engine.abort_request(f"r{i - 1}", drv.now))
                drv.now += 1
                drv.events.extend(engine.finish_step(drv.now))
        drv.run()
        engine.block_pool.check()
        return drv.events

    first = run()
    assert first == run()
    assert {e.kind for e in first} == set(EventKind)


@pytest.mark.parametrize("reserve_full", [True, False])
def test_admission_waits_until_the_whole_prompt_fits(reserve_full: bool) -> None:
    # 40 blocks of 4 tokens. a holds 20 of them; b's 120-token prompt needs 30 more: its first
    # 39-token chunk (10 blocks) would fit, the whole prompt does not. vLLM's default
    # (scheduler_reserve_full_isl) keeps b waiting; admitting it on its first chunk starts a
    # prefill that the engine later has to preempt.
    engine = create_engine(
        num_gpu_blocks=40,
        enable_prefix_caching=False,
        max_num_batched_tokens=40,
        scheduler_reserve_full_isl=reserve_full,
    )
    drv = Driver(engine)
    engine.add_request(request("a", [("a", 76)], max_tokens=8), 0.0)
    drv.step()
    drv.step()
    engine.add_request(request("b", [("b", 120)], max_tokens=2), drv.now)
    drv.step()
    drv.step()
    assert (engine.traces["b"].admitted_at == []) is reserve_full
    drv.run()
    assert drv.kinds("b")[-1] == EventKind.FINISHED
    assert (engine.num_preemptions_total == 0) is reserve_full
