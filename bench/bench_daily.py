"""How long the daily what-if takes: ``retrywatch reproduce plan-daily --once`` on a synthetic
recording of ``--hours`` (default 24), five policies, headroom to 0.05 Ĉ.

Writes the recording in the proxy's layout (``daily_growth.write_days``: a diurnal swing of
+-50 % and a burst, mean ``--mean-load`` x Ĉ), then runs the whole command as a child process on
the study's engine preset with Ĉ stated (the Azure slice's, as ``bench_whatif.py --trace hour``:
calibration is not timed) and prints its wall time, the points run and each policy's headroom.

    .venv/bin/python bench/bench_daily.py [--hours 24] [--mean-load 0.3] [--jobs 2]
        [--policies none,default,budget,coalescing,lookup-first] [--precision 0.05]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trace_replay import DEFAULT_CAPACITY, MODEL
from daily_growth import write_days


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--mean-load", type=float, default=0.3)
    parser.add_argument("--policies", default="none,default,budget,coalescing,lookup-first")
    parser.add_argument("--precision", default="0.05")
    parser.add_argument("--jobs", default="2")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-daily-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        write_days(root / "rec", [args.mean_load * DEFAULT_CAPACITY], args.hours * 3600, seed=3)
        written = time.perf_counter() - started
        command = [
            sys.executable, "-m", "retrywatch", "reproduce", "plan-daily", "--once", "--recording",
            str(root / "rec"), "--out", str(root / "state"), "--window-hours", f"{args.hours:g}",
            "--model", MODEL, "--capacity", f"{DEFAULT_CAPACITY}", "--backend-option",
            f"capacity={DEFAULT_CAPACITY}", "--policies", args.policies, "--precision", args.precision,
            "--jobs", args.jobs,
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"plan-daily failed ({done.returncode}):\n{done.stderr[-2000:]}")
        latest = json.loads((root / "state" / "latest.json").read_text(encoding="utf-8"))
        (run,) = (root / "state" / "runs").iterdir()
        points = len(json.loads((run / "points" / "summary.json").read_text(encoding="utf-8"))["runs"])
        print(
            f"{args.hours:g} h recording ({latest['window']['calls']:,} calls, written in {written:.1f} s), "
            f"{args.policies}, --precision {args.precision}, --jobs {args.jobs}: {wall:.1f} s wall, "
            f"{points} points run"
        )
        print(latest["says"])


if __name__ == "__main__":
    main()
