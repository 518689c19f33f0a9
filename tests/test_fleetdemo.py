"""``retrywatch demo --fleet N``: its plan and configurations (checked by promtool and amtool), its
errors, its shutdown, and the whole fleet end to end with real nginx, Prometheus and Alertmanager.

The end-to-end test drives the demo's pulse through nginx at a shorter time scale and sees the
retry-loop alert fire for the slow replica only, in Prometheus, Alertmanager and the detector;
it kills a replica's proxy and sees a retry of a call held there served by another replica, and
the no-data alert fire for that replica only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from foundation.processes import ManagedProcess, free_port, port_taken
from reproduce.workloads.plan import RunClock
from retrywatch import fleetdemo
from retrywatch.fleetdemo import FleetDemo, FleetPorts, fleet_plan, running_fleet
from tests.systemtools import require

LOOP = "VLLMMetastableRetryLoop"
NO_DATA = "VLLMRetrywatchNoData"
#: The end-to-end test's time scale: the study's pulse and deadline 6x faster than real time.
E2E_TIME_SCALE = 6.0


def _consecutive_free(n: int, avoid: set[int]) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1, none of them in ``avoid``."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000)
        span = set(range(base, base + n))
        if not span & avoid and all(port_taken("127.0.0.1", p) is None for p in span):
            return base
    raise RuntimeError("no run of free ports found")


def free_fleet_ports(n: int) -> FleetPorts:
    singles: list[int] = []
    while len(singles) < 5:
        port = free_port()
        if port not in singles:
            singles.append(port)
    engine = _consecutive_free(n, set(singles))
    proxy = _consecutive_free(n, set(singles) | set(range(engine, engine + n)))
    return FleetPorts(*singles, engine_base=engine, proxy_base=proxy)


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


# --- the plan and the configurations ----------------------------------------------------------


def test_each_replicas_share_of_the_pulse_tips_replica_one_and_stays_under_the_others_capacity() -> None:
    plan = fleet_plan(3)
    share = fleetdemo.PULSE_MULTIPLE * plan.load_capacity_engine / len(plan.replicas)
    first, *others = plan.replicas
    assert share / first.capacity_engine == pytest.approx(fleetdemo.PULSE_MULTIPLE)
    assert all(share / r.capacity_engine < 1.1 for r in others)
    assert len({r.name for r in plan.replicas}) == 3


def test_port_clashes_name_the_option_to_change() -> None:
    plan = fleet_plan(3)
    with pytest.raises(Exception, match="--proxy-port"):
        FleetPorts(engine_base=8100, proxy_base=8102).by_option(plan)
    with pytest.raises(Exception, match="--nginx-port"):
        FleetPorts(nginx=8001).by_option(plan)


def test_prometheus_scrapes_every_proxy_as_its_replica_and_loads_the_rules(tmp_path: Path) -> None:
    plan = fleet_plan(4)
    ports = FleetPorts()
    config = fleetdemo.prometheus_config(plan, ports, "127.0.0.1")
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "retrywatch"
    assert [(c["targets"], c["labels"]["instance"]) for c in job["static_configs"]] == [
        ([f"127.0.0.1:{8100 + i}"], f"replica-{i + 1}") for i in range(4)
    ]
    assert config["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    check = subprocess.run(
        [require("promtool"), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 1 rule files found" in check.stdout + check.stderr


def test_alertmanager_keeps_the_shipped_routes_without_webhooks(tmp_path: Path) -> None:
    config = fleetdemo.alertmanager_config()
    assert config["route"]["group_by"] == ["alertname", "instance"]
    assert all(set(r) == {"name"} for r in config["receivers"])
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    check = subprocess.run(
        [require("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


# --- the command's errors and its shutdown ----------------------------------------------------


def _demo(args: list[str], **kwargs: Any) -> list[str]:
    return [sys.executable, "-m", "retrywatch", "demo", "--no-browser", *args]


def _port_args(ports: FleetPorts) -> list[str]:
    return [
        "--nginx-port", str(ports.nginx), "--prometheus-port", str(ports.prometheus),
        "--alertmanager-port", str(ports.alertmanager), "--detector-port", str(ports.detector),
        "--dashboard-port", str(ports.dashboard), "--engine-port", str(ports.engine_base),
        "--proxy-port", str(ports.proxy_base),
    ]  # fmt: skip


def _require_fleet_tools() -> None:
    """The fleet's Debian binaries, each found (or the test skipped, failed under CI=true)."""
    for name in fleetdemo.BINARIES:
        require(name)


def test_a_taken_port_fails_before_anything_starts_naming_the_option() -> None:
    _require_fleet_tools()  # the command checks for them before its ports
    ports = free_fleet_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.proxy_base + 2))
        taken.listen()
        result = subprocess.run(
            _demo(["--fleet", *_port_args(ports)]), capture_output=True, text=True, timeout=60
        )
    # A usage error (exit 2) in the words of the single-engine demo and every serving command.
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{ports.proxy_base + 2} for the proxy of replica-3 "
        "(Address already in use): pick another with --proxy-port"
    ]


