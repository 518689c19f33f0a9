"""``retrywatch reproduce plan-daily``: the daily what-if on the proxy's recording
(``reproduce.planner.daily``), once (``--once``) or each day at ``--at`` (APScheduler, UTC),
its latest run served as series on ``GET /metrics`` and a run on demand on ``POST /run`` (202,
or 409 while one runs), on the project's bounded server (``foundation.server``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import click

from reproduce.conditions import MODELS, ClientProfile, PulseWorkload
from reproduce.executors import EXECUTORS
from reproduce.options import (
    LOAD,
    MAX_JOBS,
    MAX_RUNS,
    TIME_SCALE,
    backend_of,
    parse_backend_options,
    sweep_executor,
)
from reproduce.planner.cli import DEFAULT_POLICIES, _range
from reproduce.planner.daily import (
    DEFAULT_AT,
    HEADROOM_RANGE,
    MARGIN,
    NO_CAPACITY,
    POLICY_IN_FORCE,
    WINDOW_S,
    DailyError,
    DailyJob,
    HeadroomCollector,
    History,
    parse_at,
    run_day,
)
from reproduce.planner.whatif import POLICIES, PRECISION, WhatIf, WhatIfError, parse_policies

log = logging.getLogger("retrywatch.plan-daily")

#: Where the series and ``POST /run`` are served by default.
DEFAULT_PORT = 8300


class Runner:
    """One run at a time, whoever asks (the schedule or ``POST /run``)."""

    def __init__(self, job: DailyJob) -> None:
        self.job = job
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Start a run in a thread unless one runs already (False then)."""
        if not self._lock.acquire(blocking=False):
            return False
        threading.Thread(target=self._held, name="plan-daily-run", daemon=True).start()
        return True

    def run(self) -> bool:
        """Run now in this thread unless one runs already (False then)."""
        if not self._lock.acquire(blocking=False):
            return False
        self._held()
        return True

    def _held(self) -> None:
        """One run, the lock held; a failed run is logged, never raised (the schedule goes on)."""
        try:
            day = run_day(self.job)
            log.warning("daily what-if: %s", day.says())
        except Exception:
            log.exception("daily what-if failed")
        finally:
            self._lock.release()


