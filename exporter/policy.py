"""The proxy's policy core: every decision about attempts and executions, and nothing else.

NOTE: this module is pure and clock-injected. Every entry point takes ``now`` (seconds on any
monotonic clock) and returns what the driver must do as a list of effects; it never sleeps,
reads a clock, or touches a socket. The asyncio proxy (``exporter.proxy``) drives it in wall
time and the simulator (``reproduce.sim``) drives the very same code in simulated time, so what
the simulator validates is the code that runs in production.

Lifecycle of an execution::

    created ──► QUEUED (proxy queue) ──► DISPATCHED (sent to the engine) ──► STREAMING (first token)
                   │                          │                                   │
                   └─► dropped                └─► refused / failed / cancelled ◄──┴─► completed | orphaned

Counters stay balanced at every moment:

* attempts = attached + shed + created
* created = dispatched + dropped + queued
* dispatched = completed + orphaned + cancelled + failed + refused + live

(``refused`` is the engine's refusal of a dispatched execution; ``dispatched - refused`` is what
the engine accepted.)
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum


class PolicyConfigError(ValueError):
    """A policy setting is out of range; the message says which and what is allowed."""


class AttemptKind(StrEnum):
    FIRST = "first"
    RETRY = "retry"


class ShedReason(StrEnum):
    RETRY_BUDGET = "retry_budget"
    PROXY_QUEUE = "proxy_queue"
    DEADLINE = "deadline"


class Fate(StrEnum):
    COMPLETED = "completed"
    ORPHANED = "orphaned"
    CANCELLED = "cancelled"
    DROPPED = "dropped"
    REFUSED = "refused"
    FAILED = "failed"


class ExecutionState(StrEnum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    STREAMING = "streaming"
    FINISHED = "finished"


class Cancellation(StrEnum):
    """What happens when an execution's last subscriber leaves."""

    OFF = "off"  # keep reading: the execution runs on, orphaned
    ON = "on"  # close the upstream connection now: the engine aborts it
    DEFERRED = "deferred"  # cancel after ``cancel_after_s`` unless a retry attaches first


class BudgetOrder(StrEnum):
    LOOKUP_FIRST = "lookup-first"  # the budget sees only retries that would create an execution
    BUDGET_FIRST = "budget-first"  # the budget can refuse a retry whose call has a live execution


class QueueOrder(StrEnum):
    FIFO = "fifo"
    LIFO = "lifo"  # newest first once more than ``lifo_threshold`` are queued


@dataclass(frozen=True)
class PolicyConfig:
    """Every knob of the policy core; the defaults are the study's "answer every call" recipe."""

    coalesce: bool = True
    cancellation: Cancellation = Cancellation.DEFERRED
    cancel_after_s: float = 10.0
    retry_budget: float | None = None  # max retries per first attempt over the window; None = off
    budget_window_s: float = 60.0
    budget_order: BudgetOrder = BudgetOrder.LOOKUP_FIRST
    max_outstanding: int | None = None  # executions in the engine at once; None = no proxy cap
    max_queued: int = 10_000  # bound on the proxy queue
    queue_order: QueueOrder = QueueOrder.FIFO
    lifo_threshold: int = 50
    deadline_check: bool = False
    deadline_s: float | None = None  # the clients' deadline on a whole attempt, when known
    max_live_executions: int = 20_000  # hard bound on executions held (queued + in the engine)
    retry_memory_s: float = 900.0  # how long a call key is remembered for classifying retries
    max_remembered_calls: int = 200_000
    prefill_tokens_per_s: float = 20_000.0  # prior for the first-token wait estimate; learned online

    def __post_init__(self) -> None:
        if self.cancel_after_s < 0 or not math.isfinite(self.cancel_after_s):
            raise PolicyConfigError("cancel_after_s must be a finite number of seconds >= 0")
        if self.retry_budget is not None and not (0 <= self.retry_budget < math.inf):
            raise PolicyConfigError("retry_budget must be a ratio >= 0 (e.g. 0.1), or None for no budget")
        if self.budget_window_s <= 0:
            raise PolicyConfigError("budget_window_s must be > 0 seconds")
        if self.max_outstanding is not None and self.max_outstanding < 1:
            raise PolicyConfigError("max_outstanding must be >= 1, or None for no proxy cap")
        if self.max_queued < 0:
            raise PolicyConfigError("max_queued must be >= 0")
        if self.lifo_threshold < 0:
            raise PolicyConfigError("lifo_threshold must be >= 0")
        if self.deadline_s is not None and not (0 < self.deadline_s < math.inf):
            raise PolicyConfigError("deadline_s must be a positive number of seconds, or None")
        if self.deadline_check and self.deadline_s is None:
            raise PolicyConfigError("deadline_check needs deadline_s (the clients' deadline)")
        if self.max_live_executions < 1 or self.max_remembered_calls < 1:
            raise PolicyConfigError("max_live_executions and max_remembered_calls must be >= 1")
        if self.retry_memory_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise PolicyConfigError("retry_memory_s and prefill_tokens_per_s must be > 0")


