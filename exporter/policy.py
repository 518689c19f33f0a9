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

NOTE: first attempt or retry, and whether an attempt may attach (``Policy._classify``). A first
attempt is never a retry and never attaches; only a retry attaches, so the retry counters, the
retry budget and the signals built on them see real retries only.

* With a call id (``Attempt.identified``): the call id is the client's explicit statement that
  two attempts belong to one call. An attempt whose key was seen within ``retry_memory_s`` (or
  has a live execution) is a retry, whatever the SDK retry counter says: an application's own
  retry loop around an SDK sends the same call id with the counter at 0 every time, because the
  counter only knows the SDK's own loop. An attempt whose key was not seen is a first attempt,
  unless the client says it is a retry (its first attempt went elsewhere or was forgotten).
* Without a call id (the key is a hash of the body): identical bodies say nothing about being
  one call (five samples of one prompt at temperature 1 look alike). Such an attempt is a retry
  only when it is evident: the client says so (SDK retry counter > 0), or it says nothing and an
  attempt with the same key has left (disconnected before its answer, was shed, refused or
  failed) and that departure has not yet been used by another retry. Each departure licenses
  one retry (at most ``MAX_DEPARTURES_PER_KEY`` pending per key and ``max_remembered_departures``
  in all, each forgotten after ``retry_memory_s``: ``exporter.departures``). A counter at 0 is
  a first attempt. Such a retry attaches only to an execution nobody waits for (its predecessor
  left it): one that still has a subscriber serves another attempt that may be a distinct call
  with the same body. So without a call id an execution never serves two waiting clients at
  once, and a concurrent identical first attempt always gets an execution of its own.

