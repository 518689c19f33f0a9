"""``retrywatch demo --fleet N``: the fleet of docs/fleet.md on one machine, with real parts.

N replicas, each an emulated engine (``retrywatch emulate``) behind its own ``retrywatch proxy``;
nginx in front of them, from the shipped ``deploy/nginx`` configuration rendered by
``deploy/render.py`` (consistent hash of ``X-Call-Id``); Debian's Prometheus scraping every proxy
as job ``retrywatch`` (``deploy/prometheus/prometheus.yml`` with its targets filled in) with
``rules/retrywatch.rules.yml`` loaded and sending to Debian's Alertmanager
(``deploy/alertmanager/alertmanager.yml``, its webhook receivers left out); the detector reading
Prometheus; the dashboard reading the detector and Prometheus. Every child is a
:class:`foundation.processes.ManagedProcess` stopped by PID; everything lives in one temporary folder.

The replicas differ in capacity: replica 1 emulates the study's slowest preset (Ĉ 1.09 calls per
engine second), the others its fastest (2.78). The demo's pulse (``retrywatch.demo_load``, the
study's phases) is sized so that each replica's share of it, spread by the balancer, is the
study's pulse for replica 1 (base 0.6 Ĉ, pulse 2.7 Ĉ) and stays under the others' capacity:
replica 1 tips into the retry loop, the others stay healthy.

Ports: nginx 8080, Prometheus 9090, Alertmanager 9093, detector 8200, dashboard 8050; replica i
(1..N) has its engine on ``--engine-port`` + i - 1 (8000, 8001, ...) and its proxy on
``--proxy-port`` + i - 1 (8100, 8101, ...). Everything binds ``--host`` (127.0.0.1).

``retrywatch demo`` (``retrywatch/cli.py``) is :data:`demo` here: ``retrywatch.demo``'s
single-engine command, unchanged, with the fleet's options added (:func:`with_fleet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import sys
import tempfile
import time
import webbrowser
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import httpx
import yaml
from click.core import ParameterSource

from exporter.settings import ProxySettings
from foundation.logs import announce, check_port, setup_logging
from foundation.options import FiniteFloatRange
from foundation.processes import ManagedProcess, log_tail
from reproduce.workloads.plan import RunClock, RunPlan
from retrywatch import demo as single
from rules.generate import RULES_PATH

__all__ = [
    "APT_INSTALL",
    "FleetDemo",
    "FleetPlan",
    "FleetPorts",
    "Replica",
    "demo",
    "drive",
    "missing_binaries",
    "run_fleet_demo",
    "serving",
    "with_fleet",
]

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
#: Replica 1: the study's slowest preset, tipped by the pulse. The others: its fastest.
TIPPED_PRESET = "qwen3-14b-h100"
HEALTHY_PRESET = "qwen2.5-7b-h100"
#: The model name every replica serves (clients send one name whatever replica they reach).
SERVED_MODEL = "retrywatch-demo"
DEFAULT_REPLICAS = 3
MAX_REPLICAS = 16
PULSE_MULTIPLE = 2.7
#: Debian's packages for the parts that are not Python: binary -> package.
BINARIES: dict[str, str] = {
    "nginx": "nginx",
    "prometheus": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
}
APT_INSTALL = "apt-get install nginx prometheus prometheus-alertmanager"
_SBIN = ("/usr/sbin", "/sbin")  # nginx lives here, often outside a user's PATH


def missing_binaries() -> list[str]:
    """The fleet's non-Python binaries not found on this machine."""
    return [name for name in BINARIES if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(Path(d) / name) for d in _SBIN if (Path(d) / name).is_file()), None
    )


