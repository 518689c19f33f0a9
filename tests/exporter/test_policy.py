"""The policy core's decisions, one by one, through its public entry points."""

from __future__ import annotations

import pytest

from exporter.policy import (
    MAX_DEPARTURES_PER_KEY,
    Attached,
    Attempt,
    AttemptKind,
    BudgetOrder,
    Cancel,
    Cancellation,
    Created,
    Dispatch,
    Drop,
    Policy,
    PolicyConfig,
    PolicyConfigError,
    PolicyGauges,
    QueueOrder,
    Shed,
    StartTimer,
)
from foundation.metricnames import Fate, ShedReason


def create_policy(**overrides: object) -> Policy:
    return Policy(PolicyConfig(**overrides))  # type: ignore[arg-type]


def attempt(
    key: str | None = "call-1",
    *,
    identified: bool = True,
    says: bool | None = None,
    prompt_tokens: int = 1000,
) -> Attempt:
    """An attempt keyed by a call id (``identified``) or by its body, with the client's word."""
    return Attempt(key, identified=identified, client_says_retry=says, prompt_tokens=prompt_tokens)


def test_first_attempt_creates_and_dispatches() -> None:
    policy = create_policy()
    result = policy.on_attempt(0.0, attempt())
    assert isinstance(result.decision, Created)
    assert result.decision.kind is AttemptKind.FIRST
    assert not result.decision.queued
    assert result.effects == [Dispatch(result.decision.execution_id)]
    assert policy.counters.created == 1
    assert policy.counters.dispatched == 1
    assert policy.gauges().executions_live == 1


def test_retry_of_live_call_attaches_to_its_execution() -> None:
    policy = create_policy()
    first = policy.on_attempt(0.0, attempt())
    retry = policy.on_attempt(5.0, attempt())
    assert isinstance(retry.decision, Attached)
    assert retry.decision.kind is AttemptKind.RETRY
    assert retry.decision.execution_id == first.decision.execution_id  # type: ignore[union-attr]
    assert retry.effects == []
    assert policy.counters.attached == 1
    assert policy.counters.attempts == {AttemptKind.FIRST: 1, AttemptKind.RETRY: 1}


def test_different_parameters_do_not_attach() -> None:
    policy = create_policy()
    policy.on_attempt(0.0, attempt("call-1"))
    other = policy.on_attempt(0.0, attempt("call-2"))
    assert isinstance(other.decision, Created)
    assert other.decision.kind is AttemptKind.FIRST


def test_no_coalescing_creates_one_execution_per_attempt() -> None:
    policy = create_policy(coalesce=False)
    policy.on_attempt(0.0, attempt())
    retry = policy.on_attempt(1.0, attempt())
    assert isinstance(retry.decision, Created)
    assert retry.decision.kind is AttemptKind.RETRY  # still classified by the key seen before
    assert policy.counters.created == 2


def test_key_none_never_coalesces_but_honours_the_client_retry_hint() -> None:
    policy = create_policy()
    policy.on_attempt(0.0, attempt(None))
    retry = policy.on_attempt(1.0, attempt(None, says=True))
    assert isinstance(retry.decision, Created)
    assert retry.decision.kind is AttemptKind.RETRY


def test_key_is_forgotten_after_retry_memory() -> None:
    policy = create_policy(retry_memory_s=10.0, coalesce=False)
    policy.on_attempt(0.0, attempt())
    later = policy.on_attempt(11.0, attempt())
    assert later.decision.kind is AttemptKind.FIRST


def test_remembered_calls_are_bounded() -> None:
    policy = create_policy(max_remembered_calls=2, coalesce=False)
    for key in ("a", "b", "c"):
        policy.on_attempt(0.0, attempt(key))
    assert policy.on_attempt(0.0, attempt("a")).decision.kind is AttemptKind.FIRST  # evicted
    assert policy.on_attempt(0.0, attempt("c")).decision.kind is AttemptKind.RETRY


