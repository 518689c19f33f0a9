"""The detector's database work runs on a thread of its own, beside the evaluations: what an
evaluation decides while that work is in flight is neither lost nor undone by it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from detector.episodes import AlertEpisode
from detector.evaluator import Evaluator, Transition
from detector.lease import LeaseState
from detector.service import Detector
from detector.signals import EngineLabels, SignalFrame
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from detector.thresholds import AlertRule, Cmp
from foundation.timeseries import write_series
from tests.detector.conftest import ScriptedLease
from tests.detector.minisim import MiniSim

LOOP = "VLLMMetastableRetryLoop"
T0 = 1_800_000_000.0  # the replayed run is shifted to Unix time


class _GatedStore(EpisodeStore):
    """An episode store whose next read of the open episodes, once :meth:`hold_next_read` is
    called, waits until the test lets it go: a database that is slow to answer just then."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._gate: threading.Event | None = None
        self.reading = threading.Event()

    def hold_next_read(self) -> threading.Event:
        self._gate = threading.Event()
        return self._gate

    def firing(self) -> list[AlertEpisode]:
        gate, self._gate = self._gate, None
        if gate is not None:
            self.reading.set()
            assert gate.wait(60), "the test never let the read go"
        return super().firing()


def _loop_firing(det: Detector) -> bool:
    return any(a.alertname == LOOP for a in det.evaluator.firing())


def test_an_alert_that_resolves_while_a_take_over_reads_the_store_is_not_rearmed(tmp_path: Path) -> None:
    """A standby takes the lease; while it reads the stored episodes to re-arm the open ones, an
    evaluation resolves an alert whose episode is open there (its resolution not written yet).
    That alert is not re-armed: it stays resolved here, as in the store once its resolution lands,
    instead of firing on here with no open episode (a fire again would open none, tell nobody)."""
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = _GatedStore(f"sqlite:///{tmp_path / 'd.db'}")
    lease = ScriptedLease(LeaseState.TAKEN)
    source = ReplaySource(series, instance="proxy-a", offset=T0)
    det = Detector(source, store, lease=lease)
    times = iter(sorted({s.t for s in source.snapshots}))
    for t in times:  # a standby: it evaluates, the writer (another detector) writes
        det.tick(t)
        if _loop_firing(det):
            (alert,) = [a for a in det.evaluator.firing() if a.alertname == LOOP]
            store.record(det.evaluator.transition("firing", alert, t))  # the writer's episode
            break
    assert _loop_firing(det) and not det.writer
    lease.state = LeaseState.ACQUIRED  # the writer stopped: this detector takes over
    release = store.hold_next_read()
    taking_over = threading.Thread(target=det.tick, args=(next(times),), daemon=True)
    taking_over.start()
    assert store.reading.wait(60), "the take-over never read the open episodes"
    resolved: list[Transition] = []
    for t in times:  # evaluation goes on while the take-over waits for the database
        resolved = [tr for tr in det.tick(t) if tr.alertname == LOOP]
        if resolved:
            break
    assert [tr.kind for tr in resolved] == ["resolved"]
    release.set()
    taking_over.join(60)
    assert det.write_pending() == 0  # after the take-over: the resolution lands
    (loop,) = store.episodes(alertname=LOOP)
    assert loop.resolved_at == resolved[0].at
    assert not _loop_firing(det), "an alert resolved here and in the store fires on here"
    det.stop()
    store.close()


class _Refusing(EpisodeStore):
    """An episode store that refuses every write (a full disk): what is queued stays queued."""

    def record(self, transition: Transition, notifiers: Sequence[str] = ()) -> AlertEpisode | None:
        raise OperationalError("INSERT", None, Exception("could not extend file: No space left on device"))


def test_transitions_handed_to_the_database_work_are_counted_as_waiting_all_along(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``retrywatch_detector_store_writes_pending`` (``writes_waiting``), read on another thread
    (the API's), counts an evaluation's transitions while the database work moves them into the
    queue of waiting writes: a scrape just then reads no backlog dropping to nothing."""
    series = tmp_path / "metrics.jsonl"
    write_series(series, MiniSim(seed=3, cancellation=False).run())
    store = _Refusing(f"sqlite:///{tmp_path / 'd.db'}")
    det = Detector(ReplaySource(series, instance="proxy-a", offset=T0), store)
    seen: list[tuple[int, int]] = []  # (transitions waiting, writes_waiting() read meanwhile)
    readers: list[threading.Thread] = []
    queue = det.pending.add

    def add(transitions: Iterable[Transition]) -> None:
        """The database work moves a batch: a scrape reads the gauge on another thread just then
        (given a moment, unless the count waits for the move to end)."""
        batch = list(transitions)
        if batch:
            queued = len(det.pending) + len(batch)
            read = threading.Event()

            def scrape(queued: int = queued, read: threading.Event = read) -> None:
                seen.append((queued, det.writes_waiting()))
                read.set()

            reader = threading.Thread(target=scrape)
            readers.append(reader)
            reader.start()
            read.wait(1.0)
        queue(batch)

    monkeypatch.setattr(det.pending, "add", add)
    for t in sorted({s.t for s in det.source.snapshots}):  # type: ignore[attr-defined]
        if det.tick(t):
            break
    assert det.write_pending() > 0  # after the database work: the store refuses them
    for reader in readers:
        reader.join(60)
    assert seen and all(waiting >= queued for queued, waiting in seen), seen
    det.stop()
    store.close()


def test_the_firing_alerts_read_on_another_thread_while_an_evaluation_changes_them() -> None:
    """The API's threads read the firing alerts without the evaluation's lock (it is held across
    the source's fetch) while an evaluation adds and drops alerts: each read is whole, never an
    error. (Threads switch every microsecond here, so the reads meet the changes at once.)"""
    rule = AlertRule(
        name="TestHigh", severity="warning", summary="x is high.", description="{instance}: x={value}",
        condition=Cmp("x", ">=", 1.0), for_s=0.0, keep_firing_for_s=0.0, value_signal="x",
    )  # fmt: skip
    ev = Evaluator([rule])
    fleet = [SignalFrame(t=0.0, labels=EngineLabels("0", "m", f"p{i}"), values={"x": 1.0}) for i in range(50)]
    ev.evaluate(0.0, fleet)
    done = threading.Event()

    def evaluate() -> None:  # one engine in and out of the fleet, every evaluation
        t = 0.0
        while not done.is_set():
            t += 1.0
            extra = SignalFrame(t=t, labels=EngineLabels("0", "m", f"q{t % 2}"), values={"x": 1.0})
            ev.evaluate(t, [*fleet, extra])

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    evaluating = threading.Thread(target=evaluate)
    evaluating.start()
    try:
        reads = [len(ev.firing()) for _ in range(5000)]
    finally:
        done.set()
        evaluating.join(60)
        sys.setswitchinterval(switch)
    assert min(reads) >= len(fleet)
