"""Benchmark of the engine model: wall time of 1,800 simulated seconds (the simulator's target, in
README's benchmarks: a whole paper run, simulator included, in <= 1 s; the engine is only part of it).

Run: ``python bench/bench_engine.py [--preset qwen2.5-7b-h100]``. Prints one line per scenario:
the protocol's base/pulse/hold trace sent open loop; a constant 2.7 Ĉ overload whose queue grows
without bound; the same overload with every execution aborted at a 120-s deadline (the
cancellation-on pattern: aborts of waiting and of running executions, steps in flight).
"""

from __future__ import annotations

import argparse
import time

from reproduce.engine import EngineEvent, EngineModel, EngineRequest, EventKind, preset
from reproduce.engine.presets import STUDY_CAPACITY
from reproduce.engine.process import EngineProcess
from reproduce.simenv import Environment
from reproduce.workloads.calls import WorkloadSpec, generate_trace, paper_phases, prompt_segments


def scenario(
    name: str,
    model: str,
    phases: tuple[tuple[float, float], ...],
    deadline_s: float | None,
    coalesce: bool,
) -> None:
    spec = WorkloadSpec(capacity=STUDY_CAPACITY[model], phases=phases, seed=1)
    trace = generate_trace(spec)
    env = Environment()
    engine = EngineModel(preset(model))
    finished = aborted = 0

    def on_event(event: EngineEvent) -> None:
        nonlocal finished, aborted
        if event.kind == EventKind.FINISHED:
            finished += 1
        elif event.kind == EventKind.ABORTED:
            aborted += 1

    proc = EngineProcess(env, engine, on_event, coalesce=coalesce)

    def arrive(request: EngineRequest) -> None:
        if proc.submit(request) and deadline_s is not None:
            env.schedule(env.now + deadline_s, proc.abort, request.request_id)

    for call in trace:
        env.schedule(
            call.arrival_s, arrive, EngineRequest(call.call_id, prompt_segments(call), call.response_len)
        )
    started = time.perf_counter()
    cpu_started = time.process_time()
    env.run(until=1_800.0)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    print(
        f"{name:<28} {model}{' coalesced' if coalesce else ''}: {wall:6.3f} s wall ({cpu:.3f} s CPU) "
        f"for 1800 s simulated, {engine.steps_done} steps "
        f"({engine.steps_done / wall:,.0f} steps/s), {len(trace)} calls, {finished} finished, "
        f"{aborted} aborted, {engine.num_waiting} waiting at the end, "
        f"{engine.num_preemptions_total} preemptions"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-7b-h100", choices=sorted(STUDY_CAPACITY))
    parser.add_argument("--no-coalesce", action="store_true", help="step decode-only runs one by one")
    args = parser.parse_args()
    coalesce = not args.no_coalesce
    base, pulse, _ = paper_phases()
    hold_to_1800 = paper_phases(hold_s=1_800.0 - base[0] - pulse[0])
    scenario("base/pulse/hold, open loop", args.preset, hold_to_1800, None, coalesce)
    scenario("2.7 Ĉ overload", args.preset, ((1_800.0, 2.7),), None, coalesce)
    scenario("2.7 Ĉ, abort at 120 s", args.preset, ((1_800.0, 2.7),), 120.0, coalesce)


if __name__ == "__main__":
    main()
