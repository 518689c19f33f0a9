"""What the policy remembers of calls: who was seen (to recognise a retry) and who still awaits
delivery within the deadline (to count a missed deadline). Both bounded.

* :class:`SeenCalls`: calls with a call id, by key: when the call's first attempt was seen and
  whether it was delivered already. A call is forgotten ``memory_s`` after its latest attempt, and
  at most ``max_keys`` are kept (past it the least recently seen is forgotten first).
* :class:`AwaitingDelivery`: calls not yet delivered within their deadline, by key and the time of
  their first attempt, oldest first, until they are delivered in time or swept as missed. At most
  ``max_calls`` are kept: past it the oldest is forgotten, neither good nor bad, and counted in
  :attr:`AwaitingDelivery.forgotten`.

NOTE: compact on purpose: an adversary can fill both to their bounds (200,000 calls by default).
A seen call is one ``complex`` (latest attempt, first attempt: two exact doubles, 32 bytes, no
object the garbage collector walks) under its key in a plain dict, in the order of
``exporter.recency``, not a tuple of a float and a tuple of a float and a bool in an ordered dict
(349 bytes a call with the key; ``bench/bench_policy_memory.py``); the delivered ones are a set of
keys. A call awaiting delivery shares its key with :class:`SeenCalls` and holds its
first attempt's time under it, in a plain dict; the order is a pair of deques (key, time) whose
entries for calls delivered meanwhile are skipped when they come up, instead of an ordered dict
keyed by a tuple per call. The order is the ordered dict's but in one case: a pair delivered in
time at the very instant it arrived, then held again at that instant (a first attempt answered in
no time, and an identical one), keeps its first place, which decides only which of two calls seen
at one instant is forgotten first at the bound.
"""

from __future__ import annotations

from collections import deque

from exporter.recency import Recency


class SeenCalls:
    """Calls with a call id by key: when each one's first attempt was seen and whether it was
    delivered; forgotten ``memory_s`` after their latest attempt, at most ``max_keys`` of them (the
    least recently seen go first). Times must not go backwards."""

    def __init__(self, memory_s: float, max_keys: int) -> None:
        self.memory_s = memory_s
        self.max_keys = max_keys
        self._entries: dict[str, complex] = {}  # key -> complex(latest attempt, first attempt)
        self._order = Recency(self._entries)  # the keys, the least recently seen first
        self._delivered: set[str] = set()  # keys held whose call was delivered

    def __len__(self) -> int:
        """Calls held (forgotten ones still held until they come up)."""
        return len(self._entries)

    def attempt(self, now: float, key: str) -> float | None:
        """An attempt under ``key`` arrived: when its call's first attempt was seen if the call is
        remembered (a retry), else None (a first attempt, seen now, not delivered). Either way the
        call is remembered from ``now`` on."""
        entries, order = self._entries, self._order
        entry = entries.get(key)
        if entry is not None and not now - entry.real > self.memory_s:
            # Remembered from its latest attempt, still counted from its first: a call whose
            # retries go on is not forgotten mid-call.
            first_at: float | None = entry.imag
            entries[key] = seen = complex(now, entry.imag)
        else:
            first_at = None
            entries[key] = seen = complex(now, now)
            self._delivered.discard(key)
        order.touch(key, seen)
        horizon = now - self.memory_s
        while (oldest_key := order.oldest()) is not None:
            if len(entries) > self.max_keys or entries[oldest_key].real < horizon:
                order.pop_oldest()
                del entries[oldest_key]
                self._delivered.discard(oldest_key)
            else:
                break
        return first_at

    def deliver(self, now: float, key: str) -> bool:
        """The call under ``key`` was delivered: whether this is its first delivery (True too for
        a call not remembered, which cannot be told from a first)."""
        entry = self._entries.get(key)
        if entry is None or now - entry.real > self.memory_s:
            return True
        if key in self._delivered:
            return False
        self._delivered.add(key)
        return True


