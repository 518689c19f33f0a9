"""Ĉ learned before saturation on a real vLLM on CPU at time scale 1: a steady stretch below Ĉ.

Starts the CPU vLLM (``small``, niced as the harness runs it, on loopback, stopped by PID), sends
it open-loop calls straight from the harness's client (no proxy, no retries) at ``--load`` x
``--capacity`` for ``--seconds``, the pulse test's calls (``cpu_scaled`` at K = 10: ~1,200-token
prompts sharing a 200-token prefix, median 30 output tokens) on a K = 1 clock, and scrapes vLLM's
``/metrics`` every ``--scrape`` seconds (5: the detector's cadence at K = 1) into
``OUT/metrics.jsonl``, kept. Then prints ``bench/capacity_on_run.py``'s tables for the stretch
after ``--skip`` seconds: the detector's 5-min window with its 5-s sub-windows (and 15-s, 30-s), and
10-min windows.

    RETRYWATCH_VLLM_PYTHON=VENV .venv/bin/python bench/capacity_on_vllm.py --out OUT \\
        --capacity 3.1333 --load 0.58 --seconds 690
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from detector.capacity import PART_S
from reproduce.harness.engines import VllmBackend
from reproduce.harness.openloop import OpenLoopClient
from reproduce.harness.protocol import cpu_scaled
from reproduce.harness.scrape import MetricsScraper
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import STUDY_CLOCK, RunClock, RunPlan, plan_generated

_LENGTHS_K = 10.0  # the pulse test's calls: the study's lengths divided by its K


def _plan(capacity: float, load: float, seconds: float, seed: int) -> RunPlan:
    fields = dict(cpu_scaled(RunClock(_LENGTHS_K)).shaping().fields)
    fields["phases"] = ((seconds, load),)
    fields["phase_names"] = ("steady",)
    return plan_generated(capacity, ClientConfig(retries=0), seed=seed, clock=STUDY_CLOCK, **fields)


async def _drive(
    url: str, model: str, vocab: int, plan: RunPlan, out: Path, scrape_s: float, seed: int
) -> int:
    client = OpenLoopClient(
        url, model, vocab, plan.client, seed=seed, token_seed=seed, segments=plan.segments
    )
    t0 = time.monotonic()
    async with MetricsScraper(f"{url}/metrics", out / "metrics.jsonl", t0=t0, interval_s=scrape_s):
        calls = await client.run(plan.calls, t0)
        await asyncio.sleep(2 * scrape_s)
    stats = {
        "calls": len(calls),
        "late_starts": client.stats.late_starts,
        "loop_lag": client.stats.loop_lag(),
        "outcomes": dict(client.stats.outcomes),
    }
    (out / "client.json").write_text(json.dumps(stats, indent=1, default=str) + "\n", encoding="utf-8")
    print(json.dumps(stats, default=str))
    return len(calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run directory (kept)")
    ap.add_argument("--capacity", type=float, default=3.1333, help="calibrated Ĉ, calls/s")
    ap.add_argument("--load", type=float, default=0.58, help="multiple of Ĉ sent")
    ap.add_argument("--seconds", type=float, default=690.0, help="length of the steady stretch")
    ap.add_argument("--scrape", type=float, default=5.0, help="seconds between scrapes of /metrics")
    ap.add_argument("--skip", type=float, default=60.0, help="seconds left out of the fit at the start")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    if min(args.capacity, args.load, args.seconds, args.scrape) <= 0 or args.load >= 1:
        ap.error("--capacity, --seconds and --scrape must be above 0, --load in (0, 1)")
    python = os.environ.get("RETRYWATCH_VLLM_PYTHON", ".vllm-venv")
    args.out.mkdir(parents=True, exist_ok=True)
    plan = _plan(args.capacity, args.load, args.seconds, args.seed)
    engine = VllmBackend(
        python, "small", args.out / "_engine", startup_timeout_s=420, bound_s=args.seconds + 900
    )
    with engine as endpoint:
        print(f"vLLM up in {endpoint.startup_s:.0f} s at {endpoint.url} (pid {endpoint.pid})", flush=True)
        asyncio.run(
            _drive(
                endpoint.url, endpoint.model_name, endpoint.vocab_size, plan, args.out, args.scrape, args.seed
            )
        )
    here = Path(__file__).resolve().parent
    end = str(args.seconds)
    for window, parts in (("300", [f"{PART_S:g}", "15", "30"]), ("600", [f"{PART_S:g}"])):
        argv = [sys.executable, str(here / "capacity_on_run.py"), str(args.out), "--true", str(args.capacity)]
        argv += ["--from", str(args.skip), "--to", end, "--window", window, "--parts", *parts, "--step", "30"]
        subprocess.run(argv, check=True)


if __name__ == "__main__":
    main()
