"""``retrywatch reproduce whatif``: one workload under each named proxy policy, and (with
``--headroom``) each policy's headroom; writes ``DIR/whatif.json``, ``DIR/report.md`` and
``DIR/report.html`` (``reproduce.planner.whatif``, ``reproduce.planner.report``). One sweep writes a DIR
at a time: a second is refused at once, naming the first (``reproduce.dirlock``)."""

from __future__ import annotations

import math
from pathlib import Path

import click

from foundation.rundir import SUMMARY, RunDirError
from reproduce.conditions import MODELS, ClientProfile, PulseWorkload, Workload
from reproduce.dirlock import DirBusy, hold
from reproduce.options import (
    LOAD,
    MAX_JOBS,
    MAX_RUNS,
    STEP_S_HELP,
    STEP_SECONDS,
    STEPS_HELP,
    TIME_SCALE,
    OutputPath,
    backend_of,
    executor_options,
    parse_backend_options,
    steps_workload,
    sweep_executor,
    trace_workload,
)
from reproduce.planner.whatif import (
    CRITERIA,
    DEFAULT_CRITERION,
    HEADROOM_RANGE,
    POLICIES,
    PRECISION,
    Objective,
    WhatIf,
    WhatIfError,
    compare,
    criterion_words,
    curve,
    headroom_with_curves,
    marks,
    parse_policies,
    policy_table,
    write_whatif,
)
from reproduce.workloads.steps import STEP_S
from reproduce.workloads.traces import FORMATS

DEFAULT_POLICIES = "none,default,budget,coalescing,lookup-first"


