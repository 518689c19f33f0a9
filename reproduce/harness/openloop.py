"""The open-loop client over real sockets: every planned call of a trace, on time, with retries.

Each call runs as its own task: it sleeps until its planned arrival (open loop: it never waits
for other calls' answers), then sends attempts as the client model (``reproduce.workloads.client``)
says: every attempt with the same call-id header and the identical body, each given up at its
own deadline by closing its connection. One ``httpx.AsyncClient`` without keep-alive gives
every attempt its own connection, so a give-up is a real disconnect the proxy sees.

Times in the records are seconds from the run's start (``t0`` on the monotonic clock), the
same clock as the metrics series, so ``reproduce.judge.outcomes`` judges an HTTP run exactly as it
judges a simulated one. The run ends when no call is outstanding, or at the horizon after the
last planned arrival, whichever is first; calls still open then are closed as failed.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from reproduce.harness.attempt import AttemptResult, completion_body, run_attempt
from reproduce.workloads.calls import PlannedCall, prompt_token_ids, segment_token_ids
from reproduce.workloads.client import AttemptOutcome, CallRecord, ClientConfig, ClientModel
from reproduce.workloads.traces.planned import Segments

__all__ = ["OpenLoopClient", "OpenLoopStats", "fell_behind", "send_lag"]


#: How often the client's heartbeat checks its own event loop for lateness (seconds).
HEARTBEAT_S = 0.05
_HEARTBEAT_SAMPLES = 1 << 16
#: An attempt sent more than this many seconds after it was due counts as a late start.
LATE_START_S = 0.1
#: The longest the calls in progress get to close once the run ends or is cancelled.
STOP_TIMEOUT_S = 10.0


def _p99_and_max(ordered: Sequence[float]) -> tuple[float | None, float | None]:
    """The p99 and the maximum of values sorted ascending (None, None when there are none)."""
    if not ordered:
        return None, None
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], ordered[-1]


@dataclass
class OpenLoopStats:
    """Live counts of the client (for progress lines, the demo's and tests)."""

    calls_started: int = 0
    calls_delivered: int = 0
    calls_delivered_in_deadline: int = 0  # within the deadline of the call's first attempt
    calls_failed: int = 0  # gave up after its last attempt
    calls_skipped: int = 0  # never started: the bound on calls in progress was reached
    attempts_sent: int = 0
    retries_sent: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    late_starts: int = 0  # attempts sent more than LATE_START_S after they were due (client overload)
    #: How late the heartbeat woke, one sample per beat (the most recent 65,536): a loop starved
    #: of CPU wakes late, and then also reads answers late and may judge them past their deadline.
    loop_lags: deque[float] = field(default_factory=lambda: deque(maxlen=_HEARTBEAT_SAMPLES))

    @property
    def in_progress(self) -> int:
        """Calls started and not yet delivered or given up."""
        return self.calls_started - self.calls_delivered - self.calls_failed

    def loop_lag(self) -> dict[str, float | None]:
        """The heartbeat's lateness: p99 and max seconds (None before the first beat)."""
        p99, worst = _p99_and_max(sorted(self.loop_lags))
        return {"p99_s": p99, "max_s": worst}


def send_lag(calls: Sequence[CallRecord], start_s: float, end_s: float) -> dict[str, float | int | None]:
    """How far the client fell behind its plan for the calls planned in ``[start_s, end_s)``.

    ``planned_rate`` counts those calls over the window, ``sent_rate`` those whose first attempt
    really left within it; ``lag_p99_s`` / ``lag_max_s`` are the delays of first attempts past
    their planned arrival. A client that keeps up sends at the planned rate with lags of
    milliseconds; one starved of CPU sends the pulse late and flattens it.
    """
    if end_s <= start_s:
        raise ValueError(f"need start_s < end_s, got {start_s!r} and {end_s!r}")
    window = [c for c in calls if start_s <= c.planned_at < end_s]
    p99, worst = _p99_and_max(sorted(c.first_sent_at - c.planned_at for c in window if c.attempts))
    sent = sum(1 for c in window if c.attempts and c.first_sent_at < end_s)
    length = end_s - start_s
    return {
        "calls": len(window),
        "planned_rate": len(window) / length,
        "sent_rate": sent / length,
        "lag_p99_s": p99,
        "lag_max_s": worst,
    }


def fell_behind(
    client_stats: Mapping[str, Any],
    *,
    max_send_lag_s: float = 0.5,
    max_loop_lag_s: float = 0.5,
    max_late_share: float = 0.1,
) -> str | None:
    """Why a run's client could not keep to its plan, or None when it kept up.

    ``client_stats`` is a run entry's ``client`` (``pulse_send`` from ``send_lag`` over the
    pulse, ``loop_lag`` from ``OpenLoopStats.loop_lag``, ``late_starts`` of ``attempts_sent``).
    A client that sent the pulse late flattened it, and one whose event loop woke late sent
    retries late, read answers late and judged some that arrived in time as given up: such a
    run measures the machine's load, not the engine's, and its outcome should not be judged.
    """
    reasons = []
    sent, late = client_stats.get("attempts_sent") or 0, client_stats.get("late_starts") or 0
    if sent and late / sent > max_late_share:
        reasons.append(
            f"{late} of {sent} attempts started over {LATE_START_S:g} s late (> {max_late_share:.0%})"
        )
    send = client_stats.get("pulse_send") or {}
    send_p99 = send.get("lag_p99_s")
    if send_p99 is not None and send_p99 > max_send_lag_s:
        reasons.append(f"pulse sent late (p99 {send_p99:.2f} s > {max_send_lag_s:g} s)")
    loop = client_stats.get("loop_lag") or {}
    loop_p99 = loop.get("p99_s")
    if loop_p99 is not None and loop_p99 > max_loop_lag_s:
        reasons.append(f"event loop woke late (p99 {loop_p99:.2f} s > {max_loop_lag_s:g} s)")
    return "; ".join(reasons) or None


class OpenLoopClient:
    """Replays a trace against ``base_url`` (a proxy or an engine) with the client model's rules.

    ``max_calls_in_progress`` (None: no bound) skips a call whose arrival finds that many in
    progress (counted in ``stats.calls_skipped``; its record has no attempt). ``stats`` may be
    shared with a caller that reads the counts while the client runs.
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        vocab_size: int,
        config: ClientConfig,
        *,
        seed: int = 0,
        token_seed: int = 0,
        call_id_header: str = "x-call-id",
        connect_timeout_s: float = 10.0,
        max_connections: int = 4_096,
        max_calls_in_progress: int | None = None,
        stats: OpenLoopStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        segments: Mapping[str, Segments] | None = None,
    ) -> None:
        if max_calls_in_progress is not None and max_calls_in_progress < 1:
            raise ValueError(f"max_calls_in_progress must be >= 1, got {max_calls_in_progress!r}")
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.config = config
        self.model = ClientModel(config, random.Random(seed))
        self.token_seed = token_seed
        self.call_id_header = call_id_header
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.max_calls_in_progress = max_calls_in_progress
        self.clock = clock
        self.stats = stats if stats is not None else OpenLoopStats()
        self.calls: list[CallRecord] = []
        # a replayed trace's prompts as prefix blocks, by call id (``RunPlan.segments``)
        self.segments: Mapping[str, Segments] = segments or {}

    def _body(self, call: PlannedCall) -> bytes:
        segments = self.segments.get(call.call_id)
        if segments is not None:
            ids = segment_token_ids(segments, self.vocab_size, self.token_seed)
        else:
            ids = prompt_token_ids(call, self.vocab_size, self.token_seed)
        return completion_body(self.model_name, ids, call.response_len)

    async def _call(
        self, client: httpx.AsyncClient, planned: PlannedCall, record: CallRecord, t0: float
    ) -> None:
        await asyncio.sleep(max(0.0, t0 + planned.arrival_s - self.clock()))
        stats = self.stats
        if self.max_calls_in_progress is not None and stats.in_progress >= self.max_calls_in_progress:
            stats.calls_skipped += 1
            return
        stats.calls_started += 1
        body = self._body(planned)
        due = planned.arrival_s
        while True:
            now = self.clock() - t0
            if now - due > LATE_START_S:
                stats.late_starts += 1
            attempt = self.model.send(record, now)
            stats.attempts_sent += 1
            stats.retries_sent += attempt.is_retry
            result: AttemptResult = await run_attempt(
                client,
                self.url,
                body,
                call_id=planned.call_id,
                deadline_at=t0 + self.model.attempt_limit_at(attempt),
                call_id_header=self.call_id_header,
                read_timeout_s=self.config.read_timeout_s,
                on_first_byte=lambda at: self.model.first_byte(record, at - t0),
                clock=self.clock,
            )
            stats.outcomes[result.outcome.value] = stats.outcomes.get(result.outcome.value, 0) + 1
            ended = result.ended_at - t0
            if result.outcome is AttemptOutcome.DELIVERED:
                self.model.delivered(record, ended)
                stats.calls_delivered += 1
                stats.calls_delivered_in_deadline += ended - record.first_sent_at <= self.config.deadline_s
                return
            next_at = self.model.failed(
                record,
                ended,
                result.outcome,
                result.retry_after_s,
                status=result.status,
                should_retry=result.should_retry,
            )
            if next_at is None:
                stats.calls_failed += 1
                return
            due = next_at
            await asyncio.sleep(max(0.0, t0 + next_at - self.clock()))

    async def _heartbeat(self) -> None:
        """Sleep ``HEARTBEAT_S`` at a time and record how late each wake-up came."""
        while True:
            due = self.clock() + HEARTBEAT_S
            await asyncio.sleep(HEARTBEAT_S)
            self.stats.loop_lags.append(max(0.0, self.clock() - due))

    async def run(self, trace: Sequence[PlannedCall], t0: float | None = None) -> list[CallRecord]:
        """Run every call of ``trace``; return their records (in trace order)."""
        t0 = self.clock() if t0 is None else t0
        self.calls = [
            self.model.new_call(
                c.call_id, c.arrival_s, prompt_len=c.prompt_len, response_len=c.response_len, phase=c.phase
            )
            for c in trace
        ]
        last_arrival = max((c.arrival_s for c in trace), default=0.0)
        end_at = t0 + last_arrival + self.config.horizon_s
        # NOTE: a full garbage collection walks every object the process holds and stalls this
        # loop meanwhile: about 85 ms here in a process with only the test suite's imports, more
        # with what earlier tests left. Frozen, what exists before the run is never walked.
        gc.collect()
        gc.freeze()
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            await self._run_calls(trace, t0, end_at)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            gc.unfreeze()
        # A call cut off at the horizon: its open attempt ends now, as a give-up.
        ended = self.clock() - t0
        for record in self.calls:
            if record.attempts and record.attempts[-1].open:
                attempt = record.attempts[-1]
                attempt.ended_at = ended
                attempt.outcome = AttemptOutcome.DISCONNECTED
            record.done = True
        return self.calls

    async def _run_calls(self, trace: Sequence[PlannedCall], t0: float, end_at: float) -> None:
        limits = httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=0)
        timeout = httpx.Timeout(None, connect=self.connect_timeout_s)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            tasks = [
                asyncio.create_task(self._call(client, planned, record, t0))
                for planned, record in zip(trace, self.calls, strict=True)
            ]
            if not tasks:
                return
            try:
                await asyncio.wait(tasks, timeout=max(0.0, end_at - self.clock()))
            finally:
                # At the horizon, or when the run itself is cancelled (the demo's stop): every
                # open attempt is closed, which its server sees as a client disconnect. Bounded,
                # so that closing hundreds of attempts cannot hold up a stop.
                pending = [t for t in tasks if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=STOP_TIMEOUT_S)
            errors = [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception()) is not None]
            if errors:
                raise errors[0]  # a bug in the driver, not an attempt's outcome