@pytest.mark.parametrize("mode", list(Cancellation))
def test_last_subscriber_leaving(mode: Cancellation) -> None:
    policy = create_policy(cancellation=mode, cancel_after_s=10.0)
    created = policy.on_attempt(0.0, attempt()).decision
    assert isinstance(created, Created)
    effects = policy.on_subscriber_left(120.0, created.subscriber_id)
    execution_id = created.execution_id
    if mode is Cancellation.OFF:
        assert effects == []
        assert policy.execution(execution_id) is not None  # runs on
        policy.on_completed(300.0, execution_id)
        assert policy.counters.finished[Fate.ORPHANED] == 1
    elif mode is Cancellation.ON:
        assert effects == [Cancel(execution_id)]
        assert policy.counters.finished[Fate.CANCELLED] == 1
        assert policy.execution(execution_id) is None
    else:
        assert effects == [StartTimer(execution_id, 130.0)]
        assert policy.on_timer(129.0, execution_id) == []  # not yet due
        assert policy.on_timer(130.0, execution_id) == [Cancel(execution_id)]
        assert policy.counters.finished[Fate.CANCELLED] == 1


def test_deferred_cancellation_is_called_off_when_a_retry_attaches() -> None:
    policy = create_policy(cancellation=Cancellation.DEFERRED, cancel_after_s=10.0)
    created = policy.on_attempt(0.0, attempt()).decision
    assert isinstance(created, Created)
    policy.on_subscriber_left(120.0, created.subscriber_id)
    retry = policy.on_attempt(122.0, attempt()).decision
    assert isinstance(retry, Attached)
    assert policy.on_timer(130.0, created.execution_id) == []
    policy.on_first_token(131.0, created.execution_id)
    policy.on_completed(140.0, created.execution_id)
    policy.on_subscriber_delivered(140.0, retry.subscriber_id)
    assert policy.counters.finished[Fate.COMPLETED] == 1
    assert policy.counters.finished[Fate.CANCELLED] == 0


@pytest.mark.parametrize(("coalesce", "key"), [(False, "call-1"), (True, None)])
def test_deferred_cancellation_of_an_execution_no_retry_can_attach_to_is_at_once(
    coalesce: bool, key: str | None
) -> None:
    """Deferring keeps an execution alive for a retry to attach to: with coalescing off, or for an
    attempt without a key, none can, and the engine ran W more seconds of work nobody would get."""
    policy = create_policy(cancellation=Cancellation.DEFERRED, cancel_after_s=10.0, coalesce=coalesce)
    created = policy.on_attempt(0.0, attempt(key)).decision
    assert isinstance(created, Created)
    assert policy.on_subscriber_left(120.0, created.subscriber_id) == [Cancel(created.execution_id)]
    assert policy.counters.finished[Fate.CANCELLED] == 1


def test_cancellation_on_leaves_nothing_to_attach_to() -> None:
    policy = create_policy(cancellation=Cancellation.ON)
    created = policy.on_attempt(0.0, attempt()).decision
    assert isinstance(created, Created)
    policy.on_subscriber_left(120.0, created.subscriber_id)
    retry = policy.on_attempt(121.0, attempt()).decision
    assert isinstance(retry, Created)
    assert retry.execution_id != created.execution_id


def test_attached_subscriber_keeps_the_execution_when_the_first_leaves() -> None:
    policy = create_policy(cancellation=Cancellation.ON)
    first = policy.on_attempt(0.0, attempt()).decision
    retry = policy.on_attempt(1.0, attempt()).decision
    assert isinstance(first, Created) and isinstance(retry, Attached)
    assert policy.on_subscriber_left(2.0, first.subscriber_id) == []
    assert policy.execution(first.execution_id) is not None


