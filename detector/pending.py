"""Transitions waiting for the store: written in order, retried until they land, bounded.

Each transition (an alert fired or resolved) is written by :meth:`EpisodeStore.record` in its
own transaction, which also queues its notifications. When the database refuses a write (a
full disk, a server that is down), the transition waits here in the order the evaluator
produced it; every :meth:`PendingWrites.flush` (each evaluation, and on the detector's
schedule) writes the waiting ones oldest first and stops at the first that fails, so a
resolution never lands before its firing. Notifications go out once the write lands, once:
while the database refuses writes none is sent (``GET /alerts`` and the detector's metrics show
the alert, and ``retrywatch_detector_store_writes_pending`` the backlog).

At most ``max_pending`` transitions wait. Past the bound the oldest whole episode (a firing and
its resolution, both waiting) is dropped, else the oldest transition; each drop is counted and
logged as an error, never silent. A firing without its resolution and a resolution of an
episode the store already holds are at most two per alert and engine, so with a bound above
that only episodes that fired and resolved while the database was down are ever dropped.

A transition whose values the database refuses (SQL's data exceptions, :class:`DataError`, or a
text the driver cannot encode in the database's encoding) would be refused on every try and hold
back every transition behind it, and with them every notification: it is dropped at once,
counted and logged as an error like the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from sqlalchemy.exc import DataError

from detector.episodes import AlertEpisode
from detector.evaluator import Transition
from detector.store import EpisodeStore, store_error

log = logging.getLogger("retrywatch.detector.store")

DEFAULT_MAX_PENDING = 1000  # about 1 KB each


def _describe(tr: Transition) -> str:
    return f"{tr.alertname} on {tr.labels.instance or '-'} ({tr.kind} at {tr.at:.0f})"


class PendingWrites:
    """The transitions the store has not taken yet, oldest first."""

    def __init__(
        self,
        store: EpisodeStore,
        notifiers: Sequence[str] = (),
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_failure: Callable[[], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if max_pending < 2:
            raise ValueError("max_pending must hold at least a firing and its resolution (2)")
        self.store = store
        self.notifiers = list(notifiers)
        self.max_pending = max_pending
        self.on_failure = on_failure
        self.on_drop = on_drop
        self._queue: deque[Transition] = deque()
        self._lock = threading.Lock()
        self._failures_in_row = 0
        self._failing_since: float | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> list[Transition]:
        with self._lock:
            return list(self._queue)

    def clear(self) -> int:
        """Forget every waiting transition (another detector writes now); returns how many."""
        with self._lock:
            n = len(self._queue)
            self._queue.clear()
        return n

    def add(self, transitions: Iterable[Transition]) -> None:
        """Queue ``transitions`` (in the order given) behind those already waiting."""
        with self._lock:
            for tr in transitions:
                self._queue.append(tr)
                while len(self._queue) > self.max_pending:
                    self._drop_oldest()

    def flush(self) -> list[tuple[Transition, AlertEpisode | None]]:
        """Write the waiting transitions oldest first until one fails; returns those that landed
        with the episode each opened or resolved (None: nothing was written, so nothing to notify:
        a firing whose episode was open already, or a resolution with none open)."""
        landed: list[tuple[Transition, AlertEpisode | None]] = []
        with self._lock:
            refused: tuple[Transition, Exception] | None = None
            while self._queue:
                tr = self._queue[0]
                try:
                    episode = self.store.record(tr, self.notifiers)
                except (DataError, UnicodeError) as exc:  # refused for its values: it never lands
                    self._queue.popleft()
                    self._dropped(1, _describe(tr), f"the database refuses its values ({store_error(exc)})")
                    continue
                except Exception as exc:  # any other refusal: it waits and is tried again
                    refused = (tr, exc)
                    break
                self._queue.popleft()
                landed.append((tr, episode))
            if landed and self._failures_in_row:
                log.warning(
                    "the store took %d waiting transitions after %d failed writes over %.0f s; %d still wait",
                    len(landed), self._failures_in_row, self._failing_for(), len(self._queue),
                )  # fmt: skip
            if landed:
                self._failures_in_row = 0
                self._failing_since = None
            if refused is not None:
                self._failed(*refused)
        return landed

    def _failed(self, tr: Transition, exc: BaseException) -> None:
        if self.on_failure:
            self.on_failure()
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self._failures_in_row += 1
        level = logging.ERROR if self._failures_in_row == 1 else logging.DEBUG
        log.log(level, "writing %s to the store failed (%d waiting, retried every evaluation): %s",
                _describe(tr), len(self._queue), store_error(exc))  # fmt: skip

    def _failing_for(self) -> float:
        return 0.0 if self._failing_since is None else time.monotonic() - self._failing_since

    def _drop_oldest(self) -> None:
        """Drop the oldest waiting episode that fired and resolved, else the oldest transition."""
        queue = self._queue
        for i, tr in enumerate(queue):
            if tr.kind != "firing":
                continue
            key = (tr.alertname, tr.labels.instance)
            j = next(
                (j for j in range(i + 1, len(queue))
                 if (queue[j].alertname, queue[j].labels.instance) == key),
                None,
            )  # fmt: skip
            if j is not None:  # the next transition of an alert after its firing is its resolution
                resolved = queue[j]
                del queue[j]
                del queue[i]
                episode = f"the episode {_describe(tr)}, resolved at {resolved.at:.0f}"
                self._dropped(2, episode, self._at_bound())
                return
        oldest = queue.popleft()
        self._dropped(1, _describe(oldest), self._at_bound())

    def _at_bound(self) -> str:
        return (
            f"the store has refused writes for {self._failing_for():.0f} s"
            f" and {self.max_pending} transitions wait (the bound)"
        )

    def _dropped(self, n: int, what: str, why: str) -> None:
        if self.on_drop:
            self.on_drop(n)
        log.error("dropped %s: %s", what, why)
