"""One simulated run (a pulse, or a replayed trace): workload → client → proxy policy → engine
model, in simulated time.

NOTE: everything decides through the shared pure cores: the client model says when attempts are
sent, the policy core decides attach / shed / create and what happens when a subscriber leaves,
the engine model schedules steps. This module only carries out their effects on one event heap:

* an attempt is sent → ``Policy.on_attempt``: shed (429 with Retry-After for the retry budget,
  503 otherwise) ends it at once; attached or created subscribes it, and its deadline is set;
* ``Dispatch`` → ``engine.add_request`` (a refusal → ``Policy.on_refused``, 503 to every
  subscriber); ``Cancel`` → ``engine.abort_request``; ``StartTimer`` → a heap event calling
  ``Policy.on_timer``; ``Drop`` → forget the execution;
* the engine's first token → ``Policy.on_first_token`` and the subscribers' first byte; its
  finish → ``Policy.on_completed``, then every subscriber still waiting is delivered;
* an attempt's deadline → ``Policy.on_subscriber_left`` and the client's retry, if any.

An attempt streams its execution's output: it ends when the execution finishes (delivered)
or at its deadline. Network time is not modelled (the study measured 3 ms through the proxy).
The run ends once no call is outstanding, at most ``horizon`` after the last planned arrival.
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from exporter.policy import (
    Attached,
    Attempt,
    Cancel,
    Created,
    Dispatch,
    Drop,
    Effect,
    Policy,
    Shed,
    StartTimer,
)
from foundation.metricnames import ShedReason
from foundation.timeseries import Snapshot
from reproduce.conditions import Condition
from reproduce.engine.config import EngineConfig
from reproduce.engine.presets import preset_capacity
from reproduce.sim import engine_link
from reproduce.sim.metrics import PROXY_WINDOW_S, Scraper
from reproduce.simenv import Environment, EventHandle
from reproduce.workloads.base import Shaping
from reproduce.workloads.calls import PlannedCall
from reproduce.workloads.client import AttemptOutcome, CallRecord, ClientConfig, ClientModel
from reproduce.workloads.plan import STUDY_CLOCK, RunClock, RunPlan

__all__ = ["SimResult", "SimSpec", "simulate"]

SNAPSHOT_EVERY_S = 5.0  # at the study's scale
_FIRST_TOKEN, _FINISHED = engine_link.EventKind.FIRST_TOKEN, engine_link.EventKind.FINISHED
_RUN_YOUNG_PASS_EVERY = 50_000  # the collector's young-generation threshold during a run


@dataclass(frozen=True)
class SimSpec:
    """Everything one simulated run needs. Durations are at the study's scale; ``clock``
    scales them. ``capacity`` is Ĉ of the engine in calls per simulated second (None: the
    preset's calibrated value). ``workload`` shapes the workload (``reproduce.workloads.Shaping``:
    fields of ``WorkloadSpec``, e.g. shorter prompts for a quick test, a trace's ``token_scale``);
    ``engine`` overrides fields of the preset's ``EngineConfig``."""

    model: str
    condition: Condition
    seed: int = 0
    capacity: float | None = None
    clock: RunClock = STUDY_CLOCK
    client: ClientConfig | None = None  # instead of the condition's client (its profile's)
    workload: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    engine_config: EngineConfig | None = None  # instead of the preset's
    snapshot_every_s: float = SNAPSHOT_EVERY_S

    def plan(self) -> RunPlan:
        """The run, planned once from its workload (the condition's, with ``workload``'s
        overrides): its calls, phases and client in run seconds. The run follows this plan and
        is judged on it."""
        cond = self.condition
        capacity = self.capacity if self.capacity is not None else preset_capacity(self.model)
        return cond.workload.plan(
            capacity,
            cond.client.config(self.client),
            seed=self.seed,
            clock=self.clock,
            shaping=Shaping.of(self.workload),
        )


@dataclass
class SimResult:
    """What a run produced: call records, the metrics series, and bookkeeping."""

    spec: SimSpec
    plan: RunPlan
    capacity: float
    calls: list[CallRecord]
    snapshots: list[Snapshot]
    end_s: float
    wall_s: float
    cpu_s: float
    trace_shares: dict[str, float | None] | None = None  # when the condition traces executions


class _Call:
    """A call in flight: its plan, its record and its outstanding attempt."""

    __slots__ = ("deadline", "last_execution", "plan", "record", "segments", "subscriber")

    def __init__(self, plan: PlannedCall, record: CallRecord, segments: tuple[tuple[int, int], ...]) -> None:
        self.plan = plan
        self.record = record
        self.segments = segments
        self.subscriber: int | None = None
        self.deadline: EventHandle | None = None
        self.last_execution: int | None = None  # the execution its latest attempt created


class _World:
    """The state of one run: the environment, the client, the policy, the engine and the calls."""

    def __init__(self, spec: SimSpec, plan: RunPlan, capacity: float, engine: engine_link.Engine) -> None:
        self.spec = spec
        self.plan = plan
        self.capacity = capacity
        self.env = Environment()
        self.rng = random.Random(f"retrywatch-sim-{spec.seed}")
        self.client = ClientModel(plan.client, self.rng)
        self.policy = Policy(spec.condition.policy.config(plan))
        self.engine = engine
        self.engine.bind(self.env, self._on_engine_event)
        self.tracing = spec.condition.engine.tracing  # (read on every attempt)
        self.by_subscriber: dict[int, _Call] = {}
        self.by_execution: dict[int, _Call] = {}
        # the calls' records only: a call's state (its prompt's segments) is dropped once it is over
        self.records: list[CallRecord] = []
        # tracing: (execution id, the call's previous execution id, deadline) of each retry's execution
        self.retries: list[tuple[int, int | None, float]] = []
        self.outstanding = 0
        self.arrived = 0
        self.snapshots: list[Snapshot] = []
        self.scraper = Scraper(
            self.policy, engine.metrics_samples, capacity=capacity, window_s=plan.run_s(PROXY_WINDOW_S)
        )

    # --- arrivals and attempts ------------------------------------------------------

    def start(self, trace: list[PlannedCall]) -> None:
        self.trace = trace
        if trace:
            self.env.schedule(trace[0].arrival_s, self._arrive, 0)

    def _arrive(self, index: int) -> None:
        trace = self.trace
        plan = trace[index]
        if index + 1 < len(trace):
            self.env.schedule(trace[index + 1].arrival_s, self._arrive, index + 1)
        record = self.client.new_call(
            plan.call_id,
            plan.arrival_s,
            prompt_len=plan.prompt_len,
            response_len=plan.response_len,
            phase=plan.phase,
        )
        call = _Call(plan, record, self.plan.prompt_segments(plan))
        self.records.append(record)
        self.arrived += 1
        self.outstanding += 1
        self._send(call)

    def _send(self, call: _Call) -> None:
        now = self.env.now
        attempt = self.client.send(call.record, now)
        sent = Attempt(call.plan.call_id, identified=True, prompt_tokens=call.plan.prompt_len)
        result = self.policy.on_attempt(now, sent)
        decision = result.decision
        if isinstance(decision, Shed):
            if decision.reason is ShedReason.RETRY_BUDGET:
                self._failed(call, AttemptOutcome.SHED, decision.retry_after_s)
            else:
                self._failed(call, AttemptOutcome.REFUSED, None)
            return
        call.subscriber = decision.subscriber_id
        self.by_subscriber[decision.subscriber_id] = call
        call.deadline = self.env.schedule(attempt.deadline_at, self._give_up, call, decision.subscriber_id)
        if isinstance(decision, Created):
            self.by_execution[decision.execution_id] = call
            if self.tracing and attempt.is_retry:
                self.retries.append((decision.execution_id, call.last_execution, attempt.deadline_at))
            call.last_execution = decision.execution_id
        elif isinstance(decision, Attached):
            execution = self.policy.execution(decision.execution_id)
            if execution is not None and execution.first_token_at is not None:
                self._first_byte(call, now)
        self._apply(result.effects)

    def _first_byte(self, call: _Call, now: float) -> None:
        """The call's attempt got its first byte; its output then flows one token per engine
        step, so a read timeout no longer gives it up: only a whole-attempt limit does."""
        first = call.record.attempts[-1].first_byte_at is None
        self.client.first_byte(call.record, now)
        if first and self.client.config.read_timeout_s is not None and call.deadline is not None:
            subscriber = call.subscriber
            assert subscriber is not None
            self.env.cancel(call.deadline)
            call.deadline = None
            at = self.client.attempt_limit_at(call.record.attempts[-1])
            if math.isfinite(at):
                call.deadline = self.env.schedule(at, self._give_up, call, subscriber)

    def _failed(self, call: _Call, outcome: AttemptOutcome, retry_after_s: float | None) -> None:
        call.subscriber = None
        if call.deadline is not None:
            self.env.cancel(call.deadline)
            call.deadline = None
        nxt = self.client.failed(call.record, self.env.now, outcome, retry_after_s)
        if nxt is None:
            self.outstanding -= 1
        else:
            self.env.schedule(nxt, self._send, call)

    def _give_up(self, call: _Call, subscriber_id: int) -> None:
        if call.subscriber != subscriber_id:
            return
        del self.by_subscriber[subscriber_id]
        call.deadline = None
        effects = self.policy.on_subscriber_left(self.env.now, subscriber_id)
        self._failed(call, AttemptOutcome.DISCONNECTED, None)
        self._apply(effects)

    # --- effects ----------------------------------------------------------------------

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Dispatch):
                self._dispatch(effect.execution_id)
            elif isinstance(effect, Cancel):
                self.engine.abort(effect.execution_id, self.env.now)
                self.by_execution.pop(effect.execution_id, None)
            elif isinstance(effect, StartTimer):
                self.env.schedule(max(effect.at, self.env.now), self._timer, effect.execution_id)
            elif isinstance(effect, Drop):
                self.by_execution.pop(effect.execution_id, None)

    def _timer(self, execution_id: int) -> None:
        self._apply(self.policy.on_timer(self.env.now, execution_id))

    def _dispatch(self, execution_id: int) -> None:
        call = self.by_execution[execution_id]
        now = self.env.now
        if self.engine.add(execution_id, call.segments, call.plan.response_len, now):
            return
        execution = self.policy.execution(execution_id)
        subscribers = list(execution.subscribers) if execution is not None else []
        effects = self.policy.on_refused(now, execution_id)
        self.by_execution.pop(execution_id, None)
        for sub in subscribers:
            refused = self.by_subscriber.pop(sub, None)
            if refused is not None and refused.subscriber == sub:
                self._failed(refused, AttemptOutcome.REFUSED, None)
        self._apply(effects)

    # --- the engine's side --------------------------------------------------------------

    def _on_engine_event(self, kind: engine_link.EventKind, execution_id: int) -> None:
        now = self.env.now
        policy = self.policy
        if kind is _FIRST_TOKEN:
            execution = policy.execution(execution_id)
            policy.on_first_token(now, execution_id)
            if execution is not None:
                for sub in execution.subscribers:
                    call = self.by_subscriber.get(sub)
                    if call is not None:
                        self._first_byte(call, now)
        elif kind is _FINISHED:
            execution = policy.execution(execution_id)
            subscribers = list(execution.subscribers) if execution is not None else []
            effects = policy.on_completed(now, execution_id)
            self.by_execution.pop(execution_id, None)
            for sub in subscribers:
                call = self.by_subscriber.pop(sub, None)
                policy.on_subscriber_delivered(now, sub)
                if call is None or call.subscriber != sub:
                    continue
                call.subscriber = None
                if call.deadline is not None:
                    self.env.cancel(call.deadline)
                    call.deadline = None
                self.client.delivered(call.record, now)
                self.outstanding -= 1
            if effects:
                self._apply(effects)
        # ABORTED: the policy finished the execution when it cancelled it; nothing to do.

    # --- the run --------------------------------------------------------------------------

    def take_snapshot(self) -> None:
        self.snapshots.append(self.scraper.snapshot(self.env.now))

    def run(self) -> float:
        every = self.plan.run_s(self.spec.snapshot_every_s)
        last_arrival = self.trace[-1].arrival_s if self.trace else 0.0
        limit = last_arrival + self.client.config.horizon_s
        n = len(self.trace)
        t = 0.0
        done_at: float | None = None
        self.take_snapshot()
        while True:
            t = min(t + every, limit)
            self.env.run(until=t)
            self.take_snapshot()
            if done_at is None and self.arrived == n and self.outstanding == 0:
                done_at = t
            if t >= limit or (done_at is not None and t >= done_at + self.plan.tail_s):
                return t


