"""The discrete-event simulation environment: a clock and an event heap, nothing else.

Entities (clients, proxy, engine driver) and metrics live elsewhere and only use
``env.now``, ``env.schedule``, ``env.cancel`` and ``env.run``. Events at the same time
fire in the order they were scheduled (a per-environment counter breaks ties), so a run
is deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

__all__ = ["Environment", "EventHandle", "SimulationError"]


class SimulationError(ValueError):
    """Raised for an impossible scheduling request (an event in the past, a NaN time)."""


class EventHandle:
    """A scheduled callback; pass it to :meth:`Environment.cancel` to drop it."""

    __slots__ = ("args", "at", "callback", "cancelled", "seq")

    def __init__(self, at: float, seq: int, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.at = at
        self.seq = seq
        self.callback = callback
        self.args = args
        self.cancelled = False

    def __lt__(self, other: EventHandle) -> bool:
        return (self.at, self.seq) < (other.at, other.seq)

    def __repr__(self) -> str:
        state = " cancelled" if self.cancelled else ""
        return f"<EventHandle at={self.at:.6f} seq={self.seq}{state}>"


class Environment:
    """Simulated clock plus event heap. Cancellation is lazy: cancelled events are skipped."""

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise SimulationError(f"start time must be finite, got {start!r}")
        self._now = float(start)
        # (time, seq, handle): tuples compare in C; seq is unique, so handles never compare
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = 0
        self._live = 0

    @property
    def now(self) -> float:
        """The current simulated time in seconds."""
        return self._now

    @property
    def pending(self) -> int:
        """How many scheduled events are neither fired nor cancelled."""
        return self._live

    def schedule(self, at: float, callback: Callable[..., Any], *args: Any) -> EventHandle:
        """Call ``callback(*args)`` at simulated time ``at`` (>= now)."""
        if not self._now <= at < math.inf:  # (one comparison chain on the hot path; NaN fails it)
            if not math.isfinite(at):
                raise SimulationError(f"event time must be finite, got {at!r}")
            raise SimulationError(f"cannot schedule at {at!r}: the clock is already at {self._now!r}")
        at = float(at)
        seq = self._seq
        handle = EventHandle(at, seq, callback, args)
        self._seq = seq + 1
        self._live += 1
        heapq.heappush(self._heap, (at, seq, handle))
        return handle

    def schedule_in(self, delay: float, callback: Callable[..., Any], *args: Any) -> EventHandle:
        """Call ``callback(*args)`` ``delay`` seconds from now."""
        return self.schedule(self._now + delay, callback, *args)

    def cancel(self, handle: EventHandle) -> None:
        """Drop a scheduled event; cancelling a fired or cancelled event is a no-op."""
        if not handle.cancelled:
            handle.cancelled = True
            self._live -= 1

    def step(self) -> bool:
        """Fire the next live event; return False when none is left."""
        heap = self._heap
        while heap:
            handle = heapq.heappop(heap)[2]
            if handle.cancelled:
                continue
            self._fire(handle)
            return True
        return False

    def _fire(self, handle: EventHandle) -> None:
        handle.cancelled = True  # fired: a later cancel() is a no-op
        self._live -= 1
        self._now = handle.at
        handle.callback(*handle.args)

    def run(self, until: float | None = None) -> None:
        """Fire events in time order until none is left, or until the clock would pass ``until``.

        With ``until``, events at exactly ``until`` fire and the clock ends at ``until``.
        """
        if until is not None:
            if not math.isfinite(until):
                raise SimulationError(f"until must be finite, got {until!r}")
            if until < self._now:
                raise SimulationError(f"cannot run until {until!r}: the clock is already at {self._now!r}")
        heap = self._heap
        pop = heapq.heappop
        limit = math.inf if until is None else until
        while heap:
            at, _, handle = heap[0]
            if handle.cancelled:
                pop(heap)
                continue
            if at > limit:
                break
            pop(heap)
            handle.cancelled = True  # fired: a later cancel() is a no-op
            self._live -= 1
            self._now = at
            handle.callback(*handle.args)
        if until is not None:
            self._now = float(until)