Several live executions can share a key (concurrent identical first attempts without a call id);
every per-key structure is bounded (live executions by ``max_live_executions``, remembered keys
by ``max_remembered_calls`` and ``retry_memory_s``, departures by ``max_remembered_departures``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from exporter.callmemory import AwaitingDelivery, SeenCalls
from exporter.departures import DepartureMemory
from foundation.knobs import check_bounds, knob
from foundation.metricnames import Fate, ShedReason

# Departures of attempts without a call id remembered per key, each licensing one retry: enough
# for a burst of identical calls that all time out together; beyond it the oldest are forgotten.
MAX_DEPARTURES_PER_KEY = 32


class PolicyConfigError(ValueError):
    """A policy setting is out of range; the message says which and what is allowed."""


class AttemptKind(StrEnum):
    FIRST = "first"
    RETRY = "retry"


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
    """Every knob of the policy core; the defaults are the study's "answer every call" recipe.

    Each knob with an option (``foundation.knobs``) is a flag of ``retrywatch proxy``; the proxy's
    settings inherit these fields, so a knob is declared here once. The clients' deadline is set
    by the proxy's ``--deadline`` (seconds, or ``auto`` to infer it)."""

    coalesce: bool = knob(True, flag="coalesce", help="Attach retries to their call's live execution.")
    cancellation: Cancellation = knob(
        Cancellation.DEFERRED,
        flag="cancellation",
        help="Last subscriber gone: off (run on), on (abort now), deferred (abort after --cancel-after).",
    )
    cancel_after_s: float = knob(
        10.0, flag="cancel-after", help="Seconds of deferred cancellation.", minimum=0
    )
    retry_budget: float | None = knob(
        None,
        flag="retry-budget",
        help="Max retries per first attempt over --budget-window (e.g. 0.1); unset = no budget.",
        minimum=0,
    )
    budget_window_s: float = knob(
        60.0, flag="budget-window", help="Budget window, seconds.", minimum=0, exclusive=True
    )
    budget_order: BudgetOrder = knob(
        BudgetOrder.LOOKUP_FIRST,
        flag="budget-order",
        help="lookup-first: the budget sees only retries that would create an execution.",
    )
    max_outstanding: int | None = knob(
        None,
        flag="max-outstanding",
        help="Executions in the engine at once; more wait in the proxy queue. Unset = no proxy cap.",
        minimum=1,
    )
    max_queued: int = knob(10_000, flag="max-queued", help="Bound on the proxy queue.", minimum=0)
    queue_order: QueueOrder = knob(
        QueueOrder.FIFO,
        flag="queue-order",
        help="Proxy queue order; lifo serves the newest first once over --lifo-threshold are queued.",
    )
    lifo_threshold: int = knob(
        50, flag="lifo-threshold", help="Queue length above which LIFO applies.", minimum=0
    )
    deadline_check: bool = knob(
        False,
        flag="deadline-check",
        help="Refuse (503) an attempt the proxy estimates will miss the clients' deadline.",
    )
    deadline_s: float | None = None  # the clients' deadline on a whole attempt, when known
    max_live_executions: int = knob(
        20_000,
        flag="max-live-executions",
        help="Hard bound on executions held (queued + in the engine).",
        minimum=1,
    )
    retry_memory_s: float = 900.0  # how long a call key is remembered for classifying retries
    max_remembered_calls: int = 200_000
    # Departures without a call id remembered in all (``exporter.departures``): about 280 bytes
    # each at the bound, each under a key of its own, the key included. 100,000 in 15 min is 110
    # a second left unanswered and not yet retried, far beyond what one engine serves (the
    # study's: about 3 calls/s).
    max_remembered_departures: int = 100_000
    prefill_tokens_per_s: float = 20_000.0  # prior for the first-token wait estimate; learned online

    def __post_init__(self) -> None:
        check_bounds(self, PolicyConfigError)
        if self.deadline_s is not None and not (0 < self.deadline_s < math.inf):
            raise PolicyConfigError("deadline_s must be a positive number of seconds, or None")
        if self.deadline_check and self.deadline_s is None:
            raise PolicyConfigError("deadline_check needs deadline_s (the clients' deadline)")
        if self.max_remembered_calls < 1 or self.max_remembered_departures < 1:
            raise PolicyConfigError("max_remembered_calls and max_remembered_departures must be >= 1")
        if self.retry_memory_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise PolicyConfigError("retry_memory_s and prefill_tokens_per_s must be > 0")


# --- what the driver tells the policy ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attempt:
    """One incoming attempt, reduced to what the policy needs (never the prompt itself).

    ``identified``: the key comes from a call id the client gave; otherwise it is a hash of the
    body, which only says that two attempts look alike. ``client_says_retry`` is the client's own
    word (the SDK retry counter): None when it says nothing, True when it counts this attempt as
    a retry (counter > 0), False when it counts it a first attempt (counter 0).
    """

    key: str | None  # call key (``exporter.callkey.call_key``); None = never coalesce
    identified: bool
    client_says_retry: bool | None = None
    prompt_tokens: int = 0  # known or estimated prompt length, for the first-token wait estimate


# --- what the policy decides --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attached:
    """The attempt joined a live execution as a new subscriber (replay, then live output)."""

    kind: AttemptKind
    subscriber_id: int
    execution_id: int


@dataclass(frozen=True, slots=True)
class Created:
    """The attempt created a new execution; ``queued`` if it waits in the proxy queue."""

    kind: AttemptKind
    subscriber_id: int
    execution_id: int
    queued: bool


@dataclass(frozen=True, slots=True)
class Shed:
    """The attempt was refused before reaching the engine."""

    kind: AttemptKind
    reason: ShedReason
    retry_after_s: float | None


Decision = Attached | Created | Shed


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send this execution to the engine now."""

    execution_id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Close this execution's upstream connection so the engine aborts it."""

    execution_id: int


@dataclass(frozen=True, slots=True)
class Drop:
    """This queued execution was dropped before dispatch; release what the driver holds for it."""

    execution_id: int


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Call ``Policy.on_timer(at, execution_id)`` at time ``at`` (deferred cancellation)."""

    execution_id: int
    at: float


Effect = Dispatch | Cancel | Drop | StartTimer


@dataclass(frozen=True, slots=True)
class AttemptResult:
    decision: Decision
    effects: list[Effect]


# --- state -----------------------------------------------------------------------------


@dataclass(slots=True)
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


@dataclass(slots=True)
class Subscriber:
    subscriber_id: int
    execution_id: int
    kind: AttemptKind
    started_at: float
    call_started_at: float  # when the call's first attempt was seen
    departure_key: str | None = None  # key without a call id: its leaving licenses one retry
    call_key: str | None = None  # key with a call id: the call is delivered once, whoever gets it


@dataclass
class PolicyCounters:
    """Raw monotonic counters, named after ``foundation.metricnames``."""

    attempts: dict[AttemptKind, int] = field(default_factory=lambda: dict.fromkeys(AttemptKind, 0))
    attached: int = 0
    shed: dict[ShedReason, int] = field(default_factory=lambda: dict.fromkeys(ShedReason, 0))
    created: int = 0
    dispatched: int = 0
    finished: dict[Fate, int] = field(default_factory=lambda: dict.fromkeys(Fate, 0))
    delivered: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    # calls whose first attempt's deadline passed before they were delivered (``Policy.sweep_deadlines``)
    missed_deadline: int = 0
    # calls forgotten before their deadline passed, undelivered, at ``max_remembered_calls``
    calls_forgotten: int = 0


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

    def has_room(self, now: float) -> bool:
        """Whether the window has room for one more retry (nothing is recorded)."""
        self._prune(now)
        return len(self._retries) + 1 <= self.ratio * len(self._firsts)

    def spend(self, now: float) -> None:
        """Record one retry admitted."""
        self._retries.append(now)

    def try_spend(self, now: float) -> bool:
        """Admit one retry if the window still has room for it, and record it."""
        if not self.has_room(now):
            return False
        self.spend(now)
        return True


class FirstTokenWaitEstimator:
    """Estimates how long a new execution would wait for its first token.

    wait ≈ (prompt tokens of the executions ahead of it that have not reached their first token
    + its own prompt) / prefill throughput. The throughput starts at a configured prior and is
    learned online from first-token events observed while a backlog existed (an EWMA of prompt
    tokens per second between consecutive first tokens, or from the backlog's start).
    """

    ALPHA = 0.2

    def __init__(self, prior_tokens_per_s: float) -> None:
        self.tokens_per_s = prior_tokens_per_s
        self._last_event_at: float | None = None

    def start_backlog(self, now: float) -> None:
        """An execution enters an empty prefill backlog: the engine's prefill work starts now.

        NOTE: the interval to the next first token is measured from here, not from the last
        first token before the backlog emptied: that one took the idle time between for prefill
        time (one call 100 s after another, and the rate learned fell from 20,000 to 16,000
        tokens/s), and the deadline check shed attempts that would have made it."""
        self._last_event_at = now

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
        self._live_by_key: dict[str, list[int]] = {}  # attachable live executions, oldest first
        self._queue: deque[int] = deque()
        self._subscribers: dict[int, Subscriber] = {}
        memory_s, max_keys = self.config.retry_memory_s, self.config.max_remembered_calls
        # keys with a call id -> when the call's first attempt was seen, and whether it was delivered
        self._calls_seen = SeenCalls(memory_s, max_keys)
        # keys without a call id -> (when it left, its call's start) of each departure not yet
        # used by a retry, oldest first; the key is remembered from its latest departure
        self._departures = DepartureMemory(
            memory_s,
            per_key=MAX_DEPARTURES_PER_KEY,
            max_total=self.config.max_remembered_departures,
            max_keys=max_keys,
        )
        # calls not yet delivered whose deadline has not passed, oldest first (``sweep_deadlines``)
        self._awaiting_delivery = AwaitingDelivery(max_keys)
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
        """The wait a new execution would see now: everything prefilling goes first, and
        everything queued unless LIFO would serve the new one first (``_next_from_queue``: more
        than ``lifo_threshold`` queued with it)."""
        ahead = self._awaiting_first_token_tokens
        lifo = self.config.queue_order is QueueOrder.LIFO
        if not (lifo and len(self._queue) + 1 > self.config.lifo_threshold):
            ahead += sum(self._executions[e].prompt_tokens for e in self._queue)
        return self._estimator.wait_s(ahead, prompt_tokens)

    def stop_attaching(self, execution_id: int) -> None:
        """New attempts no longer attach to this live execution (e.g. its replay buffer is full);
        a retry of its call then creates a new execution."""
        execution = self._executions.get(execution_id)
        if execution is not None:
            self._unlist(execution)

    def set_deadline(self, deadline_s: float | None) -> None:
        """Update the clients' deadline (e.g. when inferred from disconnects)."""
        if deadline_s is not None and not (0 < deadline_s < math.inf):
            raise PolicyConfigError("deadline must be a positive number of seconds")
        self.deadline_s = deadline_s
        if deadline_s is None:  # no deadline, no miss to tell
            self._awaiting_delivery.clear()

    # --- calls that miss their deadline ------------------------------------------------
    # NOTE: the delivery SLI counts good and bad events on one clock: a call is good when it is
    # delivered within the deadline (``counters.delivered[True]``, at delivery) and bad when its
    # first attempt's deadline passes before that (``counters.missed_deadline``, at the deadline),
    # so a burst delivered in time never reads as failure while its deliveries trail its arrivals.
    # A call is remembered from its first attempt until it is delivered in time or its deadline
    # passes: under its key and its first attempt's time, which every later attempt of the call
    # carries (``Subscriber.call_started_at``), so at most a deadline's worth of arrivals, and at
    # most ``max_remembered_calls`` (past it the oldest is forgotten, neither good nor bad, and
    # counted in ``counters.calls_forgotten``). Only while the deadline is known: without one,
    # nothing is counted.

    def _await_delivery(self, now: float, key: str | None) -> None:
        """A call's first attempt arrived: remember it until it is delivered or its deadline passes."""
        if self.deadline_s is None:
            return
        self.counters.calls_forgotten += self._awaiting_delivery.add(key, now)

    def _delivered_in_time(self, subscriber: Subscriber) -> None:
        key = subscriber.call_key or subscriber.departure_key
        self._awaiting_delivery.delivered(key, subscriber.call_started_at)

    def sweep_deadlines(self, now: float) -> None:
        """Count the calls whose deadline passed by ``now`` undelivered, once each (called on the
        policy's events and by the drivers before each scrape)."""
        if self.deadline_s is None or not self._awaiting_delivery:
            return
        self.counters.missed_deadline += self._awaiting_delivery.sweep(now - self.deadline_s)

    # --- attempts ---------------------------------------------------------------------

    def _classify(self, now: float, attempt: Attempt) -> tuple[AttemptKind, float]:
        """First attempt or retry, and when the call's first attempt was seen (see the NOTE at
        the top of this module)."""
        key, says = attempt.key, attempt.client_says_retry
        if key is not None and attempt.identified:
            # Remembered from its latest attempt ("seen within retry_memory_s"), still counted
            # from its first: a call whose retries go on is not forgotten mid-call.
            first_seen_at = self._calls_seen.attempt(now, key)
            if first_seen_at is not None:
                return AttemptKind.RETRY, first_seen_at
            if key in self._live_by_key:  # seen longer ago than remembered: still the same call
                return AttemptKind.RETRY, now
        elif key is not None and says is not False:
            call_started_at = self._use_departure(now, key)
            if call_started_at is not None:
                return AttemptKind.RETRY, call_started_at
        return (AttemptKind.RETRY if says else AttemptKind.FIRST), now

    def _use_departure(self, now: float, key: str) -> float | None:
        """Use up the oldest departure under ``key`` not yet used by a retry nor forgotten; its
        call's start."""
        return self._departures.use(now, key)

    @property
    def departures(self) -> DepartureMemory:
        """The departures remembered (``total`` held, ``evicted`` at the bound)."""
        return self._departures

    def _depart(self, now: float, key: str | None, call_started_at: float) -> None:
        """An attempt without a call id left before its answer: it licenses one retry."""
        if key is not None:
            self._departures.depart(now, key, call_started_at)

    def on_attempt(self, now: float, attempt: Attempt) -> AttemptResult:
        """Decide an attempt: attach to its call's live execution, shed it, or create one."""
        self.sweep_deadlines(now)
        kind, call_started_at = self._classify(now, attempt)
        self.counters.attempts[kind] += 1
        first = kind is AttemptKind.FIRST
        if first:
            self._await_delivery(now, attempt.key)
            if self._budget is not None:
                self._budget.record_first(now)

        departure_key = None if attempt.identified else attempt.key
        call_key = attempt.key if attempt.identified else None
        budget_first = self.config.budget_order is BudgetOrder.BUDGET_FIRST
        if budget_first and kind is AttemptKind.RETRY and not self._budget_admits(now):
            wait = self.estimated_first_token_wait_s(attempt.prompt_tokens)
            return self._shed(now, kind, ShedReason.RETRY_BUDGET, wait, departure_key, call_started_at)

        live = None if first else self._attach_target(attempt, kind)
        if live is not None:
            attached = self._attach(now, kind, live, call_started_at, departure_key, call_key)
            return AttemptResult(attached, [])

        # NOTE: lookup-first, the budget limits the retries that create an execution: it is
        # checked here but spent only once the retry gets past the deadline check and the proxy
        # queue. Spent here, a retry those shed used up the budget of one that would have run.
        budget = None if budget_first or kind is not AttemptKind.RETRY else self._budget
        if budget is not None and not budget.has_room(now):
            wait = self.estimated_first_token_wait_s(attempt.prompt_tokens)
            return self._shed(now, kind, ShedReason.RETRY_BUDGET, wait, departure_key, call_started_at)

        if self.config.deadline_check and self.deadline_s is not None:
            wait = self.estimated_first_token_wait_s(attempt.prompt_tokens)
            if wait >= self.deadline_s:
                return self._shed(now, kind, ShedReason.DEADLINE, wait, departure_key, call_started_at)

        must_queue = (
            self.config.max_outstanding is not None and self._in_engine >= self.config.max_outstanding
        )
        held = self._in_engine + len(self._queue)
        if held >= self.config.max_live_executions or (
            must_queue and len(self._queue) >= self.config.max_queued
        ):
            wait = self.estimated_first_token_wait_s(attempt.prompt_tokens)
            return self._shed(now, kind, ShedReason.PROXY_QUEUE, wait, departure_key, call_started_at)

        if budget is not None:
            budget.spend(now)
        execution = Execution(
            execution_id=self._next_execution_id,
            key=attempt.key if self.config.coalesce else None,
            created_at=now,
            prompt_tokens=max(attempt.prompt_tokens, 0),
        )
        self._next_execution_id += 1
        self._executions[execution.execution_id] = execution
        if execution.key is not None:
            self._live_by_key.setdefault(execution.key, []).append(execution.execution_id)
        self.counters.created += 1
        subscriber = self._subscribe(now, kind, execution, call_started_at, departure_key, call_key)
        effects: list[Effect] = []
        if must_queue:
            self._queue.append(execution.execution_id)
        else:
            effects.append(self._dispatch(now, execution))
        decision = Created(kind, subscriber.subscriber_id, execution.execution_id, queued=must_queue)
        return AttemptResult(decision, effects)

    def _budget_admits(self, now: float) -> bool:
        return self._budget is None or self._budget.try_spend(now)

    def _shed(
        self,
        now: float,
        kind: AttemptKind,
        reason: ShedReason,
        retry_after_s: float | None,
        departure_key: str | None,
        call_started_at: float,
    ) -> AttemptResult:
        self.counters.shed[reason] += 1
        self._depart(now, departure_key, call_started_at)
        return AttemptResult(Shed(kind, reason, retry_after_s), [])

    def _attach_target(self, attempt: Attempt, kind: AttemptKind) -> Execution | None:
        """The live execution a retry attaches to: one nobody waits for first; one that still
        has subscribers only under a call id. None for a first attempt (see the NOTE above)."""
        if kind is AttemptKind.FIRST or attempt.key is None or not self.config.coalesce:
            return None
        watched: Execution | None = None
        for execution_id in self._live_by_key.get(attempt.key, ()):
            execution = self._executions[execution_id]
            if not execution.subscribers:
                return execution
            if watched is None:
                watched = execution
        return watched if attempt.identified else None

    def _attach(
        self,
        now: float,
        kind: AttemptKind,
        execution: Execution,
        call_started_at: float,
        departure_key: str | None,
        call_key: str | None,
    ) -> Attached:
        self.counters.attached += 1
        execution.cancel_at = None  # a retry arrived in time: the deferred cancellation is off
        subscriber = self._subscribe(now, kind, execution, call_started_at, departure_key, call_key)
        return Attached(kind, subscriber.subscriber_id, execution.execution_id)

    def _subscribe(
        self,
        now: float,
        kind: AttemptKind,
        execution: Execution,
        call_started_at: float,
        departure_key: str | None,
        call_key: str | None,
    ) -> Subscriber:
        subscriber = Subscriber(
            self._next_subscriber_id,
            execution.execution_id,
            kind,
            now,
            call_started_at,
            departure_key,
            call_key,
        )
        self._next_subscriber_id += 1
        self._subscribers[subscriber.subscriber_id] = subscriber
        execution.subscribers.add(subscriber.subscriber_id)
        return subscriber

    # --- dispatch and the proxy queue -------------------------------------------------

    def _dispatch(self, now: float, execution: Execution) -> Dispatch:
        execution.state = ExecutionState.DISPATCHED
        execution.dispatched_at = now
        self._in_engine += 1
        if self._awaiting_first_token == 0:
            self._estimator.start_backlog(now)
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
        self._depart(now, subscriber.departure_key, subscriber.call_started_at)
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
        # NOTE: deferring keeps an execution alive for a retry to attach to; one no retry can
        # (coalescing off, or an attempt without a key) is cancelled at once, not W s of work later.
        deferred = (
            mode is Cancellation.DEFERRED and self.config.cancel_after_s > 0 and execution.key is not None
        )
        if mode is Cancellation.ON or (mode is Cancellation.DEFERRED and not deferred):
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
        if self._first_delivery(now, subscriber):
            self.counters.delivered[within] += 1
            if within:
                self._delivered_in_time(subscriber)
        execution = self._executions.get(subscriber.execution_id)
        if execution is not None:
            execution.subscribers.discard(subscriber_id)

    def _first_delivery(self, now: float, subscriber: Subscriber) -> bool:
        """Whether this delivery is its call's first. Two attempts of one call can both be
        answered (the first one still connected when its retry attached, or created, e.g. behind
        a gateway that has not passed its client's disconnect on): the call counts once."""
        if subscriber.call_key is None:  # without a call id, each delivered attempt is a call
            return True
        return self._calls_seen.deliver(now, subscriber.call_key)

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
            subscriber = self._subscribers.pop(subscriber_id, None)
            if subscriber is not None:  # answered with an error: it licenses one retry
                self._depart(now, subscriber.departure_key, subscriber.call_started_at)
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
        self._unlist(execution)

    def _unlist(self, execution: Execution) -> None:
        """No new subscriber finds this execution under its key any more."""
        key = execution.key
        ids = self._live_by_key.get(key) if key is not None else None
        if key is not None and ids is not None and execution.execution_id in ids:
            ids.remove(execution.execution_id)
            if not ids:
                del self._live_by_key[key]
