"""A small event-driven model of the pulse experiment, for the detector's tests.

Not the project's simulator (``reproduce/``): one FIFO engine with ``slots`` executions running
at once, each taking ``slots / Ĉ`` seconds (so it completes Ĉ calls/s when saturated),
clients with a deadline and up to R retries, cancellation on or off, no proxy controls. It
writes the proxy's and vLLM's real metric names every ``scrape`` seconds, which is all the
detector reads. It reproduces the mechanism of docs/protocol.md §8 (orphaned loop with cancellation
off, Little's-law loop with cancellation on, recovery without retries) so the tests can check
verdicts against an independent model rather than against hand-written numbers.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from foundation import metricnames as mn
from foundation.timeseries import Sample, Snapshot

PROMPT_TOKENS = 12_000


@dataclass
class _Exec:
    call: int
    attempt: int
    sent: float
    subscribed: bool = True
    state: str = "queued"  # queued | running | done
    started: float = 0.0


@dataclass
class MiniSim:
    capacity: float = 2.78
    deadline: float = 120.0
    retries: int = 3
    cancellation: bool = False
    base: float = 0.6
    pulse: float = 2.7
    t_base: float = 120.0
    t_pulse: float = 107.0
    t_hold: float = 720.0
    scrape: float = 5.0
    slots: int = 20
    prefill_share: float = 0.15  # share of an execution's time before its first token
    seed: int = 0
    model: str = "mini-model"
    counters: dict[str, float] = field(default_factory=dict)

    def run(self, *, max_after_s: float = 840.0) -> list[Snapshot]:
        rng = random.Random(self.seed)
        heap: list[tuple[float, int, str, object]] = []
        seq = 0

        def push(at: float, kind: str, data: object = None) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (at, seq, kind, data))

        # planned arrivals (open loop, Poisson per phase)
        phases = [
            (0.0, self.t_base, self.base),
            (self.t_base, self.t_base + self.t_pulse, self.pulse),
            (self.t_base + self.t_pulse, self.t_base + self.t_pulse + self.t_hold, self.base),
        ]
        n_calls = 0
        for start, end, mult in phases:
            t = start
            while True:
                t += rng.expovariate(mult * self.capacity)
                if t >= end:
                    break
                push(t, "send", (n_calls, 0))
                n_calls += 1
        last_arrival = phases[-1][1]
        c: dict[str, float] = {
            "first": 0, "retry": 0, "created": 0, "dispatched": 0, "within": 0, "late": 0, "missed": 0,
            "prompt": 0, "queries": 0,
            **{f: 0 for f in mn.FATES},
        }  # fmt: skip
        first_sent: dict[int, float] = {}  # calls not yet delivered -> their first attempt's time
        queue: deque[_Exec] = deque()
        n_queued = 0  # live executions in the queue (cancelled ones are removed lazily)
        running: set[int] = set()
        outstanding = 0
        service = self.slots / self.capacity
        snapshots: list[Snapshot] = []
        push(0.0, "scrape")

        def start_next(now: float) -> None:
            nonlocal n_queued
            while len(running) < self.slots and queue:
                ex = queue.popleft()
                if ex.state != "queued":
                    continue
                n_queued -= 1
                ex.state, ex.started = "running", now
                running.add(id(ex))
                c["queries"] += PROMPT_TOKENS
                push(now + self.prefill_share * service, "first_token", ex)
                push(now + service, "finish", ex)

        while heap:
            now, _, kind, data = heapq.heappop(heap)
            if kind == "scrape":
                snapshots.append(self._snapshot(now, c, n_queued, len(running)))
                if (now > last_arrival and outstanding == 0) or now > last_arrival + max_after_s:
                    break
                push(now + self.scrape, "scrape")
            elif kind == "send":
                call, attempt = data  # type: ignore[misc]
                if attempt == 0:
                    outstanding += 1
                    first_sent[call] = now
                    push(now + self.deadline, "due", call)
                c["first" if attempt == 0 else "retry"] += 1
                c["created"] += 1
                c["dispatched"] += 1
                ex = _Exec(call, attempt, now)
                queue.append(ex)
                n_queued += 1
                push(now + self.deadline, "timeout", ex)
                start_next(now)
            elif kind == "first_token":
                ex = data  # type: ignore[assignment]
                if id(ex) in running:
                    c["prompt"] += PROMPT_TOKENS
            elif kind == "finish":
                ex = data  # type: ignore[assignment]
                if id(ex) not in running:
                    continue
                running.discard(id(ex))
                ex.state = "done"
                if ex.subscribed:
                    c["completed"] += 1
                    sent = first_sent.pop(ex.call, None)
                    c["within" if sent is not None and now - sent <= self.deadline else "late"] += 1
                    outstanding -= 1
                else:
                    c["orphaned"] += 1
                start_next(now)
            elif kind == "due":  # the call's first deadline passed: missed unless delivered
                if data in first_sent:
                    c["missed"] += 1
            elif kind == "timeout":
                ex = data  # type: ignore[assignment]
                if ex.state == "done":
                    continue
                ex.subscribed = False
                if self.cancellation:
                    if id(ex) in running:
                        running.discard(id(ex))
                    else:
                        n_queued -= 1
                    ex.state = "done"
                    c["cancelled"] += 1
                    start_next(now)
                if ex.attempt < self.retries:
                    push(now + rng.uniform(0.25, 3.0), "send", (ex.call, ex.attempt + 1))
                else:
                    outstanding -= 1
        return snapshots

    def _snapshot(self, now: float, c: dict[str, float], waiting: int, busy: int) -> Snapshot:
        vl = {"engine": "0", "model_name": self.model}
        samples: list[Sample] = [
            (mn.ATTEMPTS, {"kind": "first"}, c["first"]),
            (mn.ATTEMPTS, {"kind": "retry"}, c["retry"]),
            (mn.ATTEMPTS_ATTACHED, {}, 0.0),
            *((mn.ATTEMPTS_SHED, {"reason": r}, 0.0) for r in mn.SHED_REASONS),
            (mn.EXECUTIONS_CREATED, {}, c["created"]),
            (mn.EXECUTIONS_DISPATCHED, {}, c["dispatched"]),
            *((mn.EXECUTIONS_FINISHED, {"fate": f}, c[f]) for f in mn.FATES),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, c["within"]),
            (mn.CALLS_DELIVERED, {"within_deadline": "false"}, c["late"]),
            (mn.CALLS_MISSED_DEADLINE, {}, c["missed"]),
            (mn.EXECUTIONS_LIVE, {}, float(waiting + busy)),
            (mn.EXECUTIONS_QUEUED, {}, 0.0),
            (mn.CAPACITY, {}, self.capacity),
            (mn.CLIENT_DEADLINE, {}, self.deadline),
            (mn.UPSTREAM_UP, {}, 1.0),
            (mn.VLLM_NUM_WAITING, vl, float(waiting)),
            (mn.VLLM_NUM_RUNNING, vl, float(busy)),
            (mn.VLLM_PROMPT_TOKENS, vl, c["prompt"]),
            (mn.VLLM_PREFIX_CACHE_QUERIES, vl, c["queries"]),
        ]
        return Snapshot(t=round(now, 6), samples=samples)

    @property
    def pulse_end(self) -> float:
        return self.t_base + self.t_pulse
