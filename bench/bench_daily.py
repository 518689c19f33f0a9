"""How long the daily what-if takes: ``retrywatch reproduce plan-daily --once`` on a synthetic
recording of ``--hours`` (default 24), five policies, headroom to 0.05 Ĉ, on the local executor
or on two Ray workers; with ``--days 2``, on consecutive days, each later one warm from the day
before (the first from the estimate of the overload's onset).

Writes the recording in the proxy's layout (``daily_growth.write_days``: a diurnal swing of
+-50 % and a burst, mean ``--mean-load`` x Ĉ, each later day ``--growth`` busier), then, per day,
adds that day's file to the recording and runs the whole command as a child process on the same
state directory (the first day from the estimate of the overload's onset, each later one from
the day before's answers), on the study's engine preset with Ĉ stated, the calibrated Ĉ of the
days' token mix (:func:`mix_capacity`: calibration is not timed), and prints its wall time, the
points run, each search's start and each policy's headroom.
``--executor ray`` starts a Ray head of two CPUs on loopback in a temp dir of its own (two
workers), runs the command on it and stops the head's processes by their session, never by
``ray stop`` (which would end every Ray on the machine).

    .venv/bin/python bench/bench_daily.py [--hours 24] [--mean-load 0.3] [--executor local|ray]
        [--jobs 2] [--policies none,default,budget,coalescing,lookup-first] [--precision 0.05]
        [--days 1] [--growth 0.1] [--compare-fresh]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench_trace_replay import MODEL
from daily_growth import write_days

from reproduce.conditions import EngineSettings
from reproduce.sim.backend import trace_mix_capacity
from reproduce.workloads.trace import TraceWorkload

# every process of the cluster and its driver: no usage report, no token (as the executor tests)
RAY_ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
WORKERS = 2


def _session_processes(session: int) -> set[int]:
    found = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (p / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[3]) == session:
                found.add(int(p.name))
    return found


@contextlib.contextmanager
def ray_head(workers: int) -> Iterator[str]:
    """A Ray head of ``workers`` CPUs on loopback; its address. Stopped by its session's ids."""
    ray = str(Path(sys.executable).parent / "ray")
    temp = tempfile.mkdtemp(prefix="bd-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    argv = [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={workers}",
            "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"]  # fmt: skip
    start = subprocess.Popen(argv, env=RAY_ENV, start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out = start.communicate(timeout=180)[0].decode()
        if start.returncode != 0:
            raise SystemExit(f"ray start failed:\n{out[-2000:]}")
        yield f"127.0.0.1:{port}"
    finally:
        for sig, grace_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            for pid in _session_processes(start.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while _session_processes(start.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        subprocess.run(["rm", "-rf", temp], check=False)


def mix_capacity(probe: Path) -> float:
    """Ĉ of the synthetic days' token mix (every call alike) on :data:`MODEL`, by the simulator's
    calibration of a probe hour of it (cached; not timed): the Ĉ a detector learns for this
    traffic, which the daily job reads and states to the simulator, so that the search's loads are
    multiples of the engine's real capacity for it, as they are in service."""
    write_days(probe, [1.0], 3600.0, seed=3)
    facts = TraceWorkload(str(probe), "recording").facts
    return trace_mix_capacity(MODEL, facts, tokens_per_step=EngineSettings().tokens_per_step)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="each day's length (the window replayed)")
    parser.add_argument("--mean-load", type=float, default=0.3)
    parser.add_argument("--policies", default="none,default,budget,coalescing,lookup-first")
    parser.add_argument("--precision", default="0.05")
    parser.add_argument("--executor", choices=("local", "ray"), default="local")
    parser.add_argument("--jobs", default=str(WORKERS), help="--executor local: runs at a time")
    parser.add_argument("--days", type=int, default=1, help="consecutive days, each run on the same state")
    parser.add_argument("--growth", type=float, default=0.1, help="each day's traffic over the day before's")
    parser.add_argument(
        "--compare-fresh", action="store_true",
        help="then search the last day again on a fresh state (no history), compare the answers",
    )  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-daily-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        capacity = mix_capacity(root / "probe")
        started = time.perf_counter()
        rates = [args.mean_load * capacity * (1 + args.growth) ** k for k in range(args.days)]
        write_days(root / "days", rates, args.hours * 3600, seed=3)
        written = time.perf_counter() - started
        command = [
            sys.executable, "-m", "retrywatch", "reproduce", "plan-daily", "--once", "--recording",
            str(root / "rec"), "--out", str(root / "state"), "--window-hours", f"{args.hours:g}",
            "--model", MODEL, "--capacity", f"{capacity}", "--backend-option",
            f"capacity={capacity}", "--policies", args.policies, "--precision", args.precision,
        ]  # fmt: skip
        if args.executor == "ray":
            command += ["--executor", "ray", "--address", stack.enter_context(ray_head(WORKERS))]
            how = f"--executor ray ({WORKERS} workers)"
        else:
            command += ["--jobs", args.jobs]
            how = f"--executor local --jobs {args.jobs}"
        (root / "rec").mkdir()
        print(f"{args.days} day(s) of {args.hours:g} h written in {written:.1f} s; Ĉ of their mix "
              f"{capacity:.4g} calls/s; {args.policies}, --precision {args.precision}, {how}")  # fmt: skip
        days = sorted((root / "days").iterdir())
        for k, day in enumerate(days):
            shutil.copy(day, root / "rec" / day.name)  # the proxy's file of the day, as it rotates
            last = _day(command, root / "state", f"day {k + 1} (mean {rates[k] / capacity:.3g}x Ĉ")
        if args.compare_fresh:
            fresh = [root / "fresh" if a == str(root / "state") else a for a in command]
            again = _day(
                [str(a) for a in fresh],
                root / "fresh",
                f"day {len(days)} again, fresh (no history",
            )
            same = all(again[p]["headroom_load"] == last[p]["headroom_load"] for p in last)
            print(f"the same answers from a fresh state and warm: {same}")


def _day(command: list[str], state: Path, label: str) -> dict[str, dict[str, object]]:
    """One run of plan-daily on ``state``; prints its points, wall time and answers; returns its searches."""
    runs = set((state / "runs").glob("*"))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=RAY_ENV)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"plan-daily failed ({done.returncode}):\n{done.stderr[-2000:]}")
    (run,) = set((state / "runs").glob("*")) - runs
    body = json.loads((run / "whatif.json").read_text(encoding="utf-8"))
    points = len(json.loads((run / "points" / "summary.json").read_text(encoding="utf-8"))["runs"])
    starts = sorted({str(s["start"]["kind"]) for s in body["headroom"].values()})
    calls = body["daily"]["window"]["calls"]
    print(f"{label}, {calls:,} calls; {'/'.join(starts)} start): {wall:.1f} s wall, {points} points run")
    print(f"  {body['daily']['says']}")
    for p, search in body["headroom"].items():
        print(f"  {p}: safe mean load {search['headroom_load']} ({search['kind']}), "
              f"{len(search['tried'])} points, start {search['start']}")  # fmt: skip
    searches: dict[str, dict[str, object]] = body["headroom"]
    return searches


if __name__ == "__main__":
    main()
