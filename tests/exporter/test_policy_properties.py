"""Property tests: the counters balance for arbitrary interleavings of attempts, disconnects,
first tokens, completions, refusals, failures and timer firings, under every policy setting; and
attempts are classified as the policy's NOTE says: a first attempt never attaches, an attempt
without a call id is a retry only when evident, and without a call id an execution never serves
two waiting clients at once."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from exporter.policy import (
    Attached,
    Attempt,
    AttemptKind,
    BudgetOrder,
    Cancel,
    Cancellation,
    Created,
    Dispatch,
    Drop,
    Effect,
    Policy,
    PolicyConfig,
    QueueOrder,
    Shed,
    StartTimer,
)
from foundation.metricnames import Fate

configs = st.builds(
    PolicyConfig,
    coalesce=st.booleans(),
    cancellation=st.sampled_from(list(Cancellation)),
    cancel_after_s=st.sampled_from([0.0, 2.0, 10.0]),
    retry_budget=st.sampled_from([None, 0.1, 0.5, 2.0]),
    budget_window_s=st.sampled_from([5.0, 60.0]),
    budget_order=st.sampled_from(list(BudgetOrder)),
    max_outstanding=st.sampled_from([None, 1, 3]),
    max_queued=st.sampled_from([0, 2, 50]),
    queue_order=st.sampled_from(list(QueueOrder)),
    lifo_threshold=st.sampled_from([0, 2]),
    deadline_check=st.just(False),
    deadline_s=st.sampled_from([None, 5.0]),
    max_live_executions=st.sampled_from([4, 1000]),
)

# Keys with a call id and keys without one never coincide (``exporter.callkey`` prefixes them).
IDENTIFIED_KEYS = ("a", "b")
BODY_KEYS = ("x", "y")


class PolicyMachine(RuleBasedStateMachine):
    """Drives the policy the way a proxy would, carrying out every effect it returns."""

    @initialize(config=configs)
    def setup(self, config: PolicyConfig) -> None:
        self.policy = Policy(config)
        self.now = 0.0
        self.in_engine: set[int] = set()  # executions the "engine" is working on
        self.timers: list[tuple[float, int]] = []
        self.subscribers: set[int] = set()
        self.body_key_of: dict[int, str] = {}  # subscriber -> its key without a call id
        self.departures: Counter[str] = Counter()  # attempts without a call id that left unanswered
        self.silent_retries: Counter[str] = Counter()  # ... classified retry without the client's word

    def _left(self, subscriber_id: int) -> None:
        self.subscribers.discard(subscriber_id)
        key = self.body_key_of.pop(subscriber_id, None)
        if key is not None:
            self.departures[key] += 1

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Dispatch):
                assert effect.execution_id not in self.in_engine
                self.in_engine.add(effect.execution_id)
            elif isinstance(effect, Cancel):
                self.in_engine.discard(effect.execution_id)
            elif isinstance(effect, Drop):
                assert effect.execution_id not in self.in_engine
            elif isinstance(effect, StartTimer):
                assert effect.at >= self.now
                self.timers.append((effect.at, effect.execution_id))

    @rule(
        dt=st.floats(0.0, 8.0),
        key=st.sampled_from([*IDENTIFIED_KEYS, *BODY_KEYS, None]),
        says=st.sampled_from([None, False, True]),
    )
    def attempt(self, dt: float, key: str | None, says: bool | None) -> None:
        self.now += dt
        identified = key in IDENTIFIED_KEYS
        sent = Attempt(key, identified=identified, client_says_retry=says, prompt_tokens=100)
        result = self.policy.on_attempt(self.now, sent)
        decision = result.decision
        if isinstance(decision, Attached):
            assert decision.kind is AttemptKind.RETRY, "a first attempt never attaches"
        if not identified:  # without a call id the client's word, else a departure, decides
            if says is not None:
                assert decision.kind is (AttemptKind.RETRY if says else AttemptKind.FIRST)
            elif key is None:
                assert decision.kind is AttemptKind.FIRST
            elif decision.kind is AttemptKind.RETRY:
                self.silent_retries[key] += 1
        body_key = key if key in BODY_KEYS else None
        if isinstance(decision, Shed):
            if body_key is not None:
                self.departures[body_key] += 1
        else:
            self.subscribers.add(decision.subscriber_id)
            if body_key is not None:
                self.body_key_of[decision.subscriber_id] = body_key
        if isinstance(result.decision, Created) and result.decision.queued:
            assert result.effects == []
        self._apply(result.effects)

    @rule(data=st.data())
    def subscriber_leaves(self, data: st.DataObject) -> None:
        if not self.subscribers:
            return
        subscriber_id = data.draw(st.sampled_from(sorted(self.subscribers)))
        self._left(subscriber_id)
        self._apply(self.policy.on_subscriber_left(self.now, subscriber_id))

    @rule(data=st.data(), event=st.sampled_from(["first_token", "completed", "refused", "failed"]))
    def engine_event(self, data: st.DataObject, event: str) -> None:
        if not self.in_engine:
            return
        execution_id = data.draw(st.sampled_from(sorted(self.in_engine)))
        execution = self.policy.execution(execution_id)
        assert execution is not None, "an execution in the engine must be live in the policy"
        subscribers = set(execution.subscribers)
        if event == "first_token":
            self.policy.on_first_token(self.now, execution_id)
            return
        self.in_engine.discard(execution_id)
        if event == "completed":
            self._apply(self.policy.on_completed(self.now, execution_id))
            for subscriber_id in subscribers:
                self.policy.on_subscriber_delivered(self.now, subscriber_id)
                self.body_key_of.pop(subscriber_id, None)
            self.subscribers -= subscribers
            return
        if event == "refused":
            self._apply(self.policy.on_refused(self.now, execution_id))
        else:
            self._apply(self.policy.on_failed(self.now, execution_id))
        for subscriber_id in subscribers:  # answered with an error: they leave unanswered
            self._left(subscriber_id)

    @rule(dt=st.floats(0.0, 15.0))
    def timers_fire(self, dt: float) -> None:
        self.now += dt
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for at, execution_id in sorted(due):
            self._apply(self.policy.on_timer(at, execution_id))

    @invariant()
    def counters_balance(self) -> None:
        c = self.policy.counters
        g = self.policy.gauges()
        f = c.finished
        assert sum(c.attempts.values()) == c.attached + sum(c.shed.values()) + c.created
        assert c.created == c.dispatched + f[Fate.DROPPED] + g.executions_queued
        in_engine_fates = (Fate.COMPLETED, Fate.ORPHANED, Fate.CANCELLED, Fate.FAILED, Fate.REFUSED)
        assert c.dispatched == sum(f[x] for x in in_engine_fates) + g.executions_live
        assert g.executions_live == len(self.in_engine)
        assert g.subscribers == len(self.subscribers)

    @invariant()
    def evident_retries_only(self) -> None:
        # Without a call id, each retry the client did not announce used up a departure.
        for key, retries in self.silent_retries.items():
            assert retries <= self.departures[key]
        # ... and an execution never serves two waiting clients at once.
        for execution in self.policy.live_executions():
            if execution.key in BODY_KEYS:
                assert len(execution.subscribers) <= 1

    @invariant()
    def bounds_hold(self) -> None:
        g = self.policy.gauges()
        cfg = self.policy.config
        if cfg.max_outstanding is not None:
            assert g.executions_live <= cfg.max_outstanding
        assert g.executions_queued <= cfg.max_queued
        assert g.executions_live + g.executions_queued <= cfg.max_live_executions


TestPolicyBalance = PolicyMachine.TestCase
TestPolicyBalance.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
