"""The clients' deadline, learned from the ages at which attempts are abandoned, and until then
from the timeouts clients declare.

A client that gives up on an attempt at its timeout leaves at that age plus a little network
jitter, so the abandon ages of one client class pile up in a sharp mode at its deadline; clients
that leave early for other reasons (a user's cancel, a slow reader cut off) spread below it. The
learner keeps the most recent abandon ages (a bounded ring), finds the sharp modes in log space
(a cluster: at least a minimum share of the ages within ±5 % of one age, several times denser
than its flanks), and names each cluster's median its class's deadline. Several sharp modes are
several classes (e.g. a gateway at 30 s and an SDK at its default 600 s).

Abandons come only once clients have waited a deadline: in ordinary traffic there are none. The
SDKs built by Stainless (OpenAI's and Anthropic's among them) declare their read timeout on every
attempt (``x-stainless-read-timeout``, seconds): the age at which a request still waiting for its
first byte is abandoned. The learner keeps those too (``declare``, a ring of its own) and finds
their classes the same way; it names them only while the abandons name none, since abandons are
what clients do, and a class of clients that declares nothing (a gateway) shows only in them.

NOTE: the deadline in force is the class with the most abandons (the clients whose timeouts
shape the retries the proxy sees), and it changes only when that estimate moves by more than
:data:`HYSTERESIS` (or the class in force changes), so the proxy's uses of it do not flap
between neighbouring estimates. Pure and clock-free: ages are given, nothing is read. Finding
the classes costs about 2 ms at 512 ages, once per new abandon at most (the proxy asks every
second and at each scrape).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from foundation import metricnames as mn

#: Abandon ages kept (the most recent): the learner's memory, and how far back it looks.
MAX_AGES = 512
#: Ages the learner needs before it names any deadline.
MIN_ABANDONS = 10
#: A cluster holds at least this many ages, and at least :data:`MIN_SHARE` of those kept.
MIN_CLUSTER = 5
MIN_SHARE = 0.1
#: Half-width of a cluster's window in log space: ±5 % of its age.
WINDOW = math.log(1.05)
#: A cluster is this many times denser than its flanks (from 1 to 4 windows away on each side).
SHARPNESS = 3.0
#: Client classes told apart at most (one per value of the ``class`` label).
MAX_CLASSES = len(mn.DEADLINE_CLASSES)
#: The deadline in force follows a new estimate only when it moves by more than this share.
HYSTERESIS = 0.05
# Ages outside these bounds are not a client's deadline on an attempt (and not finite ones).
_MIN_AGE_S = 1e-3
_MAX_AGE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class LearnedDeadline:
    """One client class's deadline: its cluster's median age, and the abandons it rests on (or,
    learned from declared timeouts alone, none, and the declarations it rests on)."""

    deadline_s: float
    abandons: int
    declared: int = 0


class DeadlineLearner:
    """Learns the clients' deadlines from abandon ages (``observe``), and until they name one from
    declared timeouts (``declare``); ``classes`` names them, ``in_force`` the one the proxy uses
    where none is stated."""

    def __init__(self, max_ages: int = MAX_AGES) -> None:
        if max_ages < MIN_ABANDONS:
            raise ValueError(f"max_ages must be at least {MIN_ABANDONS}, got {max_ages}")
        self._ages: deque[float] = deque(maxlen=max_ages)
        self._declared: deque[float] = deque(maxlen=max_ages)
        self.observed = 0  # abandons observed in all, kept or not
        self.declarations = 0  # declared timeouts observed in all, kept or not
        self._classes: tuple[LearnedDeadline, ...] = ()
        self._classes_at = 0  # ``observed`` when ``_classes`` was computed
        self._declared_classes: tuple[LearnedDeadline, ...] = ()
        self._declared_at = 0  # ``declarations`` when ``_declared_classes`` was computed
        self._in_force: float | None = None

    def observe(self, age_s: float) -> None:
        """An attempt was abandoned by its client ``age_s`` seconds after it arrived."""
        if _MIN_AGE_S <= age_s <= _MAX_AGE_S:  # NaN fails both
            self._ages.append(age_s)
            self.observed += 1

    def declare(self, timeout_s: float) -> None:
        """An attempt's client declared it would give up after ``timeout_s`` seconds without an
        answer (the ``x-stainless-read-timeout`` header)."""
        if _MIN_AGE_S <= timeout_s <= _MAX_AGE_S:  # NaN fails both
            self._declared.append(timeout_s)
            self.declarations += 1

    def classes(self) -> tuple[LearnedDeadline, ...]:
        """The client classes found, most abandons first (at most :data:`MAX_CLASSES`); while
        the abandons show none (fewer than :data:`MIN_ABANDONS` kept, or no sharp mode), those of
        the declared timeouts, most declarations first; else empty."""
        if self._classes_at != self.observed:
            self._classes = find_classes(self._ages)
            self._classes_at = self.observed
        if self._classes:
            return self._classes
        if self._declared_at != self.declarations:
            self._declared_classes = tuple(
                LearnedDeadline(d.deadline_s, 0, d.abandons) for d in find_classes(self._declared)
            )
            self._declared_at = self.declarations
        return self._declared_classes

    def in_force(self) -> LearnedDeadline | None:
        """The class whose deadline is in force (the first of :meth:`classes`), its deadline held
        within :data:`HYSTERESIS` of the last one in force; None while none is learned."""
        found = self.classes()
        if not found:
            return None
        top = found[0]
        held = self._in_force
        if held is None or abs(top.deadline_s - held) > HYSTERESIS * held:
            self._in_force = held = top.deadline_s
        return LearnedDeadline(held, top.abandons, top.declared)


def find_classes(ages: Iterable[float]) -> tuple[LearnedDeadline, ...]:
    """The sharp modes of ``ages`` (an iterable of positive seconds), most abandons first; each
    mode's deadline is its members' median age, in log space (an even count's two middle ages:
    their geometric mean), an age itself where the count is odd."""
    ordered = sorted(ages)
    logs = [math.log(a) for a in ordered]
    n = len(logs)
    if n < MIN_ABANDONS:
        return ()
    need = max(MIN_CLUSTER, math.ceil(MIN_SHARE * n))

    def count(lo: float, hi: float) -> int:
        return bisect.bisect_right(logs, hi) - bisect.bisect_left(logs, lo)

    # Each age's window count, densest first: a candidate centre for a cluster.
    windows = sorted(((count(x - WINDOW, x + WINDOW), x) for x in logs), key=lambda c: (-c[0], c[1]))
    centres: list[float] = []
    tried: list[float] = []  # where a window was tried: those near one add nothing (and cost)
    found: list[LearnedDeadline] = []
    for held, x in windows:
        if held < need or len(found) == MAX_CLASSES:
            break
        if any(abs(x - c) <= 4 * WINDOW for c in centres) or any(abs(x - t) <= WINDOW for t in tried):
            continue  # a shoulder of a cluster already found, or a window already tried
        centre = _recentre(logs, x)
        tried += (x, centre)
        peak = count(centre - WINDOW, centre + WINDOW)
        flanks = count(centre - 4 * WINDOW, centre + 4 * WINDOW) - peak
        if peak < need or peak < SHARPNESS * flanks / 3:  # flanks span 3 windows' width
            continue
        lo = bisect.bisect_left(logs, centre - 2 * WINDOW)
        members = bisect.bisect_right(logs, centre + 2 * WINDOW) - lo
        mid = lo + members // 2
        median = ordered[mid] if members % 2 else math.sqrt(ordered[mid - 1] * ordered[mid])
        centres.append(centre)
        found.append(LearnedDeadline(median, members))
    found.sort(key=lambda d: (-d.abandons, d.deadline_s))
    return tuple(found)


def _recentre(logs: list[float], x: float) -> float:
    """Move a window's centre to the median of the ages it holds, a few times (a mean shift with
    a median: it settles on the mode's middle, not on the age it started from)."""
    for _ in range(4):
        held = logs[bisect.bisect_left(logs, x - WINDOW) : bisect.bisect_right(logs, x + WINDOW)]
        x = statistics.median(held)
    return x