@pytest.mark.parametrize("order", list(BudgetOrder))
def test_retry_budget_orders(order: BudgetOrder) -> None:
    # Budget 0.5 over 60 s: with 2 first attempts, one retry that creates is admitted.
    policy = create_policy(retry_budget=0.5, budget_order=order, cancellation=Cancellation.OFF)
    a = policy.on_attempt(0.0, attempt("a")).decision
    policy.on_attempt(0.0, attempt("b"))
    assert isinstance(a, Created)
    # A retry of "a" while its execution is live.
    retry_live = policy.on_attempt(1.0, attempt("a")).decision
    if order is BudgetOrder.BUDGET_FIRST:
        # The budget is spent even though the retry could have attached.
        assert isinstance(retry_live, Attached)
        refused = policy.on_attempt(2.0, attempt("b")).decision
        assert isinstance(refused, Shed)
        assert refused.reason is ShedReason.RETRY_BUDGET
        assert refused.retry_after_s is not None and refused.retry_after_s > 0
    else:
        # Lookup first: attaching does not touch the budget.
        assert isinstance(retry_live, Attached)
        assert isinstance(policy.on_attempt(2.0, attempt("b")).decision, Attached)
        policy.on_completed(3.0, a.execution_id)
        created = policy.on_attempt(4.0, attempt("a")).decision
        assert isinstance(created, Created)  # the one retry the budget allows
        policy.on_attempt(4.0, attempt("c"))
        policy.on_completed(5.0, created.execution_id)
        assert isinstance(policy.on_attempt(6.0, attempt("a")).decision, Shed)


def test_lookup_first_spends_no_budget_on_a_retry_another_control_sheds() -> None:
    # Lookup first, the budget limits the retries that create an execution (docs/protocol.md):
    # one the proxy queue sheds creates none and leaves the budget to the next.
    policy = create_policy(retry_budget=0.5, max_outstanding=1, max_queued=1, cancellation=Cancellation.ON)
    running = policy.on_attempt(0.0, attempt("a")).decision
    queued = policy.on_attempt(0.0, attempt("b")).decision  # two first attempts fund one retry
    assert isinstance(running, Created) and isinstance(queued, Created) and queued.queued
    shed = policy.on_attempt(1.0, attempt("c", says=True)).decision
    assert isinstance(shed, Shed) and shed.kind is AttemptKind.RETRY
    assert shed.reason is ShedReason.PROXY_QUEUE
    policy.on_completed(2.0, running.execution_id)  # "b" goes to the engine: the queue is empty
    created = policy.on_attempt(3.0, attempt("d", says=True)).decision
    assert isinstance(created, Created) and created.kind is AttemptKind.RETRY
    refused = policy.on_attempt(4.0, attempt("e", says=True)).decision  # the budget is spent now
    assert isinstance(refused, Shed) and refused.reason is ShedReason.RETRY_BUDGET


def test_budget_first_refuses_a_retry_that_could_attach() -> None:
    policy = create_policy(retry_budget=0.1, budget_order=BudgetOrder.BUDGET_FIRST)
    policy.on_attempt(0.0, attempt("a"))
    decision = policy.on_attempt(1.0, attempt("a")).decision
    assert isinstance(decision, Shed)
    assert decision.reason is ShedReason.RETRY_BUDGET


def test_retry_budget_window_slides() -> None:
    policy = create_policy(retry_budget=1.0, budget_window_s=60.0, coalesce=False)
    for i in range(3):
        policy.on_attempt(0.0, attempt(f"k{i}"))
    assert all(isinstance(policy.on_attempt(1.0, attempt(f"k{i}")).decision, Created) for i in range(3))
    assert isinstance(policy.on_attempt(2.0, attempt("k0")).decision, Shed)
    # After the window, old first attempts no longer fund retries: one new first funds one retry.
    policy.on_attempt(70.0, attempt("fresh"))
    assert isinstance(policy.on_attempt(70.5, attempt("fresh")).decision, Created)
    assert isinstance(policy.on_attempt(71.0, attempt("fresh")).decision, Shed)


def test_proxy_cap_queues_then_dispatches_in_fifo_order() -> None:
    policy = create_policy(max_outstanding=1, cancellation=Cancellation.ON)
    first = policy.on_attempt(0.0, attempt("a")).decision
    second = policy.on_attempt(0.1, attempt("b")).decision
    third = policy.on_attempt(0.2, attempt("c")).decision
    assert isinstance(first, Created) and not first.queued
    assert isinstance(second, Created) and second.queued
    assert isinstance(third, Created) and third.queued
    assert policy.gauges().executions_queued == 2
    effects = policy.on_completed(1.0, first.execution_id)
    assert effects == [Dispatch(second.execution_id)]