def make_app(history: History, runner: Runner) -> Any:
    """``GET /metrics`` (the latest run's series) and ``POST /run`` (a run now, in a thread)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.registry import CollectorRegistry
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    registry = CollectorRegistry()
    registry.register(HeadroomCollector(history))

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def run(_: Request) -> Response:
        if not runner.start():
            return JSONResponse({"started": False, "why": "a run is under way"}, status_code=409)
        return JSONResponse({"started": True}, status_code=202)

    return Starlette(routes=[Route("/metrics", metrics), Route("/run", run, methods=["POST"])])


@click.command("plan-daily")
@click.option(
    "--recording",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="The proxy's recording (`retrywatch proxy --record DIR`).",
)
@click.option(
    "--out",
    "state",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="STATE_DIR: each run's what-if, latest.json and the history (history.sqlite).",
)
@click.option(
    "--at", "at_text", default=DEFAULT_AT, show_default=True, help="When to run each day, HH:MM UTC."
)
@click.option("--once", is_flag=True, help="Run once now, print the answer and exit (no server).")
@click.option(
    "--window-hours",
    type=click.FloatRange(0, min_open=True),
    default=WINDOW_S / 3600,
    show_default=True,
    help="The recording's last hours replayed.",
)
@click.option(
    "--policies",
    "policies_text",
    default=DEFAULT_POLICIES,
    show_default=True,
    help=f"Named proxy policies, comma-separated: {', '.join(POLICIES)}.",
)
@click.option("--policy-in-force", default=POLICY_IN_FORCE, show_default=True, help="The proxy's policy now.")
@click.option(
    "--margin",
    type=click.FloatRange(0),
    default=MARGIN,
    show_default=True,
    help="Warn when the policy in force leaves headroom / observed peak below 1 + this.",
)
@click.option(
    "--capacity",
    type=LOAD,
    default=None,
    help="The engine's Ĉ, calls/s; wins over --detector's.",
)
@click.option(
    "--detector",
    default=None,
    metavar="URL",
    help="The detector following this engine (its base URL): Ĉ read from its /metrics at each run "
    "(retrywatch_detector_capacity_calls_per_second: stated, else measured, else predicted).",
)
@click.option(
    "--engine",
    "engine_instance",
    default=None,
    metavar="INSTANCE",
    help="--detector: this engine's instance label [its only one].",
)
@click.option("--database", default=None, help="History database URL [sqlite in STATE_DIR].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Serve /metrics and POST /run here.")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--backend", default="sim", show_default=True, help="Engine backend by name.")
@click.option("--backend-option", "backend_options", multiple=True, help="KEY=VALUE for the backend.")
@click.option("--model", default=MODELS[0], show_default=True, help="Engine model preset.")
@click.option("--client", default="study", show_default=True, help="How the clients retry.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--seeds", type=click.IntRange(1, MAX_RUNS), default=1, show_default=True)
@click.option("--time-scale", type=TIME_SCALE, default=1.0, show_default=True)
@click.option("--jobs", type=click.IntRange(1, MAX_JOBS), default=1, show_default=True)
@click.option(
    "--executor", "executor_name", type=click.Choice(sorted(EXECUTORS)), default="local", show_default=True
)
@click.option("--address", default=None, help="--executor ray: the cluster's HOST:PORT.")
@click.option(
    "--headroom-range",
    "range_text",
    default=f"{HEADROOM_RANGE[0]:g}:{HEADROOM_RANGE[1]:g}",
    show_default=True,
    help="LO:HI, the mean loads searched (multiples of Ĉ).",
)
@click.option("--precision", type=LOAD, default=PRECISION, show_default=True)
@click.option("--progress/--no-progress", default=False, show_default=True)
def plan_daily_command(
    recording: Path,
    state: Path,
    at_text: str,
    once: bool,
    window_hours: float,
    policies_text: str,
    policy_in_force: str,
    margin: float,
    capacity: float | None,
    detector: str | None,
    engine_instance: str | None,
    database: str | None,
    host: str,
    port: int,
    backend: str,
    backend_options: tuple[str, ...],
    model: str,
    client: str,
    seed: int,
    seeds: int,
    time_scale: float,
    jobs: int,
    executor_name: str,
    address: str | None,
    range_text: str,
    precision: float,
    progress: bool,
) -> None:
    """Replay the recording's last day under each policy, find each one's headroom against the
    delivery objective, keep the history and serve it as series (VLLMHeadroomLow reads them)."""
    from detector.store import StoreOpenError
    from reproduce.engine.presets import PRESET_NAMES, PresetError
    from reproduce.workloads.client import ClientConfigError
    from reproduce.workloads.clients import parse_client
    from reproduce.workloads.plan import RunClock

    if capacity is None and detector is None:
        raise click.UsageError(NO_CAPACITY)
    try:
        hour, minute = parse_at(at_text)
    except DailyError as exc:
        raise click.BadParameter(str(exc), param_hint="'--at'") from None
    try:
        policies = parse_policies(policies_text)
    except WhatIfError as exc:
        raise click.BadParameter(str(exc), param_hint="'--policies'") from None
    lo, hi = _range(range_text)
    try:
        spec = parse_client(client)
    except ClientConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="'--client'") from None
    options = parse_backend_options(backend_options)
    engine = backend_of(backend, options)
    if backend == "sim" and model not in PRESET_NAMES:  # before any run (the schedule's would only log it)
        raise click.BadParameter(
            f"unknown engine preset {model!r}; choose one of {', '.join(PRESET_NAMES)}",
            param_hint="'--model'",
        )
    state.mkdir(parents=True, exist_ok=True)
    setup = WhatIf(
        backend=engine, backend_name=backend, backend_options=options, model=model,
        client=ClientProfile(name=spec.name, base=spec.config), workload=PulseWorkload(), seed=seed,
        seeds=seeds, clock=RunClock(time_scale), progress=progress,
        executor=sweep_executor(executor_name, jobs, address, engine),
    )  # fmt: skip
    try:
        job = DailyJob(
            recording, state, setup, policies, policy_in_force, margin, capacity, window_hours * 3600,
            precision, lo, hi, database, detector, engine_instance,
        )  # fmt: skip
        history = History(job.url)
    except DailyError as exc:
        raise click.BadParameter(str(exc), param_hint="'--policy-in-force'") from None
    except StoreOpenError as exc:
        raise click.BadParameter(str(exc), param_hint="'--database'") from None
    if once:
        try:
            day = run_day(job)
        except PresetError as exc:
            raise click.BadParameter(str(exc), param_hint="'--model'") from None
        except (DailyError, WhatIfError, ValueError, RuntimeError, OSError) as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
        click.echo(day.says())
        for p in policies:
            click.echo(
                f"{p}: headroom {day.headroom[p]:g}x Ĉ at peak ({day.kind[p]}), {day.ratio(p):.3g}x the "
                f"peak; {day.search_text(p)}"
            )
        click.echo(f"wrote {day.out} and the history {job.url}")
        return
    _serve(job, history, hour, minute, host, port)


def _serve(job: DailyJob, history: History, hour: int, minute: int, host: str, port: int) -> None:
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.cron import CronTrigger

    from foundation.bounds import HttpBounds
    from foundation.server import serve

    runner = Runner(job)
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.add_job(
        runner.run, CronTrigger(hour=hour, minute=minute, timezone="UTC"), id="daily-whatif",
        max_instances=1, coalesce=True, misfire_grace_time=3600,
    )  # fmt: skip
    scheduler.start()
    click.echo(
        f"plan-daily: each day at {hour:02d}:{minute:02d} UTC; serving http://{host}:{port}/metrics", err=True
    )
    try:
        serve(make_app(history, runner), HttpBounds(host=host, port=port), None, "warning")
    finally:
        scheduler.shutdown(wait=False)
        history.close()