def test_a_missing_package_names_the_install_command(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bin_dir)}
    result = subprocess.run(
        _demo(["--fleet", "2", *_port_args(free_fleet_ports(2))]),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    assert "prometheus" in result.stderr
    assert fleetdemo.APT_INSTALL in result.stderr


def test_the_log_options_reach_every_process_and_the_start_line_is_announced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --fleet ignored --log-level and --log-format (its processes logged at their defaults) and
    # printed no start line, unlike the single-engine demo and every serving command.
    from click.testing import CliRunner

    from retrywatch.cli import main

    seen: dict[str, Any] = {}

    @contextlib.contextmanager
    def not_started(
        plan: Any, ports: FleetPorts, host: str = "127.0.0.1", **kwargs: Any
    ) -> Iterator[FleetDemo]:
        fleet = FleetDemo(plan, ports, host, tmp_path, log_args=tuple(kwargs.get("log_args", ())))
        fleet.services = fleet._plan_services()  # planned, not started
        seen["fleet"] = fleet
        yield fleet

    async def no_pulse(fleet: FleetDemo, duration_s: float, **kwargs: Any) -> dict[str, list[str]]:
        return {}

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # the command sets its own
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(fleetdemo, "missing_binaries", list)
    monkeypatch.setattr(fleetdemo, "running_fleet", not_started)
    monkeypatch.setattr(fleetdemo, "drive", no_pulse)
    ports = free_fleet_ports(2)
    args = ["demo", "--no-browser", "--fleet", "2", "--log-level", "info", "--log-format", "json"]
    result = CliRunner().invoke(main, [*args, *_port_args(ports)])
    assert result.exit_code == 0, result.output
    fleet = seen["fleet"]
    for service in fleet.services:
        if service.argv[1:3] == ["-m", "retrywatch"]:
            assert service.argv[-4:] == ["--log-level", "info", "--log-format", "json"], service.argv
    assert {"--log.level=info", "--log.format=json"} <= set(fleet.service("prometheus").argv)
    assert {"--log.level=info", "--log.format=json"} <= set(fleet.service("alertmanager").argv)
    (start,) = [json.loads(line) for line in result.output.splitlines() if line.startswith('{"time"')]
    assert start["logger"] == "retrywatch.start" and start["message"] == fleetdemo.serving(fleet)
    for port in (ports.nginx, ports.prometheus, ports.alertmanager, ports.detector, ports.dashboard):
        assert f"http://127.0.0.1:{port}" in start["message"]
    assert f"replica-2 engine http://127.0.0.1:{ports.engine_base + 1}" in start["message"]
    assert f"runbook http://127.0.0.1:{ports.detector}/runbook" in start["message"]
    assert f"in {tmp_path} (removed at the end)" in start["message"]


def test_warning_maps_to_the_binaries_levels() -> None:
    assert fleetdemo.binary_log_args(["--log-level", "warning", "--log-format", "text"]) == [
        "--log.level=warn",
        "--log.format=logfmt",
    ]
    assert fleetdemo.binary_log_args(["--log-level", "CRITICAL"]) == ["--log.level=error"]


def test_fleet_options_without_fleet_are_usage_errors() -> None:
    # They were silently ignored: the single-engine demo ran at its own time scale.
    for extra in (["--time-scale", "8"], ["--nginx-port", "8081"], ["--prometheus-port", "9091"]):
        result = subprocess.run(
            _demo(["--duration", "5", *extra]), capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"Error: {extra[0]} needs --fleet"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_every_process_and_removes_the_temporary_folder(tmp_path: Path) -> None:
    _require_fleet_tools()
    ports = free_fleet_ports(2)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = _demo(["--fleet", "2", "--duration", "600", *_port_args(ports)])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{ports.dashboard}/", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert any(tmp_path.iterdir())  # the fleet's temporary folder
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert process.returncode == 0, output[-3000:]
    assert "interrupted: stopped every process" in output
    assert f"nginx        http://127.0.0.1:{ports.nginx}" in output  # printed before anything starts
    every = [ports.nginx, ports.prometheus, ports.alertmanager, ports.detector, ports.dashboard]
    every += [ports.engine_base, ports.engine_base + 1, ports.proxy_base, ports.proxy_base + 1]
    assert all(_port_closed(port) for port in every)
    assert not any(tmp_path.iterdir())


# --- the fleet end to end ---------------------------------------------------------------------


def _prometheus_firing(fleet: FleetDemo) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        for alert in httpx.get(fleet.prometheus_url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]:
            if alert["state"] == "firing":
                out.setdefault(alert["labels"]["instance"], set()).add(alert["labels"]["alertname"])
    return out


def _alertmanager_active(fleet: FleetDemo) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        for alert in httpx.get(fleet.alertmanager_url + "/api/v2/alerts", timeout=5).json():
            out.setdefault(alert["labels"]["instance"], set()).add(alert["labels"]["alertname"])
    return out


def _detector_firing(fleet: FleetDemo) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        for alert in httpx.get(fleet.detector_url + "/alerts", timeout=5).json()["alerts"]:
            out.setdefault(alert["labels"]["instance"], set()).add(alert["alertname"])
    return out


def _attempts(fleet: FleetDemo, replica: fleetdemo.Replica) -> dict[str, float]:
    """The proxy's attempts by kind ({} when it does not answer)."""
    out: dict[str, float] = {}
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(fleet.proxy_url(replica) + "/metrics", timeout=5).text.splitlines():
            if line.startswith("retrywatch_attempts_total{"):
                kind = line.split('kind="', 1)[1].split('"', 1)[0]
                out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def _completion(
    client: httpx.Client, fleet: FleetDemo, call_id: str, retry: int | None = None
) -> httpx.Response:
    headers = {"X-Call-Id": call_id}
    if retry is not None:
        headers["x-stainless-retry-count"] = str(retry)
    body = {"model": fleetdemo.SERVED_MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2}
    return client.post(fleet.nginx_url + "/v1/completions", json=body, headers=headers)


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float, describe: Callable[[], object]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(2)
    pytest.fail(f"{what} not seen within {timeout_s:.0f} s: {describe()}")


@contextlib.contextmanager
def _pulse(fleet: FleetDemo, duration_s: float) -> Iterator[dict[str, list[str]]]:
    """The demo's load driven through nginx in a thread while the test looks on."""
    fired: dict[str, list[str]] = {}
    stop = threading.Event()

    def run() -> None:
        fired.update(
            asyncio.run(
                fleetdemo.drive(
                    fleet, duration_s, on_report=lambda line: None, stop_when=lambda firing: stop.is_set()
                )
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield fired
    finally:
        stop.set()
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetDemo]:
    _require_fleet_tools()
    plan = fleet_plan(3, clock=RunClock(E2E_TIME_SCALE))
    with running_fleet(plan, free_fleet_ports(3), timeout_s=120) as started:
        yield started


def _kill(service: fleetdemo.Service) -> None:
    assert service.process is not None
    service.process.send_signal(signal.SIGKILL)
    service.process.wait(timeout=10)


def _restart(service: fleetdemo.Service) -> None:
    """The same command again (a replica's proxy restarted at its address)."""
    assert service.process is not None
    service.process.stop()
    service.process = ManagedProcess(
        service.argv, log_path=service.process.log_path, bound_s=None, name=service.name
    ).start()
    service.process.wait_ready(service.url + service.ready_path, timeout_s=60, poll_s=0.25)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_pulse_tips_one_replica_and_a_lost_replicas_calls_move_and_raise_no_data(
    fleet: FleetDemo,
) -> None:
    tipped, healthy, lost = fleet.plan.replicas
    lost_proxy = fleet.service(f"proxy {lost.name}")

    # A call held by the last replica (its first attempt counted there), found while all are idle.
    with httpx.Client(timeout=30) as client:
        for i in range(60):
            before = _attempts(fleet, lost).get("first", 0.0)
            response = _completion(client, fleet, f"probe-{i}", retry=0)
            assert response.status_code == 200, response.text
            if _attempts(fleet, lost).get("first", 0.0) == before + 1:
                held = f"probe-{i}"
                break
        else:
            pytest.fail("no probe reached the last replica")
        # Its replica's proxy dies: the call's retry (same X-Call-Id) is served by another replica.
        _kill(lost_proxy)
        retries_before = {r.name: _attempts(fleet, r).get("retry", 0.0) for r in (tipped, healthy)}
        response = _completion(client, fleet, held, retry=1)
        assert response.status_code == 200, response.text
        retries_after = {r.name: _attempts(fleet, r).get("retry", 0.0) for r in (tipped, healthy)}
        assert sum(retries_after.values()) == sum(retries_before.values()) + 1, retries_after
    _restart(lost_proxy)

    with _pulse(fleet, duration_s=240):
        # The retry loop: replica 1 only, in Prometheus, Alertmanager and the detector.
        sources = (_prometheus_firing, _alertmanager_active, _detector_firing)

        def loop_everywhere() -> bool:
            return all(LOOP in source(fleet).get(tipped.name, set()) for source in sources)

        _wait_for(
            f"{LOOP} for {tipped.name}", loop_everywhere, 150, lambda: {s.__name__: s(fleet) for s in sources}
        )
        for source in sources:
            seen = source(fleet)
            assert all(LOOP not in seen.get(r.name, set()) for r in (healthy, lost)), (source.__name__, seen)

        # A replica's proxy killed mid-run: the no-data alert fires for that replica only.
        _kill(lost_proxy)

        def no_data_for_lost() -> bool:
            return NO_DATA in _prometheus_firing(fleet).get(lost.name, set())

        _wait_for(f"{NO_DATA} for {lost.name}", no_data_for_lost, 60, lambda: _prometheus_firing(fleet))
        seen = _prometheus_firing(fleet)
        assert all(NO_DATA not in seen.get(r.name, set()) for r in (tipped, healthy)), seen
        assert LOOP in seen.get(tipped.name, set()), seen