# --- what the driver tells the policy ---------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """One incoming attempt, reduced to what the policy needs (never the prompt itself)."""

    key: str | None  # call key (``exporter.callkey.call_key``); None = never coalesce
    retry_hint: bool = False  # the client says it is a retry (e.g. x-stainless-retry-count > 0)
    prompt_tokens: int = 0  # known or estimated prompt length, for the first-token wait estimate


# --- what the policy decides --------------------------------------------------------------


@dataclass(frozen=True)
class Attached:
    """The attempt joined a live execution as a new subscriber (replay, then live output)."""

    kind: AttemptKind
    subscriber_id: int
    execution_id: int


@dataclass(frozen=True)
class Created:
    """The attempt created a new execution; ``queued`` if it waits in the proxy queue."""

    kind: AttemptKind
    subscriber_id: int
    execution_id: int
    queued: bool


@dataclass(frozen=True)
class Shed:
    """The attempt was refused before reaching the engine."""

    kind: AttemptKind
    reason: ShedReason
    retry_after_s: float | None


Decision = Attached | Created | Shed


@dataclass(frozen=True)
class Dispatch:
    """Send this execution to the engine now."""

    execution_id: int


@dataclass(frozen=True)
class Cancel:
    """Close this execution's upstream connection so the engine aborts it."""

    execution_id: int


@dataclass(frozen=True)
class Drop:
    """This queued execution was dropped before dispatch; release what the driver holds for it."""

    execution_id: int


@dataclass(frozen=True)
class StartTimer:
    """Call ``Policy.on_timer(at, execution_id)`` at time ``at`` (deferred cancellation)."""

    execution_id: int
    at: float


Effect = Dispatch | Cancel | Drop | StartTimer


@dataclass(frozen=True)
class AttemptResult:
    decision: Decision
    effects: list[Effect]


# --- state -----------------------------------------------------------------------------


@dataclass
class Execution:
    """One unit of engine work and the subscribers waiting for its output."""

    execution_id: int
    key: str | None
    created_at: float
    prompt_tokens: int
    state: ExecutionState = ExecutionState.QUEUED
    subscribers: set[int] = field(default_factory=set)
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    fate: Fate | None = None
    cancel_at: float | None = None  # pending deferred cancellation

    @property
    def live(self) -> bool:
        return self.state is not ExecutionState.FINISHED


@dataclass
class Subscriber:
    subscriber_id: int
    execution_id: int
    kind: AttemptKind
    started_at: float
    call_started_at: float  # when the call's first attempt was seen


