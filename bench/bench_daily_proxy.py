"""Does the daily what-if warn before the traffic outgrows the policy in force? Through the real
proxy on the emulated engine.

One ``retrywatch emulate`` (``--model``'s preset, at time scale ``--time-scale``) and, in front of
it, one real ``retrywatch proxy --record DIR`` with the policy in force, both kept for the whole
check. A request trace (``--trace``, its window ``--window``) is replayed through the proxy by the
open-loop clients as ``--days`` consecutive time-scaled "days", day k at ``--first-load`` x
``--growth``^k x Ĉ (mean; the trace's own burst shape). After each day the daily job
(``reproduce.planner.daily.run_day``) runs on the proxy's recording, its window that day's
calls, Ĉ stated (the emulator's: the simulator's Ĉ of the trace's mix x the time scale). Truth per
day: the day's own calls through the proxy, judged as the what-if judges a point (the delivery
objective: >= 98 % within the deadline, every collapse over within two deadlines of arrivals
falling back below Ĉ) and whether a retry loop formed. Then, with ``--held``, the same days held
30 % below the first day that missed: the warning should never fire there.

Prints one JSON line per day and, at the end, the lead (days from the first warning to the first
day that missed the objective or looped) and the false alarms.

    .venv/bin/python bench/bench_daily_proxy.py [--days 8] [--trace FILE] [--window 0:120]
        [--first-load 0.45] [--time-scale 10] [--policies default,none] [--held [--held-days N]]
        [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reproduce.conditions import ClientProfile
from reproduce.harness.backend import drive_run
from reproduce.harness.engines import EmulatedBackend
from reproduce.harness.proxyproc import ProxyProcess
from reproduce.judge.groundtruth import calls_of_records, ground_truth
from reproduce.judge.summary import judged_span
from reproduce.planner.daily import DailyJob, Day, observe, run_day
from reproduce.planner.whatif import Objective, WhatIf, overload_end
from reproduce.registry import get_backend
from reproduce.workloads.clients import parse_client
from reproduce.workloads.plan import STUDY_CLOCK, RunClock
from reproduce.workloads.trace import TraceWorkload

DATA = Path(__file__).resolve().parents[1] / "reproduce" / "workloads" / "traces" / "data"
TRACE = DATA / "mooncake_conversation_4min.jsonl"
GROWTH = 1.15
HELD = 0.7
TAIL_DEADLINES = 1.0


def judge(
    calls: list[Any], snapshots: list[Any], plan: Any, capacity: float, duration_s: float
) -> dict[str, Any]:
    """A day's calls as the what-if judges a point: the objective met, and a retry loop formed."""
    objective = Objective()
    times = calls_of_records(calls)
    truth = ground_truth(times, sorted(snapshots, key=lambda s: s.t), judged_span(plan, capacity, duration_s))
    judged = [c for c in times if truth.span.start_s <= c.planned_at < truth.span.end_s]
    share = sum(c.within(plan.deadline_s) for c in judged) / max(1, len(judged))
    planned = sorted(c.planned_at for c in judged)
    limit = objective.recovery_deadlines * plan.deadline_s
    slow = sum(
        not c.ended or c.end_s > overload_end(c, truth, planned) + limit + 1e-9 for c in truth.collapses
    )
    loops = any(c.metastable for c in truth.collapses)
    meets = share >= objective.target and slow == 0
    return {"share": round(share, 4), "collapses": len(truth.collapses), "loops": loops, "meets": meets,
            "ok": meets and not loops}  # fmt: skip