def _load_render() -> ModuleType:
    """``deploy/render.py`` (a standalone script beside the packages) as a module."""
    path = DEPLOY / "render.py"
    if not path.is_file():
        raise click.ClickException(
            f"the fleet demo runs from a source checkout: {path} (the shipped nginx renderer) is missing"
        )
    spec = importlib.util.spec_from_file_location("retrywatch_deploy_render", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """One replica's part of the plan: its name (Prometheus' ``instance``), preset and Ĉ."""

    index: int  # 1..N
    preset: str
    capacity_engine: float  # Ĉ in calls per engine second

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


@dataclass(frozen=True)
class FleetPlan:
    """Every number the fleet demo runs with: each replica's single-engine plan, planned once."""

    replicas: tuple[Replica, ...]
    with_controls: bool
    replica_plans: tuple[single.DemoPlan, ...]  # by replica, in the order of ``replicas``

    def replica_plan(self, replica: Replica) -> single.DemoPlan:
        """The single-engine demo's plan of ``replica``: its numbers in wall seconds."""
        return self.replica_plans[replica.index - 1]

    @property
    def run(self) -> RunPlan:
        """Replica 1's run plan (the pulse's phases and the client, in wall seconds)."""
        return self.replica_plans[0].run

    @property
    def deadline_s(self) -> float:
        return self.run.deadline_s

    @property
    def load_capacity_engine(self) -> float:
        """The capacity the pulse is sized against: N x replica 1's Ĉ, so that each replica's share
        of the load is the study's pulse for replica 1."""
        return len(self.replicas) * self.replicas[0].capacity_engine

    def capacity(self, replica: Replica) -> float:
        """Ĉ of ``replica`` in calls per wall second."""
        return self.replica_plan(replica).capacity


def fleet_plan(n: int, *, with_controls: bool = False, clock: RunClock = single.DEMO_CLOCK) -> FleetPlan:
    """N replicas, each planned at ``clock``."""
    if not 2 <= n <= MAX_REPLICAS:
        raise click.UsageError(f"--fleet takes 2 to {MAX_REPLICAS} replicas, got {n}")
    presets = [TIPPED_PRESET] + [HEALTHY_PRESET] * (n - 1)
    plans = tuple(single.demo_plan(with_controls, p, clock) for p in presets)
    replicas = tuple(Replica(i, p.preset, p.capacity_engine) for i, p in enumerate(plans, start=1))
    return FleetPlan(replicas, with_controls, plans)


@dataclass(frozen=True)
class FleetPorts:
    """Every port the fleet listens on; replica i's engine and proxy at the bases + i - 1."""

    nginx: int = 8080
    prometheus: int = 9090
    alertmanager: int = 9093
    detector: int = 8200
    dashboard: int = 8050
    engine_base: int = 8000
    proxy_base: int = 8100

    def engine(self, replica: Replica) -> int:
        return self.engine_base + replica.index - 1

    def proxy(self, replica: Replica) -> int:
        return self.proxy_base + replica.index - 1

    def by_option(self, plan: FleetPlan) -> dict[int, tuple[str, str]]:
        """port -> (what listens there, the option that moves it); UsageError on a clash."""
        out: dict[int, tuple[str, str]] = {}
        entries = [
            (self.nginx, "nginx", "--nginx-port"),
            (self.prometheus, "Prometheus", "--prometheus-port"),
            (self.alertmanager, "Alertmanager", "--alertmanager-port"),
            (self.detector, "the detector", "--detector-port"),
            (self.dashboard, "the dashboard", "--dashboard-port"),
            *((self.engine(r), f"the engine of {r.name}", "--engine-port") for r in plan.replicas),
            *((self.proxy(r), f"the proxy of {r.name}", "--proxy-port") for r in plan.replicas),
        ]
        for port, what, option in entries:
            if not 1 <= port <= 65535:
                raise click.UsageError(f"{what} would listen on port {port}: change {option}")
            if port in out:
                other, other_option = out[port]
                change = option if option == other_option else f"{option} or {other_option}"
                raise click.UsageError(
                    f"{what} and {other} would both listen on port {port}: change {change}"
                )
            out[port] = (what, option)
        return out


def check_ports_free(plan: FleetPlan, ports: FleetPorts, host: str) -> None:
    """Exit 2 with one line naming the option to change for the first port taken on ``host``, as
    the single-engine demo and every serving command do (:func:`foundation.logs.check_port`)."""
    for port, (what, option) in ports.by_option(plan).items():
        check_port(host, port, option, what=what)


# --- configuration files ------------------------------------------------------------------------


def prometheus_config(plan: FleetPlan, ports: FleetPorts, host: str) -> dict[str, Any]:
    """``deploy/prometheus/prometheus.yml`` with this fleet's proxies, rules and Alertmanager: one
    target per proxy, its ``instance`` the replica's name."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text("utf-8"))
    config["rule_files"] = [str(RULES_PATH)]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"{host}:{ports.alertmanager}"]}]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [
        {"targets": [f"{host}:{ports.proxy(r)}"], "labels": {"instance": r.name}} for r in plan.replicas
    ]
    return config


def alertmanager_config() -> dict[str, Any]:
    """``deploy/alertmanager/alertmanager.yml`` as shipped (grouping, routes, inhibition), its
    receivers without their placeholder webhooks: alerts are seen in its API and UI."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text("utf-8"))
    config["receivers"] = [{"name": r["name"]} for r in config["receivers"]]
    return config


# --- processes ----------------------------------------------------------------------------------


@dataclass
class Service:
    name: str
    url: str
    ready_path: str
    argv: list[str]
    process: ManagedProcess | None = None


@dataclass
class FleetDemo:
    """The fleet's processes: ``start()`` (all of them, each awaited), ``stop()`` (by PID)."""

    plan: FleetPlan
    ports: FleetPorts
    host: str
    workdir: Path
    services: list[Service] = field(default_factory=list)
    #: ``--log-level LEVEL --log-format FORMAT`` of the demo, given to each retrywatch process
    #: (Prometheus and Alertmanager get their equivalents, :func:`binary_log_args`).
    log_args: tuple[str, ...] = ()

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"

    @property
    def nginx_url(self) -> str:
        return self.url(self.ports.nginx)

    @property
    def prometheus_url(self) -> str:
        return self.url(self.ports.prometheus)

    @property
    def alertmanager_url(self) -> str:
        return self.url(self.ports.alertmanager)

    @property
    def detector_url(self) -> str:
        return self.url(self.ports.detector)

    @property
    def dashboard_url(self) -> str:
        return self.url(self.ports.dashboard)

    def proxy_url(self, replica: Replica) -> str:
        return self.url(self.ports.proxy(replica))

    def engine_url(self, replica: Replica) -> str:
        return self.url(self.ports.engine(replica))

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def _plan_services(self) -> list[Service]:
        out = self._plan_commands()
        for service in out:
            if service.argv[:3] == [sys.executable, "-m", "retrywatch"]:
                service.argv += self.log_args
            elif service.name in ("prometheus", "alertmanager"):
                service.argv += binary_log_args(self.log_args)
        return out

    def _plan_commands(self) -> list[Service]:
        plan, ports, host, work = self.plan, self.ports, self.host, self.workdir
        exe = [sys.executable, "-m", "retrywatch"]
        vocab = str(single.VOCAB_SIZE)
        binary = {name: _which(name) or name for name in BINARIES}
        out: list[Service] = []
        for r in plan.replicas:
            out.append(
                Service(
                    f"engine {r.name}",
                    self.engine_url(r),
                    "/health",
                    [
                        *exe,
                        "emulate",
                        "--model",
                        r.preset,
                        "--served-model-name",
                        SERVED_MODEL,
                        *plan.run.clock.argv(),
                        "--vocab-size",
                        vocab,
                        "--host",
                        host,
                        "--port",
                        str(ports.engine(r)),
                    ],
                )
            )
        for r in plan.replicas:
            # The single-engine demo's proxy (its "no control" condition, or with controls), at
            # this replica's capacity.
            settings: ProxySettings = single.proxy_settings(
                plan.replica_plan(r), self.engine_url(r), host, ports.proxy(r)
            )
            out.append(
                Service(
                    f"proxy {r.name}", self.proxy_url(r), "/metrics", [*exe, "proxy", *settings.to_argv()]
                )
            )
        nginx_conf = _load_render().render_nginx(
            [f"{host}:{ports.proxy(r)}" for r in plan.replicas], f"{host}:{ports.nginx}", work / "nginx"
        )
        out.append(
            Service(
                "nginx",
                self.nginx_url,
                "/health",
                [binary["nginx"], "-p", str(nginx_conf.parent), "-e", "stderr", "-c", str(nginx_conf)],
            )
        )
        am_yml = work / "alertmanager.yml"
        am_yml.write_text(yaml.safe_dump(alertmanager_config(), sort_keys=False), encoding="utf-8")
        out.append(
            Service(
                "alertmanager",
                self.alertmanager_url,
                "/-/ready",
                [
                    binary["prometheus-alertmanager"],
                    f"--config.file={am_yml}",
                    f"--web.listen-address={host}:{ports.alertmanager}",
                    "--cluster.listen-address=",
                    f"--storage.path={work / 'alertmanager'}",
                ],
            )
        )
        prom_yml = work / "prometheus.yml"
        prom_yml.write_text(
            yaml.safe_dump(prometheus_config(plan, ports, host), sort_keys=False), encoding="utf-8"
        )
        out.append(
            Service(
                "prometheus",
                self.prometheus_url,
                "/-/ready",
                [
                    binary["prometheus"],
                    f"--config.file={prom_yml}",
                    f"--web.listen-address={host}:{ports.prometheus}",
                    f"--storage.tsdb.path={work / 'prometheus'}",
                    "--storage.tsdb.retention.time=1d",
                ],
            )
        )
        out.append(
            Service(
                "detector",
                self.detector_url,
                "/healthz",
                [
                    *exe,
                    "detect",
                    "--prometheus",
                    self.prometheus_url,
                    "--db",
                    f"sqlite:///{work / 'detector.db'}",
                    "--interval",
                    "2",
                    "--host",
                    host,
                    "--port",
                    str(ports.detector),
                ],
            )
        )
        out.append(
            Service(
                "dashboard",
                self.dashboard_url,
                "/",
                [
                    *exe,
                    "dashboard",
                    "--detector",
                    self.detector_url,
                    "--prometheus",
                    self.prometheus_url,
                    "--host",
                    host,
                    "--port",
                    str(ports.dashboard),
                ],
            )
        )
        return out

    def start(self, timeout_s: float = 90.0) -> None:
        """Start every process (replicas first, nginx once they answer), each awaited on HTTP."""
        self.services = self._plan_services()
        deadline = time.monotonic() + timeout_s
        # Start in waves so that a process finds what it reads already there.
        waves = [
            [s for s in self.services if s.name.startswith(("engine", "proxy", "alertmanager"))],
            [s for s in self.services if s.name in ("nginx", "prometheus")],
            [s for s in self.services if s.name in ("detector", "dashboard")],
        ]
        for wave in waves:
            for service in wave:
                log = self.workdir / f"{service.name.replace(' ', '-')}.log"
                service.process = ManagedProcess(
                    service.argv, log_path=log, bound_s=None, name=service.name
                ).start()
            single.wait_services_ready(wave, deadline, at_least_s=1.0)

    def stop(self) -> None:
        single.stop_services(self.services)

    def engine_lagged(self) -> bool:
        """Whether an emulated engine could not keep up with the scaled wall clock (CPU-bound)."""
        return any(
            s.process is not None and "trails the scaled wall clock" in log_tail(s.process.log_path, 20_000)
            for s in self.services
            if s.name.startswith("engine")
        )


def binary_log_args(log_args: Sequence[str]) -> list[str]:
    """Prometheus' and Alertmanager's flags for the demo's ``--log-level`` and ``--log-format``."""
    options = dict(zip(log_args[::2], log_args[1::2], strict=True))
    out: list[str] = []
    if "--log-level" in options:
        level = {"critical": "error", "warning": "warn"}.get(options["--log-level"].lower())
        out.append(f"--log.level={level or options['--log-level'].lower()}")
    if "--log-format" in options:
        out.append(f"--log.format={'json' if options['--log-format'] == 'json' else 'logfmt'}")
    return out


@contextlib.contextmanager
def running_fleet(
    plan: FleetPlan,
    ports: FleetPorts,
    host: str = "127.0.0.1",
    *,
    timeout_s: float = 90.0,
    announce: Callable[[FleetDemo], None] | None = None,
    log_args: Sequence[str] = (),
) -> Iterator[FleetDemo]:
    """The fleet started in a temporary folder, stopped and the folder removed on exit;
    ``announce(fleet)`` is called before anything starts; ``log_args``: ``--log-level`` and
    ``--log-format`` for every process."""
    with tempfile.TemporaryDirectory(prefix="retrywatch-fleet-") as tmp:
        fleet = FleetDemo(plan, ports, host, Path(tmp), log_args=tuple(log_args))
        if announce is not None:
            announce(fleet)
        try:
            fleet.start(timeout_s=timeout_s)
            yield fleet
        finally:
            fleet.stop()


# --- the run ------------------------------------------------------------------------------------


async def firing_by_instance(http: httpx.AsyncClient, prometheus_url: str) -> dict[str, list[str]]:
    """Prometheus' firing alerts: {instance: sorted alert names}."""
    out: dict[str, set[str]] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
        response = await http.get(prometheus_url + "/api/v1/alerts")
        for alert in response.json()["data"]["alerts"]:
            if alert.get("state") == "firing":
                labels = alert["labels"]
                out.setdefault(labels.get("instance", "?"), set()).add(labels["alertname"])
    return {k: sorted(v) for k, v in out.items()}


async def drive(
    fleet: FleetDemo,
    duration_s: float,
    *,
    seed: int = 0,
    report_every_s: float = 10.0,
    on_report: Callable[[str], None] = click.echo,
    stop_when: Callable[[dict[str, list[str]]], bool] | None = None,
) -> dict[str, list[str]]:
    """Drive the pulse through nginx for ``duration_s`` (or until ``stop_when(firing)``), reporting
    the clients' counts and each replica's firing alerts; every alert that fired, by instance."""
    from reproduce.harness.openloop import OpenLoopStats
    from reproduce.workloads.calls import paper_phases
    from retrywatch.demo_load import run_load

    plan = fleet.plan
    first = plan.replica_plan(plan.replicas[0])
    run_plan = first.planned(seed, plan.load_capacity_engine, phases=paper_phases(PULSE_MULTIPLE))
    bounds = [(p.name, p.start_s, p.end_s) for p in run_plan.phases]
    stats = OpenLoopStats()
    load = asyncio.create_task(
        run_load(
            fleet.nginx_url,
            run_plan,
            served_model=SERVED_MODEL,
            vocab_size=single.VOCAB_SIZE,
            stats=stats,
            seed=seed,
        )
    )
    fired: dict[str, set[str]] = {}
    start = time.monotonic()
    next_report = start + report_every_s
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while (elapsed := time.monotonic() - start) < duration_s:
                await asyncio.sleep(min(1.0, max(0.05, duration_s - elapsed)))
                firing = await firing_by_instance(http, fleet.prometheus_url)
                for instance, names in firing.items():
                    fired.setdefault(instance, set()).update(names)
                if stop_when is not None and stop_when(firing):
                    break
                if time.monotonic() >= next_report:
                    next_report += report_every_s
                    elapsed = time.monotonic() - start
                    phase = next((name for name, a, b in bounds if a <= elapsed < b), "drain")
                    states = "; ".join(
                        f"{r.name} {', '.join(firing.get(r.name, [])) or 'ok'}" for r in plan.replicas
                    )
                    on_report(
                        f"[{elapsed:6.1f}s] {phase:<5} calls {stats.calls_started}: {stats.calls_delivered} "
                        f"delivered ({stats.calls_delivered_in_deadline} in deadline), {stats.calls_failed} "
                        f"failed; attempts {stats.attempts_sent} ({stats.retries_sent} retries) | {states}"
                    )
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return {k: sorted(v) for k, v in fired.items()}


def _what_to_watch(fleet: FleetDemo, duration_s: float) -> str:
    plan = fleet.plan
    lines = [
        "",
        f"The fleet: {len(plan.replicas)} replicas behind nginx (consistent hash of X-Call-Id), "
        f"time {plan.run.clock.k:g}x faster than the study's, deadline {plan.deadline_s:g} s.",
    ]
    for r in plan.replicas:
        lines.append(
            f"  {r.name}: engine ({r.preset}, Ĉ {plan.capacity(r):.2f} calls/s) {fleet.engine_url(r)}, "
            f"proxy {fleet.proxy_url(r)}"
        )
    pulse = plan.replica_plan(plan.replicas[0]).pulse_text
    lines += [
        f"  nginx        {fleet.nginx_url}   (clients' address)",
        f"  Prometheus   {fleet.prometheus_url}   (alerts: {fleet.prometheus_url}/alerts)",
        f"  Alertmanager {fleet.alertmanager_url}",
        f"  detector     {fleet.detector_url}",
        f"  dashboard    {single.dashboard_link(fleet.dashboard_url, duration_s)}",
        f"The pulse ({pulse}) is spread over the replicas: {plan.replicas[0].name}, the slowest, gets "
        f"{PULSE_MULTIPLE:g}x its capacity and tips into the retry loop (VLLMMetastableRetryLoop for "
        f"instance={plan.replicas[0].name}); the others stay under theirs and stay healthy.",
        single.how_long(duration_s),
        "",
    ]
    return "\n".join(lines)


def serving(fleet: FleetDemo) -> str:
    """The fleet demo's start line, as the single-engine demo's: every service's URL, and where
    their logs, configurations and the detector's database live."""
    replicas = ", ".join(
        f"{r.name} engine {fleet.engine_url(r)} proxy {fleet.proxy_url(r)}" for r in fleet.plan.replicas
    )
    detector = fleet.detector_url
    return (
        f"nginx {fleet.nginx_url} (clients' address), {replicas}, Prometheus {fleet.prometheus_url} "
        f"(alerts {fleet.prometheus_url}/alerts), Alertmanager {fleet.alertmanager_url}, detector "
        f"{detector} (alerts {detector}/alerts, runbook {detector}/runbook), dashboard "
        f"{fleet.dashboard_url}; logs, configurations and the detector's database in {fleet.workdir} "
        "(removed at the end)"
    )


def run_fleet_demo(
    n: int,
    *,
    duration_s: float,
    with_controls: bool,
    no_browser: bool,
    host: str,
    seed: int,
    ports: FleetPorts,
    clock: RunClock = single.DEMO_CLOCK,
    log_level: str = "warning",
    log_format: str = "text",
) -> None:
    """The ``retrywatch demo --fleet N`` command: check, start, drive, stop."""
    missing = missing_binaries()
    if missing:
        raise click.ClickException(
            f"the fleet demo needs {', '.join(missing)} (Debian packages): {APT_INSTALL}"
        )
    plan = fleet_plan(n, with_controls=with_controls, clock=clock)
    check_ports_free(plan, ports, host)
    setup_logging(log_level, log_format)
    log_args = ("--log-level", log_level, "--log-format", log_format)  # each process's, in its log

    previous = single.take_stop_signals()
    lagged = False
    try:
        with running_fleet(
            plan, ports, host, announce=lambda f: click.echo(_what_to_watch(f, duration_s)), log_args=log_args
        ) as fleet:
            try:
                announce(serving(fleet))
                click.echo("every process is ready: the pulse starts now")
                if not no_browser:
                    with contextlib.suppress(Exception):
                        webbrowser.open(single.dashboard_link(fleet.dashboard_url, duration_s))
                fired = asyncio.run(drive(fleet, duration_s, seed=seed))
                summary = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(fired.items())) or "none"
                click.echo(f"done: alerts fired (Prometheus) {summary}")
            finally:
                lagged = fleet.engine_lagged()
    except KeyboardInterrupt:
        click.echo("\ninterrupted: stopped every process")
    finally:
        single.restore_signals(previous)
    if lagged:
        click.echo(
            "note: this machine could not step the emulated engines in time (CPU-bound), so they ran "
            "below their capacity; use fewer replicas, close other work or run on a larger machine."
        )