@dataclass
class PolicyCounters:
    """Raw monotonic counters, named after ``retrywatch.metricnames``."""

    attempts: dict[AttemptKind, int] = field(default_factory=lambda: dict.fromkeys(AttemptKind, 0))
    attached: int = 0
    shed: dict[ShedReason, int] = field(default_factory=lambda: dict.fromkeys(ShedReason, 0))
    created: int = 0
    dispatched: int = 0
    finished: dict[Fate, int] = field(default_factory=lambda: dict.fromkeys(Fate, 0))
    delivered: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})


@dataclass(frozen=True)
class PolicyGauges:
    executions_live: int  # dispatched and not finished (in the engine)
    executions_queued: int  # waiting in the proxy queue
    subscribers: int


class RetryBudget:
    """Retries may be at most ``ratio`` times the first attempts seen over a sliding window."""

    def __init__(self, ratio: float, window_s: float) -> None:
        self.ratio = ratio
        self.window_s = window_s
        self._firsts: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        for q in (self._firsts, self._retries):
            while q and q[0] <= horizon:
                q.popleft()

    def record_first(self, now: float) -> None:
        self._prune(now)
        self._firsts.append(now)

    def try_spend(self, now: float) -> bool:
        """Admit one retry if the window still has room for it, and record it."""
        self._prune(now)
        if len(self._retries) + 1 > self.ratio * len(self._firsts):
            return False
        self._retries.append(now)
        return True


class FirstTokenWaitEstimator:
    """Estimates how long a new execution would wait for its first token.

    wait ≈ (prompt tokens of the executions ahead of it that have not reached their first token
    + its own prompt) / prefill throughput. The throughput starts at a configured prior and is
    learned online from first-token events observed while a backlog existed (an EWMA of prompt
    tokens per second between consecutive first tokens).
    """

    ALPHA = 0.2

    def __init__(self, prior_tokens_per_s: float) -> None:
        self.tokens_per_s = prior_tokens_per_s
        self._last_event_at: float | None = None

    def observe_first_token(self, now: float, prompt_tokens: int, backlog_before: int) -> None:
        if self._last_event_at is not None and backlog_before > 1 and prompt_tokens > 0:
            dt = now - self._last_event_at
            if dt > 0:
                sample = prompt_tokens / dt
                self.tokens_per_s += self.ALPHA * (sample - self.tokens_per_s)
        self._last_event_at = now

    def wait_s(self, tokens_ahead: int, prompt_tokens: int) -> float:
        return (tokens_ahead + max(prompt_tokens, 1)) / self.tokens_per_s