class AwaitingDelivery:
    """Calls awaiting delivery within the deadline, by (key, first attempt's time), with how many
    calls share the pair (identical first attempts without a call id at one instant), oldest
    first; at most ``max_calls`` pairs (past it the oldest is forgotten and counted). Times must
    not go backwards."""

    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        # key -> the first attempt's time of its one call awaiting (the common case), or
        # {time: calls} when several are (one key without a call id, several first attempts)
        self._by_key: dict[str | None, float | dict[float, int]] = {}
        self._pairs = 0  # (key, time) pairs held
        # every pair in the order it was first held; pairs delivered since are skipped
        self._order_keys: deque[str | None] = deque()
        self._order_times: deque[float] = deque()
        self.forgotten = 0  # calls forgotten at ``max_calls``, neither delivered nor missed

    def __len__(self) -> int:
        """(key, time) pairs held."""
        return self._pairs

    def add(self, key: str | None, at: float) -> int:
        """A call's first attempt arrived at ``at`` (the latest time so far): how many calls were
        forgotten to make room for it (0 or those of the oldest pair)."""
        by_key = self._by_key
        held = by_key.get(key)
        if held is None:
            by_key[key] = at
        elif isinstance(held, dict):
            calls = held.get(at, 0)
            held[at] = calls + 1
            if calls:
                return 0
        elif held == at:
            by_key[key] = {at: 2}
            return 0
        else:
            by_key[key] = {held: 1, at: 1}
        self._pairs += 1
        self._order_keys.append(key)
        self._order_times.append(at)
        if self._pairs > self.max_calls:
            while self._order_keys:
                forgotten = self._take(self._order_keys.popleft(), self._order_times.popleft())
                if forgotten:
                    self.forgotten += forgotten
                    return forgotten
        return 0

    def delivered(self, key: str | None, at: float) -> None:
        """One call of (``key``, ``at``) was delivered within the deadline: it awaits no more."""
        held = self._by_key.get(key)
        if held is None:
            return
        if isinstance(held, dict):
            calls = held.get(at)
            if calls is None:
                return
            if calls > 1:
                held[at] = calls - 1
                return
            del held[at]
            if not held:
                del self._by_key[key]
        elif held == at:
            del self._by_key[key]
        else:
            return
        self._pairs -= 1
        if len(self._order_keys) > 2 * self._pairs + 1024:  # drop the skipped entries at once
            self._compact()

    def sweep(self, cut: float) -> int:
        """Forget the calls whose first attempt came before ``cut``; how many were held."""
        keys, times = self._order_keys, self._order_times
        missed = 0
        while times and times[0] < cut:
            missed += self._take(keys.popleft(), times.popleft())
        return missed

    def clear(self) -> None:
        """Forget every call (not counted)."""
        self._by_key.clear()
        self._order_keys.clear()
        self._order_times.clear()
        self._pairs = 0

    def _take(self, key: str | None, at: float) -> int:
        """Forget (``key``, ``at``): how many calls it held (0 when delivered already)."""
        held = self._by_key.get(key)
        if held is None:
            return 0
        if isinstance(held, dict):
            calls = held.pop(at, 0)
            if not held:
                del self._by_key[key]
        elif held == at:
            calls = 1
            del self._by_key[key]
        else:
            return 0
        if calls:
            self._pairs -= 1
        return calls

    def _compact(self) -> None:
        """Rebuild the order with the pairs still held only, keeping their order."""
        held: set[tuple[str | None, float]] = set()
        keys: deque[str | None] = deque()
        times: deque[float] = deque()
        for key, at in zip(self._order_keys, self._order_times, strict=True):
            if (key, at) not in held and self._holds(key, at):
                held.add((key, at))
                keys.append(key)
                times.append(at)
        self._order_keys, self._order_times = keys, times

    def _holds(self, key: str | None, at: float) -> bool:
        held = self._by_key.get(key)
        if isinstance(held, dict):
            return at in held
        return held is not None and held == at
