"""The options ``retrywatch reproduce``'s commands share, and ``retrywatch emulate``'s: the bounds of
their numbers (time scale, pulse multiple, load, start rate, runs, jobs), the output path that is
refused before any work starts, and the parsers of ``--backend-option`` and of ``--trace`` with its
options. The commands themselves live in ``reproduce/cli.py`` and beside what they drive."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import click

from foundation.options import FiniteFloatRange
from reproduce.conditions import TraceWorkload
from reproduce.executors import Executor, ExecutorError, get_executor
from reproduce.registry import Backend
from reproduce.workloads.base import Workload
from reproduce.workloads.steps import SteppedWorkload, StepsError, parse_steps
from reproduce.workloads.traces import TraceError, parse_window

__all__ = [
    "LOAD",
    "MAX_JOBS",
    "MAX_RUNS",
    "PULSE_MULTIPLE",
    "START_RATE",
    "STEPS_HELP",
    "STEP_SECONDS",
    "STEP_S_HELP",
    "TIME_SCALE",
    "OutputPath",
    "backend_of",
    "executor_options",
    "parse_backend_options",
    "steps_workload",
    "sweep_executor",
    "trace_workload",
]

#: ``--time-scale`` of ``reproduce run`` and ``emulate``: engine seconds per wall second.
TIME_SCALE = FiniteFloatRange(min=0.001, max=1000.0)
#: Bounds of ``reproduce run``: runs per condition (the study's counts are 3 to 5), and worker
#: processes (each a simulator of its own).
MAX_RUNS = 1000
MAX_JOBS = 256
#: ``--pulse-multiple``: the pulse's rate as a multiple of Ĉ (the study's sweep: 1.5 to 2.7).
PULSE_MULTIPLE = FiniteFloatRange(min=0, min_open=True, max=100.0)
#: ``--load``: a trace's mean call rate as a multiple of Ĉ.
LOAD = FiniteFloatRange(min=0, min_open=True, max=100.0)
#: ``--start-rate`` of the calibrations: the first stage's calls per second.
START_RATE = FiniteFloatRange(min=0, min_open=True, max=100.0)
#: ``--steps``, ``--step-s``: a stepped load (``reproduce.workloads.steps``).
STEPS_HELP = "A stepped load instead of the pulse: these multiples of Ĉ in turn (0.5,1,1.5,2)."
STEP_S_HELP = "--steps: how long each step is held (study seconds; docs/reproducing.md)."
STEP_SECONDS = FiniteFloatRange(min=0, min_open=True, max=86_400.0)


class OutputPath(click.Path):
    """``click.Path`` that refuses an empty name (which would mean the current directory) and a
    place that cannot be created or written (its nearest existing parent is a file, or not
    writable): a usage error before the command starts its work, so nothing it computes is lost
    for want of somewhere to write it. Nothing is created here."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path is not an output path.", param, ctx)
        path = super().convert(value, param, ctx)
        target = Path(os.fsdecode(path)).absolute()
        parent = target
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if parent != target and not parent.is_dir():
            self.fail(f"{target} cannot be created: {parent} is not a directory.", param, ctx)
        if not os.access(parent, os.W_OK | os.X_OK):
            self.fail(f"{target} cannot be written: {parent} is not writable.", param, ctx)
        return path


def executor_options(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--executor`` and ``--address`` of a sweep's command; ``what`` names what its runs are."""
    from reproduce.executors import EXECUTORS

    executor = click.option(
        "--executor",
        "executor_name",
        type=click.Choice(sorted(EXECUTORS)),
        default="local",
        show_default=True,
        help=f"Where the {what} execute: processes here (--jobs), or a Ray cluster (docs/reproducing.md).",
    )
    address = click.option(
        "--address",
        default=None,
        help="--executor ray: the running cluster's HOST:PORT [RAY_ADDRESS].",
    )
    return lambda command: executor(address(command))


def sweep_executor(name: str, jobs: int, address: str | None, engine: Backend) -> Executor:
    """``--executor``/``--address``/``--jobs`` as the executor of ``engine``'s runs, closed when the
    command ends; a usage error when they do not fit."""
    from reproduce.runner import cap_jobs

    try:
        executor = get_executor(name, jobs=cap_jobs(jobs, lambda n: click.echo(n, err=True)), address=address)
        executor.check(engine)
    except ExecutorError as exc:
        raise click.BadParameter(str(exc), param_hint="'--executor'") from None
    click.get_current_context().with_resource(closing(executor))
    return executor


def backend_of(name: str, options: dict[str, Any]) -> Backend:
    """``--backend`` with its options (``parse_backend_options``) as a backend; a usage error
    naming the option at fault when the name or an option is not the backend's."""
    from reproduce.registry import BackendNotFound, get_backend

    try:
        return get_backend(name, **options)
    except BackendNotFound as exc:
        raise click.BadParameter(str(exc), param_hint="'--backend'") from None
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(f"backend {name!r}: {exc}", param_hint="'--backend-option'") from None


def parse_backend_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``--backend-option KEY=VALUE`` pairs as keyword arguments: VALUE as JSON where it is JSON,
    else as text; dashes in KEY become underscores."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--backend-option")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        options[key.replace("-", "_")] = value
    return options


def steps_workload(
    text: str | None, step_s: float, trace: Workload | None, pulse_multiple: float | None
) -> SteppedWorkload | None:
    """``--steps`` and ``--step-s`` as a workload (none without ``--steps``)."""
    source = click.get_current_context().get_parameter_source
    if text is None:
        if source("step_s") is not click.core.ParameterSource.DEFAULT:
            raise click.BadParameter("needs --steps", param_hint="'--step-s'")
        return None
    for given, hint in ((trace is not None, "'--trace'"), (pulse_multiple is not None, "'--pulse-multiple'")):
        if given:
            raise click.BadParameter("a stepped load is a workload of its own", param_hint=hint)
    try:
        return SteppedWorkload(parse_steps(text), step_s)
    except StepsError as exc:
        raise click.BadParameter(str(exc), param_hint="'--steps'") from None


def trace_workload(
    path: Path | None,
    trace_format: str | None,
    load: float,
    window_text: str | None,
    pulse_multiple: float | None,
    *,
    load_needs_trace: bool = True,
) -> TraceWorkload | None:
    """``--trace`` and its options as a workload, its first pass already read (a bad file is a
    one-line usage error naming its line and column, before any run). ``load_needs_trace``:
    ``--load`` is a trace's option (``run``), not every workload's (``whatif``)."""
    source = click.get_current_context().get_parameter_source
    given = [
        name
        for name, param in (
            ("--trace-format", "trace_format"),
            ("--load", "load"),
            ("--window", "window_text"),
        )
        if source(param) is not click.core.ParameterSource.DEFAULT and (load_needs_trace or param != "load")
    ]
    if path is None:
        if given:
            raise click.BadParameter("needs --trace FILE", param_hint=f"'{given[0]}'")
        return None
    if pulse_multiple is not None:
        raise click.BadParameter("a trace replay has no pulse", param_hint="'--pulse-multiple'")
    try:
        start, end = parse_window(window_text) if window_text is not None else (0.0, math.inf)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--window'") from None
    try:
        workload = TraceWorkload(str(path), trace_format, load, start, end)
        _ = workload.facts
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--trace'") from None
    return workload
