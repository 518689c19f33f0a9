"""Fixtures for the dashboard tests: a detector-API-shaped server, a reproduce output
directory written in the real formats, and the app served by a real HTTP server thread."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import make_server

from dashboard.app import create_app
from dashboard.context import DashboardConfig
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, write_series
from reproduce.workloads.tracecapacity import CACHE_ENV
from tests.dashboard.staticapi import StaticDetectorAPI, synthetic_history
from tests.systemtools import require

NOW = 1_790_000_000.0  # a fixed "now" (Unix s) so tests do not depend on the wall clock

# A fleet as the detector sees it: engines keyed by instance (the scraped proxy URL); vLLM's
# ``engine`` label is "0" on every vLLM, so it tells engines apart no more than in production.
ENGINE_A = "http://10.0.0.1:8100/metrics"  # past a collapse: the retry loop fires
ENGINE_B = "http://10.0.0.2:8100/metrics"  # healthy, but its prompt-token gap alert fires
MODELS = {ENGINE_A: "qwen", ENGINE_B: "llama"}


def labels_of(instance: str) -> dict[str, str]:
    return {"engine": "0", "model": MODELS.get(instance, "qwen"), "instance": instance}


def loop_alert(instance: str = ENGINE_A, started_at: float = NOW - 1100.0) -> dict[str, Any]:
    return {
        "alertname": "VLLMMetastableRetryLoop",
        "severity": "critical",
        "labels": labels_of(instance),
        "state": "firing",
        "started_at": started_at,
        "value": 2.3,
        "summary": "The engine is serving retries, not clients.",
        "description": "Executions created at 2.3 Ĉ while 5% of completions are delivered.",
    }


def gap_alert(instance: str = ENGINE_B, started_at: float = NOW - 600.0) -> dict[str, Any]:
    return {
        "alertname": "VLLMPromptTokensUncounted",
        "severity": "warning",
        "labels": labels_of(instance),
        "state": "firing",
        "started_at": started_at,
        "value": 0.3,
        "summary": "Admitted prompt tokens vLLM never counts.",
        "description": "30% of admitted prompt tokens are missing from vLLM's counter.",
    }


def episode(
    alertname: str, instance: str, start: float, end: float | None, severity: str = "warning", ident: int = 1
) -> dict[str, Any]:
    return {
        "id": ident,
        "alertname": alertname,
        "severity": severity,
        "labels": labels_of(instance),
        "started_at": start,
        "resolved_at": end,
        "summary": f"{alertname} summary",
        "description": "",
    }


@pytest.fixture
def api() -> Iterator[StaticDetectorAPI]:
    """A fleet of two engines (engine label "0" on both, distinct instances and models), 1 h of
    5-s history each: engine A past a collapse with the loop alert firing, engine B healthy with a
    prompt-token gap warning firing."""
    server = StaticDetectorAPI().start()
    server.set_signals(
        ENGINE_A,
        synthetic_history(end=NOW, duration_s=3600, collapse_from=NOW - 1200, seed=1),
        engine="0",
        model=MODELS[ENGINE_A],
    )
    server.set_signals(
        ENGINE_B, synthetic_history(end=NOW, duration_s=3600, seed=2), engine="0", model=MODELS[ENGINE_B]
    )
    server.set_alerts([loop_alert(), gap_alert()])
    server.set_episodes(
        [
            episode("VLLMBacklogBeyondDeadline", ENGINE_A, NOW - 1180, NOW - 1000, ident=1),
            episode("VLLMMetastableRetryLoop", ENGINE_A, NOW - 1100, None, severity="critical", ident=2),
            episode("VLLMOrphanedExecutions", ENGINE_B, NOW - 30000, NOW - 29000, ident=3),
            episode("VLLMPromptTokensUncounted", ENGINE_B, NOW - 600, None, ident=4),
        ]
    )
    yield server
    server.stop()


# --- a reproduce output directory ---------------------------------------------------------


def write_run_series(path: Path, *, collapse: bool, capacity: float = 2.8) -> None:
    """A run's metrics.jsonl with the proxy's and vLLM's real names: 0.6 Ĉ of first attempts;
    when ``collapse``, retries from the pulse on and completions orphaned."""
    path.parent.mkdir(parents=True, exist_ok=True)
    snaps = []
    first = retry = created = completed = orphaned = delivered = counted = admitted = 0.0
    waiting = 0.0
    for i in range(0, 121):
        t = 5.0 * i
        pulse = 120.0 <= t < 227.0
        rate_first = (2.7 if pulse else 0.6) * capacity
        rate_retry = 1.8 * capacity if collapse and t >= 200.0 else 0.0
        first += 5 * rate_first
        retry += 5 * rate_retry
        created += 5 * (rate_first + rate_retry)
        if collapse and t >= 200.0:
            orphaned += 5 * capacity
            waiting += 5 * (rate_first + rate_retry - capacity)
        else:
            completed += 5 * min(rate_first, capacity)
            delivered += 5 * min(rate_first, capacity)
            waiting = max(0.0, waiting + 5 * (rate_first - capacity))
        admitted += 5 * capacity * 12000
        counted += 5 * capacity * 12000 * (0.6 if collapse and t >= 200.0 else 1.0)
        samples = [
            (mn.ATTEMPTS, {"kind": "first"}, first),
            (mn.ATTEMPTS, {"kind": "retry"}, retry),
            (mn.ATTEMPTS_ATTACHED, {}, 0.0),
            (mn.ATTEMPTS_SHED, {"reason": "retry_budget"}, 0.0),
            (mn.EXECUTIONS_CREATED, {}, created),
            (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, completed),
            (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, orphaned),
            (mn.EXECUTIONS_FINISHED, {"fate": "cancelled"}, 0.0),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, delivered),
            (mn.CALLS_DELIVERED, {"within_deadline": "false"}, 0.0),
            (mn.EXECUTIONS_QUEUED, {}, 0.0),
            (mn.CAPACITY, {}, capacity),
            (mn.CLIENT_DEADLINE, {}, 120.0),
            (mn.VLLM_NUM_WAITING, {"engine": "0", "model_name": "qwen"}, waiting),
            (mn.VLLM_NUM_RUNNING, {"engine": "0", "model_name": "qwen"}, 40.0),
            (mn.VLLM_PROMPT_TOKENS, {"engine": "0", "model_name": "qwen"}, counted),
            (mn.VLLM_PREFIX_CACHE_QUERIES, {"engine": "0", "model_name": "qwen"}, admitted),
        ]
        snaps.append(Snapshot(t=t, samples=[(n, dict(lb), v) for n, lb, v in samples]))
    write_series(path, snaps)


def summary_run(condition: str, run: int, *, recovered: bool) -> dict[str, Any]:
    slug = f"diagnostic__{condition}__qwen2.5-7b__r{run}"
    return {
        "block": "diagnostic",
        "condition": condition,
        "model": "qwen2.5-7b",
        "run": run,
        "seed": 100 + run,
        "capacity": 2.8,
        "recovered": recovered,
        "recovery_time_s": 120.0 if recovered else None,
        "delivery": {
            "pulse": {"within_deadline": 0.5, "by_horizon": 0.95 if recovered else 0.6},
            "hold": {"within_deadline": 0.97 if recovered else 0.02, "by_horizon": 1.0 if recovered else 0.1},
            "primary": {
                "within_deadline": 0.99 if recovered else 0.01,
                "by_horizon": 1.0 if recovered else 0.05,
            },
        },
        "rates_x_capacity": {
            "attempts": 0.6 if recovered else 2.4,
            "executions_created": 0.6 if recovered else 2.3,
        },
        "series": f"runs/{slug}/metrics.jsonl",
        "duration_s": 600.0,
        "time_scale": 1.0,
        "pulse": {"start_s": 120.0, "end_s": 227.0},
        "deadline_s": 120.0,
    }


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "out"
    runs = [
        summary_run("retries-off", 1, recovered=True),
        summary_run("retries-on", 1, recovered=False),
    ]
    for run in runs:
        write_run_series(root / run["series"], collapse=not run["recovered"])
    (root / "summary.json").write_text(json.dumps({"runs": runs}))
    validation = {
        "runs": [
            {
                **{k: runs[1][k] for k in ("block", "condition", "model", "run", "series")},
                "alerts": [
                    {"alertname": "VLLMBacklogBeyondDeadline", "fired_at_s": 180.0, "resolved_at_s": None},
                    {"alertname": "VLLMMetastableRetryLoop", "fired_at_s": 260.0, "resolved_at_s": None},
                ],
            },
            {**{k: runs[0][k] for k in ("block", "condition", "model", "run", "series")}, "alerts": []},
        ]
    }
    (root / "validation.json").write_text(json.dumps(validation))
    return root


# --- a replayed trace, by the real `retrywatch reproduce run --trace` -----------------------


def whatif_dir(points_dir: Path) -> Path:
    """A what-if's DIR in ``reproduce whatif``'s shapes: whatif.json beside its points."""
    root = points_dir.parent / "whatif"
    shutil.copytree(points_dir, root / "points")

    def point(within: int, late: int, failed: int, loops: int, **extra: Any) -> dict[str, Any]:
        calls = within + late + failed
        return {
            "load": 2.7, "runs": 1, "calls": calls,
            "within_deadline": within, "late": late, "failed": failed,
            "within_deadline_share": within / calls, "late_share": late / calls,
            "failed_share": failed / calls,
            "executions_per_call": 3.34 if loops else 1.01, "collapses": 1, "loops": loops,
            "loop_at_s": [28.0] if loops else [None], "loop_for_s": [41.5] if loops else [0.0],
            "recovered": 0 if loops else 1, "safe": not loops, **extra,
        }  # fmt: skip

    def on_curve(load: float, within: int, late: int, failed: int, state: str) -> dict[str, Any]:
        return {**point(within, late, failed, int(state == "loop")), "load": load, "state": state}

    body = {
        "load": 2.7,
        "workload_text": "the study's pulse",
        "objective": {"target": 0.98, "recovery_deadlines": 2.0},
        "criterion": {
            "name": "objective",
            "safe": "meets the delivery objective",
            "unsafe": "misses the delivery objective",
        },
        "safe_rule": "A load counts as safe when every seed's run meets the delivery objective.",
        "policies": {
            "none": {
                "does": "a plain proxy",
                "at_load": point(171, 0, 609, 1, alerts={"VLLMMetastableRetryLoop": [30.0]}),
                "curve": [
                    on_curve(0.5, 780, 0, 0, "meets"),
                    on_curve(1.325, 770, 10, 0, "meets"),
                    on_curve(1.4, 700, 80, 0, "overload"),
                    on_curve(2.7, 171, 0, 609, "loop"),
                ],
                "loop_onset": {"load": 2.7, "below": 1.4, "says": "at 2.7x Ĉ (not at 1.4x)"},
                "overload": {"load": 1.4, "below": 1.325, "says": "at 1.4x Ĉ (not at 1.325x)"},
                "headroom": {
                    "headroom_load": 1.325,
                    "kind": "bracketed",
                    "precision_reached": 0.0687,
                    "lower_limit": 0.5,
                    "upper_limit": 6.0,
                    "tried": [{"load": 1.325, "safe": True}, {"load": 2.7, "safe": False}],
                },
            },
            "coalescing": {
                "does": "a retry attaches to its call's execution still running",
                "at_load": point(418, 360, 2, 0),
                "headroom": {
                    "headroom_load": 6.0,
                    "kind": "at-least",
                    "precision_reached": None,
                    "lower_limit": 0.5,
                    "upper_limit": 6.0,
                    "tried": [{"load": 6.0, "safe": True}],
                },
            },
        },
    }
    (root / "whatif.json").write_text(json.dumps(body))
    return root


TRACE = (
    Path(__file__).resolve().parents[2]
    / "reproduce"
    / "workloads"
    / "traces"
    / "data"
    / "azure_code_2023_30min.csv.gz"
)
TRACE_MODEL = "qwen2.5-7b-h100"
# The shipped slice whole (a few seconds on the simulator): at 3 Ĉ its busiest minutes collapse
# the engine into the retry loop; at 1 Ĉ nothing collapses. A window of 5 or 10 minutes of it at
# 3 Ĉ holds no collapse (its load is the window's own mean).
TRACE_SLUGS = {
    load: f"composition__no-control-azure_code_2023_30min-load{load}__{TRACE_MODEL}__r0" for load in (3, 1)
}


@pytest.fixture(scope="session")
def trace_runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reproduce output of the shipped Azure slice replayed at 3 Ĉ (a metastable collapse)
    and at 1 Ĉ (none) into one DIR, then validated: real processes, the CLI's own files."""
    out = tmp_path_factory.mktemp("trace-runs")
    env = {**os.environ, CACHE_ENV: str(out.parent / "trace-cache")}
    command = [sys.executable, "-m", "retrywatch", "reproduce"]
    for load in TRACE_SLUGS:
        run = ["run", "--trace", str(TRACE), "--load", str(load), "--model", TRACE_MODEL, "--runs", "1"]
        done = subprocess.run(
            [*command, *run, "--seed", "5", "--out", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [*command, "validate", str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    runs = {r["slug"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert any(c["metastable"] for c in runs[TRACE_SLUGS[3]]["collapses"]), "the 3-Ĉ replay must collapse"
    assert runs[TRACE_SLUGS[1]]["collapses"] == []
    return out


# --- a plan-daily state directory --------------------------------------------------------


@pytest.fixture(scope="session")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two daily runs of the real ``retrywatch reproduce plan-daily --once`` on the planner's own
    test recording (seconds each): the default policy in force, then none with a larger margin
    (as an operator would after switching)."""
    from reproduce.planner.daily import RUNS_DIR
    from tests.reproduce.planner.test_daily import invoke, write_recording
    from tests.reproduce.test_runner import SMALL

    root = tmp_path_factory.mktemp("plan")
    write_recording(root / "rec")
    out = root / "state"
    args = ["--once", "--policies", "none,default", "--capacity", str(SMALL["capacity"])]
    for extra in ([], ["--policy-in-force", "none", "--margin", "0.5"]):
        result = invoke("--recording", str(root / "rec"), "--out", str(out), *args, *extra)
        assert result.exit_code == 0, result.output
    assert len(list((out / RUNS_DIR).iterdir())) == 2  # each run its own directory (its UTC second)
    return out


# --- the app on a real HTTP server thread --------------------------------------------------


class ServedApp:
    def __init__(self, config: DashboardConfig) -> None:
        self.app = create_app(config)
        self._server = make_server("127.0.0.1", 0, self.app.server, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ServedApp:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def wait_until(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def write_episode_series(path: Path, *, capacity: float = 2.8, end_s: float = 480.0) -> None:
    """A run that tips into the retry loop and recovers, in the proxy's and vLLM's real names:
    0.6 Ĉ of first attempts; from 100 s to 200 s retries at 1.8 Ĉ with completions orphaned and
    the queue growing; then retries stop, load falls to 0.3 Ĉ, the queue drains and completions
    reach clients again.
    Prompt tokens are all counted (the 5-min gap alert would outlast a short replay), and no call
    is counted as missing its deadline (the symptom alert's 5-min burn would too); the counter is
    there, so the detector has every series it needs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    totals = dict.fromkeys(("first", "retry", "created", "completed", "orphaned", "delivered", "tokens"), 0.0)
    waiting = 0.0
    snaps = []
    for i in range(int(end_s / 5) + 1):
        t = 5.0 * i
        loop = 100.0 <= t < 200.0
        rate_first = (0.3 if t >= 200.0 else 0.6) * capacity
        rate_retry = 1.8 * capacity if loop else 0.0
        totals["first"] += 5 * rate_first
        totals["retry"] += 5 * rate_retry
        totals["created"] += 5 * (rate_first + rate_retry)
        if loop:
            totals["orphaned"] += 5 * capacity
            waiting += 5 * (rate_first + rate_retry - capacity)
        else:
            drained = min(waiting, 5 * (capacity - rate_first))
            waiting -= drained
            totals["completed"] += 5 * rate_first + drained
            totals["delivered"] += 5 * rate_first
        totals["tokens"] += 5 * capacity * 12000
        vllm = {"engine": "0", "model_name": "qwen"}
        samples = [
            (mn.ATTEMPTS, {"kind": "first"}, totals["first"]),
            (mn.ATTEMPTS, {"kind": "retry"}, totals["retry"]),
            (mn.ATTEMPTS_ATTACHED, {}, 0.0),
            (mn.ATTEMPTS_SHED, {"reason": "retry_budget"}, 0.0),
            (mn.EXECUTIONS_CREATED, {}, totals["created"]),
            (mn.EXECUTIONS_DISPATCHED, {}, totals["created"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, totals["completed"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, totals["orphaned"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "cancelled"}, 0.0),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, totals["delivered"]),
            (mn.CALLS_DELIVERED, {"within_deadline": "false"}, 0.0),
            (mn.CALLS_MISSED_DEADLINE, {}, 0.0),
            (mn.EXECUTIONS_QUEUED, {}, 0.0),
            (mn.EXECUTIONS_LIVE, {}, waiting + 40.0),
            (mn.CAPACITY, {}, capacity),
            (mn.CLIENT_DEADLINE, {}, 120.0),
            (mn.UPSTREAM_UP, {}, 1.0),
            (mn.VLLM_NUM_WAITING, vllm, waiting),
            (mn.VLLM_NUM_RUNNING, vllm, 40.0),
            (mn.VLLM_PROMPT_TOKENS, vllm, totals["tokens"]),
            (mn.VLLM_PREFIX_CACHE_QUERIES, vllm, totals["tokens"]),
        ]
        snaps.append(Snapshot(t=t, samples=[(n, dict(lb), v) for n, lb, v in samples]))
    write_series(path, snaps)


# --- a real headless Chromium (Debian's chromium, driven by Playwright) -------------------

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "artifacts" / "screenshots"
DRAW_TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # NOTE: module scope, not session: Playwright's sync API keeps an asyncio loop marked as
    # running in the main thread while it is open, which breaks every later test that calls
    # asyncio.run() in the same session.
    chromium = require("chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield b
        b.close()


class Page:
    """A browser tab at 1280x720 that records console errors and uncaught exceptions."""

    def __init__(self, browser: Any) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 720})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def wait_graphs(self, n: int) -> None:
        self.page.wait_for_function(
            "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2 * n"
            " && [...document.querySelectorAll('.js-plotly-plot')].every(g => g._fullData !== undefined)",
            arg=n,
            timeout=DRAW_TIMEOUT_MS,
        )

    def trace_max(self, graph_id: str, name: str) -> float:
        return float(
            self.page.evaluate(
                """([id, name]) => {
                    const gd = document.querySelector('#' + id + ' .js-plotly-plot');
                    // _fullData holds the decoded arrays (data keeps the base64 typed-array spec)
                    const tr = gd._fullData.find(t => t.name === name);
                    const ys = Array.from(tr.y || []).filter(v => v !== null && !Number.isNaN(v));
                    return ys.length ? Math.max(...ys) : -1;
                }""",
                [graph_id, name],
            )
        )

    def select(self, dropdown_id: str, option_text: str) -> None:
        self.page.click(f"#{dropdown_id}")
        self.page.get_by_role("option", name=option_text, exact=True).click()

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.page.close()
