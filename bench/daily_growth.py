"""Does the daily what-if warn before the traffic outgrows the policy in force? A simulated check.

A synthetic recording, in the proxy's recording layout, of consecutive time-scaled "days" (each
``--day-s`` seconds: a diurnal swing of +-50 % and a short burst), the traffic growing 15 % a
day; the daily job (``reproduce.planner.daily.run_day``) runs at the end of each day on that
day's window. Truth per day: the day replayed alone at its own load under the policy in force
(``reproduce.planner.whatif.compare``), meeting the delivery objective or not. Then the same
days held flat at 30 % below the first day that missed the objective: the warning should never
fire there. Prints each day's observed peak, headroom, warning and truth, the lead (days between
the first warning and the first missed day) and the false alarms. Each day after the first
searches warm from the day before's answers (``reproduce.planner.daily.warm_start``); each row
gives the loads it ran.

    .venv/bin/python bench/daily_growth.py [--days 10] [--day-s 600] [--policies default,budget]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter.recorder import format_record
from reproduce.conditions import MODELS, ClientProfile, PulseWorkload
from reproduce.planner.daily import DailyJob, run_day
from reproduce.planner.whatif import WhatIf, compare
from reproduce.registry import get_backend
from reproduce.workloads.clients import parse_client
from reproduce.workloads.plan import RunClock
from reproduce.workloads.trace import TraceWorkload

# The runner tests' small engine (Ĉ 9.77 calls/s stated): a day's replay takes seconds.
SMALL = {
    "capacity": 9.77,
    "engine": {
        "step_time": {
            "fixed_s": 0.002,
            "per_prompt_token_s": 1e-4,
            "per_running_s": 0.0,
            "per_context_token_s": 0.0,
        },
        "max_model_len": 4096,
        "num_gpu_blocks": 4000,
    },
    "workload": {"prompt_mean": 1200, "prompt_std": 0, "shared_prefix_len": 200, "response_median": 20},
}
T0 = 1_765_000_000.0
GROWTH = 1.15
HELD = 0.7


def write_days(folder: Path, rates: list[float], day_s: float, seed: int) -> None:
    """One file per day: Poisson arrivals at ``rate`` x (1 + 0.5 sin) calls/s, doubled for a
    twentieth of the day at its crest."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    n = 0
    for day, rate in enumerate(rates):
        lines = []
        t = 0.0
        top = rate * 3.0
        while True:  # thinning: a Poisson process of the day's varying rate
            t += rng.expovariate(top)
            if t >= day_s:
                break
            phase = t / day_s
            now = rate * (1 + 0.5 * math.sin(2 * math.pi * phase)) * (2.0 if 0.22 <= phase < 0.27 else 1.0)
            if rng.random() * top > now:
                continue
            n += 1
            at = T0 + day * day_s + t
            record = (at, at + 3, 1200, 20, True, 64, f"c{n}", "k", 0, "created", None, "delivered", False)
            lines.append(format_record(record))
        name = f"attempts-{day:04d}0101T000000.000000Z-000001.jsonl"
        (folder / name).write_text("".join(lines), encoding="utf-8")


def run(label: str, rates: list[float], args: argparse.Namespace, root: Path) -> list[dict[str, object]]:
    rec = root / f"{label}-rec"
    write_days(rec, rates, args.day_s, seed=args.seed)
    engine = get_backend("sim", **SMALL)
    spec = parse_client("study")
    profile = ClientProfile(name=spec.name, base=spec.config)
    setup = WhatIf(engine, "sim", SMALL, MODELS[0], profile, PulseWorkload(), clock=RunClock(args.time_scale),
                   jobs=args.jobs, progress=False)  # fmt: skip
    policies = args.policies.split(",")
    job = DailyJob(rec, root / f"{label}-state", setup, policies, policies[0], capacity=SMALL["capacity"],
                   window_s=args.day_s, precision=args.precision, lo=0.05, hi=3.0)  # fmt: skip
    # the recording's clock starts at its first call, a fraction of a second into day 0
    with open(sorted(rec.iterdir())[0], encoding="utf-8") as f:
        first = json.loads(f.readline())["arrival_s"] - T0
    rows = []
    for k in range(len(rates)):
        end = (k + 1) * args.day_s - first - 1e-3
        t = time.perf_counter()
        day = run_day(job, now=T0 + (k + 1) * args.day_s, end_s=end)
        wall = time.perf_counter() - t
        w = day.window
        load = w.mean_rate / SMALL["capacity"]
        truth = replace(setup, workload=TraceWorkload(str(rec), "recording", load, w.start_s, w.end_s + 1e-6))
        point = compare(truth, [job.policy_in_force], root / f"{label}-truth-{k}")[job.policy_in_force]
        rows.append({
            "day": k, "calls": w.calls, "peak": round(day.observed_peak_load, 3),
            "mean": round(day.observed_mean_load, 3),
            "headroom": {p: day.headroom[p] for p in policies},
            "ratio": round(day.ratio(job.policy_in_force), 3), "warn": day.low,
            "meets": point["meets_objective"], "share": point["within_deadline_share"],
            "wall_s": round(wall, 1), "points": sum(len(s["tried"]) for s in day.searches.values()),
            "best": day.best(),
        })  # fmt: skip
        print(label, json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--day-s", type=float, default=600.0)
    parser.add_argument("--first-load", type=float, default=0.22, help="day 0's mean load, multiples of Ĉ")
    parser.add_argument("--policies", default="default,budget")
    parser.add_argument("--precision", type=float, default=0.05)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    base = args.first_load * SMALL["capacity"]
    with tempfile.TemporaryDirectory(prefix="daily-growth-") as tmp:
        root = Path(tmp)
        grow = run("growing", [base * GROWTH**k for k in range(args.days)], args, root)
        missed = next((r["day"] for r in grow if not r["meets"]), None)
        warned = next((r["day"] for r in grow if r["warn"]), None)
        print(f"growing: first warning on day {warned}, first missed day {missed}")
        if missed is None:
            print("no day missed the objective: grow for more days")
            return
        held_rate = HELD * base * GROWTH ** int(missed)  # type: ignore[call-overload]
        held = run("held", [held_rate] * args.days, args, root)
        alarms = [r["day"] for r in held if r["warn"]]
        misses = [r["day"] for r in held if not r["meets"]]
        print(f"held 30 % below day {missed}: warnings on days {alarms}, missed days {misses}")


if __name__ == "__main__":
    main()
