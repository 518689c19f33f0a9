"""The departures the policy remembers, so that a retry without a call id is recognised.

An attempt without a call id that leaves before its answer (disconnected, shed, refused, failed)
licenses one retry of its key (``exporter.policy``'s NOTE on first attempts and retries). This
module owns what is kept of those departures, and its bounds:

* each departure is forgotten ``memory_s`` after it happened, whatever departed after it;
* at most ``per_key`` pending under one key (a burst of identical calls that all time out
  together); past it the key's oldest is forgotten;
* at most ``max_total`` in all, whatever the number of keys, and under at most ``max_keys``
  keys: past either the departures of the key that departed longest ago are forgotten first,
  its oldest first, and counted in :attr:`DepartureMemory.evicted`.

NOTE: compact on purpose. The bound per key alone let 200,000 keys hold 32 departures each,
every one a tuple of two float objects inside a tuple per key: about 3.5 KB a key, 695 MiB in
all (``bench/bench_policy_memory.py``). Here a key's one departure is a ``complex``
``(left_at, call_started_at)``, two exact doubles in 32 bytes, and its several departures one
``array('d')`` of such pairs, oldest first (shrunk in place, so it may come to hold one): 16
bytes a departure, with no object the garbage collector walks; the keys are in a plain dict, in
the order of ``exporter.recency``, not an ordered dict; and the total bound caps the memory
whatever the keys.
"""

from __future__ import annotations

from array import array
from typing import TypeAlias

from exporter.recency import Recency

# A key's departures: one as complex(left_at, call_started_at); several as an array of
# [left_at, call_started_at, left_at, call_started_at, ...], oldest first, shrunk in place (a new
# object only when the key departs again: ``exporter.recency`` tells its place by identity).
Held: TypeAlias = "complex | array[float]"


def _pairs(held: Held) -> array[float]:
    """A key's departures as an array of pairs, oldest first."""
    if isinstance(held, complex):
        return array("d", (held.real, held.imag))
    return held


class DepartureMemory:
    """Departures by key, oldest first, each licensing one retry; bounded in time, per key and
    in total. Times must not go backwards."""

    def __init__(self, memory_s: float, *, per_key: int, max_total: int, max_keys: int) -> None:
        if memory_s <= 0 or min(per_key, max_total, max_keys) < 1:
            raise ValueError("memory_s must be > 0, and per_key, max_total and max_keys >= 1")
        self.memory_s = memory_s
        self.per_key = per_key
        self.max_total = max_total
        self.max_keys = max_keys
        self._by_key: dict[str, Held] = {}
        self._order = Recency(self._by_key)  # the keys by their latest departure, least recent first
        self.total = 0  # departures held (forgotten ones still held until their key is touched)
        self.evicted = 0  # departures forgotten at ``max_total`` or ``max_keys``, before their time

    def __len__(self) -> int:
        """Keys with departures held."""
        return len(self._by_key)

    def pending(self, now: float, key: str) -> int:
        """Departures under ``key`` within the memory, not yet used by a retry."""
        held = self._by_key.get(key)
        if held is None:
            return 0
        pairs = _pairs(held)
        return (len(pairs) - self._expired(now, pairs)) // 2

    def held(self, key: str) -> list[tuple[float, float]]:
        """The departures held under ``key``, those past the memory too (until the key is touched),
        oldest first: ``(left_at, call_started_at)`` each."""
        held = self._by_key.get(key)
        pairs = _pairs(held) if held is not None else array("d")
        return list(zip(pairs[::2], pairs[1::2], strict=True))

    def depart(self, now: float, key: str, call_started_at: float) -> None:
        """An attempt under ``key`` left before its answer: remember it from ``now`` on."""
        old = self._by_key.get(key)
        held: Held
        if old is None:
            held = complex(now, call_started_at)
            self.total += 1
        else:  # its pending ones within the memory, at most per_key with this one
            pairs = _pairs(old)
            self.total -= len(pairs) // 2
            start = max(self._expired(now, pairs), len(pairs) - 2 * (self.per_key - 1))
            if start == len(pairs):
                held = complex(now, call_started_at)
            else:  # exactly the size it needs
                held = pairs[start:] + array("d", (now, call_started_at))
            self.total += 1 + (len(pairs) - start) // 2
        self._by_key[key] = held
        self._order.touch(key, held)  # the most recent now: a new object under the key
        self._forget(now)

    def use(self, now: float, key: str) -> float | None:
        """Use up the oldest departure under ``key`` within the memory; its call's start, or
        None when there is none."""
        held = self._by_key.get(key)
        if held is None:
            return None
        if isinstance(held, complex):  # its one departure, within the memory or not
            del self._by_key[key]
            self.total -= 1
            return None if held.real < now - self.memory_s else held.imag
        pairs = held
        expired = self._expired(now, pairs)
        if expired == len(pairs):
            del self._by_key[key]
            self.total -= len(pairs) // 2
            return None
        call_started_at = pairs[expired + 1]
        if expired + 2 == len(pairs):
            del self._by_key[key]
        else:  # in place: the key keeps its place (``exporter.recency``)
            del pairs[: expired + 2]
        self.total -= expired // 2 + 1
        return call_started_at

    def _expired(self, now: float, pairs: array[float]) -> int:
        """How many of ``pairs``' leading values belong to departures past the memory."""
        horizon = now - self.memory_s
        i = 0
        while i < len(pairs) and pairs[i] < horizon:
            i += 2
        return i

    def _forget(self, now: float) -> None:
        """Drop the keys whose latest departure is past the memory; then, over ``max_keys`` or
        ``max_total``, the least recent key's departures, oldest first (counted)."""
        by_key, order = self._by_key, self._order
        while (oldest_key := order.oldest()) is not None:
            pairs = _pairs(by_key[oldest_key])
            expired = self._expired(now, pairs)
            if expired == len(pairs):  # its latest is past the memory: forgotten in time
                order.pop_oldest()
                del by_key[oldest_key]
                self.total -= len(pairs) // 2
                continue
            if len(by_key) > self.max_keys:
                over = len(pairs) // 2
            elif self.total > self.max_total:
                over = self.total - self.max_total
            else:
                return
            if expired:  # those past the memory go first, forgotten in time, not evicted
                del pairs[:expired]  # in place (an array: one departure alone is never expired)
                self.total -= expired // 2
                continue
            if 2 * over >= len(pairs):
                order.pop_oldest()
                del by_key[oldest_key]
                over = len(pairs) // 2
            else:
                del pairs[: 2 * over]  # in place (an array: a complex goes whole)
            self.total -= over
            self.evicted += over
