"""EngineProcess drives the engine model in simulated time and forwards its events."""

from __future__ import annotations

import pytest

from reproduce.engine import (
    EngineConfig,
    EngineEvent,
    EngineModel,
    EngineRequest,
    EventKind,
    Sample,
    StepTimeModel,
    preset,
)
from reproduce.engine.process import EngineProcess
from reproduce.simenv import Environment
from reproduce.workloads.calls import WorkloadSpec, generate_trace, prompt_segments

STEP = StepTimeModel(fixed_s=0.01, per_prompt_token_s=1e-4, per_running_s=0.0, per_context_token_s=0.0)


def create(**overrides: object) -> tuple[Environment, EngineModel, EngineProcess, list[EngineEvent]]:
    options: dict[str, object] = {"num_gpu_blocks": 2_000, "step_time": STEP, "max_num_batched_tokens": 512}
    options.update(overrides)
    env = Environment()
    engine = EngineModel(EngineConfig(**options))  # type: ignore[arg-type]
    events: list[EngineEvent] = []
    return env, engine, EngineProcess(env, engine, events.append), events


def test_runs_executions_to_completion_in_simulated_time() -> None:
    env, engine, proc, events = create()
    env.schedule(0.0, proc.submit, EngineRequest("a", (("p", 256), ("a", 256)), 20))
    env.schedule(0.5, proc.submit, EngineRequest("b", (("p", 256), ("b", 256)), 20))
    env.run()
    by_id = {(e.request_id, e.kind): e.t for e in events}
    # a: one full 512-token step to its first token, then 19 decode steps
    assert by_id["a", EventKind.FIRST_TOKEN] == pytest.approx(0.01 + 512 * 1e-4)
    assert by_id["a", EventKind.FINISHED] == pytest.approx(0.0612 + 19 * 0.01)
    # b arrives when the engine is idle: it starts at once and hits the shared prefix
    assert by_id["b", EventKind.FIRST_TOKEN] > 0.5
    assert engine.prefix_cache_hits_total == 256
    assert not proc.busy and not engine.has_work
    assert engine.generation_tokens_total == 40


def test_abort_through_the_process_and_queue_cap_refusal() -> None:
    env, engine, proc, events = create(max_num_queued_reqs=1)
    env.schedule(0.0, proc.submit, EngineRequest("a", (("a", 4_000),), 5))
    refused: list[bool] = []
    env.schedule(0.001, lambda: refused.append(proc.submit(EngineRequest("b", (("b", 10),), 5))))
    env.schedule(0.1, proc.abort, "a")
    env.run()
    assert refused == [False]
    assert [e.kind for e in events] == [EventKind.ABORTED]
    # the abort arrived during one step; it took effect after the next one
    assert len(events[0].in_flight_steps) == 2
    assert engine.prompt_tokens_total == 0 and engine.prefix_cache_queries_total == 4_000


def test_step_callback_sees_every_step_or_run_of_decode_steps() -> None:
    for coalesce, expected in [(False, [1, 2, 3]), (True, [1, 3])]:
        env = Environment()
        engine = EngineModel(EngineConfig(num_gpu_blocks=100, step_time=STEP))
        seen: list[int] = []

        def on_step(now: float, eng: EngineModel, seen: list[int] = seen) -> None:
            seen.append(eng.steps_done)

        proc = EngineProcess(env, engine, None, on_step, coalesce=coalesce)
        env.schedule(0.0, proc.submit, EngineRequest("a", (("a", 100),), 3))
        env.run()
        assert seen == expected


def test_batch_callback_gets_the_same_events_in_the_same_order() -> None:
    batches: list[list[EngineEvent]] = []
    runs: list[list[EngineEvent]] = []
    for batched in (False, True):
        env = Environment()
        engine = EngineModel(EngineConfig(num_gpu_blocks=2_000, step_time=STEP, max_num_batched_tokens=512))
        events: list[EngineEvent] = []
        if batched:

            def on_events(got: list[EngineEvent], events: list[EngineEvent] = events) -> None:
                batches.append(got)
                events.extend(got)

            proc = EngineProcess(env, engine, on_events=on_events)
        else:
            proc = EngineProcess(env, engine, events.append)
        for i, at in enumerate((0.0, 0.001, 0.002, 0.3)):
            env.schedule(at, proc.submit, EngineRequest(f"r{i}", ((f"r{i}", 300),), 4 + i))
        env.schedule(0.05, proc.abort, "r2")
        env.run()
        runs.append(events)
    assert runs[0] == runs[1]
    assert {e.kind for e in runs[1]} == {EventKind.FIRST_TOKEN, EventKind.FINISHED, EventKind.ABORTED}
    # one call per non-empty batch (a step's events together), never an empty one
    assert all(batches) and len(batches) < len(runs[1])


def run_workload(
    coalesce: bool, deadline_s: float | None, queue_cap: int | None
) -> tuple[list[EngineEvent], list[Sample]]:
    config = preset("qwen2.5-7b-h100", max_num_queued_reqs=queue_cap)
    env = Environment()
    engine = EngineModel(config)
    events: list[EngineEvent] = []
    proc = EngineProcess(env, engine, events.append, coalesce=coalesce)
    spec = WorkloadSpec(capacity=2.78, phases=((40.0, 0.6), (30.0, 2.7), (80.0, 0.6)), seed=4)

    def arrive(request: EngineRequest) -> None:
        if proc.submit(request) and deadline_s is not None:
            env.schedule(env.now + deadline_s, proc.abort, request.request_id)

    for call in generate_trace(spec):
        env.schedule(
            call.arrival_s, arrive, EngineRequest(call.call_id, prompt_segments(call), call.response_len)
        )
    env.run()
    engine.check()
    return events, engine.metrics_samples({"engine": "0"})


@pytest.mark.parametrize(("deadline_s", "queue_cap"), [(None, None), (12.0, 25)])
def test_coalesced_decode_runs_change_nothing_observable(
    deadline_s: float | None, queue_cap: int | None
) -> None:
    one_by_one = run_workload(False, deadline_s, queue_cap)
    coalesced = run_workload(True, deadline_s, queue_cap)
    # Histogram sums of a run are added in one piece, not step by step: equal up to rounding.
    sums = [(n, lb, pytest.approx(v, rel=1e-12)) for n, lb, v in one_by_one[1] if n.endswith("_sum")]
    assert [s for s in coalesced[1] if s[0].endswith("_sum")] == sums
    strip = [s for s in one_by_one[1] if not s[0].endswith("_sum")]
    assert (coalesced[0], [s for s in coalesced[1] if not s[0].endswith("_sum")]) == (one_by_one[0], strip)
    assert len(sums) == 8  # every histogram is compared: same events at the same times, same counts
    kinds = {e.kind for e in one_by_one[0]}
    assert EventKind.FINISHED in kinds
    if deadline_s is not None:
        assert EventKind.ABORTED in kinds
