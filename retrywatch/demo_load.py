"""The demo's load: an open-loop pulse of retrying clients over real sockets.

Every planned call of a workload trace (``reproduce.workload``) starts at its planned time
whether or not earlier calls were answered (open loop); its attempts follow the study's client
model (``reproduce.client``: deadline on the whole attempt, backoff, Retry-After, giving up) and
go through ``reproduce.httpdriver.attempt.run_attempt`` (one connection per attempt, the same
call-id header on every attempt, the connection closed at the deadline). Only counts are kept.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from reproduce.client import AttemptOutcome, CallRecord, ClientConfig, ClientModel
from reproduce.httpdriver.attempt import completion_body, run_attempt
from reproduce.workload import PlannedCall, prompt_token_ids

__all__ = ["LoadStats", "run_load"]


@dataclass
class LoadStats:
    """What the clients saw so far (counts only)."""

    calls_started: int = 0
    calls_delivered: int = 0
    calls_delivered_in_deadline: int = 0
    calls_failed: int = 0
    attempts: int = 0
    retries: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in AttemptOutcome})

    @property
    def in_progress(self) -> int:
        return self.calls_started - self.calls_delivered - self.calls_failed


STOP_TIMEOUT_S = 10.0  # the longest the calls in progress get to end once the load is stopped


async def _run_call(
    http: httpx.AsyncClient,
    url: str,
    model: ClientModel,
    call: PlannedCall,
    record: CallRecord,
    body: bytes,
    stats: LoadStats,
    call_id_header: str,
    clock: Callable[[], float],
) -> None:
    next_at: float | None = clock()
    while next_at is not None:
        delay = next_at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        attempt = model.send(record, clock())
        stats.attempts += 1
        stats.retries += attempt.is_retry
        result = await run_attempt(
            http,
            url,
            body,
            call_id=call.call_id,
            deadline_at=attempt.deadline_at,
            call_id_header=call_id_header,
            clock=clock,
        )
        stats.outcomes[result.outcome.value] += 1
        if result.outcome is AttemptOutcome.DELIVERED:
            model.delivered(record, result.ended_at)
            stats.calls_delivered += 1
            first_sent = record.attempts[0].sent_at
            if result.ended_at - first_sent <= model.config.deadline_s:
                stats.calls_delivered_in_deadline += 1
            return
        next_at = model.failed(record, result.ended_at, result.outcome, result.retry_after_s)
    stats.calls_failed += 1


async def run_load(
    base_url: str,
    calls: Sequence[PlannedCall],
    client_config: ClientConfig,
    *,
    served_model: str,
    vocab_size: int,
    stats: LoadStats,
    seed: int = 0,
    call_id_header: str = "x-call-id",
    max_calls_in_progress: int = 2000,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Replay ``calls`` (arrival times in wall seconds from now) against ``base_url``.

    Returns when every started call is over. Cancel the task to stop early: attempts in
    progress are closed, which their server sees as client disconnects.
    """
    url = base_url.rstrip("/") + "/v1/completions"
    model = ClientModel(client_config, random.Random(seed))
    # No keep-alive: each attempt has its own connection, so giving up closes it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        start = clock()
        try:
            for call in calls:
                delay = start + call.arrival_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if stats.in_progress >= max_calls_in_progress:
                    continue  # not started: the bound on calls in progress is reached
                record = model.new_call(
                    call.call_id,
                    clock(),
                    prompt_len=call.prompt_len,
                    response_len=call.response_len,
                    phase=call.phase,
                )
                body = completion_body(
                    served_model, prompt_token_ids(call, vocab_size, seed), call.response_len
                )
                stats.calls_started += 1
                task = asyncio.create_task(
                    _run_call(http, url, model, call, record, body, stats, call_id_header, clock)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
        finally:
            for task in list(tasks):
                task.cancel()
            if tasks:
                # Bounded: closing hundreds of attempts must not hold up the demo's stop.
                await asyncio.wait(list(tasks), timeout=STOP_TIMEOUT_S)
