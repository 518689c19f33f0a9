"""The order in which keys were last touched, for the policy's bounded memories (``exporter.callmemory``,
``exporter.departures``): what an ordered dict's ``move_to_end`` and ``popitem(last=False)`` give,
beside a plain dict that holds the values.

NOTE: compact on purpose. An ``OrderedDict`` keeps a linked node and a slot of its own per key
beside its dict; after its keys have turned over a few times (a memory held at its bound by new
keys) it took about 190 bytes a key beyond its values, a plain dict and this order about 90. A touch
appends the key and the value object it stored in its owner's dict to a deque; an entry is stale
once the owner holds another object under the key (a later touch stores a new one) or none (the key
was dropped), which is told by identity, so no count is kept and two touches at one instant keep
their order. Stale entries are skipped when they come to the front, and all dropped at once when
the deque holds more than four entries a key listed (plus 1,024), so it never holds more than that
(32 bytes a key at most, 8 when each was touched once); the rebuild runs in C, about 30 ns an
entry.
A value changed in place keeps its key's place; one replaced without a touch loses it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import compress
from operator import is_

# The deque is rebuilt without its stale entries once it holds more than this many entries a key
# listed (plus the slack): each rebuild then costs at most one pass over 4/3 of an entry a touch.
_ENTRIES_A_KEY = 4
_SLACK = 1024


class Recency:
    """The keys of ``owner`` (a dict whose values are objects of their own, never shared) in the
    order they were last touched, the least recent first."""

    def __init__(self, owner: Mapping[str, object]) -> None:
        self._owner = owner
        self._keys: deque[str] = deque()  # every touch, oldest first
        self._values: deque[object] = deque()  # the value each touch stored

    def touch(self, key: str, value: object) -> None:
        """``key`` now holds ``value``, a new object, in the owner's dict: the most recent."""
        self._keys.append(key)
        self._values.append(value)
        if len(self._keys) > _ENTRIES_A_KEY * len(self._owner) + _SLACK:
            self._compact()

    def oldest(self) -> str | None:
        """The least recently touched key of the owner; None when it has none."""
        keys, values, get = self._keys, self._values, self._owner.get
        while keys:
            key = keys[0]
            if get(key) is values[0]:
                return key
            keys.popleft()
            values.popleft()
        return None

    def pop_oldest(self) -> None:
        """Forget the place of the key :meth:`oldest` just returned (the owner drops it)."""
        self._keys.popleft()
        self._values.popleft()

    def _compact(self) -> None:
        """Rebuild the deques without their stale entries, in the same order."""
        current = list(map(is_, map(self._owner.get, self._keys), self._values))
        self._keys = deque(compress(self._keys, current))
        self._values = deque(compress(self._values, current))
