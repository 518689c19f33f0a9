"""Regenerate the documentation's screenshots (docs/img/) from a real ``retrywatch demo``.

``python -m tests.dashboard.screenshots`` (from the repository root; Debian's Chromium, as the
browser tests) starts the demo headless on free ports, waits until the retry-loop alert fires
and has been firing a while, then photographs the live page through the demo's own dashboard
link (a default 300-s demo's: 5 min) and the history page at 1280 px wide, and stops the demo
by its PID. About four minutes, bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from foundation.processes import free_port
from retrywatch.demo import DEFAULT_DURATION_S, dashboard_link
from tests.dashboard.conftest import CHROMIUM_FLAGS, Page
from tests.systemtools import locate, missing_line

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
ALERT = "VLLMMetastableRetryLoop"


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _firing_since(detector_url: str) -> float | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        for alert in httpx.get(detector_url + "/alerts", timeout=5).json()["alerts"]:
            if alert["alertname"] == ALERT:
                return float(alert["started_at"])
    return None


def _shoot(dashboard_url: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    chromium = locate("chromium")
    if chromium is None:
        raise SystemExit(missing_line("chromium"))
    shots = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        tab = Page(browser)
        # The link a default demo prints (the run here lasts up to --timeout, so it is not its own).
        tab.page.goto(dashboard_link(dashboard_url, DEFAULT_DURATION_S))
        tab.wait_graphs(4)
        tab.page.locator("#alert-banner").wait_for(state="visible", timeout=30_000)
        time.sleep(2)  # the first refresh settles
        shots.append(out / "dashboard-live.png")
        tab.page.screenshot(path=str(shots[-1]), full_page=True)
        tab.page.goto(dashboard_url.rstrip("/") + "/history")
        tab.wait_graphs(1)
        tab.page.wait_for_function("() => document.querySelectorAll('.episode-row').length > 0")
        shots.append(out / "dashboard-history.png")
        tab.page.screenshot(path=str(shots[-1]), full_page=True)
        if tab.errors:
            raise SystemExit(f"the browser reported errors: {tab.errors}")
        browser.close()
    return shots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=IMG)
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds before giving up")
    parser.add_argument("--firing-for", type=float, default=150.0, help="seconds of firing to show")
    args = parser.parse_args()
    engine, proxy, detector, dashboard = _free_ports(4)
    command = [
        *(sys.executable, "-m", "retrywatch", "demo", "--no-browser", "--duration", str(args.timeout)),
        *("--engine-port", str(engine), "--proxy-port", str(proxy)),
        *("--detector-port", str(detector), "--dashboard-port", str(dashboard)),
    ]
    log = Path(tempfile.mkstemp(prefix="retrywatch-screenshots-", suffix=".log")[1])
    with log.open("w") as sink:
        demo = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    detector_url, dashboard_url = f"http://127.0.0.1:{detector}", f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline and demo.poll() is None:
            time.sleep(5)
            since = _firing_since(detector_url)
            if since is not None and time.time() - since >= args.firing_for:
                break
        else:
            raise SystemExit(f"{ALERT} did not fire for {args.firing_for:g} s within {args.timeout:g} s")
        args.out.mkdir(parents=True, exist_ok=True)
        for path in _shoot(dashboard_url, args.out):
            print(f"wrote {path}")
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)  # the demo stops every process it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            demo.wait(timeout=60)
        if demo.poll() is None:
            demo.kill()
        print(f"the demo's output: {log}")


if __name__ == "__main__":
    main()