FLEET_OPTIONS: tuple[click.Option, ...] = (
    click.Option(
        ["--fleet"],
        type=click.IntRange(2, MAX_REPLICAS),
        is_flag=False,
        flag_value=DEFAULT_REPLICAS,
        default=None,
        help=f"Run a fleet of N replicas behind nginx, with Prometheus and Alertmanager "
        f"(--fleet alone: {DEFAULT_REPLICAS}). Engines and proxies then take N ports from "
        "--engine-port and --proxy-port.",
    ),
    click.Option(
        ["--nginx-port"],
        type=click.IntRange(1, 65535),
        default=FleetPorts().nginx,
        show_default=True,
        help="With --fleet: the balancer's port.",
    ),
    click.Option(
        ["--prometheus-port"],
        type=click.IntRange(1, 65535),
        default=FleetPorts().prometheus,
        show_default=True,
        help="With --fleet: Prometheus' port.",
    ),
    click.Option(
        ["--alertmanager-port"],
        type=click.IntRange(1, 65535),
        default=FleetPorts().alertmanager,
        show_default=True,
        help="With --fleet: Alertmanager's port.",
    ),
    click.Option(
        ["--time-scale"],
        type=FiniteFloatRange(1.0, 16.0),
        default=single.DEMO_CLOCK.k,
        show_default=True,
        help="With --fleet: engine seconds per wall second (the single-engine demo's).",
    ),
)


