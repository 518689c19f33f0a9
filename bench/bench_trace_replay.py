"""How fast the simulator replays a request trace, and the peak memory of a million-call replay.

Two figures, each from ``retrywatch reproduce run --trace FILE --load 1`` run as a child process
(the whole command: both passes over the file, Ĉ, the simulated run, its ground truth and its
files), with Ĉ given (``--backend-option capacity=``) so that calibration is not timed:

* **speed**: an hour of trace, the Azure code slice shipped (30 minutes) twice over, written to a
  temporary file in the retrywatch layout: simulated seconds of the run per wall second of the
  simulation (the run's own ``wall_s``), and calls per wall second; the same per CPU second of
  the simulation (its ``cpu_s``: on a shared machine the wall time also counts the time other
  processes had the core, the CPU time far less so); beside it, measured in turn
  with it (``--repeats`` times each, medians), two replays of the hour at once as two child
  processes (as ``--jobs 2`` runs them): their simulated seconds together per wall second of
  the longer simulation. Target: ≥ 1,000× real time with two jobs.
  With ``--baseline DIR`` (a checkout of the code before a change, e.g. a ``git worktree``),
  each repeat also replays the hour with that code, in turn with the current code's replay,
  so that both see the same machine: the same line for it, then the ratios of the medians.
* **memory**: ``--calls`` calls (1,000,000 by default) synthesized on the fly in the retrywatch
  layout, row by row (the Azure slice's lengths and gaps, repeated): the child's peak resident
  memory (``ru_maxrss``). Target: ≤ 2 GiB, the trace streamed.

    .venv/bin/python bench/bench_trace_replay.py [--calls 1000000] [--skip-memory] [--capacity C]
        [--repeats 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from reproduce.workloads.traces import read_trace

SLICE = (
    Path(__file__).resolve().parent.parent
    / "reproduce"
    / "workloads"
    / "traces"
    / "data"
    / "azure_code_2023_30min.csv.gz"
)
MODEL = "qwen2.5-7b-h100"
#: Ĉ of the slice's token mix on the simulator (``reproduce.workloads.tracecapacity``, seed 0), measured once.
DEFAULT_CAPACITY = 21.62


def slice_rows() -> list[tuple[float, int, int]]:
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in read_trace(SLICE)]


def repeated(rows: list[tuple[float, int, int]], n: int) -> Iterator[tuple[float, int, int]]:
    """``n`` rows: the slice's rows again and again, each copy after the one before."""
    span = rows[-1][0] + (rows[-1][0] - rows[0][0]) / (len(rows) - 1)
    i = 0
    while i < n:
        copy, j = divmod(i, len(rows))
        t, prompt, output = rows[j]
        yield copy * span + t, prompt, output
        i += 1


def write(path: Path, rows: Iterator[tuple[float, int, int]]) -> int:
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        fh.write("arrival_s,prompt_tokens,output_tokens\n")
        for t, prompt, output in rows:
            fh.write(f"{t:.6f},{prompt},{output}\n")
            n += 1
    return n


