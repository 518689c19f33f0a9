"""End to end in a real headless Chromium: ``retrywatch dashboard`` and ``retrywatch detect
--replay`` as real processes. The detector replays (paced) a run that tips into the retry loop
and recovers; the live page shows the banner while its alerts fire and none once they resolve,
over the detector's real signal history; the history page lists the real episodes."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from foundation.processes import ManagedProcess, free_port

from .conftest import Page, write_episode_series

pytestmark = pytest.mark.browser

REPLAY_SPEED = 20.0  # run-seconds per wall second: the loop fires ~6 s in, resolves ~18 s in
PROCESS_START_S = 90.0


def _start(args: list[str], log: Path) -> ManagedProcess:
    argv = [sys.executable, "-m", "retrywatch", *args]
    return ManagedProcess(argv, log_path=log, bound_s=None, name=args[0]).start()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[dict[str, Any]]:
    started: list[ManagedProcess] = []
    yield {"started": started, "tmp": tmp_path}
    for proc in reversed(started):
        proc.stop(grace_s=10)


def test_live_page_against_the_real_detector(browser: Any, processes: dict[str, Any]) -> None:
    tmp: Path = processes["tmp"]
    series = tmp / "runs" / "episode" / "metrics.jsonl"
    write_episode_series(series)
    detector_port, dashboard_port = free_port(), free_port()
    detector_url = f"http://127.0.0.1:{detector_port}"
    # Both start at once (each takes seconds to import); the replay is paced from its start.
    detector = _start(
        [
            "detect",
            "--replay",
            str(series),
            "--replay-speed",
            str(REPLAY_SPEED),
            "--db",
            f"sqlite:///{tmp / 'episodes.db'}",
            "--port",
            str(detector_port),
        ],
        tmp / "detector.log",
    )
    processes["started"].append(detector)
    dashboard = _start(
        ["dashboard", "--detector", detector_url, "--port", str(dashboard_port), "--refresh", "1"],
        tmp / "dashboard.log",
    )
    processes["started"].append(dashboard)
    base = f"http://127.0.0.1:{dashboard_port}"
    dashboard.wait_ready(base + "/", timeout_s=PROCESS_START_S, poll_s=0.2)
    detector.wait_ready(detector_url + "/healthz", timeout_s=PROCESS_START_S, poll_s=0.2)

    tab = Page(browser)
    tab.page.goto(base + "/?range=900")
    tab.wait_graphs(4)
    banner = tab.page.locator("#alert-banner")
    tab.page.wait_for_function(
        "() => document.querySelector('#alert-banner').innerText.includes('VLLMMetastableRetryLoop')",
        timeout=60_000,
    )
    assert "CRITICAL" in banner.inner_text()
    with urllib.request.urlopen(detector_url + "/signals", timeout=5) as r:
        engines = json.load(r)["engines"]
    assert engines == ["episode"]  # the replayed run's slug is its instance, the detector's key
    assert tab.page.locator("#live-engine").inner_text().strip() == engines[0]  # selected by default
    assert "on episode (qwen) since" in banner.inner_text()  # by instance and model, never "on 0"
    # Ĉ and the deadline first, with where they come from: the run's series state both (the
    # deadline as the proxy's gauge alone, without its source series)
    capacity = tab.page.locator("#tile-input_capacity").inner_text()
    deadline = tab.page.locator("#tile-input_deadline").inner_text()
    assert "2.8 calls/s" in capacity and "stated" in capacity and "since" in capacity
    assert "120 s" in deadline and "the proxy's" in deadline
    tab.screenshot("live-real-detector.png")
    # the recovery: the loop's condition clears and it keeps firing a while, shown as resolving
    tab.page.wait_for_function(
        "() => document.querySelector('#alert-banner').innerText.includes('RESOLVING critical')",
        timeout=60_000,
    )
    assert "unless it returns" in banner.inner_text()
    tab.screenshot("live-real-detector-resolving.png")
    banner.wait_for(state="hidden", timeout=60_000)  # every alert resolved after the recovery
    tab.wait_graphs(4)
    assert tab.trace_max("graph-attempts", "executions created") > 2.8  # the loop, in the history
    shaded = tab.page.evaluate(
        "() => document.querySelector('#graph-attempts .js-plotly-plot').layout.shapes.length"
    )
    assert shaded >= 1
    tab.screenshot("live-real-detector-resolved.png")

    tab.page.goto(base + "/history")
    tab.wait_graphs(1)
    tab.page.wait_for_function("() => document.querySelectorAll('.episode-row').length >= 2")
    rows = tab.page.locator("#episodes-table").inner_text()
    assert "VLLMMetastableRetryLoop" in rows and "critical" in rows
    assert "firing" not in rows
    assert tab.errors == [], tab.errors
    tab.close()
    if os.environ.get("RETRYWATCH_KEEP_LOGS"):
        print((tmp / "dashboard.log").read_text(), (tmp / "detector.log").read_text())