def test_lifo_serves_newest_once_over_threshold() -> None:
    policy = create_policy(max_outstanding=1, queue_order=QueueOrder.LIFO, lifo_threshold=2)
    running = policy.on_attempt(0.0, attempt("run")).decision
    queued = [policy.on_attempt(0.1 * i, attempt(f"q{i}")).decision for i in range(3)]
    assert isinstance(running, Created)
    # 3 queued > threshold 2: newest first.
    assert policy.on_completed(1.0, running.execution_id) == [Dispatch(queued[2].execution_id)]  # type: ignore[union-attr]
    # 2 queued, not over the threshold: back to FIFO.
    assert policy.on_completed(2.0, queued[2].execution_id) == [Dispatch(queued[0].execution_id)]  # type: ignore[union-attr]


def test_queued_execution_is_dropped_when_its_subscribers_leave() -> None:
    policy = create_policy(max_outstanding=1, cancellation=Cancellation.OFF)
    policy.on_attempt(0.0, attempt("a"))
    queued = policy.on_attempt(0.0, attempt("b")).decision
    assert isinstance(queued, Created) and queued.queued
    assert policy.on_subscriber_left(120.0, queued.subscriber_id) == [Drop(queued.execution_id)]
    assert policy.counters.finished[Fate.DROPPED] == 1
    assert policy.gauges().executions_queued == 0


def test_full_proxy_queue_sheds() -> None:
    policy = create_policy(max_outstanding=1, max_queued=1)
    policy.on_attempt(0.0, attempt("a"))
    policy.on_attempt(0.0, attempt("b"))
    shed = policy.on_attempt(0.0, attempt("c")).decision
    assert isinstance(shed, Shed) and shed.reason is ShedReason.PROXY_QUEUE


def test_deadline_check_refuses_an_attempt_that_would_miss_its_deadline() -> None:
    policy = create_policy(deadline_check=True, deadline_s=10.0, prefill_tokens_per_s=1000.0)
    # 5 executions of 1,000 prompt tokens ahead at 1,000 tokens/s: ~6 s, within the deadline.
    for i in range(5):
        assert isinstance(policy.on_attempt(0.0, attempt(f"k{i}")).decision, Created)
    for i in range(5, 9):
        policy.on_attempt(0.0, attempt(f"k{i}"))
    shed = policy.on_attempt(0.0, attempt("late")).decision
    assert isinstance(shed, Shed) and shed.reason is ShedReason.DEADLINE
    assert shed.retry_after_s is not None and shed.retry_after_s >= 10.0


def test_engine_refusal_and_failure_end_the_execution() -> None:
    policy = create_policy(max_outstanding=1)
    a = policy.on_attempt(0.0, attempt("a")).decision
    b = policy.on_attempt(0.0, attempt("b")).decision
    assert isinstance(a, Created) and isinstance(b, Created)
    assert policy.on_refused(0.1, a.execution_id) == [Dispatch(b.execution_id)]
    assert policy.subscriber(a.subscriber_id) is None
    policy.on_failed(0.2, b.execution_id)
    assert policy.counters.finished[Fate.REFUSED] == 1
    assert policy.counters.finished[Fate.FAILED] == 1
    assert policy.gauges() == PolicyGauges(executions_live=0, executions_queued=0, subscribers=0)


def test_delivery_within_deadline_counts_from_the_calls_first_attempt() -> None:
    policy = create_policy(deadline_s=120.0, cancellation=Cancellation.OFF)
    first = policy.on_attempt(0.0, attempt()).decision
    assert isinstance(first, Created)
    policy.on_subscriber_left(120.0, first.subscriber_id)
    retry = policy.on_attempt(121.0, attempt()).decision
    assert isinstance(retry, Attached)
    policy.on_completed(150.0, first.execution_id)
    policy.on_subscriber_delivered(150.0, retry.subscriber_id)
    assert policy.counters.delivered == {True: 0, False: 1}
    assert policy.counters.finished[Fate.COMPLETED] == 1


