"""``retrywatch demo``: the command lines it runs, its port check, and a headless run."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from foundation.processes import free_port
from reproduce.harness.openloop import OpenLoopStats
from retrywatch.demo import closing_summary, dashboard_link, dashboard_range_s, demo_commands, demo_plan


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:  # distinct ones
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _value(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def test_controls_switch_the_proxy_between_no_control_and_coalescing_with_deferred_cancel(
    tmp_path: Path,
) -> None:
    ports = dict(zip(("engine", "proxy", "detector", "dashboard"), free_ports(4), strict=True))
    plain = demo_commands(demo_plan(with_controls=False), ports, "127.0.0.1", tmp_path)
    controlled = demo_commands(demo_plan(with_controls=True), ports, "127.0.0.1", tmp_path)
    assert "--no-coalesce" in plain["proxy"] and _value(plain["proxy"], "--cancellation") == "off"
    assert "--coalesce" in controlled["proxy"] and _value(controlled["proxy"], "--cancellation") == "deferred"
    plan = demo_plan(with_controls=True)
    # Deferred by W = 10 study seconds, scaled like every other duration.
    assert float(_value(controlled["proxy"], "--cancel-after")) == pytest.approx(plan.run.run_s(10.0))
    for commands in (plain, controlled):
        assert float(_value(commands["engine"], "--time-scale")) == plan.run.clock.k
        assert _value(commands["proxy"], "--upstream") == f"http://127.0.0.1:{ports['engine']}"
        assert _value(commands["detector"], "--exporter") == f"http://127.0.0.1:{ports['proxy']}/metrics"
        assert float(_value(commands["detector"], "--capacity")) == pytest.approx(plan.capacity, rel=1e-3)
        assert float(_value(commands["detector"], "--deadline")) == pytest.approx(plan.run.run_s(120.0))
        assert _value(commands["detector"], "--db").startswith(f"sqlite:///{tmp_path}")
        assert _value(commands["dashboard"], "--detector") == f"http://127.0.0.1:{ports['detector']}"
    # the pulse the story names is the load's own (120-227 study seconds), at the demo's K
    start, end = next((p.start_s, p.end_s) for p in plan.planned(seed=1).phases if p.name == "pulse")
    assert (start, end) == pytest.approx((plan.run.run_s(120.0), plan.run.run_s(227.0)))
    assert plan.pulse_text == f"{start:.0f}-{end:.0f} s"


def test_a_taken_port_fails_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine, detector, dashboard = free_ports(3)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "retrywatch",
                "demo",
                "--no-browser",
                "--duration",
                "5",
                "--engine-port",
                str(engine),
                "--proxy-port",
                str(port),
                "--detector-port",
                str(detector),
                "--dashboard-port",
                str(dashboard),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} for the proxy (Address already in use): "
        "pick another with --proxy-port"
    ]


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        # NaN passes click.FloatRange's bound: the demo used to start every service, run no pulse
        # at all and exit 0 with "done: of 0 calls".
        ("--duration", "nan", "nan is not a finite number."),
        # It started every service, then ended in a traceback from the workload's generator.
        ("--seed", "-1", "-1 is not in the range x>=0."),
    ],
)
def test_a_bad_number_is_a_usage_error_before_anything_starts(option: str, value: str, error: str) -> None:
    engine, proxy, detector, dashboard = free_ports(4)
    result = subprocess.run(
        [sys.executable, "-m", "retrywatch", "demo", "--no-browser", "--duration", "5", option, value,
         "--engine-port", str(engine), "--proxy-port", str(proxy),
         "--detector-port", str(detector), "--dashboard-port", str(dashboard)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"Error: Invalid value for '{option}': {error}"


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _retries(proxy_url: str) -> float:
    for line in httpx.get(proxy_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('retrywatch_attempts_total{kind="retry"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_headless_demo_fires_the_retry_loop_alert_and_serves_the_dashboard() -> None:
    engine, proxy, detector, dashboard = free_ports(4)
    command = [
        sys.executable,
        "-m",
        "retrywatch",
        "demo",
        "--no-browser",
        "--duration",
        "210",
        "--engine-port",
        str(engine),
        "--proxy-port",
        str(proxy),
        "--detector-port",
        str(detector),
        "--dashboard-port",
        str(dashboard),
    ]
    # Started with SIGINT ignored, as a shell starts a background job (and CI its jobs): Ctrl-C
    # must still stop the demo.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    detector_url = f"http://127.0.0.1:{detector}"
    fired = firing_amid_retries = dashboard_answered = False
    try:
        deadline = time.monotonic() + 230
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(3)
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                episodes = httpx.get(detector_url + "/episodes", timeout=5).json()["episodes"]
                fired = fired or any(e["alertname"] == "VLLMMetastableRetryLoop" for e in episodes)
                # The loop itself: retries keep arriving while the alert is firing.
                alerts = httpx.get(detector_url + "/alerts", timeout=5).json()["alerts"]
                if any(a["alertname"] == "VLLMMetastableRetryLoop" for a in alerts):
                    firing_amid_retries = _retries(f"http://127.0.0.1:{proxy}") >= 100
            with contextlib.suppress(httpx.HTTPError):
                page = httpx.get(f"http://127.0.0.1:{dashboard}/", timeout=10)
                dashboard_answered = dashboard_answered or (
                    page.status_code == 200 and "<html" in page.text.lower()
                )
            if fired and firing_amid_retries and dashboard_answered:
                break
        # Ctrl-C: the demo stops every process it started.
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired as exc:
            told = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output
            pytest.fail(
                f"the demo did not stop within 60 s of Ctrl-C; its output ended: {(told or '')[-3000:]}"
            )
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)
    assert fired, output[-3000:]
    assert firing_amid_retries, output[-3000:]
    assert dashboard_answered, output[-3000:]
    assert process.returncode == 0, output[-3000:]
    assert f"Dashboard: http://127.0.0.1:{dashboard}/?range=300" in output  # a 210-s demo: on 5 min
    assert "It runs 210 s, then stops every service, the dashboard and its history with them" in output
    assert "--duration inf until Ctrl-C" in output
    # One start line with every service's address and where their logs and database live.
    (start,) = [line for line in output.splitlines() if line.startswith("engine http://")]
    for port in (engine, proxy, detector, dashboard):
        assert f"http://127.0.0.1:{port}" in start
    assert f"runbook {detector_url}/runbook" in start and "logs and the detector's database in" in start
    assert all(_port_closed(port) for port in (engine, proxy, detector, dashboard))


def test_the_closing_summary_shows_late_deliveries_beside_those_within_the_deadline() -> None:
    # --with-controls once ended: 769 of 776 calls delivered, only 558 within the deadline
    stats = OpenLoopStats(
        calls_started=776, calls_delivered=769, calls_delivered_in_deadline=558, calls_failed=7
    )
    line = closing_summary(stats, {"VLLMBacklogBeyondDeadline"})
    assert "558 delivered within the deadline, 211 delivered late" in line
    assert "7 failed" in line and "in progress" not in line
    assert line.endswith("alerts fired: VLLMBacklogBeyondDeadline")
    stats = OpenLoopStats(calls_started=10, calls_delivered=6, calls_delivered_in_deadline=6, calls_failed=1)
    assert "0 delivered late" in closing_summary(stats, set()) and "3 still in progress" in closing_summary(
        stats, set()
    )


def test_the_dashboard_link_opens_the_live_page_on_the_range_that_fits_the_demo() -> None:
    """The default 300-s demo on 5 min (it opened on 15 min, squeezing the run into the right
    fifth of every chart); a longer one on the smallest range that holds it, at most 15 min."""
    from dashboard.pages.live import RANGES

    assert dashboard_link("http://127.0.0.1:8050", 300.0) == "http://127.0.0.1:8050/?range=300"
    assert [dashboard_range_s(d) for d in (5.0, 300.0, 301.0, 900.0, 5000.0, float("inf"))] == [
        300,
        300,
        900,
        900,
        900,
        900,
    ]
    assert {dashboard_range_s(d) for d in (5.0, 600.0, float("inf"))} <= {seconds for _, seconds in RANGES}


def test_the_demo_says_how_long_it_runs_and_how_to_keep_it_running() -> None:
    from click.testing import CliRunner

    from retrywatch.demo import demo, how_long

    assert how_long(300.0) == (
        "It runs 300 s, then stops every service, the dashboard and its history with them: "
        "--duration SECONDS runs longer, --duration inf until Ctrl-C."
    )
    assert how_long(float("inf")) == "It runs until Ctrl-C (--duration inf), then stops every service."
    shown = " ".join(CliRunner().invoke(demo, ["--help"]).output.split())
    assert "the dashboard with it ('inf': until Ctrl-C). [default: 300.0;" in shown
