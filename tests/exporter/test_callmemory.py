"""The compact memories of calls and the order of keys decide exactly as an ordered dict of
tuples would (the layout they replaced), under random traffic that reaches their bounds."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from exporter.callmemory import AwaitingDelivery, SeenCalls
from exporter.recency import Recency


class OrderedSeenCalls:
    """The reference: key -> (latest attempt, (first attempt, delivered)) in an ordered dict."""

    def __init__(self, memory_s: float, max_keys: int) -> None:
        self.memory_s, self.max_keys = memory_s, max_keys
        self.entries: OrderedDict[str, tuple[float, tuple[float, bool]]] = OrderedDict()

    def get(self, now: float, key: str) -> tuple[float, bool] | None:
        entry = self.entries.get(key)
        return None if entry is None or now - entry[0] > self.memory_s else entry[1]

    def set(self, now: float, key: str, value: tuple[float, bool]) -> None:
        self.entries[key] = (now, value)
        self.entries.move_to_end(key)
        while self.entries:
            oldest = next(iter(self.entries))
            if len(self.entries) > self.max_keys or self.entries[oldest][0] < now - self.memory_s:
                self.entries.popitem(last=False)
            else:
                break

    def attempt(self, now: float, key: str) -> float | None:
        seen = self.get(now, key)
        self.set(now, key, seen if seen is not None else (now, False))
        return None if seen is None else seen[0]

    def deliver(self, now: float, key: str) -> bool:
        seen = self.get(now, key)
        if seen is None:
            return True
        if seen[1]:
            return False
        self.entries[key] = (self.entries[key][0], (seen[0], True))
        return True


@pytest.mark.parametrize("seed", range(4))
def test_seen_calls_decide_as_an_ordered_dict_of_tuples(seed: int) -> None:
    rng = random.Random(seed)
    memory, reference = SeenCalls(30.0, 12), OrderedSeenCalls(30.0, 12)
    now = 0.0
    for _ in range(5_000):
        now += rng.choice((0.0, rng.random() * 3))  # instants repeat too
        key = f"call-{rng.randrange(40)}"
        if rng.random() < 0.7:
            assert memory.attempt(now, key) == reference.attempt(now, key)
        else:
            assert memory.deliver(now, key) == reference.deliver(now, key)
        assert len(memory) == len(reference.entries) <= 12


class OrderedAwaiting:
    """The reference: (key, first attempt) -> calls in an ordered dict."""

    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        self.pending: OrderedDict[tuple[str | None, float], int] = OrderedDict()
        self.forgotten = 0

    def add(self, key: str | None, at: float) -> None:
        self.pending[(key, at)] = self.pending.get((key, at), 0) + 1
        if len(self.pending) > self.max_calls:
            self.forgotten += self.pending.popitem(last=False)[1]

    def delivered(self, key: str | None, at: float) -> None:
        left = self.pending.get((key, at))
        if left is not None and left > 1:
            self.pending[(key, at)] = left - 1
        elif left is not None:
            del self.pending[(key, at)]

    def sweep(self, cut: float) -> int:
        missed = 0
        while self.pending and next(iter(self.pending))[1] < cut:
            missed += self.pending.popitem(last=False)[1]
        return missed


@pytest.mark.parametrize("seed", range(4))
def test_calls_awaiting_delivery_are_counted_as_an_ordered_dict_of_tuples(seed: int) -> None:
    """Several first attempts under one key (without a call id, or none), at one instant too;
    deliveries of any of them in any order, always after the instant they arrived; sweeps;
    enough of them to pass the bound, and enough deliveries to rebuild the order."""
    rng = random.Random(seed)
    memory, reference = AwaitingDelivery(50), OrderedAwaiting(50)
    now, arrived = 0.0, []
    for _ in range(20_000):
        now += rng.random() * 0.1
        roll = rng.random()
        if roll < 0.45:
            key = rng.choice((None, f"body-{rng.randrange(30)}"))
            for _ in range(rng.choice((1, 1, 1, 2))):  # identical first attempts at one instant
                memory.add(key, now)
                reference.add(key, now)
                arrived.append((key, now))
        elif roll < 0.97 and arrived:
            key, at = arrived.pop(rng.randrange(len(arrived)))
            now += 1e-3  # delivered after it arrived
            memory.delivered(key, at)
            reference.delivered(key, at)
        else:
            cut = now - rng.random() * 10
            assert memory.sweep(cut) == reference.sweep(cut)
        assert len(memory) == len(reference.pending) <= 50
        assert memory.forgotten == reference.forgotten
    assert memory.forgotten > 0
    assert memory.sweep(now + 1) == reference.sweep(now + 1)


def test_the_order_of_calls_awaiting_is_rebuilt_and_stays_bounded() -> None:
    memory = AwaitingDelivery(10)
    for i in range(5_000):  # each delivered right after it arrived: its place is left behind
        memory.add(f"call-{i}", float(i))
        memory.delivered(f"call-{i}", float(i))
        assert len(memory._order_keys) <= 1024 + 1
    memory.add("last", 5_000.0)
    assert memory.sweep(10_000.0) == 1


@pytest.mark.parametrize("seed", range(4))
def test_the_order_of_keys_is_an_ordered_dicts(seed: int) -> None:
    """Keys touched (moved to the end), changed in place, dropped anywhere and popped from the
    front, as an ordered dict's; its deque rebuilt as stale entries pile up."""
    rng = random.Random(seed)
    owner: dict[str, list[int]] = {}
    reference = OrderedDict[str, None]()
    order = Recency(owner)
    for _ in range(20_000):
        key = f"k{rng.randrange(60)}"
        roll = rng.random()
        if roll < 0.5:
            owner[key] = value = [0]  # a new object at each touch
            order.touch(key, value)
            reference[key] = None
            reference.move_to_end(key)
        elif roll < 0.6 and key in owner:
            owner[key].append(1)  # changed in place: it keeps its place
        elif roll < 0.8 and key in owner:
            del owner[key]
            del reference[key]
        elif reference:
            assert order.oldest() == next(iter(reference))
            if rng.random() < 0.5:
                order.pop_oldest()
                del owner[next(iter(reference))]
                reference.popitem(last=False)
        assert len(order._keys) <= 4 * len(owner) + 1024
    assert order.oldest() == next(iter(reference), None)