class Policy:
    """The decision core. One instance per proxy (or per simulated proxy)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.counters = PolicyCounters()
        self.deadline_s: float | None = self.config.deadline_s
        self._budget = (
            RetryBudget(self.config.retry_budget, self.config.budget_window_s)
            if self.config.retry_budget is not None
            else None
        )
        self._estimator = FirstTokenWaitEstimator(self.config.prefill_tokens_per_s)
        self._executions: dict[int, Execution] = {}  # live ones only
        self._live_by_key: dict[str, int] = {}
        self._queue: deque[int] = deque()
        self._subscribers: dict[int, Subscriber] = {}
        self._calls_seen: OrderedDict[str, float] = OrderedDict()  # key -> first seen
        self._in_engine = 0  # dispatched and not finished
        self._awaiting_first_token_tokens = 0  # prompt tokens dispatched without a first token yet
        self._awaiting_first_token = 0
        self._next_execution_id = 1
        self._next_subscriber_id = 1

    # --- queries ----------------------------------------------------------------------

    def gauges(self) -> PolicyGauges:
        return PolicyGauges(
            executions_live=self._in_engine,
            executions_queued=len(self._queue),
            subscribers=len(self._subscribers),
        )

    def execution(self, execution_id: int) -> Execution | None:
        """A live execution by id (None once finished)."""
        return self._executions.get(execution_id)

    def subscriber(self, subscriber_id: int) -> Subscriber | None:
        return self._subscribers.get(subscriber_id)

    def live_executions(self) -> Iterator[Execution]:
        return iter(list(self._executions.values()))

    def estimated_first_token_wait_s(self, prompt_tokens: int) -> float:
        """The wait a new execution would see now: everything queued or prefilling goes first."""
        ahead = self._awaiting_first_token_tokens + sum(
            self._executions[e].prompt_tokens for e in self._queue
        )
        return self._estimator.wait_s(ahead, prompt_tokens)

    def stop_attaching(self, execution_id: int) -> None:
        """New attempts no longer attach to this live execution (e.g. its replay buffer is full);
        a retry of its call then creates a new execution."""
        execution = self._executions.get(execution_id)
        key = execution.key if execution is not None else None
        if key is not None and self._live_by_key.get(key) == execution_id:
            del self._live_by_key[key]

    def set_deadline(self, deadline_s: float | None) -> None:
        """Update the clients' deadline (e.g. when inferred from disconnects)."""
        if deadline_s is not None and not (0 < deadline_s < math.inf):
            raise PolicyConfigError("deadline must be a positive number of seconds")
        self.deadline_s = deadline_s

    # --- attempts ---------------------------------------------------------------------

    def _classify(self, now: float, attempt: Attempt) -> tuple[AttemptKind, float]:
        """First attempt or retry, and when the call's first attempt was seen."""
        call_started_at = now
        seen = False
        if attempt.key is not None:
            first_seen = self._calls_seen.get(attempt.key)
            if first_seen is not None and now - first_seen <= self.config.retry_memory_s:
                seen = True
                call_started_at = first_seen
            else:
                self._calls_seen[attempt.key] = now
                self._calls_seen.move_to_end(attempt.key)
                self._forget_old_calls(now)
        kind = AttemptKind.RETRY if (seen or attempt.retry_hint) else AttemptKind.FIRST
        return kind, call_started_at

    def _forget_old_calls(self, now: float) -> None:
        seen = self._calls_seen
        horizon = now - self.config.retry_memory_s
        while seen:
            oldest_key = next(iter(seen))
            if len(seen) > self.config.max_remembered_calls or seen[oldest_key] < horizon:
                seen.popitem(last=False)
            else:
                break

    def on_attempt(self, now: float, attempt: Attempt) -> AttemptResult:
        """Decide an attempt: attach to its call's live execution, shed it, or create one."""
        kind, call_started_at = self._classify(now, attempt)
        self.counters.attempts[kind] += 1
        if kind is AttemptKind.FIRST and self._budget is not None:
            self._budget.record_first(now)

        budget_first = self.config.budget_order is BudgetOrder.BUDGET_FIRST
        if budget_first and kind is AttemptKind.RETRY and not self._budget_admits(now):
            return self._shed(
                kind, ShedReason.RETRY_BUDGET, self.estimated_first_token_wait_s(attempt.prompt_tokens)
            )

        live = self._live_for(attempt.key)
        if live is not None:
            return AttemptResult(self._attach(now, kind, live, call_started_at), [])

        if not budget_first and kind is AttemptKind.RETRY and not self._budget_admits(now):
            return self._shed(
                kind, ShedReason.RETRY_BUDGET, self.estimated_first_token_wait_s(attempt.prompt_tokens)
            )

        if self.config.deadline_check and self.deadline_s is not None:
            wait = self.estimated_first_token_wait_s(attempt.prompt_tokens)
            if wait >= self.deadline_s:
                return self._shed(kind, ShedReason.DEADLINE, wait)

        must_queue = (
            self.config.max_outstanding is not None and self._in_engine >= self.config.max_outstanding
        )
        held = self._in_engine + len(self._queue)
        if held >= self.config.max_live_executions or (
            must_queue and len(self._queue) >= self.config.max_queued
        ):
            return self._shed(
                kind, ShedReason.PROXY_QUEUE, self.estimated_first_token_wait_s(attempt.prompt_tokens)
            )

        execution = Execution(
            execution_id=self._next_execution_id,
            key=attempt.key if self.config.coalesce else None,
            created_at=now,
            prompt_tokens=max(attempt.prompt_tokens, 0),
        )
        self._next_execution_id += 1
        self._executions[execution.execution_id] = execution
        if execution.key is not None:
            self._live_by_key[execution.key] = execution.execution_id
        self.counters.created += 1
        subscriber = self._subscribe(now, kind, execution, call_started_at)
        effects: list[Effect] = []
        if must_queue:
            self._queue.append(execution.execution_id)
        else:
            effects.append(self._dispatch(now, execution))
        decision = Created(kind, subscriber.subscriber_id, execution.execution_id, queued=must_queue)
        return AttemptResult(decision, effects)

    def _budget_admits(self, now: float) -> bool:
        return self._budget is None or self._budget.try_spend(now)

    def _shed(self, kind: AttemptKind, reason: ShedReason, retry_after_s: float | None) -> AttemptResult:
        self.counters.shed[reason] += 1
        return AttemptResult(Shed(kind, reason, retry_after_s), [])

    def _live_for(self, key: str | None) -> Execution | None:
        if key is None or not self.config.coalesce:
            return None
        execution_id = self._live_by_key.get(key)
        return None if execution_id is None else self._executions.get(execution_id)

    def _attach(
        self, now: float, kind: AttemptKind, execution: Execution, call_started_at: float
    ) -> Attached:
        self.counters.attached += 1
        execution.cancel_at = None  # a retry arrived in time: the deferred cancellation is off
        subscriber = self._subscribe(now, kind, execution, call_started_at)
        return Attached(kind, subscriber.subscriber_id, execution.execution_id)

    def _subscribe(
        self, now: float, kind: AttemptKind, execution: Execution, call_started_at: float
    ) -> Subscriber:
        subscriber = Subscriber(self._next_subscriber_id, execution.execution_id, kind, now, call_started_at)
        self._next_subscriber_id += 1
        self._subscribers[subscriber.subscriber_id] = subscriber
        execution.subscribers.add(subscriber.subscriber_id)
        return subscriber

    # --- dispatch and the proxy queue -------------------------------------------------

    def _dispatch(self, now: float, execution: Execution) -> Dispatch:
        execution.state = ExecutionState.DISPATCHED
        execution.dispatched_at = now
        self._in_engine += 1
        self._awaiting_first_token += 1
        self._awaiting_first_token_tokens += execution.prompt_tokens
        self.counters.dispatched += 1
        return Dispatch(execution.execution_id)

    def _next_from_queue(self) -> int:
        over = len(self._queue) > self.config.lifo_threshold
        if self.config.queue_order is QueueOrder.LIFO and over:
            return self._queue.pop()
        return self._queue.popleft()

    def _fill_slots(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        cap = self.config.max_outstanding
        while self._queue and (cap is None or self._in_engine < cap):
            execution = self._executions[self._next_from_queue()]
            effects.append(self._dispatch(now, execution))
        return effects

    # --- subscribers leaving ---------------------------------------------------------

    def on_subscriber_left(self, now: float, subscriber_id: int) -> list[Effect]:
        """A client gave up or disconnected before receiving the whole response."""
        subscriber = self._subscribers.pop(subscriber_id, None)
        if subscriber is None:
            return []
        execution = self._executions.get(subscriber.execution_id)
        if execution is None:
            return []
        execution.subscribers.discard(subscriber_id)
        if execution.subscribers:
            return []
        if execution.state is ExecutionState.QUEUED:
            self._queue.remove(execution.execution_id)
            self._finish(now, execution, Fate.DROPPED)
            return [Drop(execution.execution_id)]
        mode = self.config.cancellation
        if mode is Cancellation.ON or (mode is Cancellation.DEFERRED and self.config.cancel_after_s == 0):
            return self._cancel(now, execution)
        if mode is Cancellation.DEFERRED:
            execution.cancel_at = now + self.config.cancel_after_s
            return [StartTimer(execution.execution_id, execution.cancel_at)]
        return []  # cancellation off: it runs on, orphaned unless a retry attaches

    def on_subscriber_delivered(self, now: float, subscriber_id: int) -> None:
        """The subscriber received the complete response."""
        subscriber = self._subscribers.pop(subscriber_id, None)
        if subscriber is None:
            return
        if self.deadline_s is not None:
            within = now - subscriber.call_started_at <= self.deadline_s
        else:  # no known deadline: a call answered by its first attempt counts as on time
            within = subscriber.kind is AttemptKind.FIRST
        self.counters.delivered[within] += 1
        execution = self._executions.get(subscriber.execution_id)
        if execution is not None:
            execution.subscribers.discard(subscriber_id)

    def on_timer(self, now: float, execution_id: int) -> list[Effect]:
        """A deferred cancellation is due; it applies only if nobody attached meanwhile."""
        execution = self._executions.get(execution_id)
        if execution is None or execution.subscribers or execution.cancel_at is None:
            return []
        if now + 1e-9 < execution.cancel_at:
            return []
        return self._cancel(now, execution)

    def _cancel(self, now: float, execution: Execution) -> list[Effect]:
        self._finish(now, execution, Fate.CANCELLED)
        return [Cancel(execution.execution_id), *self._fill_slots(now)]

    # --- the engine's side ----------------------------------------------------------

    def on_first_token(self, now: float, execution_id: int) -> None:
        execution = self._executions.get(execution_id)
        if execution is None or execution.state is not ExecutionState.DISPATCHED:
            return
        backlog_before = self._awaiting_first_token
        self._leave_prefill(execution)
        execution.state = ExecutionState.STREAMING
        execution.first_token_at = now
        self._estimator.observe_first_token(now, execution.prompt_tokens, backlog_before)

    def on_completed(self, now: float, execution_id: int) -> list[Effect]:
        """The engine finished the execution. Subscribers still attached are then delivered by
        the driver (``on_subscriber_delivered``)."""
        execution = self._executions.get(execution_id)
        if execution is None or execution.state is ExecutionState.QUEUED:
            return []
        fate = Fate.COMPLETED if execution.subscribers else Fate.ORPHANED
        self._finish(now, execution, fate)
        return self._fill_slots(now)

    def on_refused(self, now: float, execution_id: int) -> list[Effect]:
        """The engine refused the execution (queue cap, HTTP 503). Its subscribers (read
        ``execution(id).subscribers`` before this call) get 503 and are removed."""
        return self._end_with_error(now, execution_id, Fate.REFUSED)

    def on_failed(self, now: float, execution_id: int) -> list[Effect]:
        """The upstream failed (down, or broke mid-stream). Its subscribers (read them before
        this call) get an error and are removed."""
        return self._end_with_error(now, execution_id, Fate.FAILED)

    def _end_with_error(self, now: float, execution_id: int, fate: Fate) -> list[Effect]:
        execution = self._executions.get(execution_id)
        if execution is None or execution.state is ExecutionState.QUEUED:
            return []
        for subscriber_id in execution.subscribers:
            self._subscribers.pop(subscriber_id, None)
        self._finish(now, execution, fate)
        return self._fill_slots(now)

    def _leave_prefill(self, execution: Execution) -> None:
        if execution.state is ExecutionState.DISPATCHED:
            self._awaiting_first_token -= 1
            self._awaiting_first_token_tokens -= execution.prompt_tokens

    def _finish(self, now: float, execution: Execution, fate: Fate) -> None:
        if execution.state in (ExecutionState.DISPATCHED, ExecutionState.STREAMING):
            self._in_engine -= 1
        self._leave_prefill(execution)
        execution.state = ExecutionState.FINISHED
        execution.finished_at = now
        execution.fate = fate
        execution.cancel_at = None
        self.counters.finished[fate] += 1
        del self._executions[execution.execution_id]
        if execution.key is not None and self._live_by_key.get(execution.key) == execution.execution_id:
            del self._live_by_key[execution.key]
