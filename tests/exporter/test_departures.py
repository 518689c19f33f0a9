"""The departures the policy remembers: bounded per key, in time and in total, the oldest
forgotten first and counted; through the policy's entry points and the memory itself."""

from __future__ import annotations

import random

import pytest

from exporter.departures import DepartureMemory
from exporter.policy import (
    MAX_DEPARTURES_PER_KEY,
    Attempt,
    AttemptKind,
    Cancellation,
    Created,
    Policy,
    PolicyConfig,
    PolicyConfigError,
)


def create_policy(**overrides: object) -> Policy:
    return Policy(PolicyConfig(coalesce=False, cancellation=Cancellation.ON, **overrides))  # type: ignore[arg-type]


def depart(policy: Policy, now: float, key: str) -> None:
    """An attempt without a call id that leaves before its answer."""
    created = policy.on_attempt(now, Attempt(key, identified=False, client_says_retry=False)).decision
    assert isinstance(created, Created) and created.kind is AttemptKind.FIRST
    policy.on_subscriber_left(now, created.subscriber_id)


def kind_of_next(policy: Policy, now: float, key: str) -> AttemptKind:
    """The kind of an attempt without a call id whose client says nothing."""
    return policy.on_attempt(now, Attempt(key, identified=False)).decision.kind


def test_the_departures_held_in_all_never_exceed_their_bound_and_the_oldest_go_first() -> None:
    policy = create_policy(max_remembered_departures=5)
    for i in range(8):  # eight distinct calls leave, one after the other
        depart(policy, float(i), f"body-{i}")
        assert policy.departures.total <= 5
    assert policy.departures.total == 5 and policy.departures.evicted == 3
    later = [kind_of_next(policy, 10.0, f"body-{i}") for i in range(8)]
    # the three that left first are forgotten; each of the five others licenses its retry
    assert later == [AttemptKind.FIRST] * 3 + [AttemptKind.RETRY] * 5


def test_the_total_bound_holds_across_keys_with_many_departures_each() -> None:
    """The bound per key alone let every key hold 32: 200,000 keys held 6.4 million departures."""
    policy = create_policy(max_remembered_departures=6)
    for i in range(4):
        depart(policy, float(i), "burst")  # four identical calls time out together
    for i in range(4):
        depart(policy, 10.0 + i, "other")
    # The least recent key's oldest went first: two of "burst" are left, the four of "other".
    assert policy.departures.total == 6 and policy.departures.evicted == 2
    assert policy.departures.pending(20.0, "burst") == 2
    assert policy.departures.pending(20.0, "other") == 4
    kinds = [kind_of_next(policy, 20.0, "burst") for _ in range(3)]
    assert kinds == [AttemptKind.RETRY, AttemptKind.RETRY, AttemptKind.FIRST]


def test_departures_forgotten_in_time_are_not_counted_as_evicted() -> None:
    policy = create_policy(retry_memory_s=10.0, max_remembered_departures=2)
    depart(policy, 0.0, "a")
    depart(policy, 1.0, "b")
    depart(policy, 20.0, "c")  # a and b are past the memory: forgotten in time, not evicted
    depart(policy, 21.0, "d")
    assert policy.departures.total == 2 and policy.departures.evicted == 0
    assert len(policy.departures) == 2


def test_the_bound_on_departures_is_checked() -> None:
    with pytest.raises(PolicyConfigError, match="max_remembered_departures"):
        PolicyConfig(max_remembered_departures=0)


def test_the_memory_keeps_its_count_and_every_bound_under_random_traffic() -> None:
    """Random departures and retries over a few keys, in time order: the count held is what is
    held, never over the total, per key or key bounds; a retry uses its key's oldest departure
    within the memory, and finds none only when none is left."""
    rng = random.Random(7)
    memory = DepartureMemory(30.0, per_key=4, max_total=25, max_keys=12)
    now = 0.0
    for _ in range(5_000):
        now += rng.random()
        key = f"k{rng.randrange(20)}"
        if rng.random() < 0.6:
            memory.depart(now, key, -now)  # a call's start that says when it left
        else:
            within = sorted(left for left, _ in memory.held(key) if left >= now - 30.0)
            started = memory.use(now, key)
            assert started == (-within[0] if within else None)
        held = [memory.held(f"k{i}") for i in range(20)]
        assert memory.total == sum(map(len, held)) <= 25
        assert len(memory) == sum(1 for h in held if h) <= 12
        assert all(len(h) <= 4 for h in held)
    assert memory.evicted > 0  # the traffic did reach the bounds


def test_below_its_bounds_a_key_keeps_at_most_its_own_bound() -> None:
    policy = create_policy()
    for _ in range(MAX_DEPARTURES_PER_KEY + 8):
        depart(policy, 0.0, "burst")
    assert policy.departures.total == MAX_DEPARTURES_PER_KEY
    assert policy.departures.evicted == 0  # forgotten by the bound per key, as before
