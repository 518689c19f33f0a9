"""Property test: random arrivals, aborts and tiny KV caches never break the engine's books."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from reproduce.engine import EngineConfig, EngineEvent, EngineModel, EngineRequest, EventKind, StepTimeModel
from reproduce.engine.process import EngineProcess
from reproduce.simenv import Environment

STEP = StepTimeModel(fixed_s=0.01, per_prompt_token_s=1e-4, per_running_s=1e-3, per_context_token_s=1e-6)

operation = st.tuples(
    st.floats(min_value=0.0, max_value=5.0),  # when
    st.integers(min_value=0, max_value=11),  # which call (retries of a call resend its prompt)
    st.integers(min_value=1, max_value=300),  # unique prompt tokens
    st.integers(min_value=1, max_value=60),  # max tokens
    st.booleans(),  # abort this execution later?
    st.floats(min_value=0.0, max_value=2.0),  # abort delay
)


def run(
    ops: list[tuple[float, int, int, int, bool, float]],
    blocks: int,
    budget: int,
    coalesce: bool,
    cap: int | None,
):
    env = Environment()
    config = EngineConfig(
        num_gpu_blocks=blocks,
        step_time=STEP,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        max_model_len=400,
        max_num_queued_reqs=cap,
    )
    engine = EngineModel(config)
    events: list[EngineEvent] = []
    prompts: dict[str, int] = {}

    def on_step(now: float, eng: EngineModel) -> None:
        eng.check()

    proc = EngineProcess(env, engine, events.append, on_step, coalesce=coalesce)

    def send(i: int, call: int, unique: int, max_tokens: int, abort: bool, delay: float) -> None:
        rid = f"e{i}"
        segments = (("shared", 10), (f"call{call}", unique))
        request = EngineRequest(rid, segments, max_tokens)
        if proc.submit(request):
            prompts[rid] = request.prompt_len
            if abort:
                env.schedule(env.now + delay, proc.abort, rid)

    for i, (at, call, unique, max_tokens, abort, delay) in enumerate(ops):
        # a call's prompt is fixed: its unique part depends on the call only
        unique = 20 + (call * 37) % 250 if call % 3 else unique
        env.schedule(at, send, i, call, unique, max_tokens, abort, delay)
    env.run()
    engine.check()
    return engine, events, prompts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(operation, min_size=1, max_size=40),
    blocks=st.integers(min_value=110, max_value=400),
    budget=st.sampled_from([8, 32, 256]),
    cap=st.one_of(st.none(), st.integers(min_value=1, max_value=10)),
)
def test_books_balance_for_any_sequence(
    ops: list[tuple[float, int, int, int, bool, float]], blocks: int, budget: int, cap: int | None
) -> None:
    engine, events, prompts = run(ops, blocks, budget, True, cap)
    assert not engine.has_work and engine.num_running == 0 and engine.num_waiting == 0
    terminal = [e for e in events if e.kind != EventKind.FIRST_TOKEN]
    # every accepted execution ends exactly once
    assert sorted(e.request_id for e in terminal) == sorted(prompts)
    finished = [e for e in terminal if e.kind == EventKind.FINISHED]
    first = [e for e in events if e.kind == EventKind.FIRST_TOKEN]
    assert len({e.request_id for e in first}) == len(first)
    assert engine.request_success_total["length"] == len(finished)
    assert engine.request_success_total["abort"] == 0
    # vLLM's counting rules, summed over executions
    assert engine.prompt_tokens_total == sum(prompts[e.request_id] for e in first)
    assert engine.generation_tokens_total == sum(e.output_tokens for e in terminal)
    assert engine.prefix_cache_queries_total <= sum(prompts.values())
    # with the cache emptied of holders, every block is free again
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    # coalescing decode-only steps changes nothing observable
    other, other_events, _ = run(ops, blocks, budget, False, cap)
    assert other_events == events
    # (a coalesced run adds its inter-token latencies in one piece: sums equal up to rounding)
    assert [
        (n, lb, pytest.approx(v, rel=1e-9, abs=1e-12)) if n.endswith("_sum") else (n, lb, v)
        for n, lb, v in other.metrics_samples()
    ] == engine.metrics_samples()
    # vLLM's histograms: TTFT at each first token, the per-request families at each finish, and
    # every delivered token is either a first token or a later one (inter-token latency)
    snap = Snapshot(0.0, engine.metrics_samples())
    assert snap.value(mn.VLLM_TTFT + "_count") == len(first)
    for family in (mn.VLLM_E2E_LATENCY, mn.VLLM_QUEUE_TIME, mn.VLLM_PREFILL_TIME, mn.VLLM_DECODE_TIME):
        assert snap.value(family + "_count") == len(finished)
    itl = snap.value(mn.VLLM_INTER_TOKEN_LATENCY + "_count") or 0.0
    assert engine.generation_tokens_total == len(first) + itl
    assert snap.value(mn.VLLM_REQUEST_GENERATION_TOKENS + "_sum") == sum(e.output_tokens for e in finished)
