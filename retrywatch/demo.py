"""``retrywatch demo``: the whole stack on one machine, and a pulse that tips it.

Starts, as subprocesses stopped by PID, the emulated engine (``retrywatch emulate``, scaled
time), the proxy (``retrywatch proxy``), the detector (``retrywatch detect --exporter``, SQLite
in a temporary folder) and the dashboard (``retrywatch dashboard``); then drives the study's
pulse (base 0.6 Ĉ, pulse 2.7 Ĉ, hold 0.6 Ĉ, planned once in wall seconds) with
retrying clients (``retrywatch.demo_load``). Without controls the proxy runs the study's "no
control" condition (retries on, no coalescing, cancellation off): the pulse's backlog outlives
the deadline, retries keep the engine saturated and the detector's ``VLLMMetastableRetryLoop``
fires. ``--with-controls`` runs the same pulse through coalescing with deferred cancellation,
which attaches retries to their live execution so the engine recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import tempfile
import time
import webbrowser
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import click
import httpx

from exporter.policy import Cancellation, PolicyConfig
from exporter.settings import ProxySettings
from foundation.logs import announce, check_port, log_options, setup_logging
from foundation.metricnames import VLLM_NUM_WAITING
from foundation.options import FiniteFloatRange, listen_host
from foundation.processes import ManagedProcess, ProcessStartError, log_tail
from foundation.timeseries import parse_exposition
from reproduce.engine.presets import PresetError, preset_capacity
from reproduce.workloads.calls import WorkloadSpec
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import RunClock, RunPlan, outline

if TYPE_CHECKING:
    from reproduce.harness.openloop import OpenLoopStats

__all__ = ["DemoPlan", "demo", "demo_commands", "demo_plan"]

#: The emulated engine's preset: the study's Qwen3-14B on one H100, its slowest model, so the
#: emulated token stream (Ĉ x ~400 tokens per engine second) stays light for a laptop.
DEMO_PRESET = "qwen3-14b-h100"
#: Engine seconds per wall second (K = 4): the protocol's 947-s trace plays in under 4 minutes.
DEMO_CLOCK = RunClock(4.0)
CANCEL_AFTER_S = PolicyConfig().cancel_after_s  # the study's deferred cancellation W (engine seconds)
VOCAB_SIZE = 32_000
SERVICES = ("engine", "proxy", "detector", "dashboard")


@dataclass(frozen=True)
class DemoPlan:
    """Every number the demo runs with: the study's pulse and client planned once (``run``, in wall
    seconds) for an engine of ``preset``; the services and the banner read it from there."""

    preset: str
    capacity_engine: float  # Ĉ in calls per engine second
    with_controls: bool
    spec: WorkloadSpec  # the study's pulse at Ĉ (seed 0), its phases and arrivals in engine seconds
    run: RunPlan  # spec's phases and the study's client in wall seconds (no calls)

    @property
    def capacity(self) -> float:
        """Ĉ in calls per wall second."""
        return self.run.run_rate(self.capacity_engine)

    @property
    def deadline_s(self) -> float:
        return self.run.deadline_s

    @property
    def cancel_after_s(self) -> float:
        return self.run.run_s(CANCEL_AFTER_S)

    def planned(self, seed: int, capacity_engine: float | None = None, **fields: Any) -> RunPlan:
        """The load's run (the study's pulse unless ``fields`` say otherwise) at Ĉ
        ``capacity_engine`` (default: this engine's), planned at :attr:`run`'s clock: its calls,
        phases and the study's client in wall seconds."""
        capacity = self.capacity_engine if capacity_engine is None else capacity_engine
        spec = replace(self.spec, capacity=capacity, seed=seed, **fields)
        return self.run.clock.plan_spec(spec, ClientConfig())

    @property
    def pulse_text(self) -> str:
        """When the pulse runs, in wall seconds from the load's start (``120-227 s`` at K = 1)."""
        pulse = self.run.pulse
        assert pulse is not None  # the study's pulse has one
        return f"{pulse.start_s:.0f}-{pulse.end_s:.0f} s"


def demo_plan(with_controls: bool, preset: str = DEMO_PRESET, clock: RunClock = DEMO_CLOCK) -> DemoPlan:
    """The demo's numbers: Ĉ of ``preset`` (its calibration), planned at ``clock``."""
    try:
        capacity = preset_capacity(preset)
    except PresetError as exc:
        raise click.UsageError(str(exc)) from None
    spec = WorkloadSpec(capacity=capacity, seed=0, max_context=32_768)
    return DemoPlan(preset, capacity, with_controls, spec, outline(spec, ClientConfig(), clock))


# --- processes ------------------------------------------------------------------------------


@dataclass
class _Service:
    name: str
    url: str
    ready_path: str
    process: ManagedProcess | None = None


def proxy_settings(plan: DemoPlan, upstream: str, host: str, port: int) -> ProxySettings:
    """The demo's proxy: the study's "no control" condition (retries on, no coalescing,
    cancellation off), or with controls coalescing with deferred cancellation."""
    return ProxySettings(
        upstream=upstream,
        host=host,
        port=port,
        coalesce=plan.with_controls,
        cancellation=Cancellation.DEFERRED if plan.with_controls else Cancellation.OFF,
        cancel_after_s=plan.cancel_after_s,
        capacity=plan.capacity,
        deadline_s=plan.deadline_s,
        vocab_size=VOCAB_SIZE,
    )


def demo_commands(plan: DemoPlan, ports: dict[str, int], host: str, workdir: Path) -> dict[str, list[str]]:
    exe = [sys.executable, "-m", "retrywatch"]
    engine_url = f"http://{host}:{ports['engine']}"
    proxy_url = f"http://{host}:{ports['proxy']}"
    detector_url = f"http://{host}:{ports['detector']}"
    capacity = ["--capacity", f"{plan.capacity:.4f}", "--deadline", f"{plan.deadline_s:g}"]
    return {
        "engine": [
            *exe,
            "emulate",
            "--model",
            plan.preset,
            *plan.run.clock.argv(),
            "--vocab-size",
            str(VOCAB_SIZE),
            "--host",
            host,
            "--port",
            str(ports["engine"]),
        ],
        "proxy": [*exe, "proxy", *proxy_settings(plan, engine_url, host, ports["proxy"]).to_argv()],
        "detector": [
            *exe,
            "detect",
            "--exporter",
            proxy_url + "/metrics",
            "--db",
            f"sqlite:///{workdir / 'detector.db'}",
            "--interval",
            "2",
            *capacity,
            "--host",
            host,
            "--port",
            str(ports["detector"]),
        ],
        "dashboard": [
            *exe,
            "dashboard",
            "--detector",
            detector_url,
            "--host",
            host,
            "--port",
            str(ports["dashboard"]),
        ],
    }


def take_stop_signals() -> dict[int, Any]:
    """Make Ctrl-C (SIGINT) and SIGTERM stop the demo (a ``KeyboardInterrupt``), whatever its
    parent left them as (a shell starts a background job with SIGINT ignored, and the ignoring is
    inherited); returns the handlers to put back (:func:`restore_signals`)."""

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    return {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate),
    }


def restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _start(service: _Service, command: Sequence[str], workdir: Path) -> None:
    # Own session: a Ctrl-C in the terminal reaches the demo only, which stops each child by PID.
    service.process = ManagedProcess(
        command, log_path=workdir / f"{service.name}.log", bound_s=None, name=f"the {service.name}"
    ).start()


class Served(Protocol):
    """A service the demos start: where it answers once ready, and its process."""

    url: str
    ready_path: str
    process: ManagedProcess | None


def stop_services(services: Sequence[Served]) -> None:
    """Stop each service's process, the last started first."""
    for service in reversed(services):
        if service.process is not None:
            service.process.stop(grace_s=8.0)


def wait_services_ready(services: Sequence[Served], deadline: float, at_least_s: float = 0.0) -> None:
    """Wait until each service answers (below 500) by ``deadline`` (``time.monotonic``), giving
    each at least ``at_least_s``; a service that exits or does not answer ends the command."""
    for service in services:
        assert service.process is not None
        try:
            service.process.wait_ready(
                service.url + service.ready_path,
                timeout_s=max(at_least_s, deadline - time.monotonic()),
                poll_s=0.25,
                ready=lambda status: status < 500,
            )
        except ProcessStartError as exc:
            raise click.ClickException(str(exc)) from None


# --- the run ------------------------------------------------------------------------------


