"""The order in which keys were last touched, for the policy's bounded memories (``exporter.callmemory``,
``exporter.departures``): what an ordered dict's ``move_to_end`` and ``popitem(last=False)`` give,
beside a plain dict that holds the values.

NOTE: compact on purpose. An ``OrderedDict`` keeps a linked node and a slot of its own per key
beside its dict; after its keys have turned over a few times (a memory held at its bound by new
keys) it took about 190 bytes a key beyond its values, a plain dict and this order about 85. A touch
appends the key to a deque; its earlier entry, if any, becomes stale and is counted under the key in
``_stale``, so the stale entries of a key are always its earliest. They are skipped when they come
to the front, and all dropped at once when the deque holds more than twice the keys listed (plus
1,024), so it never holds more than that.
"""

from __future__ import annotations

from collections import deque

# Stale entries tolerated beyond the keys listed before the deque is rebuilt without them.
_SLACK = 1024


class Recency:
    """Keys listed in the order they were last touched, the least recent first. The caller keeps
    the keys' values and tells what it listed: a key is listed from its first touch until it is
    dropped or popped."""

    def __init__(self) -> None:
        self._order: deque[str] = deque()  # every touch, oldest first
        self._stale: dict[str, int] = {}  # key -> how many of its earliest entries are stale
        self._listed = 0

    def __len__(self) -> int:
        """Keys listed."""
        return self._listed

    def touch(self, key: str, listed: bool) -> None:
        """``key`` is the most recent now; ``listed``: it was listed already (its place moves)."""
        self._order.append(key)
        if not listed:
            self._listed += 1
            return
        stale = self._stale
        stale[key] = stale.get(key, 0) + 1
        if len(self._order) > 2 * self._listed + _SLACK:
            self._compact()

    def drop(self, key: str) -> None:
        """``key``, listed, is listed no more (wherever its place)."""
        stale = self._stale
        stale[key] = stale.get(key, 0) + 1
        self._listed -= 1
        if len(self._order) > 2 * self._listed + _SLACK:
            self._compact()

    def oldest(self) -> str | None:
        """The least recently touched key listed; None when none is."""
        order, stale = self._order, self._stale
        while order:
            key = order[0]
            skip = stale.get(key)
            if skip is None:
                return key
            order.popleft()
            if skip > 1:
                stale[key] = skip - 1
            else:
                del stale[key]
        return None

    def pop_oldest(self) -> None:
        """Unlist the key :meth:`oldest` just returned."""
        self._order.popleft()
        self._listed -= 1

    def clear(self) -> None:
        self._order.clear()
        self._stale.clear()
        self._listed = 0

    def _compact(self) -> None:
        """Rebuild the deque without its stale entries, in the same order."""
        stale = self._stale
        kept: deque[str] = deque()
        for key in self._order:
            skip = stale.get(key)
            if skip is None:
                kept.append(key)
            elif skip > 1:
                stale[key] = skip - 1
            else:
                del stale[key]
        self._order = kept