def _range(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (float(lo), float(hi)) if sep else (math.nan, math.nan)
    except ValueError:
        bounds = (math.nan, math.nan)
    if not (0 < bounds[0] < bounds[1] and math.isfinite(bounds[1])):
        raise click.BadParameter(f"{text!r} is not LO:HI with 0 < LO < HI", param_hint="'--headroom-range'")
    return bounds


def _loads(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        loads = [math.nan]
    if not loads or not all(math.isfinite(x) and x > 0 for x in loads):
        raise click.BadParameter(
            f"{text!r} is not loads M,M,... (positive multiples of Ĉ)", param_hint="'--curve'"
        )
    return loads


@click.command("whatif")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Replay this request trace instead of the pulse (docs/traces.md).",
)
@click.option("--steps", "steps_text", default=None, help=STEPS_HELP)
@click.option("--step-s", type=STEP_SECONDS, default=STEP_S, show_default=True, help=STEP_S_HELP)
@click.option(
    "--trace-format", type=click.Choice(FORMATS), default=None, help="--trace's layout [from its header]."
)
@click.option("--window", "window_text", default=None, help="--trace: START:END seconds of it.")
@click.option(
    "--load",
    type=LOAD,
    default=None,
    help="The workload's load, a multiple of Ĉ: the pulse's rate [2.7], the trace's mean rate [1], or "
    "the top step (the steps scaled with it) [the largest of --steps].",
)
@click.option(
    "--client",
    "client",
    default="study",
    show_default=True,
    help="How the clients retry (as `reproduce run --client`).",
)
@click.option(
    "--policies",
    "policies_text",
    default=DEFAULT_POLICIES,
    show_default=True,
    help=f"Named proxy policies, comma-separated: {', '.join(POLICIES)}.",
)
@click.option(
    "--out",
    type=OutputPath(path_type=Path, file_okay=False),
    required=True,
    help="Output DIR; points already in DIR/points are reused (a rerun resumes).",
)
@click.option("--backend", default="sim", show_default=True, help="Engine backend by name.")
@click.option("--backend-option", "backend_options", multiple=True, help="KEY=VALUE for the backend.")
@click.option("--model", default=MODELS[0], show_default=True, help="Engine model preset.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="First seed.")
@click.option(
    "--seeds",
    type=click.IntRange(1, MAX_RUNS),
    default=1,
    show_default=True,
    help="Runs per point, seeds SEED to SEED+N-1.",
)
@click.option(
    "--time-scale",
    type=TIME_SCALE,
    default=1.0,
    show_default=True,
    help="K: the study's durations divided by K.",
)
@click.option(
    "--jobs",
    type=click.IntRange(1, MAX_JOBS),
    default=1,
    show_default=True,
    help="Parallel processes (at most the cores this process may use).",
)
@executor_options("points")
@click.option("--headroom", is_flag=True, help="Also search each policy's headroom (bisection over load).")
@click.option(
    "--headroom-range",
    "range_text",
    default=f"{HEADROOM_RANGE[0]:g}:{HEADROOM_RANGE[1]:g}",
    show_default=True,
    help="--headroom: LO:HI, the loads searched (multiples of Ĉ).",
)
@click.option(
    "--precision",
    type=LOAD,
    default=PRECISION,
    show_default=True,
    help="--headroom: stop when safe and unsafe loads are this close.",
)
@click.option(
    "--criterion",
    "--unsafe-on",
    "criterion",
    type=click.Choice(CRITERIA),
    default=DEFAULT_CRITERION,
    show_default=True,
    help="--headroom: what makes a load unsafe: missing the delivery objective, any collapse, or a "
    "metastable collapse only (--unsafe-on is the older spelling).",
)
@click.option(
    "--objective",
    "target",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=Objective().target,
    show_default=True,
    help="The delivery objective: the share of calls to deliver within the deadline.",
)
@click.option(
    "--recovery-deadlines",
    type=click.FloatRange(0, min_open=True),
    default=Objective().recovery_deadlines,
    show_default=True,
    help="The delivery objective: every collapse over within this many deadlines of arrivals "
    "falling back below Ĉ.",
)
@click.option(
    "--curve",
    "curve_text",
    default=None,
    help="Also run these loads (M,M,..., multiples of Ĉ) for every policy's curve.",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
def whatif_command(
    trace_path: Path | None,
    steps_text: str | None,
    step_s: float,
    trace_format: str | None,
    window_text: str | None,
    load: float | None,
    client: str,
    policies_text: str,
    out: Path,
    backend: str,
    backend_options: tuple[str, ...],
    model: str,
    seed: int,
    seeds: int,
    time_scale: float,
    jobs: int,
    executor_name: str,
    address: str | None,
    headroom: bool,
    range_text: str,
    precision: float,
    criterion: str,
    target: float,
    recovery_deadlines: float,
    curve_text: str | None,
    progress: bool,
) -> None:
    """Run one workload (the pulse, --trace or --steps) under each named proxy policy; with --headroom,
    search each one's largest safe load. Writes DIR/whatif.json, DIR/report.md and report.html."""
    from reproduce.engine.presets import PresetError
    from reproduce.planner.report import write_whatif_report
    from reproduce.workloads.client import ClientConfigError
    from reproduce.workloads.clients import parse_client
    from reproduce.workloads.plan import RunClock

    try:
        policies = parse_policies(policies_text)
    except WhatIfError as exc:
        raise click.BadParameter(str(exc), param_hint="'--policies'") from None
    lo, hi = _range(range_text)
    fixed = _loads(curve_text)
    objective = Objective(target, recovery_deadlines)
    trace = trace_workload(trace_path, trace_format, load or 1.0, window_text, None, load_needs_trace=False)
    workload: Workload = steps_workload(steps_text, step_s, trace, None) or trace or PulseWorkload()
    if load is not None:
        workload = workload.at_load(load)
    try:
        spec = parse_client(client)
    except ClientConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--client'") from None
    if (out / SUMMARY).exists():
        raise click.BadParameter(
            f"{out} holds a `reproduce run`'s {SUMMARY}: a what-if writes its own report there; "
            "pick another DIR",
            param_hint="'--out'",
        )
    options = parse_backend_options(backend_options)
    engine = backend_of(backend, options)
    executor = sweep_executor(executor_name, jobs, address, engine)
    setup = WhatIf(
        backend=engine, backend_name=backend, backend_options=options, model=model,
        client=ClientProfile(name=spec.name, base=spec.config), workload=workload,
        seed=seed, seeds=seeds, clock=RunClock(time_scale), progress=progress, executor=executor,
    )  # fmt: skip

    def on_round(n: int, loads: dict[str, float]) -> None:
        click.echo(f"headroom round {n}: " + ", ".join(f"{p} at {x:g}x" for p, x in loads.items()), err=True)

    try:
        # held until the command ends: the points, whatif.json and the report are one sweep's
        click.get_current_context().with_resource(hold(out))
        points = compare(setup, policies, out, objective)
        if fixed:  # the fixed loads first: they bracket the search too
            curve(setup, policies, out, fixed, objective)
        if headroom:  # the curves from the search's own points, each judged once
            found, curves = headroom_with_curves(
                setup, policies, out, lo=lo, hi=hi, precision=precision, criterion=criterion,
                objective=objective, on_round=on_round,
            )  # fmt: skip
        else:
            found, curves = {}, curve(setup, policies, out, (), objective)
    except (DirBusy, WhatIfError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--out'") from None
    except PresetError as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from exc
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    sources = {row["policy"]: row for row in policy_table()}
    body = {
        "setup": setup.setup(),
        "load": workload.load,
        "workload": workload.describe(),
        "workload_text": workload.text(),
        "seeds": list(range(seed, seed + seeds)),
        "objective": objective.describe(),
        "criterion": criterion_words(criterion, objective),
        "safe_rule": criterion_words(criterion, objective)["rule"],
        "policies": {
            p: {
                "does": sources[p]["does"],
                "from": sources[p]["from"],
                "at_load": points[p],
                "curve": curves[p],
                **marks(curves[p]),
                **({"headroom": found[p]} if p in found else {}),
            }
            for p in policies
        },
    }
    path = write_whatif(out, body)
    md, html = write_whatif_report(out, body)
    for p in policies:
        point = points[p]
        line = (
            f"{p}: {point['within_deadline']}/{point['calls']} within the deadline, {point['late']} late, "
            f"{point['failed']} failed; {point['loops']}/{point['runs']} runs looped"
        )
        if p in found:
            line += f"; headroom: {found[p]['says']}"
        seen = marks(curves[p])
        line += f"; loop onset: {seen['loop_onset']['says']}; overload: {seen['overload']['says']}"
        click.echo(line)
    click.echo(f"wrote {path}, {md} and {html}")
