"""How long a ``retrywatch reproduce whatif --headroom`` search takes for three policies.

Runs the whole command as a child process (every point simulated, judged by the ground truth,
the detector's replay at the what-if's own load, whatif.json and the report written) with
``--jobs 2``, into a fresh DIR, and prints its wall time, each policy's headroom and the
precision reached, and how many points it ran. Target: under 10 minutes.

* the study's pulse (default), on the study's engine preset at the study's scale;
* ``--trace hour``: an hour of trace, the Azure code slice shipped (30 minutes) twice over (as
  ``bench_trace_replay.py`` builds it), with Ĉ given so that calibration is not timed; or
  ``--trace FILE`` for a trace of your own.

    .venv/bin/python bench/bench_whatif.py [--trace hour|FILE] [--policies none,budget,coalescing]
        [--precision 0.05] [--seeds 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trace_replay import DEFAULT_CAPACITY, repeated, slice_rows, write

MODEL = "qwen2.5-7b-h100"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=None, help="'hour' (the Azure slice twice over) or a trace file")
    parser.add_argument("--policies", default="none,budget,coalescing")
    parser.add_argument("--precision", default="0.05")
    parser.add_argument("--seeds", default="1")
    parser.add_argument("--seed", default="31")
    parser.add_argument("--jobs", default="2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-whatif-") as tmp:
        root = Path(tmp)
        workload: list[str] = []
        what = "the study's pulse"
        if args.trace == "hour":
            hour = root / "hour.csv"
            rows = slice_rows()
            n = write(hour, repeated(rows, 2 * len(rows)))
            workload = [
                "--trace",
                str(hour),
                "--load",
                "1",
                "--backend-option",
                f"capacity={DEFAULT_CAPACITY}",
            ]
            what = f"an hour of trace (the Azure code slice twice, {n:,} calls; Ĉ {DEFAULT_CAPACITY:g} given)"
        elif args.trace is not None:
            workload = ["--trace", args.trace]
            what = f"the trace {args.trace}"
        out = root / "out"
        command = [
            sys.executable, "-m", "retrywatch", "reproduce", "whatif", *workload, "--model", MODEL,
            "--policies", args.policies, "--headroom", "--precision", args.precision, "--seeds", args.seeds,
            "--seed", args.seed, "--jobs", args.jobs, "--out", str(out), "--no-progress",
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"whatif failed ({done.returncode}):\n{done.stderr[-2000:]}")
        body = json.loads((out / "whatif.json").read_text(encoding="utf-8"))
        points = len(json.loads((out / "points" / "summary.json").read_text(encoding="utf-8"))["runs"])
        print(
            f"{what}: --headroom for {args.policies} with --jobs {args.jobs}, --seeds {args.seeds}, "
            f"--precision {args.precision}: {wall:.1f} s wall, {points} points run"
        )
        for name, policy in body["policies"].items():
            head = policy["headroom"]
            print(
                f"  {name}: headroom {head['headroom_load']} ({head['says']}); precision reached "
                f"{head['precision_reached']}; {len(head['tried'])} loads tried"
            )


if __name__ == "__main__":
    main()