async def _engine_waiting(http: httpx.AsyncClient, engine_url: str) -> str:
    """The engine's ``vllm:num_requests_waiting`` (as text; "?" when unreachable)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        samples = parse_exposition((await http.get(engine_url + "/metrics")).text)
        waiting = [value for name, _, value in samples if name == VLLM_NUM_WAITING]
        if waiting:
            return f"{sum(waiting):.0f}"
    return "?"


async def _alerts(http: httpx.AsyncClient, detector_url: str) -> list[str]:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        response = await http.get(detector_url + "/alerts")
        return sorted({a["alertname"] for a in response.json()["alerts"]})
    return []


async def _episodes(http: httpx.AsyncClient, detector_url: str) -> list[str]:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        response = await http.get(detector_url + "/episodes")
        return sorted({e["alertname"] for e in response.json()["episodes"]})
    return []


async def _run(plan: DemoPlan, services: list[_Service], duration_s: float, seed: int) -> None:
    from reproduce.harness.openloop import OpenLoopStats
    from retrywatch.demo_load import run_load

    run_plan = plan.planned(seed)
    bounds = [(p.name, p.start_s, p.end_s) for p in run_plan.phases]
    proxy, detector = services[1], services[2]
    stats = OpenLoopStats()
    load = asyncio.create_task(
        run_load(proxy.url, run_plan, served_model=plan.preset, vocab_size=VOCAB_SIZE, stats=stats, seed=seed)
    )
    start = time.monotonic()
    fired: set[str] = set()
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            announced = False
            while (elapsed := time.monotonic() - start) < duration_s:
                await asyncio.sleep(min(10.0, max(0.1, duration_s - elapsed)))
                elapsed = time.monotonic() - start
                phase = next((name for name, a, b in bounds if a <= elapsed < b), "drain")
                firing = await _alerts(http, detector.url)
                fired.update(firing)
                if load.done() and not announced:
                    announced = True
                    click.echo("the pulse is over; everything stays up until --duration ends or Ctrl-C")
                waiting = await _engine_waiting(http, services[0].url)
                click.echo(
                    f"[{elapsed:6.1f}s] {phase:<5} calls {stats.calls_started}: "
                    f"{stats.calls_delivered} delivered ({stats.calls_delivered_in_deadline} in deadline), "
                    f"{stats.calls_failed} failed; "
                    f"attempts {stats.attempts_sent} ({stats.retries_sent} retries); "
                    f"engine waiting {waiting}; firing: {', '.join(firing) or 'none'}"
                )
            fired.update(await _episodes(http, detector.url))
    finally:
        load.cancel()
        try:
            await load
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # report the driver's failure, then stop everything as usual
            click.echo(f"the load driver failed: {type(exc).__name__}: {exc}", err=True)
    click.echo(closing_summary(stats, fired))


def closing_summary(stats: OpenLoopStats, fired: set[str]) -> str:
    """The demo's last line: calls delivered within the deadline and late side by side (a call
    delivered after its deadline is one its client already gave up on), failed, alerts fired."""
    late = stats.calls_delivered - stats.calls_delivered_in_deadline
    return (
        f"done: of {stats.calls_started} calls, {stats.calls_delivered_in_deadline} delivered within "
        f"the deadline, {late} delivered late (after it), {stats.calls_failed} failed"
        f"{_undelivered(stats)}; alerts fired: {', '.join(sorted(fired)) or 'none'}"
    )


def _serving(urls: dict[str, str], workdir: Path) -> str:
    """The demo's start line: every service's URL, and where their logs and database live."""
    detector = urls["detector"]
    return (
        f"engine {urls['engine']}, proxy {urls['proxy']} (metrics /metrics), detector {detector} "
        f"(alerts {detector}/alerts, runbook {detector}/runbook), dashboard {urls['dashboard']}; "
        f"logs and the detector's database in {workdir} (removed at the end)"
    )


def _undelivered(stats: OpenLoopStats) -> str:
    pending = stats.calls_started - stats.calls_delivered - stats.calls_failed
    return f", {pending} still in progress" if pending > 0 else ""


#: How long the demo runs unless told (``--duration``), wall seconds.
DEFAULT_DURATION_S = 300.0
#: The longest range the demo's link opens on: a demo kept running longer (``--duration inf``)
#: shows the last 15 min, the pulse and the loop that follows it, not a sliver of 6 h.
LONGEST_LINK_RANGE_S = 900


def dashboard_range_s(duration_s: float) -> int:
    """The live page's range (one of its presets) for a demo of ``duration_s``: the smallest that
    holds the whole run, so the pulse and the loop fill the panels instead of a sliver at their
    right (5 min for the default 300 s)."""
    from dashboard.pages.live import RANGES

    wanted = min(duration_s, LONGEST_LINK_RANGE_S)
    return next(seconds for _, seconds in RANGES if seconds >= wanted)


def dashboard_link(dashboard_url: str, duration_s: float) -> str:
    """The live page of ``dashboard_url`` on the range that fits a demo of ``duration_s``."""
    return f"{dashboard_url.rstrip('/')}/?range={dashboard_range_s(duration_s)}"


def how_long(duration_s: float) -> str:
    """The start banner's line on how long the demo runs, and how to keep it running."""
    if duration_s == float("inf"):
        return "It runs until Ctrl-C (--duration inf), then stops every service."
    return (
        f"It runs {duration_s:g} s, then stops every service, the dashboard and its history with "
        "them: --duration SECONDS runs longer, --duration inf until Ctrl-C."
    )