def test_first_token_wait_estimate_learns_the_prefill_rate() -> None:
    policy = create_policy(prefill_tokens_per_s=1_000_000.0)
    ids = []
    for i in range(10):
        decision = policy.on_attempt(0.0, attempt(f"k{i}", prompt_tokens=1000)).decision
        assert isinstance(decision, Created)
        ids.append(decision.execution_id)
    # Ten prompts of 1,000 tokens ahead, at the prior's 1M tokens/s.
    assert policy.estimated_first_token_wait_s(1000) == pytest.approx(11_000 / 1_000_000)
    for i, execution_id in enumerate(ids):
        policy.on_first_token(1.0 * (i + 1), execution_id)  # 1,000 tokens/s observed
    # Nothing ahead now; the learned rate has moved far from the prior towards 1,000 tokens/s.
    assert policy.estimated_first_token_wait_s(1000) > 5 * (1000 / 1_000_000)


def test_the_prefill_rate_is_learned_from_busy_time_not_from_the_idle_time_before() -> None:
    # The interval of a first token was measured from the last first token, even across an idle
    # engine: one call, 100 s of nothing, then two at once whose first token came 0.6 s later
    # gave a sample of 120 tokens/s, and the rate learned fell from 20,000 to 16,024.
    policy = create_policy(prefill_tokens_per_s=20_000.0)
    alone = policy.on_attempt(0.0, attempt("alone", prompt_tokens=12_000)).decision
    assert isinstance(alone, Created)
    policy.on_first_token(0.6, alone.execution_id)
    pair = [policy.on_attempt(100.0, attempt(f"k{i}", prompt_tokens=12_000)).decision for i in range(2)]
    assert all(isinstance(d, Created) for d in pair)
    policy.on_first_token(100.6, pair[0].execution_id)  # type: ignore[union-attr]
    # 12,000 tokens in the 0.6 s since the backlog began: the rate learned is the prior's.
    assert policy.estimated_first_token_wait_s(0) == pytest.approx((12_000 + 1) / 20_000)


