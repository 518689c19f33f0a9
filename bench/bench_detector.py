"""Benchmark the detector: replay speed of ``replay_run`` and the cost of one live evaluation.

Run: ``python bench/bench_detector.py [--series PATH/metrics.jsonl] [--repeat 5]``. Without a
series it builds a synthetic 24-minute run (a pulse that tips into the retry loop). Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from detector.replay import replay_run
from detector.service import Detector
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, write_series


def synthetic_series(path: Path, capacity: float = 2.78, step: float = 5.0, end: float = 1435.0) -> None:
    """Counters of a run that tips: creation at 2.7 Ĉ in the pulse, 2.4 Ĉ of orphaned-loop after."""
    snaps = []
    created = completed = orphaned = first = missed = 0.0
    waiting = 0.0
    t = 0.0
    while t <= end:
        rate_first = capacity * (2.7 if 120 <= t < 227 else 0.6)
        loop = t >= 300
        rate_created = rate_first * (4.0 if loop else 1.0)
        first += rate_first * step
        created += rate_created * step
        if t >= 300 + 120:  # calls of the loop miss their deadline, judged one deadline later
            missed += rate_first * step
        if loop:
            orphaned += capacity * step
        else:
            completed += min(capacity, rate_created) * step
        waiting = max(0.0, waiting + (rate_created - capacity) * step)
        vl = {"engine": "0", "model_name": "bench"}
        snaps.append(Snapshot(t=t, samples=[
            (mn.ATTEMPTS, {"kind": "first"}, first), (mn.ATTEMPTS, {"kind": "retry"}, created - first),
            (mn.EXECUTIONS_CREATED, {}, created),
            (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, completed),
            (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, orphaned),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, completed),
            (mn.CALLS_MISSED_DEADLINE, {}, missed),
            (mn.EXECUTIONS_QUEUED, {}, 0.0), (mn.CAPACITY, {}, capacity), (mn.CLIENT_DEADLINE, {}, 120.0),
            (mn.VLLM_NUM_WAITING, vl, waiting), (mn.VLLM_NUM_RUNNING, vl, 96.0),
        ]))  # fmt: skip
        t += step
    write_series(path, snaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--series", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        series = args.series
        if series is None:
            series = Path(tmp) / "metrics.jsonl"
            synthetic_series(series)
        n = sum(1 for line in series.open() if line.strip())
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            episodes = replay_run(series)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"replay_run: {n} snapshots in {med * 1000:.1f} ms (median of {args.repeat}), "
              f"{n / med:,.0f} snapshots/s, {len(episodes)} episodes")  # fmt: skip
        source = ReplaySource(series, offset=time.time())
        store = EpisodeStore(f"sqlite:///{Path(tmp) / 'bench.db'}")
        det = Detector(source, store)
        tick_times = []
        for snap in list(source.snapshots):
            t0 = time.perf_counter()
            det.tick(snap.t)
            tick_times.append(time.perf_counter() - t0)
        tick_times.sort()
        p99 = tick_times[int(0.99 * (len(tick_times) - 1))]
        print(f"Detector.tick (fetch + signals + rules + SQLite episodes + history): "
              f"median {statistics.median(tick_times) * 1000:.2f} ms, "
              f"p99 {p99 * 1000:.2f} ms over {len(tick_times)} ticks")  # fmt: skip
        store.close()


if __name__ == "__main__":
    main()
