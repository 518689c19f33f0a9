"""Benchmark: time from page load to all live graphs drawn, with 6 h of 5-s history for 8 engines.

Serves 8 engines x 6 h x 5 s of signal history (24 signals each) from a detector-API-shaped
server in its own process, starts ``retrywatch dashboard`` as a real process, and loads the live
page with the 6-h range in headless Chromium at 1280x720, timing navigation start -> the 4 graphs
drawn with their data, then an engine switch -> graphs redrawn. Before each timing the history
moves on by one 5-s scrape, so the dashboard cannot answer from memory. Target: <= 2 s for the
page load.

    .venv/bin/python bench/bench_dashboard.py [--repeat 5] [--engines 8] [--hours 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.dashboard

from dashboard.context import Context, DashboardConfig
from dashboard.data import instance_label
from dashboard.pages import live
from foundation.processes import ManagedProcess, free_port
from tests.dashboard.conftest import CHROMIUM_FLAGS
from tests.dashboard.staticapi import StaticDetectorAPI, synthetic_history
from tests.systemtools import locate, missing_line

# The argument: [the engine's instance, its chip's label (instance_label)].
GRAPHS_DRAWN = """([engine, label]) => {
    const ids = ['graph-attempts', 'graph-fates', 'graph-queue', 'graph-prompt'];
    const chip = document.querySelector('#engine-states');
    return ids.every(id => {
        const gd = document.querySelector('#' + id + ' .js-plotly-plot');
        if (!gd || !gd._fullData || !gd.querySelector('.main-svg')) return false;
        return gd._fullData.some(t => t.x && t.x.length >= 600);
    }) && chip && chip.innerText.includes(label)
      && document.querySelector('#graph-attempts .js-plotly-plot').layout.uirevision.startsWith(engine + ':');
}"""


def drawn(engine: str) -> list[str]:
    """GRAPHS_DRAWN's argument for ``engine``."""
    return [engine, instance_label(engine)]


def instance_url(i: int) -> str:
    """Engine ``i``'s instance: the URL the detector scrapes its proxy at."""
    return f"http://10.0.0.{i + 1}:8100/metrics"


def serve_history(n_engines: int, hours: float, ready: mp.Queue[str], commands: mp.Queue[float]) -> None:
    """Serve ``n_engines`` x ``hours`` of 5-s history until terminated (a child process)."""
    now = time.time()
    api = StaticDetectorAPI().start()
    for i in range(n_engines):
        collapse = now - 1800 if i % 3 == 0 else None
        # A real fleet: engines keyed by instance, vLLM's engine label "0" on every one.
        api.set_signals(
            instance_url(i),
            synthetic_history(end=now, duration_s=hours * 3600, collapse_from=collapse, seed=i),
            engine="0",
            model="qwen",
        )
    ready.put(api.url)
    while True:
        # Each command is a new "scrape": the history moves on, so no fetch is remembered.
        api.advance(float(commands.get()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--hours", type=float, default=6.0)
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    # The history server runs in its own process, like the detector does.
    ready: mp.Queue[str] = mp.Queue()
    commands: mp.Queue[float] = mp.Queue()
    server = mp.Process(target=serve_history, args=(args.engines, args.hours, ready, commands), daemon=True)
    server.start()
    api_url = ready.get(timeout=120)
    engines = [instance_url(i) for i in range(args.engines)]
    points = int(args.hours * 3600 / 5) + 1
    port = free_port()
    chromium = locate("chromium")
    if chromium is None:
        raise SystemExit(missing_line("chromium"))
    cmd = [sys.executable, "-m", "retrywatch", "dashboard", "--detector", api_url, "--port", str(port)]
    log = Path(tempfile.mkdtemp(prefix="bench-dashboard-")) / "dashboard.log"  # kept
    proc = ManagedProcess(cmd, log_path=log, bound_s=None, name="dashboard").start()
    try:
        base = f"http://127.0.0.1:{port}"
        proc.wait_ready(base + "/", timeout_s=60, poll_s=0.2)
        cold: list[float] = []
        warm: list[float] = []
        switches: list[float] = []
        first, other = engines[0], engines[1 % len(engines)]
        url = f"{base}/?{urllib.parse.urlencode({'engine': first, 'range': int(args.hours * 3600)})}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
            for r in range(args.repeat + 1):  # round 0 warms the server and is not counted
                context = browser.new_context(viewport={"width": 1280, "height": 720})
                times = []
                for visit in range(2):  # a first visit (empty cache), then a returning one
                    commands.put(5.0)
                    time.sleep(0.2)
                    page = context.new_page()
                    t0 = time.perf_counter()
                    page.goto(url)
                    page.wait_for_function(GRAPHS_DRAWN, arg=drawn(first), timeout=60_000, polling="raf")
                    times.append(time.perf_counter() - t0)
                    if visit == 0:
                        page.close()  # its refresh timer would compete with the next visit
                commands.put(5.0)
                time.sleep(0.2)
                page.click("#live-engine")
                t1 = time.perf_counter()
                page.get_by_role("option", name=instance_label(other), exact=True).click()
                page.wait_for_function(GRAPHS_DRAWN, arg=drawn(other), timeout=60_000, polling="raf")
                if r > 0:
                    cold.append(times[0])
                    warm.append(times[1])
                    switches.append(time.perf_counter() - t1)
                context.close()
            browser.close()
        # The server-side share of a refresh: the live callback run in this process.
        ctx = Context(DashboardConfig(detector_url=api_url))
        server_side = []
        for _ in range(args.repeat):
            commands.put(5.0)
            time.sleep(0.2)
            t0 = time.perf_counter()
            live.update(ctx, first, int(args.hours * 3600))
            server_side.append(time.perf_counter() - t0)
    finally:
        proc.stop(grace_s=10.0)
        server.terminate()
        server.join(timeout=10)
    print(
        f"history: {args.engines} engines x {args.hours:g} h at 5 s ({points} points per signal, 24 signals)"
    )
    for label, values in (
        ("page load -> 4 graphs drawn, first visit", cold),
        ("page load -> 4 graphs drawn, returning (cached scripts)", warm),
        ("engine switch -> 4 graphs redrawn", switches),
        ("  of which the live callback (fetch 18+3 signals, build 4 figures)", server_side),
    ):
        print(f"{label}: median {statistics.median(values):.2f} s, max {max(values):.2f} s (n={len(values)})")
    print("target: page load <= 2 s")
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
