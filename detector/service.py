"""The running detector: source -> signals -> rules -> episodes (SQL) -> notifications.

:class:`Detector.tick` is one evaluation (the scheduler calls it every interval; tests call it
directly with their own ``now``). It keeps a bounded in-memory history of every engine's
signals for the API and the dashboard, and its own Prometheus metrics in a private registry.
A transition the database refuses waits in :class:`~detector.pending.PendingWrites` and is
written, in order, once the database takes writes again; its notifications follow it.

The database work of an evaluation (the writer lease's check, the writes of its transitions) runs
on a worker thread of its own, one piece at a time, and the evaluation waits for it at most
:data:`DB_WAIT_S`: a database that stops answering (a network partition) holds up no evaluation
past that, nor the API. The stuck work ends within the connections' own bounds
(:func:`detector.store.pg_connection_parameters`); meanwhile the evaluations' transitions wait,
and the next evaluation's database work takes them.

Only the detector that holds its database's writer lease (``detector.lease``) writes transitions
and notifies; another one on the same database evaluates and serves its API, and takes over when
the lease comes free: it first brings the stored episodes in line with its own alerts
(:meth:`Detector._take_over`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from apscheduler.schedulers.background import BackgroundScheduler
from prometheus_client import CollectorRegistry, Counter, Gauge

from detector.capacity import CAPACITY_SOURCES
from detector.episodes import DEFAULT_RETENTION_DAYS
from detector.evaluator import Evaluator, Transition
from detector.lease import LeaseState, WriterLease, lease_for
from detector.notify import AlertmanagerNotifier, Dispatcher, Notifier
from detector.pending import DEFAULT_MAX_PENDING, PendingWrites
from detector.runbook import DEFAULT_PATTERN, runbook_url
from detector.signals import MAX_INSTANCES, SIGNALS, EngineLabels, SignalConfig, SignalEngine, SignalFrame
from detector.sources import Source
from detector.store import EpisodeStore, store_error
from detector.thresholds import AlertRule, tier_rules
from foundation.timeseries import DuplicateSeries, TooManySeries

log = logging.getLogger("retrywatch.detector")

SIGNAL_NAMES: tuple[str, ...] = tuple(s.name for s in SIGNALS)
PRUNE_EVERY_S = 3_600.0  # how often the writer deletes the episodes past the retention
#: How long an evaluation waits for its database work (the lease's check, the writes) before it
#: goes on without it; the work goes on in the background (see the module's docstring).
DB_WAIT_S = 2.0
_SIGNAL_INDEX = {name: i for i, name in enumerate(SIGNAL_NAMES)}


class SignalHistory:
    """A ring buffer of signal values per engine: ``points`` evaluations, ``max_engines`` engines
    (e.g. 4320 points = 6 h at 5 s; about 1.2 MB per engine, taken when the engine is first seen).
    The detector keeps one for every engine it follows (its ``max_engines``). Engines are keyed by
    ``instance`` (vLLM's ``engine`` label is "0" on every vLLM); each keeps its latest labels. When
    it is full, a new engine takes the place of the one with the oldest newest point, if that one
    has left; else the new one is not kept (:meth:`add_evaluation` says which)."""

    def __init__(self, points: int = 4320, max_engines: int = MAX_INSTANCES) -> None:
        if points < 2:
            raise ValueError("signal history needs at least 2 points")
        self.points = points
        self.max_engines = max_engines
        self._labels: dict[str, EngineLabels] = {}
        self._data: dict[str, np.ndarray] = {}
        self._times: dict[str, np.ndarray] = {}
        self._next: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def add_evaluation(self, frames: Sequence[SignalFrame]) -> list[str]:
        """One evaluation's frames; returns the instances whose history is not kept (no room).
        Room for a new engine is made only from an engine this evaluation does not name and whose
        newest point is older than it."""
        named = {frame.labels.instance for frame in frames}
        with self._lock:
            return [frame.labels.instance for frame in frames if not self._add(frame, named)]

    def _add(self, frame: SignalFrame, named: set[str]) -> bool:
        key = frame.labels.instance
        if key not in self._data:
            if len(self._data) >= self.max_engines and not self._evict_stalest(frame.t, named):
                return False
            self._data[key] = np.full((self.points, len(SIGNAL_NAMES)), np.nan)
            self._times[key] = np.full(self.points, np.nan)
            self._next[key] = 0
            self._count[key] = 0
        self._labels[key] = frame.labels
        i = self._next[key]
        row = self._data[key][i]
        for name, value in frame.values.items():
            j = _SIGNAL_INDEX.get(name)
            if j is not None:
                row[j] = np.nan if value is None else value
        self._times[key][i] = frame.t
        self._next[key] = (i + 1) % self.points
        self._count[key] = min(self._count[key] + 1, self.points)
        return True

    def _evict_stalest(self, before: float, named: set[str]) -> bool:
        """Make room: drop the engine whose newest point is the oldest, if it is older than
        ``before`` and not ``named`` (one that left the fleet); False when there is none."""

        def newest(key: str) -> float:
            return float(self._times[key][(self._next[key] - 1) % self.points])

        stalest = min((key for key in self._data if key not in named), key=newest, default=None)
        if stalest is None or not newest(stalest) < before:
            return False
        for table in (self._labels, self._data, self._times, self._next, self._count):
            del table[stalest]
        return True

    def engines(self) -> list[EngineLabels]:
        """Every engine's latest labels (one per instance)."""
        with self._lock:
            return list(self._labels.values())

    def series(
        self, name: str, since: float | None = None, engine: str | None = None
    ) -> list[tuple[EngineLabels, np.ndarray]]:
        """``name``'s points per engine, oldest first, as rows of (time, value) with NaN where the
        value could not be computed; ``engine`` selects one engine by its key (``instance``)."""
        j = _SIGNAL_INDEX[name]
        out = []
        with self._lock:
            for key, data in self._data.items():
                if engine and key != engine:
                    continue
                n, nxt = self._count[key], self._next[key]
                order = np.arange(nxt - n, nxt) % self.points
                points = np.column_stack((self._times[key][order], data[order, j]))
                if since is not None:
                    points = points[points[:, 0] >= since]
                out.append((self._labels[key], points))
        return out


@dataclass
class SourceStatus:
    up: bool = False
    last_scrape_at: float | None = None
    last_error: str | None = None


class DetectorMetrics:
    """The detector's own metrics (``GET /metrics``), in a private registry."""

    def __init__(self, rules: Sequence[AlertRule]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.evaluations = Counter("retrywatch_detector_evaluations_total", "Evaluations run.", registry=r)
        self.source_errors = Counter(
            "retrywatch_detector_source_errors_total", "Fetches from the source that failed.", registry=r
        )
        self.scrapes_refused = Counter(
            "retrywatch_detector_scrapes_refused_total",
            "Targets' answers refused whole, by reason: series_limit (more series than"
            " --series-limit), duplicate_series (one series twice).",
            ["reason"],
            registry=r,
        )
        for reason in (TooManySeries.reason, DuplicateSeries.reason):
            self.scrapes_refused.labels(reason=reason)
        self.source_up = Gauge(
            "retrywatch_detector_source_up", "1 when the last fetch succeeded.", registry=r
        )
        self.engines = Gauge("retrywatch_detector_engines", "Engines followed.", registry=r)
        self.engines_left_out = Gauge(
            "retrywatch_detector_engines_left_out",
            "Engines the source named in the last fetch that are not followed (past --max-engines).",
            registry=r,
        )
        self.history_left_out = Gauge(
            "retrywatch_detector_history_engines_left_out",
            "Engines evaluated at the last evaluation whose signal history the API does not keep"
            " (no room in it).",
            registry=r,
        )
        self.eval_seconds = Gauge(
            "retrywatch_detector_evaluation_duration_seconds", "Duration of the last evaluation.", registry=r
        )
        self.firing = Gauge(
            "retrywatch_detector_alerts_firing", "Alerts firing, by alert.", ["alertname"], registry=r
        )
        for rule in rules:
            self.firing.labels(alertname=rule.name).set(0)
        self.transitions = Counter(
            "retrywatch_detector_transitions_total", "Alerts fired or resolved.", ["kind"], registry=r
        )
        for kind in ("firing", "resolved"):
            self.transitions.labels(kind=kind)
        self.notifications = Counter(
            "retrywatch_detector_notifications_total",
            "Notification deliveries by notifier and result.",
            ["notifier", "result"],
            registry=r,
        )
        self.store_write_failures = Counter(
            "retrywatch_detector_store_write_failures_total",
            "Episode writes the database refused (each is retried until it lands).",
            registry=r,
        )
        self.store_writes_pending = Gauge(
            "retrywatch_detector_store_writes_pending",
            "Alert transitions waiting for the database to take them.",
            registry=r,
        )
        self.store_writes_dropped = Counter(
            "retrywatch_detector_store_writes_dropped_total",
            "Alert transitions dropped: at the bound while the database refused writes,"
            " or refused for their values.",
            registry=r,
        )
        self.episodes_pruned = Counter(
            "retrywatch_detector_episodes_pruned_total",
            "Resolved episodes deleted, with their notification rows, past the retention.",
            registry=r,
        )
        self.capacity = Gauge(
            "retrywatch_detector_capacity_calls_per_second",
            "Ĉ in force per engine and tier, labelled with its source: stated, saturated (measured"
            " while vLLM's queue never emptied) or predicted (below saturation, detector.capacity).",
            ["instance", "tier", "source"],
            registry=r,
        )
        self.capacity_predicted = Gauge(
            "retrywatch_detector_capacity_predicted_calls_per_second",
            "Ĉ predicted below saturation from vLLM's own series, whichever Ĉ is in force.",
            ["instance"],
            registry=r,
        )
        self.writer = Gauge(
            "retrywatch_detector_writer",
            "1 while this detector holds its database's writer lease (it writes episodes and"
            " notifies); 0 while another detector does.",
            registry=r,
        )


class Detector:
    def __init__(
        self,
        source: Source,
        store: EpisodeStore,
        *,
        notifiers: Sequence[Notifier] = (),
        config: SignalConfig | None = None,
        rules: Sequence[AlertRule] = tier_rules("proxy"),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        history_points: int = 4320,
        alertmanager_refresh_s: float = 60.0,
        max_pending_writes: int = DEFAULT_MAX_PENDING,
        runbook_pattern: str = DEFAULT_PATTERN,
        max_engines: int = MAX_INSTANCES,
        lease: WriterLease | None = None,
        retention_days: float = DEFAULT_RETENTION_DAYS,
    ) -> None:
        self.source = source
        self.retention_s = retention_days * 86_400.0  # 0: every episode is kept
        self.runbook_pattern = runbook_pattern
        self.store = store
        self.rules = tuple(rules)
        self.clock = clock
        self.monotonic = monotonic
        self._last_tick_mono: float | None = None  # ``monotonic`` at the last clock reading
        self.signals = SignalEngine(config, max_instances=max_engines)
        self._left_out = 0  # engines left out at the last fetch (a warning on each change)
        self.evaluator = Evaluator(self.rules)
        self.history = SignalHistory(history_points, max_engines=max_engines)  # every engine followed
        self._history_left_out: list[str] = []
        self.metrics = DetectorMetrics(self.rules)
        self.status = SourceStatus()
        self._source_seen: bool | None = None  # the source's last state (None: not fetched yet)
        self.dispatcher = Dispatcher(
            store,
            notifiers,
            on_result=lambda n, res: self.metrics.notifications.labels(notifier=n, result=res).inc(),
        )
        self.pending = PendingWrites(
            store,
            self.dispatcher.names,
            max_pending=max_pending_writes,
            on_failure=self.metrics.store_write_failures.inc,
            on_drop=self.metrics.store_writes_dropped.inc,
        )
        # Evaluated, not yet taken by the database work (which checks the lease first).
        self._unsettled: list[Transition] = []
        self.metrics.store_writes_pending.set_function(lambda: float(self.writes_waiting()))
        self._alertmanagers = [n for n in notifiers if isinstance(n, AlertmanagerNotifier)]
        self._am_refresh_s = alertmanager_refresh_s
        self._am_last_refresh = 0.0
        self._lock = threading.Lock()  # the evaluation's state; never held across database work
        self._db_lock = threading.Lock()  # one piece of database work at a time
        # Held while transitions move from ``_unsettled`` to ``pending`` (taken inside ``_lock``,
        # never across database work): :meth:`writes_waiting` counts them in one place or the other.
        self._handover = threading.Lock()
        self._db_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrywatch-db")
        self._db_job: Future[None] | None = None
        self._db_late = False  # the last database work outlasted :data:`DB_WAIT_S` (one warning)
        self._scheduler: BackgroundScheduler | None = None
        self.lease = lease_for(store.engine) if lease is None else lease
        self.writer = False  # holds the writer lease (as of the last evaluation)
        # The lease was confirmed at the last check: a writer whose database did not answer for its
        # lease keeps its transitions waiting but writes none (another detector may hold it by now).
        self._confirmed = False
        # The stored episodes match the evaluator's alerts: restored from them just below, they do
        # until the lease is seen taken, or lost, and then taken by this detector again. Taken at
        # the first check, they match but for the episodes opened since the restore (by a writer
        # that stopped just then): those are re-armed then (:meth:`_rearm_open`).
        self._in_line = True
        self._first_hold = True
        self._restore()

    def _restore(self) -> None:
        """Re-arm alerts that were firing when the detector stopped, and queue unsent notifications."""
        for ep in self.store.firing():
            if any(r.name == ep.alertname for r in self.rules):
                self.evaluator.restore_firing(ep.alertname, ep.labels, ep.started_at, ep.value)

    def tick(self, now: float | None = None) -> list[Transition]:
        """One evaluation: fetch, compute, evaluate; then record and notify (the database work,
        waited for at most :data:`DB_WAIT_S`)."""
        start = time.perf_counter()
        with self._lock:
            now = self._read_clock() if now is None else now
            result = self.source.fetch(now)
            left_out = 0
            for snap in result.snapshots:  # several in a backfill: the last says who is left out
                left_out = self.signals.add(snap)
            left_out += sum(not self.signals.mark_down(instance, now) for instance in result.down)
            self._engines_left_out(left_out)
            for reason in result.refused:
                self.metrics.scrapes_refused.labels(reason=reason).inc()
            if result.error:
                self.metrics.source_errors.inc()
                self.status.last_error = result.error
                log.debug("source: %s", result.error)
            self._source_changed(not result.down and result.error is None, result.error, result.down)
            if result.snapshots:
                self.status.last_scrape_at = max(s.t for s in result.snapshots)
            gone = self.signals.forget_departed(now)
            if gone:
                log.info("%d engines the source no longer names are forgotten (their alerts resolve): %s",
                         len(gone), ", ".join(gone[:10]) + (", ..." if len(gone) > 10 else ""))  # fmt: skip
            frames = self.signals.compute(now)
            self._history_kept(self.history.add_evaluation(frames))
            transitions = self.evaluator.evaluate(now, frames)
            for tr in transitions:
                self.metrics.transitions.labels(kind=tr.kind).inc()
            self._unsettled.extend(transitions)
            self.metrics.evaluations.inc()
            self.metrics.source_up.set(1.0 if self.status.up else 0.0)
            self.metrics.engines.set(len(frames))
            self._publish_capacity(frames)
            counts = {r.name: 0 for r in self.rules}
            for alert in self.evaluator.firing():
                counts[alert.alertname] += 1
            for rule_name, n in counts.items():
                self.metrics.firing.labels(alertname=rule_name).set(n)
        self._sync_database(now)
        self.metrics.eval_seconds.set(time.perf_counter() - start)
        return transitions

    def _publish_capacity(self, frames: Sequence[SignalFrame]) -> None:
        """Ĉ in force per engine and tier with its source, and the prediction (this evaluation's
        engines only: one label set each, so an engine that left takes its series with it)."""
        in_force, predicted = self.metrics.capacity, self.metrics.capacity_predicted
        in_force.clear()
        predicted.clear()
        for frame in frames:
            instance, v = frame.labels.instance, frame.values
            for tier, value, source in (
                ("proxy", v.get("capacity"), v.get("capacity_source")),
                ("vllm", v.get("vllm_capacity"), v.get("vllm_capacity_source")),
            ):
                if value is not None and source is not None:
                    in_force.labels(instance=instance, tier=tier, source=CAPACITY_SOURCES[int(source)]).set(
                        value
                    )
            if v.get("capacity_predicted") is not None:
                predicted.labels(instance=instance).set(v["capacity_predicted"])  # type: ignore[arg-type]

    def _sync_database(self, now: float) -> None:
        """Start the database work for the evaluation at ``now`` and wait for it at most
        :data:`DB_WAIT_S`; while earlier work is still stuck, start none and wait for none (the
        transitions wait for the next evaluation's work)."""
        job = self._db_job
        if job is not None and not job.done():
            return
        job = self._db_job = self._db_worker.submit(self._database_work, now)
        try:
            job.result(timeout=DB_WAIT_S)
        except TimeoutError:
            if not self._db_late:
                log.warning("the database (%s) has not answered in %.0f s: evaluation goes on; alert"
                            " transitions wait, unwritten and unnotified, until it does",
                            self.store.display_url, DB_WAIT_S)  # fmt: skip
            self._db_late = True
            return
        if self._db_late:
            log.warning("the database (%s) answers in time again", self.store.display_url)
            self._db_late = False

    def _database_work(self, now: float) -> None:
        """Check the lease; as the writer, queue the transitions evaluated since the last check,
        write what waits, and notify what landed (on the database worker's thread)."""
        try:
            with self._db_lock:
                self._settle(self._hold_lease())
                if self._may_write():
                    self._write_pending()
                    if not self._in_line:
                        self._take_over(now)
                    self._refresh_alertmanagers(now)
        except Exception:  # keep the worker alive; the next evaluation tries again
            log.exception("the evaluation's database work failed")

    def _read_clock(self) -> float:
        """The clock's time for this evaluation. When the wall clock went back past the last
        evaluation (an NTP step, a VM restored), every time held in memory is moved back by the
        step (measured against the monotonic clock), so evaluation goes on: windows, ``for`` and
        ``keep_firing_for`` keep their lengths, and no alert fires, resolves or goes silent for
        it (the evaluator refuses a time before its last one)."""
        now, mono = self.clock(), self.monotonic()
        last, last_mono = self.evaluator.last_eval, self._last_tick_mono
        self._last_tick_mono = mono
        if last is not None and last_mono is not None and now < last:
            step = now - (last + max(0.0, mono - last_mono))  # < 0: how far the clock went back
            self.signals.shift_time(step)
            self.evaluator.shift_time(step)
            self._am_last_refresh += step
            log.warning("the clock went back %.1f s; the detector's times are moved back with it", -step)
        return now

    def _hold_lease(self) -> bool:
        """Whether this detector writes: take or confirm the writer lease, and say when that
        changes. While the database does not answer, a writer stays one (its transitions wait
        for the database) but writes nothing until the lease is confirmed (:meth:`_may_write`):
        its lease's session may be gone, and another detector may hold the lease by now; a
        detector that finds the lease taken drops what waits (the holder writes its own)."""
        try:
            state = self.lease.hold()
        except Exception as exc:  # a lease that fails (a broken lock file) writes nothing
            log.error("the writer lease (%s) failed: %s", self.lease.description, exc)
            state = LeaseState.TAKEN
        was, first = self.writer, self._first_hold
        self._first_hold = False
        confirmed, self._confirmed = self._confirmed, state in (LeaseState.ACQUIRED, LeaseState.HELD)
        if state is LeaseState.UNREACHABLE and was and confirmed:
            log.warning("the writer lease (%s) cannot be confirmed: the database does not answer;"
                        " transitions wait until it is", self.lease.description)  # fmt: skip
        if state is LeaseState.ACQUIRED:
            self.writer = True
            if not first:
                self._in_line = False  # another detector may have written meanwhile
            elif self._in_line:
                self._rearm_open()
        elif state is LeaseState.TAKEN:
            self.writer = False
            dropped = self.pending.clear()
            if was or first or dropped:
                log.warning(
                    "another detector holds the writer lease (%s) of %s: this one evaluates but writes"
                    " no episode and sends no notification until it comes free%s",
                    self.lease.description, self.store.display_url,
                    f"; {dropped} transitions that waited are dropped" if dropped else "",
                )  # fmt: skip
        if self.writer and not was:
            log.info("this detector writes the episodes of %s and notifies (%s)",
                     self.store.display_url, self.lease.description)  # fmt: skip
        self.metrics.writer.set(1.0 if self.writer else 0.0)
        return self.writer

    def _may_write(self) -> bool:
        """Whether this detector writes now: the writer, with its lease confirmed at the last check."""
        return self.writer and self._confirmed

    def _take_over(self, now: float) -> None:
        """Once the lease is taken after another detector held it (one that stopped or died), or
        taken again after it was lost, bring the stored episodes in line with this detector's
        alerts: re-arm each open episode it does not have firing (it resolves through the usual
        hysteresis, and notifies then), and write a firing at ``now`` (and notify it) for each
        alert firing here that has no open episode. (At start the alerts come from the store.)"""
        with self._lock:
            firing = {(a.alertname, a.labels.instance): a for a in self.evaluator.firing()}
        stored = self._rearm_open()
        if stored is None:  # the database refuses reads: tried again next evaluation
            return
        with self._lock:
            missing = [
                self.evaluator.transition("firing", a, now) for key, a in firing.items() if key not in stored
            ]
        if missing:
            log.warning("%d alerts firing here had no open episode when this detector took the writer"
                        " lease: written now", len(missing))  # fmt: skip
            self.pending.add(missing)
            self._write_pending()
        self._in_line = True

    def _rearm_open(self) -> set[tuple[str, str]] | None:
        """Re-arm each open episode this detector does not have firing (it resolves through the
        usual hysteresis, and notifies then); returns the open episodes' (alertname, instance),
        None when the database refuses the read. Also on taking the lease at the first check: the
        alerts came from the store when the detector was made, and the writer before it (one
        that stopped just then) may have opened an episode since, which would stay open."""
        try:
            open_episodes = self.store.firing()
        except Exception as exc:
            log.warning("reading the open episodes on taking the writer lease failed: %s", store_error(exc))
            return None
        known = {r.name for r in self.rules}
        with self._lock:
            # Not re-armed: an alert firing here, and one whose transition waits unwritten (it
            # resolved here, maybe while the store was read: its resolution closes the episode).
            skip = {(a.alertname, a.labels.instance) for a in self.evaluator.firing()}
            skip.update(
                (tr.alertname, tr.labels.instance) for tr in (*self._unsettled, *self.pending.waiting())
            )
            for ep in open_episodes:
                if ep.alertname in known and (ep.alertname, ep.labels.instance) not in skip:
                    self.evaluator.restore_firing(ep.alertname, ep.labels, ep.started_at, ep.value)
        return {(ep.alertname, ep.labels.instance) for ep in open_episodes}

    def _engines_left_out(self, n: int) -> None:
        """Set the gauge; warn when the number of engines left out changes."""
        self.metrics.engines_left_out.set(n)
        if n != self._left_out:
            if n:
                log.warning(
                    "following %d engines, the most there may be: %d more the source names are not"
                    " watched (raise --max-engines)", self.signals.max_instances, n,
                )  # fmt: skip
            else:
                log.warning("every engine the source names is followed again")
            self._left_out = n

    def _history_kept(self, left_out: list[str]) -> None:
        """Set the gauge; warn when the engines whose history is not kept change."""
        self.metrics.history_left_out.set(len(left_out))
        if left_out != self._history_left_out:
            if left_out:
                log.warning("the signal history (/signals) keeps %d engines, all live: %d evaluated are"
                            " not kept: %s", self.history.max_engines, len(left_out),
                            ", ".join(left_out[:10]) + (", ..." if len(left_out) > 10 else ""))  # fmt: skip
            else:
                log.warning("the signal history keeps every engine evaluated again")
            self._history_left_out = left_out

    def _source_changed(self, up: bool, error: str | None, down: Sequence[str]) -> None:
        """Record the source's state; one warning per change (down, back up), not per failure,
        and none for a first fetch that works."""
        before, self.status.up = self._source_seen, up
        self._source_seen = up
        if up == before:
            return
        if not up:
            reason = error or f"no answer from {', '.join(down)}"
            log.warning("source %s is down: %s", self.source.name, reason)
        elif before is not None:
            log.warning("source %s is back up", self.source.name)

    def _write_pending(self) -> None:
        """Write the waiting transitions (in order, until one is refused) and notify those that
        landed: their notification rows were written with them."""
        for tr, episode in self.pending.flush():
            if episode is not None:
                for notifier in self.dispatcher.names:
                    self.dispatcher.submit(episode, notifier, tr.kind)

    def writes_waiting(self) -> int:
        """Transitions not written yet: those waiting for the database to take them, and those
        evaluated since the database work last checked the lease (read from any thread)."""
        with self._handover:
            return len(self.pending) + len(self._unsettled)

    def _settle(self, writer: bool) -> None:
        """Hand the transitions evaluated since the last lease check to the waiting writes, as the
        writer (else they are dropped: the holder writes its own); in one step for
        :meth:`writes_waiting`, which counts them in one place or the other."""
        with self._lock, self._handover:
            settled, self._unsettled = self._unsettled, []
            if writer:
                self.pending.add(settled)

    def write_pending(self) -> int:
        """Retry the waiting transitions now (a replay's scheduler and :meth:`stop` call it; an
        evaluation does it by itself), after any database work in progress; returns how many
        still wait. Only the writer writes (as of its last lease check)."""
        with self._db_lock:
            self._settle(self.writer)
            if self._may_write():
                self._write_pending()
        return len(self.pending)

    def _refresh_alertmanagers(self, now: float) -> None:
        if not self._alertmanagers or now - self._am_last_refresh < self._am_refresh_s:
            return
        self._am_last_refresh = now
        try:
            firing = [ep for ep in self.store.firing() if ep.id is not None]
        except Exception as exc:  # a database that is down must not stop evaluation
            log.warning("alertmanager refresh: reading the firing episodes failed: %s", store_error(exc))
            return
        self.dispatcher.refresh(firing)  # posted by each Alertmanager's worker, not in the evaluation

    def runbook_url(self, alertname: str) -> str:
        """The link to ``alertname``'s runbook section (``detector.runbook``)."""
        return runbook_url(self.runbook_pattern, alertname)

    def firing_alerts(self) -> list[dict[str, object]]:
        return [
            {**a.as_dict(), "runbook_url": self.runbook_url(a.rule.name)} for a in self.evaluator.firing()
        ]

    def start(self, interval_s: float = 5.0, *, evaluate: bool = True) -> None:
        """Run :meth:`tick` every ``interval_s`` on APScheduler's background scheduler, with the
        notifications and the retries of waiting writes; ``evaluate=False`` (a replay that ticks
        by itself) runs only those."""
        if interval_s <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval_s}")
        self.dispatcher.start()
        with self._db_lock:
            self._hold_lease()
        self._safe_requeue()
        sched = BackgroundScheduler(timezone="UTC")
        if evaluate:
            self._safe_tick()
            sched.add_job(self._safe_tick, "interval", seconds=interval_s, max_instances=1, coalesce=True)
        else:
            sched.add_job(self.write_pending, "interval", seconds=interval_s, max_instances=1, coalesce=True)
        sched.add_job(self._safe_requeue, "interval", seconds=max(30.0, interval_s * 6),
                      max_instances=1, coalesce=True)  # fmt: skip
        if self.retention_s > 0:
            self._safe_prune()
            sched.add_job(self._safe_prune, "interval", seconds=PRUNE_EVERY_S, max_instances=1, coalesce=True)
        sched.start()
        self._scheduler = sched

    def _safe_requeue(self) -> None:
        if not self._may_write():  # the writer sends what is unsent
            return
        try:
            self.dispatcher.requeue_unsent()
        except Exception as exc:  # the database is down: the next round picks them up
            log.warning("reading unsent notifications failed: %s", store_error(exc))

    def prune(self, now: float | None = None) -> int:
        """Delete the episodes resolved more than the retention before ``now`` (the writer does,
        at start and every :data:`PRUNE_EVERY_S`); returns how many."""
        if self.retention_s <= 0 or not self._may_write():
            return 0
        now = self.clock() if now is None else now
        deleted = self.store.prune(now - self.retention_s)
        if deleted:
            self.metrics.episodes_pruned.inc(deleted)
            log.info("deleted %d episodes resolved more than %g days ago", deleted, self.retention_s / 86_400)
        return deleted

    def _safe_prune(self) -> None:
        try:
            self.prune()
        except Exception as exc:  # the database is down: the next round deletes them
            log.warning("deleting episodes past the retention failed: %s", store_error(exc))

    def _safe_tick(self) -> None:
        try:
            self.tick()
        except Exception:  # keep the schedule alive; the error is logged and counted
            log.exception("evaluation failed")
            self.metrics.source_errors.inc()

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        if self.write_pending():
            lost = "; ".join(f"{t.alertname} on {t.labels.instance} {t.kind} at {t.at:.0f}"
                             for t in self.pending.waiting())  # fmt: skip
            log.error("stopping with %d transitions the store never took (they are lost; an alert "
                      "still true fires again after a restart): %s", len(self.pending), lost)  # fmt: skip
        self._db_worker.shutdown(wait=True)
        self.dispatcher.close()
        self.lease.release()
        self.source.close()
