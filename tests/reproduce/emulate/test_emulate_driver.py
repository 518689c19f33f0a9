"""The emulated engine's stepping loop, on the real engine model, in a real event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from reproduce.emulate.driver import EngineDriver, EngineRefused, Execution, TooManyLive
from reproduce.emulate.prompts import segments_of
from reproduce.engine import EngineModel, EngineRequest, preset
from reproduce.workloads.plan import RunClock


class RecordingEngine(EngineModel):
    """The real engine model, recording the duration of every step it starts."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.durations: list[float] = []

    def start_step(self, now: float) -> float | None:
        duration = super().start_step(now)
        if duration is not None:
            self.durations.append(duration)
        return duration


def make_request(request_id: str, segments: Sequence[tuple[int, int]], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, tuple(segments), max_tokens)


def driver_for(time_scale: float, **options: object) -> tuple[EngineDriver, RecordingEngine]:
    engine = RecordingEngine(preset("qwen2.5-7b-h100", **options))  # type: ignore[arg-type]
    return EngineDriver(engine, make_request, clock=RunClock(time_scale), max_live=8), engine


async def _until_done(executions: Sequence[Execution], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not all(e.done for e in executions):
            await asyncio.sleep(0.01)


def test_wall_time_follows_engine_time_without_losing_sleep_overshoot() -> None:
    # Hundreds of steps of a fraction of a millisecond of wall time each: asyncio oversleeps
    # every one of them, and the driver must make that up instead of slowing the engine.
    async def run() -> tuple[float, float, list[int]]:
        driver, engine = driver_for(time_scale=50.0)
        stepper = asyncio.create_task(driver.run())
        start = time.monotonic()
        executions = [driver.submit(segments_of(list(range(i, i + 800))), 800, 1000) for i in range(8)]
        await _until_done(executions)
        wall = time.monotonic() - start
        stepper.cancel()
        return wall, driver.clock.run_s(sum(engine.durations)), [e.tokens for e in executions]

    wall, ideal, tokens = asyncio.run(run())
    assert tokens == [1000] * 8
    assert ideal > 0.1
    assert wall < 1.25 * ideal + 0.1, (wall, ideal)
    assert wall >= ideal * 0.95


def test_token_counts_grow_one_per_step_and_finish_at_max_tokens() -> None:
    async def run() -> list[int]:
        driver, _ = driver_for(time_scale=20.0)
        stepper = asyncio.create_task(driver.run())
        execution = driver.submit(segments_of(list(range(100))), 100, 20)
        seen: list[int] = []
        while not execution.done:
            await execution.changed.wait()
            execution.changed.clear()
            seen.append(execution.tokens)
        stepper.cancel()
        assert execution.finished and not execution.aborted
        return seen

    seen = asyncio.run(run())
    assert seen == sorted(seen) and seen[-1] == 20
    assert len(seen) >= 10  # published step by step, not all at the end


def test_queue_cap_refuses_and_live_bound_holds() -> None:
    async def run() -> None:
        driver, _ = driver_for(time_scale=1.0, max_num_queued_reqs=2)
        for _ in range(2):
            driver.submit(segments_of([1, 2, 3]), 3, 100)
        with pytest.raises(EngineRefused):
            driver.submit(segments_of([1, 2, 3]), 3, 100)
        bounded, _ = driver_for(time_scale=1.0)
        for _ in range(8):
            bounded.submit(segments_of([4, 5]), 2, 10)
        with pytest.raises(TooManyLive):
            bounded.submit(segments_of([4, 5]), 2, 10)

    asyncio.run(run())


def test_abort_of_a_waiting_execution_at_the_next_step_of_a_running_one_after_the_steps_in_flight() -> None:
    async def run() -> None:
        driver, engine = driver_for(time_scale=0.5, max_num_batched_tokens=512)
        stepper = asyncio.create_task(driver.run())
        running = driver.submit(segments_of([9] * 5000), 5000, 10)
        waiting = driver.submit(segments_of([8] * 100), 100, 10)
        await asyncio.sleep(0.05)
        assert engine.num_running == 1 and engine.num_waiting == 1
        # the next step was scheduled with it still waiting (vLLM's asynchronous scheduling):
        # it leaves when that step starts, without the budget to have computed anything
        driver.abort(waiting)
        await _until_done([waiting])
        assert waiting.aborted and waiting.tokens == 0 and driver.live == 1
        assert engine.num_waiting == 0
        steps_at_abort = len(engine.durations)
        driver.abort(running)
        assert not running.done  # the steps in flight finish first
        await _until_done([running])
        assert running.aborted and running.tokens == 0
        assert len(engine.durations) == steps_at_abort + 1  # exactly one more step ran
        stepper.cancel()

    asyncio.run(run())