def with_fleet(command: click.Command) -> click.Command:
    """``command`` (the single-engine ``retrywatch demo``) with the fleet's options: without
    ``--fleet`` it runs as it is; with it, the fleet runs, taking the single demo's duration,
    controls, browser, host, seed and ports."""
    fleet_names = [str(option.name) for option in FLEET_OPTIONS]

    def callback(**kwargs: Any) -> None:
        ctx = click.get_current_context()
        fleet = {name: kwargs.pop(name) for name in fleet_names}
        if fleet["fleet"] is None:
            for option in FLEET_OPTIONS[1:]:  # given without --fleet: never silently ignored
                if ctx.get_parameter_source(str(option.name)) not in (None, ParameterSource.DEFAULT):
                    raise click.UsageError(f"{option.opts[0]} needs --fleet")
            ctx.invoke(command, **kwargs)
            return
        ports = FleetPorts(
            nginx=fleet["nginx_port"],
            prometheus=fleet["prometheus_port"],
            alertmanager=fleet["alertmanager_port"],
            detector=kwargs["detector_port"],
            dashboard=kwargs["dashboard_port"],
            engine_base=kwargs["engine_port"],
            proxy_base=kwargs["proxy_port"],
        )
        run_fleet_demo(
            fleet["fleet"],
            duration_s=kwargs["duration"],
            with_controls=kwargs["with_controls"],
            no_browser=kwargs["no_browser"],
            host=kwargs["host"],
            seed=kwargs["seed"],
            ports=ports,
            clock=RunClock(fleet["time_scale"]),
            log_level=kwargs["log_level"],
            log_format=kwargs["log_format"],
        )

    return click.Command(
        command.name,
        params=[*command.params, *FLEET_OPTIONS],
        callback=callback,
        help=command.help,
        short_help=command.short_help,
        context_settings=command.context_settings,
    )


#: ``retrywatch demo`` (``retrywatch/cli.py``): the single-engine demo, or ``--fleet N``.
demo = with_fleet(single.demo)
