"""Figures behind the simulator's departures from the study (docs/results.md), printed.

Five measurements, none of which feeds the presets or any threshold::

    .venv/bin/python bench/sim_fidelity.py throughput      # drain throughput against Ĉ, preemptions
    .venv/bin/python bench/sim_fidelity.py windows DIR     # what holds recovery back, per run
    .venv/bin/python bench/sim_fidelity.py edge DIR        # engine cap Q = 338 at the deadline's edge
    .venv/bin/python bench/sim_fidelity.py rate-window DIR...  # the loop alert over shorter rate windows
    .venv/bin/python bench/sim_fidelity.py seeds DIR...    # the loop alert's misses and late firings, per DIR

``throughput``: per preset, the completion rate under a sustained 2 Ĉ load (the engine's most,
with a full running batch and a long queue: what drains a pulse's backlog) in multiples of Ĉ,
and preemptions in one saturated calibration stage with vLLM's full-sequence admission gate
(``scheduler_reserve_full_isl``) and without it. ``windows``: for every recovered run of a
reproduce output DIR, the hold windows before its recovery that delivered at least 98 % of their
calls within the deadline yet failed the rule's queue conditions, with their mean waiting
queue. ``edge``: the loop alert's signals 103, 118 and 148 s after the pulse's end in every
engine-cap-338 run of DIR, by outcome. ``rate-window``: the loop alert replayed over every run of
each DIR with the detector's rate window and with shorter ones (``--rate-s``): recall, lead
after the pulse's end (median / max), and the recovered runs in which it fired. ``seeds``: the
loop alert over every run of each DIR (one a seed), as ``retrywatch reproduce validate`` judges
it: recall, lead (median / max), each run it missed with the executions it created over the
hold, each late firing with when the loop formed, and the recovered runs it fired in.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
from pathlib import Path

from detector.signals import WINDOWS, SignalConfig, SignalEngine
from detector.sources.replay import load_snapshots
from reproduce.engine import EngineConfig, EngineModel, EngineRequest, EventKind, preset
from reproduce.engine.presets import PRESET_NAMES, preset_capacity
from reproduce.engine.process import EngineProcess
from reproduce.judge.outcomes import RecoveryRule
from reproduce.judge.validate import (
    RETRY_LOOP,
    RunResult,
    check_targets,
    load_runs,
    replay_firings,
    score_alert,
)
from reproduce.simenv import Environment
from reproduce.workloads.calls import WorkloadSpec, generate_trace, prompt_segments

SIGNALS = ("creation_capacity_ratio", "backlog_deadline_ratio", "orphaned_fraction", "cancelled_fraction")


def run_load(
    config: EngineConfig, rate: float, duration_s: float, seed: int
) -> tuple[list[float], EngineModel]:
    """Open-loop Poisson calls at ``rate`` straight into the engine model (no proxy, no retries)."""
    spec = dataclasses.replace(
        WorkloadSpec(capacity=1.0), capacity=rate, phases=((duration_s, 1.0),), phase_names=("s",), seed=seed
    )
    env = Environment()
    model = EngineModel(config)
    done: list[float] = []
    process = EngineProcess(
        env, model, lambda e: done.append(env.now) if e.kind is EventKind.FINISHED else None
    )
    for call in generate_trace(spec):
        request = EngineRequest(call.call_id, prompt_segments(call), call.response_len)
        env.schedule(call.arrival_s, process.submit, request)
    env.run(until=duration_s)
    return done, model


def sustained_rate(
    name: str, seed: int, duration_s: float = 900.0, settle_s: float = 300.0
) -> tuple[float, int]:
    """Completions per second over ``[settle_s, duration_s]`` under 2 Ĉ, and the running batch at the end."""
    done, model = run_load(preset(name), 2 * preset_capacity(name), duration_s, seed)
    n = bisect.bisect_left(done, duration_s) - bisect.bisect_left(done, settle_s)
    return n / (duration_s - settle_s), model.num_running


def preemptions(name: str, reserve_full: bool, seed: int = 0) -> int:
    """Preemptions in a 300-s stage at 1.2 Ĉ (the protocol's first saturated calibration stage)."""
    config = preset(name).with_options(scheduler_reserve_full_isl=reserve_full)
    _, model = run_load(config, 1.2 * preset_capacity(name), 300.0, seed)
    return model.num_preemptions_total


def throughput() -> None:
    print(
        f"{'preset':18} {'Ĉ':>5} {'2Ĉ for 900 s: completed / Ĉ (seeds 0-2)':>42} {'running':>8}"
        f" {'preemptions full-ISL / first chunk':>36}"
    )
    for name in PRESET_NAMES:
        capacity = preset_capacity(name)
        rates = [sustained_rate(name, seed) for seed in range(3)]
        ratios = ", ".join(f"{r / capacity:.3f}" for r, _ in rates)
        print(
            f"{name:18} {capacity:5.2f} {ratios:>42} {rates[0][1]:8d} "
            f"{preemptions(name, True):>17} / {preemptions(name, False):<17}"
        )


def windows(out: Path) -> None:
    rule = RecoveryRule()
    runs = json.loads((out / "summary.json").read_text(encoding="utf-8"))["runs"]
    print("run | recovered after (s) | windows on time but queued (end s: mean waiting)")
    for run in runs:
        if not run.get("recovered"):
            continue
        held = [
            f"{w['end_s'] - run['pulse']['end_s']:.0f}: {w['waiting_mean']:.1f}"
            for w in run["recovery_windows"]
            if w["delivered_within_deadline"] >= rule.min_delivered and not w["ok"]
        ]
        if held:
            print(f"{run['slug']} | {run['recovery_time_s']:.0f} | {'; '.join(held)}")


def edge(out: Path) -> None:
    runs = json.loads((out / "summary.json").read_text(encoding="utf-8"))["runs"]
    print(
        "condition | recovered | created over the hold xĈ | "
        + " | ".join(SIGNALS)
        + " at +103 / +118 / +148 s"
    )
    rows = []
    for run in runs:
        if not run["condition"].startswith("engine-cap-338"):
            continue
        engine = SignalEngine(SignalConfig())
        at: dict[float, dict[str, float | None] | None] = {
            run["pulse"]["end_s"] + d: None for d in (103.0, 118.0, 148.0)
        }
        for snap in load_snapshots(out / run["series"], None):
            engine.add(snap)
            if snap.t in at:
                (frame,) = engine.compute(snap.t)
                at[snap.t] = frame.values
        cells = [
            " / ".join("–" if v is None or v.get(k) is None else f"{v[k]:.2f}" for v in at.values())
            for k in SIGNALS
        ]
        rows.append(
            (run["condition"], run["recovered"], run["rates_x_capacity"]["executions_created"], cells)
        )
    for condition, recovered, created, cells in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
        print(f"{condition} | {recovered} | {created:.2f} | " + " | ".join(cells))


def rate_window(outs: list[Path], rates_s: list[float]) -> None:
    print("DIR | rate window (s) | recall | lead median / max (s) | recovered runs it fired in")
    for out in outs:
        infos = load_runs(out)
        for rate_s in rates_s:
            results = [
                RunResult(
                    info,
                    replay_firings(
                        info, dataclasses.replace(info.detector.windows, rate_s=info.run_s(rate_s))
                    ),
                )
                for info in infos
            ]
            score = score_alert(RETRY_LOOP, results)
            fired = [
                r.info.slug
                for r in results
                if r.info.recovered and any(f.alertname == RETRY_LOOP for f in r.firings)
            ]
            lead = score["lead_time_s"]
            print(
                f"{out} | {rate_s:g} | {score['recall']} | {lead['median']} / {lead['max']} |"
                f" {len(fired)}{': ' + ', '.join(fired) if fired else ''}"
            )


def _plus(seconds: float | None) -> str:
    return "–" if seconds is None else f"+{seconds:g}"


def _times_capacity(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f} Ĉ"  # None: the summary gives no creation rate


def seeds(outs: list[Path]) -> None:
    columns = ("recall", "lead median / max (s)", "missed: created over the hold", "late: lead, loop formed")
    print(" | ".join(("DIR", *columns, "recovered runs it fired in")))
    for out in outs:
        infos = load_runs(out)
        hold = {info.slug: info.hold_creation_x_capacity for info in infos}
        results = [RunResult(info, replay_firings(info)) for info in infos]
        score = score_alert(RETRY_LOOP, results)
        targets = check_targets(results)[RETRY_LOOP]
        missed = [f"{m['run']} ({_times_capacity(hold[m['run']])})" for m in targets["missed_runs"]]
        late = [
            f"{m['run']} (+{m['lead_time_s']:g}, formed {_plus(m.get('loop_formed_s'))})"
            for m in targets["late_runs"]
        ]
        fired = sorted({m["run"] for m in targets["fired_between_pulse_and_recovery"]})
        lead = score["lead_time_s"]
        cells = (missed, late, fired)
        print(
            f"{out} | {score['recall']} | {lead['median']} / {lead['max']} | "
            + " | ".join(f"{len(c)}{': ' + ', '.join(c) if c else ''}" for c in cells)
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("throughput")
    for name in ("windows", "edge"):
        sub.add_parser(name).add_argument("out", type=Path, help="a reproduce output folder")
    rates = sub.add_parser("rate-window")
    rates.add_argument("outs", type=Path, nargs="+", help="reproduce output folders")
    rates.add_argument(
        "--rate-s", type=float, nargs="+", default=[WINDOWS.rate_s, 30.0], help="rate windows (s)"
    )
    sub.add_parser("seeds").add_argument("outs", type=Path, nargs="+", help="reproduce output folders")
    args = parser.parse_args()
    if args.what == "throughput":
        throughput()
    elif args.what == "windows":
        windows(args.out)
    elif args.what == "rate-window":
        rate_window(args.outs, args.rate_s)
    elif args.what == "seeds":
        seeds(args.outs)
    else:
        edge(args.out)


if __name__ == "__main__":
    main()