@contextmanager
def _collector_skips_the_heap_before() -> Iterator[None]:
    """Leave the objects alive before the run (modules, the caller's data: most of the heap)
    out of the cyclic garbage collector's full passes while it runs (``gc.freeze``): the run
    allocates a few objects per event, which triggers a full pass now and then, and each such
    pass would walk all of them again, about a sixth of a replay's time. They are handed back
    (``gc.unfreeze``) when the run ends. The young generation is also collected less often
    while it runs (every ``_RUN_YOUNG_PASS_EVERY`` net allocations instead of 700): a replay of
    an hour of trace made 181 passes that freed nothing (a run's objects live until its end, and
    the cycles it makes are broken as it goes), 7 % of its time. So cyclic garbage made during
    the run is collected at most that many allocations later, and cyclic garbage that existed
    before it when the run ends. A caller that froze the heap itself is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(_RUN_YOUNG_PASS_EVERY, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def simulate(spec: SimSpec) -> SimResult:
    """Run one pulse run to its end; deterministic for ``spec`` (same seed, same result)."""
    with _collector_skips_the_heap_before():
        return _simulate(spec)


def _simulate(spec: SimSpec) -> SimResult:
    started = time.perf_counter()
    cpu_started = time.process_time()
    settings = spec.condition.engine
    engine = engine_link.Engine.for_preset(
        spec.model,
        tokens_per_step=settings.tokens_per_step,
        queue_cap=settings.engine_queue_cap,
        trace=settings.tracing,
        overrides=spec.engine,
        config=spec.engine_config,
    )
    capacity = spec.capacity if spec.capacity is not None else preset_capacity(spec.model)
    plan = spec.plan()
    world = _World(spec, plan, capacity, engine)
    world.start(list(plan.calls))
    end = world.run()
    return SimResult(
        spec=spec,
        plan=plan,
        capacity=capacity,
        calls=world.records,
        snapshots=world.snapshots,
        end_s=end,
        wall_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu_started,
        trace_shares=engine.shares() | engine.retry_timing(world.retries) if settings.tracing else None,
    )