@pytest.mark.parametrize(
    "bad",
    [
        {"cancel_after_s": -1.0},
        {"retry_budget": -0.1},
        {"budget_window_s": 0.0},
        {"max_outstanding": 0},
        {"deadline_check": True},
        {"deadline_s": 0.0},
    ],
)
def test_bad_config_is_refused_with_a_clear_error(bad: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        PolicyConfig(**bad)  # type: ignore[arg-type]


# --- first attempt or retry: call ids, the client's word, and keys without a call id ------------


def test_with_a_call_id_a_seen_key_is_a_retry_even_when_the_sdk_counter_says_0() -> None:
    # An application's own retry loop around an SDK with max_retries=0 sends the same call id
    # with the counter at 0 every time: the call id decides.
    policy = create_policy()
    first = policy.on_attempt(0.0, attempt(says=False)).decision
    retry = policy.on_attempt(5.0, attempt(says=False)).decision
    assert isinstance(first, Created) and first.kind is AttemptKind.FIRST
    assert isinstance(retry, Attached) and retry.kind is AttemptKind.RETRY
    assert retry.execution_id == first.execution_id


@pytest.mark.parametrize(
    ("says", "kind"), [(None, AttemptKind.FIRST), (False, AttemptKind.FIRST), (True, AttemptKind.RETRY)]
)
def test_with_a_call_id_an_unseen_key_is_first_unless_the_client_says_retry(
    says: bool | None, kind: AttemptKind
) -> None:
    policy = create_policy()
    decision = policy.on_attempt(0.0, attempt(says=says)).decision
    assert isinstance(decision, Created) and decision.kind is kind


def test_without_a_call_id_concurrent_identical_first_attempts_each_create_their_own() -> None:
    # Five samples of one prompt at temperature 1, sent at once without a call id.
    policy = create_policy(retry_budget=0.1)
    decisions = [policy.on_attempt(0.0, attempt("body", identified=False)).decision for _ in range(5)]
    assert all(isinstance(d, Created) and d.kind is AttemptKind.FIRST for d in decisions)
    assert len({d.execution_id for d in decisions}) == 5  # type: ignore[union-attr]
    assert policy.counters.attempts == {AttemptKind.FIRST: 5, AttemptKind.RETRY: 0}
    assert policy.counters.attached == 0 and policy.gauges().executions_live == 5


def test_without_a_call_id_a_silent_attempt_after_a_departure_is_a_retry_and_attaches() -> None:
    policy = create_policy()
    first = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(first, Created)
    policy.on_subscriber_left(120.0, first.subscriber_id)
    retry = policy.on_attempt(121.0, attempt("body", identified=False)).decision
    assert isinstance(retry, Attached) and retry.kind is AttemptKind.RETRY
    assert retry.execution_id == first.execution_id
    # The departure was used up: the next identical attempt is a concurrent first attempt.
    other = policy.on_attempt(122.0, attempt("body", identified=False)).decision
    assert isinstance(other, Created) and other.kind is AttemptKind.FIRST
    assert other.execution_id != first.execution_id


def test_without_a_call_id_a_sdk_counter_at_0_is_a_first_attempt_even_after_a_departure() -> None:
    policy = create_policy()
    first = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(first, Created)
    policy.on_subscriber_left(120.0, first.subscriber_id)
    fresh = policy.on_attempt(121.0, attempt("body", identified=False, says=False)).decision
    assert isinstance(fresh, Created) and fresh.kind is AttemptKind.FIRST
    # It did not use the departure: a silent attempt after it still finds it.
    retry = policy.on_attempt(122.0, attempt("body", identified=False)).decision
    assert isinstance(retry, Attached) and retry.execution_id == first.execution_id


def test_without_a_call_id_a_retry_attaches_only_to_an_execution_nobody_waits_for() -> None:
    policy = create_policy()
    watched = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    left = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(watched, Created) and isinstance(left, Created)
    # The client says retry, but the only execution with this key serves another attempt.
    alone = policy.on_attempt(1.0, attempt("body", identified=False, says=True)).decision
    assert isinstance(alone, Created) and alone.kind is AttemptKind.RETRY
    policy.on_subscriber_left(2.0, left.subscriber_id)
    retry = policy.on_attempt(3.0, attempt("body", identified=False, says=True)).decision
    assert isinstance(retry, Attached) and retry.execution_id == left.execution_id
    assert all(len(e.subscribers) == 1 for e in policy.live_executions())


def test_a_call_id_retry_past_stop_attaching_creates_another_execution() -> None:
    policy = create_policy(cancellation=Cancellation.OFF)
    first = policy.on_attempt(0.0, attempt()).decision
    second = policy.on_attempt(1.0, attempt()).decision  # attaches: two subscribers
    assert isinstance(first, Created) and isinstance(second, Attached)
    policy.stop_attaching(first.execution_id)  # e.g. its replay buffer overflowed
    third = policy.on_attempt(2.0, attempt()).decision
    assert isinstance(third, Created) and third.kind is AttemptKind.RETRY
    assert policy.execution(first.execution_id) is not None  # still live, just not attachable


@pytest.mark.parametrize("how", ["shed", "refused", "failed"])
def test_without_a_call_id_a_shed_refused_or_failed_attempt_licenses_one_retry(how: str) -> None:
    policy = create_policy(max_outstanding=1, max_queued=0)
    first = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(first, Created)
    if how == "shed":
        shed = policy.on_attempt(0.0, attempt("body", identified=False)).decision
        assert isinstance(shed, Shed) and shed.kind is AttemptKind.FIRST
        policy.on_completed(1.0, first.execution_id)
        policy.on_subscriber_delivered(1.0, first.subscriber_id)
    elif how == "refused":
        policy.on_refused(1.0, first.execution_id)
    else:
        policy.on_failed(1.0, first.execution_id)
    retry = policy.on_attempt(2.0, attempt("body", identified=False)).decision
    assert isinstance(retry, Created) and retry.kind is AttemptKind.RETRY
    assert policy.on_attempt(3.0, attempt("body", identified=False)).decision.kind is AttemptKind.FIRST


def test_departures_are_forgotten_after_the_retry_memory_and_bounded_per_key() -> None:
    policy = create_policy(retry_memory_s=10.0, coalesce=False, cancellation=Cancellation.ON)
    burst = [policy.on_attempt(0.0, attempt("body", identified=False)).decision for _ in range(40)]
    for created in burst:  # 40 identical calls at once, all timing out
        assert isinstance(created, Created) and created.kind is AttemptKind.FIRST
        policy.on_subscriber_left(1.0, created.subscriber_id)
    kinds = [policy.on_attempt(2.0, attempt("body", identified=False)).decision.kind for _ in range(40)]
    assert kinds.count(AttemptKind.RETRY) == MAX_DEPARTURES_PER_KEY
    gone = policy.on_attempt(3.0, attempt("late", identified=False)).decision
    assert isinstance(gone, Created)
    policy.on_subscriber_left(3.0, gone.subscriber_id)
    assert policy.on_attempt(14.0, attempt("late", identified=False)).decision.kind is AttemptKind.FIRST


def test_departure_keys_are_bounded() -> None:
    policy = create_policy(max_remembered_calls=2, coalesce=False, cancellation=Cancellation.ON)
    for key in ("a", "b", "c"):
        created = policy.on_attempt(0.0, attempt(key, identified=False)).decision
        assert isinstance(created, Created)
        policy.on_subscriber_left(0.0, created.subscriber_id)
    assert policy.on_attempt(1.0, attempt("a", identified=False)).decision.kind is AttemptKind.FIRST
    assert policy.on_attempt(1.0, attempt("c", identified=False)).decision.kind is AttemptKind.RETRY


def test_without_a_call_id_delivery_counts_from_the_departed_attempt() -> None:
    policy = create_policy(deadline_s=120.0, cancellation=Cancellation.OFF)
    first = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(first, Created)
    policy.on_subscriber_left(120.0, first.subscriber_id)
    retry = policy.on_attempt(121.0, attempt("body", identified=False)).decision
    assert isinstance(retry, Attached)
    policy.on_completed(150.0, first.execution_id)
    policy.on_subscriber_delivered(150.0, retry.subscriber_id)
    assert policy.counters.delivered == {True: 0, False: 1}


def test_the_retry_budget_sees_only_real_retries() -> None:
    # Identical first attempts without a call id fund the budget; they are never refused by it.
    policy = create_policy(retry_budget=0.5, cancellation=Cancellation.ON)
    firsts = [policy.on_attempt(0.0, attempt("body", identified=False)).decision for _ in range(4)]
    assert all(isinstance(d, Created) for d in firsts)
    for d in firsts:
        policy.on_subscriber_left(1.0, d.subscriber_id)  # type: ignore[union-attr]
    kinds = [policy.on_attempt(2.0, attempt("body", identified=False)).decision for _ in range(4)]
    assert [type(d) for d in kinds] == [Created, Created, Shed, Shed]
    assert all(d.kind is AttemptKind.RETRY for d in kinds)


def test_with_a_call_id_the_key_is_remembered_from_its_latest_attempt() -> None:
    # A call whose attempts span more than the retry memory (long deadlines, several retries):
    # its key was seen by the previous attempt, well within the memory, so the next is a retry
    # of the same call, counted from its first attempt.
    policy = create_policy(retry_memory_s=100.0, deadline_s=50.0, cancellation=Cancellation.ON)
    for t, kind in ((0.0, AttemptKind.FIRST), (60.0, AttemptKind.RETRY)):
        decision = policy.on_attempt(t, attempt()).decision
        assert isinstance(decision, Created) and decision.kind is kind
        policy.on_subscriber_left(t + 50.0, decision.subscriber_id)  # timed out: cancelled
    late = policy.on_attempt(150.0, attempt()).decision  # 90 s after the key was last seen
    assert isinstance(late, Created) and late.kind is AttemptKind.RETRY
    policy.on_completed(160.0, late.execution_id)
    policy.on_subscriber_delivered(160.0, late.subscriber_id)
    assert policy.counters.delivered == {True: 0, False: 1}  # late: 160 s after the call began
    # Once the key has gone unseen for the whole memory, it is forgotten.
    assert policy.on_attempt(251.0, attempt()).decision.kind is AttemptKind.FIRST


def test_without_a_call_id_each_departure_is_forgotten_after_the_retry_memory() -> None:
    # A departure licenses a retry for the retry memory from when it happened; a later departure
    # under the same key does not keep an older one alive.
    policy = create_policy(
        retry_memory_s=100.0, deadline_s=120.0, coalesce=False, cancellation=Cancellation.ON
    )
    old = policy.on_attempt(0.0, attempt("body", identified=False)).decision
    assert isinstance(old, Created)
    policy.on_subscriber_left(10.0, old.subscriber_id)  # departs at 10: forgotten after 110
    fresh = policy.on_attempt(50.0, attempt("body", identified=False, says=False)).decision
    assert isinstance(fresh, Created) and fresh.kind is AttemptKind.FIRST  # the counter at 0
    policy.on_subscriber_left(90.0, fresh.subscriber_id)  # departs at 90
    retry = policy.on_attempt(150.0, attempt("body", identified=False)).decision
    assert isinstance(retry, Created) and retry.kind is AttemptKind.RETRY  # of the call begun at 50
    policy.on_completed(160.0, retry.execution_id)
    policy.on_subscriber_delivered(160.0, retry.subscriber_id)
    assert policy.counters.delivered == {True: 1, False: 0}  # 110 s after its call began
    # The departure at 10 was forgotten: nothing is left to license another retry.
    assert policy.on_attempt(151.0, attempt("body", identified=False)).decision.kind is AttemptKind.FIRST


@pytest.mark.parametrize("coalesce", [True, False])
def test_a_call_answered_to_two_of_its_attempts_is_delivered_once(coalesce: bool) -> None:
    # The first attempt still waits (a gateway that has not passed its client's disconnect on,
    # a hedged request) when a retry of its call arrives: both are answered, the call once.
    policy = create_policy(deadline_s=120.0, coalesce=coalesce)
    first = policy.on_attempt(0.0, attempt()).decision
    retry = policy.on_attempt(1.0, attempt()).decision
    assert isinstance(first, Created) and retry.kind is AttemptKind.RETRY
    assert isinstance(retry, Attached if coalesce else Created)
    for decision in (first, retry):
        policy.on_completed(5.0, decision.execution_id)
        policy.on_subscriber_delivered(5.0, decision.subscriber_id)
    assert policy.counters.delivered == {True: 1, False: 0}
    assert policy.gauges().subscribers == 0
    # Another call with the same body, sent without a call id, is delivered on its own.
    other = policy.on_attempt(6.0, attempt("body", identified=False)).decision
    assert isinstance(other, Created)
    policy.on_completed(7.0, other.execution_id)
    policy.on_subscriber_delivered(7.0, other.subscriber_id)
    assert policy.counters.delivered == {True: 2, False: 0}


def test_under_lifo_the_deadline_check_does_not_count_the_queue_a_new_attempt_skips() -> None:
    # LIFO over its threshold serves the newest first: the queue is behind a new attempt, not
    # ahead of it. Counting it ahead shed exactly the fresh attempts LIFO is there to serve.
    policy = create_policy(
        max_outstanding=1,
        queue_order=QueueOrder.LIFO,
        lifo_threshold=2,
        deadline_check=True,
        deadline_s=10.0,
        prefill_tokens_per_s=1000.0,
    )
    running = policy.on_attempt(0.0, attempt("run", prompt_tokens=1000)).decision
    assert isinstance(running, Created) and not running.queued
    queued = [policy.on_attempt(0.1, attempt(f"q{i}", prompt_tokens=2500)).decision for i in range(4)]
    assert all(isinstance(d, Created) and d.queued for d in queued)
    # Within two queued (FIFO still) the queue is ahead: 1,000 + 2 × 2,500 + 2,500 tokens.
    fifo = create_policy(max_outstanding=1, prefill_tokens_per_s=1000.0)
    fifo.on_attempt(0.0, attempt("run", prompt_tokens=1000))
    for i in range(2):
        fifo.on_attempt(0.1, attempt(f"q{i}", prompt_tokens=2500))
    assert fifo.estimated_first_token_wait_s(2500) == pytest.approx(8.5)
    # Over the threshold a new attempt goes next: only the prefill in the engine is ahead.
    assert policy.estimated_first_token_wait_s(2500) == pytest.approx(3.5)
    newest = queued[-1]
    assert isinstance(newest, Created)
    assert policy.on_completed(3.0, running.execution_id) == [Dispatch(newest.execution_id)]
