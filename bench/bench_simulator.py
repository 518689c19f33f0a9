"""Speed of the simulator (targets: one paper run <= 1 s, the 137-run paper block <= 3 min with 2 jobs):
one full-length paper run, then ``--block paper``.

Targets: one 1,800-s paper run in <= 1 s of wall time, and the 137 runs of ``--block paper`` in
<= 3 min with 2 jobs. Prints simulated seconds per wall second (Vidur runs at roughly 20x
real time), and CPU seconds too, which stay meaningful on a shared, loaded machine, and the size
of each run's series file (``metrics.jsonl``, vLLM's histograms included). Run::

    .venv/bin/python bench/bench_simulator.py            # single runs only
    .venv/bin/python bench/bench_simulator.py --paper    # also the 137 paper runs, 2 jobs
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from reproduce.conditions import block, expand
from reproduce.registry import get_backend
from reproduce.runner import run_many
from reproduce.sim import SimSpec, simulate


def single_runs(repeat: int) -> None:
    cases = [
        ("qwen2.5-7b-h100", "diagnostic", "retries-on-cancel-off"),
        ("qwen2.5-7b-h100", "diagnostic", "retries-on-cancel-on"),
        ("qwen2.5-7b-h100", "diagnostic", "retries-off-cancel-off"),
        ("qwen2.5-7b-h100", "deferral", "deferred-cancellation"),
        ("qwen3-14b-h100", "diagnostic", "retries-on-cancel-off"),
    ]
    print(
        f"{'model':18} {'condition':26} {'sim s':>7} {'wall s':>7} {'cpu s':>7} {'sim s / wall s':>15}"
        f" {'calls':>6} {'attempts':>9} {'series KiB':>11}"
    )
    for model, block_slug, condition in cases:
        spec = SimSpec(model=model, condition=block(block_slug).condition(condition), seed=0)
        best = None
        for _ in range(repeat):
            result = simulate(spec)
            best = result if best is None or result.wall_s < best.wall_s else best
        assert best is not None
        attempts = sum(len(c.attempts) for c in best.calls)
        # the size of the run's metrics.jsonl (vLLM's histograms included: foundation.timeseries)
        series_kib = sum(len(s.to_json()) + 1 for s in best.snapshots) / 1024
        print(
            f"{model:18} {condition:26} {best.end_s:7.0f} {best.wall_s:7.3f} {best.cpu_s:7.3f} "
            f"{best.end_s / best.wall_s:15.0f} {len(best.calls):6d} {attempts:9d} {series_kib:11.0f}"
        )


def paper(jobs: int, out: Path | None) -> None:
    runs = expand("paper")
    with tempfile.TemporaryDirectory() as tmp:
        folder = out if out is not None else Path(tmp)
        started = time.perf_counter()
        entries = run_many(get_backend("sim"), runs, folder, jobs=jobs, progress=True)
        wall = time.perf_counter() - started
    simulated = sum(float(e["duration_s"]) for e in entries)
    cpu = sum(float(e["cpu_s"]) for e in entries)
    slowest = sorted(entries, key=lambda e: -float(e["cpu_s"]))[:5]
    for e in slowest:
        print(f"  slow: {e['slug']} {float(e['cpu_s']):.2f} CPU s, {float(e['duration_s']):.0f} simulated s")
    print(
        f"--block paper: {len(entries)} runs, {wall:.1f} s wall with {jobs} jobs, {cpu:.1f} CPU s in runs, "
        f"{simulated:.0f} simulated s, {simulated / wall:.0f} simulated s per wall s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paper", action="store_true", help="also run the 137 runs of --block paper")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="best of N for the single runs")
    parser.add_argument("--out", type=Path, default=None, help="keep the paper runs in this folder")
    args = parser.parse_args()
    single_runs(args.repeat)
    if args.paper:
        paper(args.jobs, args.out)


if __name__ == "__main__":
    main()
