"""Calls that miss their deadline: counted once each, when the first attempt's deadline passes
undelivered, on the same clock as the calls delivered in time."""

from __future__ import annotations

from exporter.policy import Attached, Attempt, Cancellation, Created, Policy, PolicyConfig, Shed

DEADLINE = 120.0


def create_policy(**overrides: object) -> Policy:
    settings: dict[str, object] = {"deadline_s": DEADLINE, "cancellation": Cancellation.OFF, **overrides}
    return Policy(PolicyConfig(**settings))  # type: ignore[arg-type]


def attempt(key: str | None = "call-1", *, identified: bool = True) -> Attempt:
    return Attempt(key, identified=identified, prompt_tokens=1000)


def created(policy: Policy, now: float, a: Attempt) -> Created:
    decision = policy.on_attempt(now, a).decision
    assert isinstance(decision, Created)
    return decision


def test_an_undelivered_call_is_missed_once_when_its_deadline_passes_not_before() -> None:
    policy = create_policy()
    call = created(policy, 0.0, attempt())
    policy.sweep_deadlines(DEADLINE)  # at the deadline a delivery is still in time
    assert policy.counters.missed_deadline == 0
    policy.sweep_deadlines(DEADLINE + 0.5)
    assert policy.counters.missed_deadline == 1
    policy.on_completed(200.0, call.execution_id)
    policy.on_subscriber_delivered(200.0, call.subscriber_id)  # late: counted late, not missed again
    policy.sweep_deadlines(1000.0)
    assert policy.counters.missed_deadline == 1
    assert policy.counters.delivered == {True: 0, False: 1}


def test_a_burst_delivered_in_time_misses_nothing_though_deliveries_trail_arrivals() -> None:
    policy = create_policy()
    calls = [created(policy, i * 0.1, attempt(f"call-{i}")) for i in range(100)]
    for i, call in enumerate(calls):  # each answered just inside its deadline
        now = i * 0.1 + DEADLINE - 1.0
        policy.sweep_deadlines(now)
        policy.on_completed(now, call.execution_id)
        policy.on_subscriber_delivered(now, call.subscriber_id)
    policy.sweep_deadlines(10_000.0)
    assert policy.counters.missed_deadline == 0
    assert policy.counters.delivered == {True: 100, False: 0}


def test_a_call_delivered_in_time_by_its_retry_is_not_missed() -> None:
    for identified in (True, False):
        policy = create_policy()
        first = created(policy, 0.0, attempt("body", identified=identified))
        policy.on_subscriber_left(30.0, first.subscriber_id)
        retry = policy.on_attempt(31.0, attempt("body", identified=identified)).decision
        assert isinstance(retry, Attached)
        policy.on_completed(60.0, first.execution_id)
        policy.on_subscriber_delivered(60.0, retry.subscriber_id)
        policy.sweep_deadlines(1000.0)
        assert policy.counters.missed_deadline == 0, identified


def test_a_shed_call_never_answered_is_missed_and_swept_by_the_next_attempt() -> None:
    policy = create_policy(max_outstanding=1, max_queued=0)
    created(policy, 0.0, attempt("a"))
    shed = policy.on_attempt(1.0, attempt("b")).decision
    assert isinstance(shed, Shed)
    policy.on_attempt(DEADLINE + 2.0, attempt("c"))  # an event of the policy sweeps
    assert policy.counters.missed_deadline == 2  # "a" still unanswered, "b" shed


def test_identical_first_attempts_without_a_call_id_at_one_instant_are_two_calls() -> None:
    policy = create_policy()
    one = created(policy, 5.0, attempt("body", identified=False))
    created(policy, 5.0, attempt("body", identified=False))
    policy.on_completed(6.0, one.execution_id)
    policy.on_subscriber_delivered(6.0, one.subscriber_id)
    policy.sweep_deadlines(1000.0)
    assert policy.counters.missed_deadline == 1


def test_without_a_deadline_nothing_is_counted() -> None:
    policy = Policy(PolicyConfig())
    created(policy, 0.0, attempt())
    policy.sweep_deadlines(10_000.0)
    assert policy.counters.missed_deadline == 0
    policy = create_policy()
    created(policy, 0.0, attempt())
    policy.set_deadline(None)  # the calls it remembered cannot be judged any more
    policy.set_deadline(DEADLINE)
    policy.sweep_deadlines(10_000.0)
    assert policy.counters.missed_deadline == 0


def test_calls_awaiting_their_deadline_are_bounded() -> None:
    policy = create_policy(max_remembered_calls=10)
    for i in range(50):
        created(policy, float(i) * 0.01, attempt(f"call-{i}"))
    policy.sweep_deadlines(10_000.0)
    assert policy.counters.missed_deadline == 10
    assert policy.counters.calls_forgotten == 40  # the oldest 40, neither good nor bad: counted apart