def run(label: str, loads: list[float], args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """The days at ``loads`` (multiples of Ĉ) through one proxy, the daily job after each."""
    policies = args.policies.split(",")
    in_force = policies[0]
    spec_client = parse_client(args.client)
    profile = ClientProfile(name=spec_client.name, base=spec_client.config)
    backend = get_backend("emulated")
    clock = RunClock(args.time_scale)
    protocol = backend.protocol(clock)  # type: ignore[attr-defined]
    start, _, end = args.window.partition(":")
    trace = TraceWorkload(str(args.trace), start_s=float(start), end_s=float(end))
    http = WhatIf(backend, "emulated", {}, args.model, profile, trace, seed=args.seed,
                  clock=clock, progress=False)  # fmt: skip
    capacity, how = backend.capacity_of(http.spec(in_force, loads[0], 0), protocol)  # type: ignore[attr-defined]
    sim = get_backend("sim")
    # NOTE: the simulator replays the recording at the study's own scale (time scale 1): the
    # headroom is a multiple of Ĉ, the same at any scale, and on this long-prompt recording the
    # simulator at the emulator's scale judged even 0.05x Ĉ late (left for the what-if's owners).
    setup = replace(http, backend=sim, backend_name="sim", clock=STUDY_CLOCK, jobs=args.jobs)
    folder = root / label
    rec, state = folder / "rec", folder / "state"
    rows: list[dict[str, Any]] = []
    with EmulatedBackend(folder / "engine", preset=args.model, clock=clock) as endpoint:
        spec0 = http.spec(in_force, loads[0], 0)
        plan0 = protocol.plan(capacity, spec0.condition, seed=spec0.seed)
        proxy = ProxyProcess(
            spec0.condition.policy.config(plan0), upstream=endpoint.url, workdir=folder, capacity=capacity,
            vocab_size=endpoint.vocab_size, window_s=protocol.gauge_window_s(plan0),
        )  # fmt: skip
        proxy.settings = replace(proxy.settings, record=str(rec))
        with proxy as proxy_url:
            before: float | None = None
            for k, load in enumerate(loads):
                spec = http.spec(in_force, round(load, 4), k)
                plan = protocol.plan(capacity, spec.condition, seed=spec.seed)
                # the queue watched drain for TAIL_DEADLINES deadlines after the last call, not the
                # horizon: the days follow each other as on a real proxy
                plan = replace(plan, tail_s=min(plan.tail_s, TAIL_DEADLINES * plan.deadline_s))
                t = time.perf_counter()
                calls, snapshots, duration, _ = asyncio.run(
                    drive_run(proxy_url, endpoint, folder / f"day{k}", plan=plan,
                              scrape_every_s=protocol.scrape_every_s(plan), seed=spec.seed)
                )  # fmt: skip
                drive_s = time.perf_counter() - t
                # the window: this day's calls as the proxy recorded them (the clients may lag the
                # plan on a busy machine), from the end of the day before
                end = observe(rec, 1e12).end_s
                window_s = end - before - 1e-3 if before is not None else end + 1.0
                before = end
                truth = judge(calls, snapshots, plan, capacity, duration)
                job = DailyJob(rec, state, setup, policies, in_force, capacity=capacity,
                               window_s=window_s, precision=args.precision,
                               lo=0.05, hi=3.0)  # fmt: skip
                t = time.perf_counter()
                day: Day = run_day(job)
                rows.append({
                    "day": k, "load": round(load, 3), "calls": day.window.calls,
                    "peak": round(day.observed_peak_load, 3),
                    "headroom": day.headroom, "ratio": round(day.ratio(in_force), 3), "warn": day.low,
                    "best": day.best(), **truth, "drive_s": round(drive_s, 1),
                    "plan_s": round(time.perf_counter() - t, 1),
                })  # fmt: skip
                print(label, json.dumps(rows[-1]), flush=True)
    print(f"{label}: Ĉ {capacity:.3f} calls/s ({how['method']})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=8)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--window", default="0:120", help="START:END of the trace, seconds")
    parser.add_argument("--first-load", type=float, default=0.45, help="day 0's mean load, multiples of Ĉ")
    parser.add_argument("--model", default="qwen3-14b-h100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", default="study")
    parser.add_argument("--policies", default="default,none", help="the policy in force first")
    parser.add_argument("--precision", type=float, default=0.05)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--held", action="store_true", help="then days held 30 %% below the first missed")
    parser.add_argument("--held-days", type=int, default=None, help="how many [--days]")
    parser.add_argument("--out", type=Path, default=None, help="keep the files here")
    args = parser.parse_args()
    args.held_days = args.held_days or args.days
    with tempfile.TemporaryDirectory(prefix="daily-proxy-") as tmp:
        root = args.out or Path(tmp)
        grow = run("growing", [args.first_load * GROWTH**k for k in range(args.days)], args, root)
        missed = next((r["day"] for r in grow if not r["ok"]), None)
        warned = next((r["day"] for r in grow if r["warn"]), None)
        lead = None if missed is None or warned is None else missed - warned
        print(f"growing: first warning on day {warned}, first day missed or looped {missed}, lead {lead}")
        summary: dict[str, Any] = {"warned": warned, "missed": missed, "lead": lead}
        if args.held:
            # 30 % below the first day missed (below the last day where none was)
            top = missed if missed is not None else args.days - 1
            held = run("held", [HELD * args.first_load * GROWTH**top] * args.held_days, args, root)
            summary |= {"held_below_day": top, "false_alarms": [r["day"] for r in held if r["warn"]],
                        "held_missed": [r["day"] for r in held if not r["ok"]]}  # fmt: skip
        print("summary", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