def _what_to_watch(plan: DemoPlan, dashboard_url: str, duration_s: float) -> str:
    pulse = plan.pulse_text
    if plan.with_controls:
        story = (
            "With controls (coalescing + cancellation deferred by "
            f"{plan.cancel_after_s:g} s), retries attach to their call's live execution: executions "
            "created stay near the call rate, the backlog drains after the pulse and service recovers."
        )
    else:
        story = (
            "Without controls (retries on, no coalescing, cancellation off), the pulse's backlog "
            f"outlives the {plan.deadline_s:g}-s deadline: every timed-out attempt leaves an orphaned "
            "execution and a retry, executions created climb above capacity, and "
            "VLLMMetastableRetryLoop fires. It does not recover."
        )
    return (
        f"\nDashboard: {dashboard_url}\n"
        f"Time runs {plan.run.clock.k:g}x faster than the study's: capacity {plan.capacity:.2f} calls/s, "
        f"deadline {plan.deadline_s:g} s, pulse at {pulse} (2.7x capacity).\n{story}\n"
        "Watch executions created vs capacity, the engine's waiting queue, and the alerts.\n"
        f"{how_long(duration_s)}\n"
    )


@click.command("demo")
@click.option(
    "--duration",
    type=FiniteFloatRange(min=5.0, allow_inf=True),
    default=DEFAULT_DURATION_S,
    show_default=True,
    help="Seconds to run before stopping everything, the dashboard with it ('inf': until Ctrl-C).",
)
@click.option(
    "--with-controls", is_flag=True, help="Run the proxy with coalescing and deferred cancellation."
)
@click.option("--no-browser", is_flag=True, help="Do not open the dashboard in a browser.")
@click.option("--engine-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--proxy-port", type=click.IntRange(1, 65535), default=8100, show_default=True)
@click.option("--detector-port", type=click.IntRange(1, 65535), default=8200, show_default=True)
@click.option("--dashboard-port", type=click.IntRange(1, 65535), default=8050, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, callback=listen_host)
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the workload trace."
)
@log_options
def demo(
    duration: float,
    with_controls: bool,
    no_browser: bool,
    engine_port: int,
    proxy_port: int,
    detector_port: int,
    dashboard_port: int,
    host: str,
    seed: int,
    log_level: str,
    log_format: str,
) -> None:
    """Start engine, proxy, detector and dashboard, and drive a pulse of retrying clients."""
    ports = {
        "engine": engine_port,
        "proxy": proxy_port,
        "detector": detector_port,
        "dashboard": dashboard_port,
    }
    if len(set(ports.values())) != len(ports):
        raise click.UsageError("the four ports must differ")
    for name, port in ports.items():
        check_port(host, port, f"--{name}-port", what=f"the {name}")
    setup_logging(log_level, log_format)
    plan = demo_plan(with_controls)
    urls = {name: f"http://{host}:{port}" for name, port in ports.items()}
    ready = {"engine": "/health", "proxy": "/metrics", "detector": "/healthz", "dashboard": "/"}
    services = [_Service(name, urls[name], ready[name]) for name in SERVICES]

    previous = take_stop_signals()
    with tempfile.TemporaryDirectory(prefix="retrywatch-demo-") as tmp:
        workdir = Path(tmp)
        log_args = ["--log-level", log_level, "--log-format", log_format]  # each service's, in its log
        commands = {
            name: [*argv, *log_args] for name, argv in demo_commands(plan, ports, host, workdir).items()
        }
        try:
            for service in services:
                _start(service, commands[service.name], workdir)
            wait_services_ready(services, time.monotonic() + 60.0)
            announce(_serving(urls, workdir))
            link = dashboard_link(urls["dashboard"], duration)
            click.echo(_what_to_watch(plan, link, duration))
            if not no_browser:
                with contextlib.suppress(Exception):
                    webbrowser.open(link)
            asyncio.run(_run(plan, services, duration, seed))
        except KeyboardInterrupt:
            click.echo("\ninterrupted: stopping")
        finally:
            stop_services(services)
            engine_log = services[0].process.log_path if services[0].process else None
            if engine_log is not None and "trails the scaled wall clock" in log_tail(engine_log, 20_000):
                click.echo(
                    "note: this machine could not step the emulated engine in time (CPU-bound), so it ran "
                    "below its capacity; close other work or run on a larger machine."
                )
            restore_signals(previous)