def start(trace: Path, out: Path, capacity: float, code: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the replay as a child process (with the code checked out at ``code``, if given)."""
    env = {**os.environ, "RETRYWATCH_CACHE_DIR": str(out / "cache")}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    return subprocess.Popen(
        [
            sys.executable, "-m", "retrywatch", "reproduce", "run", "--trace", str(trace), "--load", "1",
            "--model", MODEL, "--runs", "1", "--seed", "1", "--out", str(out), "--no-progress",
            "--backend-option", f"capacity={capacity}",
        ],
        env=env,
        cwd=code,  # ``python -m`` puts it first on the path
        stdout=subprocess.DEVNULL,  # its one line naming its summary
    )  # fmt: skip


def finish(
    child: subprocess.Popen[bytes], out: Path, started: float
) -> tuple[dict[str, object], float, float]:
    """Wait for a replay; its summary entry, wall time and peak RSS (MiB)."""
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not any other's
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"the replay failed with exit status {child.returncode}")
    peak = usage.ru_maxrss / 1024.0
    entry = json.loads((out / "summary.json").read_text())["runs"][0]
    return entry, wall, peak


def replay(
    trace: Path, out: Path, capacity: float, code: Path | None = None
) -> tuple[dict[str, object], float, float]:
    """Run the replay as a child process; its summary entry, wall time and peak RSS (MiB)."""
    started = time.perf_counter()
    return finish(start(trace, out, capacity, code), out, started)


def simulated(entry: dict[str, object]) -> tuple[float, float]:
    """A run's simulated seconds and its simulation's wall seconds."""
    return float(entry["duration_s"]), float(entry["wall_s"])  # type: ignore[arg-type]


def cpu(entry: dict[str, object]) -> float:
    """A run's simulation's CPU seconds."""
    return float(entry["cpu_s"])  # type: ignore[arg-type]


def two_jobs(trace: Path, root: Path, capacity: float, code: Path | None = None) -> tuple[float, float]:
    """Two replays at once, as two child processes: their simulated seconds together per wall
    second of the longer simulation, and the wall time of the two commands."""
    outs = [root / "job-a", root / "job-b"]
    started = time.perf_counter()
    children = [start(trace, out, capacity, code) for out in outs]
    entries = [finish(child, out, started)[0] for child, out in zip(children, outs, strict=True)]
    wall = time.perf_counter() - started
    runs = [simulated(e) for e in entries]
    return sum(s for s, _ in runs) / max(w for _, w in runs), wall


class Speed:
    """The speed figures of one code over the repeats."""

    def __init__(self, code: Path | None) -> None:
        self.code = code
        self.one: list[float] = []  # the simulation's wall seconds, one job
        self.one_cpu: list[float] = []  # its CPU seconds
        self.two: list[float] = []  # simulated seconds per wall second, two jobs
        self.sim_s = self.wall = self.peak = self.both_wall = 0.0

    def measure(self, hour: Path, root: Path, capacity: float) -> None:
        entry, self.wall, self.peak = replay(hour, root / "one", capacity, self.code)
        self.sim_s, sim_wall = simulated(entry)
        self.one.append(sim_wall)
        self.one_cpu.append(cpu(entry))
        rate, self.both_wall = two_jobs(hour, root / "two", capacity, self.code)
        self.two.append(rate)

    def line(self, n: int, capacity: float, repeats: int) -> str:
        sim_s, sim_wall, two = self.sim_s, statistics.median(self.one), statistics.median(self.two)
        sim_cpu = statistics.median(self.one_cpu)
        return (
            f"speed: an hour of trace ({n:,} calls) at --load 1, Ĉ = {capacity:g} calls/s, "
            f"medians of {repeats}: one job {sim_s:.0f} simulated s in {sim_wall:.2f} s of simulation = "
            f"{sim_s / sim_wall:,.0f}x real time, {n / sim_wall:,.0f} calls per wall s; "
            f"{sim_cpu:.2f} CPU s = {sim_s / sim_cpu:,.0f}x per CPU second (the whole command "
            f"{self.wall:.1f} s, peak RSS {self.peak:.0f} MiB); two jobs at once {two:,.0f}x real "
            f"time together (the two commands {self.both_wall:.1f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--capacity", type=float, default=DEFAULT_CAPACITY)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each speed figure (medians)")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout of the code before a change, measured in turn with this one"
    )
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "retrywatch" / "__main__.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a checkout of retrywatch")
    rows = slice_rows()
    with tempfile.TemporaryDirectory(prefix="bench-trace-replay-") as tmp:
        root = Path(tmp)
        hour = root / "hour.csv"
        n = write(hour, repeated(rows, 2 * len(rows)))
        now = Speed(None)
        before = Speed(args.baseline) if args.baseline is not None else None
        for r in range(args.repeats):  # in turn, so that both see the same machine
            now.measure(hour, root / f"speed-{r}", args.capacity)
            if before is not None:
                before.measure(hour, root / f"before-{r}", args.capacity)
        print(now.line(n, args.capacity, args.repeats))
        if before is not None:
            print(f"before ({args.baseline}): {before.line(n, args.capacity, args.repeats)}")
            one = statistics.median(before.one) / statistics.median(now.one)
            one_cpu = statistics.median(before.one_cpu) / statistics.median(now.one_cpu)
            two = statistics.median(now.two) / statistics.median(before.two)
            print(
                f"one job {one:.2f}x as fast as before ({one_cpu:.2f}x in CPU time), two jobs {two:.2f}x "
                "(ratios of the medians)"
            )
        if args.skip_memory:
            return
        big = root / "million.csv"
        n = write(big, repeated(rows, args.calls))
        size = big.stat().st_size / 2**20
        entry, wall, peak = replay(big, root / "memory", args.capacity)
        print(
            f"memory: {n:,} calls ({size:.0f} MiB file) at --load 1: peak RSS {peak:,.0f} MiB "
            f"({peak / 1024:.2f} GiB); {float(entry['duration_s']):,.0f} simulated s in "  # type: ignore[arg-type]
            f"{float(entry['wall_s']):.0f} s of simulation, the whole command {wall:.0f} s"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
