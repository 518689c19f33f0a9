"""The Python detector and the rules evaluated by a real Prometheus give the same verdict.

Each run's series is replayed through ``detector.replay.replay_run`` and, separately, loaded into
a real Prometheus (``promtool tsdb create-blocks-from openmetrics``), its recording rules
materialised over the run with ``promtool tsdb create-blocks-from rules`` and each alert's
expression evaluated with ``query_range`` on the rule group's grid, with Prometheus' alerting
state machine applied (``rules/backfill.py`` explains why: Prometheus evaluates rules only in
real time). Every episode must match: same alerts, fired and resolved within one evaluation
interval of each other.

Runs: two runs of the simulator (``retrywatch reproduce run --backend sim``, one collapsing, one
recovering), the promtool scenarios (crisp edges), and seeded stochastic runs of a small fluid
model of the retry loop (noisy edges, hysteresis).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from detector.replay import replay_run
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, read_series, write_series
from rules import generate, unittests
from rules.backfill import RunEpisode, evaluate_rules
from rules.equivalence import Key, disagreements, python_verdict, rules_only

pytestmark = pytest.mark.promtool

STEP_S = 5.0


def fluid_run(seed: int, *, pulse: float, cancellation: bool, duration_s: float = 1200.0) -> list[Snapshot]:
    """A noisy run of the retry loop: Poisson first attempts at 0.6 Ĉ with a pulse on [120, 227),
    an engine serving Ĉ, attempts timing out once the backlog exceeds the deadline and retried
    (up to 3 times); cancellation on aborts timed-out executions, off lets them run orphaned."""
    rng = np.random.default_rng(seed)
    cap, deadline = 2.78, 120.0
    c = dict.fromkeys(
        (
            "first",
            "retry",
            "created",
            "completed",
            "orphaned",
            "cancelled",
            "within",
            "late",
            "pt",
            "pq",
            "missed",
        ),
        0.0,
    )
    waiting, retry_backlog = 0.0, 0.0
    # first attempts that will time out, each step's counted one deadline later (a missed deadline)
    due = [0.0] * int(deadline / STEP_S)
    snaps: list[Snapshot] = []
    t = 0.0
    while t <= duration_s + 1e-9:
        if t > 0:
            rate = (pulse if 120 <= t < 227 else 0.6) * cap
            first = float(rng.poisson(rate * STEP_S))
            late_share = min(1.0, max(0.0, waiting / cap / deadline - 0.8))  # attempts that will time out
            retries = float(rng.poisson(retry_backlog * 0.2)) if retry_backlog > 0 else 0.0
            retry_backlog = max(0.0, retry_backlog - retries) + 3 * late_share * first
            created = first + retries
            served = min(waiting + created, float(rng.normal(cap * STEP_S, 0.8)))
            served = max(served, 0.0)
            timed_out = late_share * served
            aborted = 0.0
            if cancellation:  # timed-out executions still waiting are aborted, never counted by vLLM
                aborted = min(waiting, late_share * (created + 0.05 * waiting))
                c["cancelled"] += aborted
                waiting -= aborted
                c["completed"] += served - timed_out
            else:  # timed-out executions run on: completions orphaned
                c["orphaned"] += timed_out
                c["completed"] += served - timed_out
            c["within"] += served - timed_out
            waiting = max(0.0, waiting + created - served)
            c["first"] += first
            due.append(late_share * first)
            c["missed"] += due.pop(0)
            c["retry"] += retries
            c["created"] += created
            c["pt"] += served * 12000
            # Admitted prompt tokens include those of aborted executions that had been admitted.
            c["pq"] += served * 12000 + aborted * 12000 * float(rng.uniform(0.2, 0.9))
        samples: list[tuple[str, dict[str, str], float]] = [
            (mn.ATTEMPTS, {"kind": "first"}, c["first"]),
            (mn.ATTEMPTS, {"kind": "retry"}, c["retry"]),
            (mn.ATTEMPTS_ATTACHED, {}, 0.0),
            (mn.EXECUTIONS_CREATED, {}, c["created"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, c["completed"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, c["orphaned"]),
            (mn.EXECUTIONS_FINISHED, {"fate": "cancelled"}, c["cancelled"]),
            (mn.CALLS_DELIVERED, {"within_deadline": "true"}, c["within"]),
            (mn.CALLS_DELIVERED, {"within_deadline": "false"}, c["late"]),
            (mn.CALLS_MISSED_DEADLINE, {}, c["missed"]),
            (mn.EXECUTIONS_QUEUED, {}, 0.0),
            (mn.CAPACITY, {}, cap),
            (mn.CLIENT_DEADLINE, {}, deadline),
            (mn.VLLM_NUM_WAITING, {"engine": "0", "model_name": "qwen"}, math.floor(waiting)),
            (mn.VLLM_NUM_RUNNING, {"engine": "0", "model_name": "qwen"}, 40.0),
            (mn.VLLM_PROMPT_TOKENS, {"engine": "0", "model_name": "qwen"}, c["pt"]),
            (mn.VLLM_PREFIX_CACHE_QUERIES, {"engine": "0", "model_name": "qwen"}, c["pq"]),
        ]
        snaps.append(Snapshot(t, samples))
        t += STEP_S
    return snaps


def simulated_runs(out: Path) -> dict[str, list[Snapshot]]:
    """Two runs of the simulator's diagnostic block through its public CLI: one that collapses
    into the retry loop (retries on, cancellation off) and one that recovers (retries off)."""
    cmd = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--backend", "sim",
        "--model", "qwen2.5-7b-h100", "--block", "diagnostic", "--condition", "retries-on-cancel-off",
        "--condition", "retries-off-cancel-on", "--runs", "1", "--seed", "7", "--out", str(out),
        "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    runs: dict[str, list[Snapshot]] = {}
    for run in summary["runs"]:
        path = out / run["series"]
        runs[f"sim-{path.parent.name}"] = list(read_series(path))
    assert len(runs) == 2
    return runs


def _runs(sim_dir: Path) -> dict[str, list[Snapshot]]:
    runs: dict[str, list[Snapshot]] = simulated_runs(sim_dir)
    for scenarios in unittests.ALL_SCENARIOS:
        if scenarios.alertname in ("VLLMRetrywatchNoData", "VLLMTierNoData"):
            continue  # its scenario is a failed scrape, which a series of scrapes cannot hold
        for i, case in enumerate(scenarios.cases):
            snaps = unittests.case_snapshots(case, tier=scenarios.tier)
            runs[f"scenario-{scenarios.alertname.lower()}-{i}"] = snaps
    # vLLM's series vanish from the proxy's scrapes for 500 s: stale at once, NoData after its `for`.
    lost = unittests.case_snapshots(unittests.SCENARIOS[0].cases[0])
    runs[LOST] = [
        Snapshot(s.t, [x for x in s.samples if not (300 <= s.t < 800 and x[0].startswith("vllm:"))])
        for s in lost
    ]
    # The proxy stops exporting the clients' deadline (restarted without --deadline) for 500 s, and
    # with it the calls that missed it: the alerts that need them cannot be evaluated, and both
    # evaluators say so with NoData.
    without_deadline = (mn.CLIENT_DEADLINE, mn.CALLS_MISSED_DEADLINE)
    runs[DEADLINE_UNKNOWN] = [
        Snapshot(s.t, [x for x in s.samples if not (300 <= s.t < 800 and x[0] in without_deadline)])
        for s in lost
    ]
    # A proxy that knows the deadline but does not count missed deadlines (an older one): the
    # symptom alert is blind, and NoData says so.
    runs[MISSED_UNKNOWN] = [
        Snapshot(s.t, [x for x in s.samples if not (300 <= s.t < 800 and x[0] == mn.CALLS_MISSED_DEADLINE)])
        for s in lost
    ]
    runs["fluid-collapse-cancel-off"] = fluid_run(1, pulse=2.7, cancellation=False)
    runs["fluid-collapse-cancel-on"] = fluid_run(2, pulse=2.7, cancellation=True)
    runs["fluid-small-pulse"] = fluid_run(3, pulse=1.5, cancellation=False)
    runs["fluid-tipping-pulse"] = fluid_run(4, pulse=2.1, cancellation=True)
    return runs


def _match(python: list[Key], prometheus: list[Key]) -> list[str]:
    return disagreements(python, prometheus, tolerance_s=STEP_S)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory, promtool: str, prometheus_binary: str) -> dict:
    runs = _runs(tmp_path_factory.mktemp("sim"))
    out = tmp_path_factory.mktemp("runs")
    python: dict[str, list[Key]] = {}
    for slug, snaps in runs.items():
        path = out / slug / "metrics.jsonl"
        path.parent.mkdir()
        write_series(path, snaps)
        python[slug] = python_verdict(path)
    doc = yaml.safe_load(generate.RULES_PATH.read_text(encoding="utf-8"))
    prom = evaluate_rules(runs, doc, job=generate.group_job, promtool=promtool, prometheus=prometheus_binary)
    skip = rules_only()
    prometheus: dict[str, list[Key]] = {
        slug: sorted((e.alertname, e.fired_at_s, e.resolved_at_s) for e in eps if e.alertname not in skip)
        for slug, eps in prom.items()
    }
    return {"python": python, "prometheus": prometheus, "episodes": prom}


LOST = "scenario-vllm-series-lost"
DEADLINE_UNKNOWN = "scenario-deadline-unknown"
MISSED_UNKNOWN = "scenario-missed-deadlines-unknown"


def _only(keys: list[Key], name: str) -> list[Key]:
    return [k for k in keys if k[0] == name]


def test_python_and_prometheus_fire_and_resolve_together(verdicts: dict) -> None:
    problems = {
        slug: diff
        for slug in verdicts["python"]
        if slug != LOST and (diff := _match(verdicts["python"][slug], verdicts["prometheus"].get(slug, [])))
    }
    assert problems == {}


def test_nodata_when_vllm_series_vanish(verdicts: dict) -> None:
    py = _only(verdicts["python"][LOST], "VLLMRetrywatchNoData")
    pr = _only(verdicts["prometheus"][LOST], "VLLMRetrywatchNoData")
    assert py and _match(py, pr) == []


def test_nodata_when_the_deadline_is_unknown(verdicts: dict) -> None:
    py = _only(verdicts["python"][DEADLINE_UNKNOWN], "VLLMRetrywatchNoData")
    pr = _only(verdicts["prometheus"][DEADLINE_UNKNOWN], "VLLMRetrywatchNoData")
    assert py and _match(py, pr) == []


def test_neither_assumes_a_deadline_the_proxy_stopped_exporting(verdicts: dict) -> None:
    """The vLLM tier reads the proxy's deadline too: without it both say NoData, and the rules'
    VLLMDeadlineMissing says why (no 120 s assumed)."""
    py = _only(verdicts["python"][DEADLINE_UNKNOWN], "VLLMTierNoData")
    pr = _only(verdicts["prometheus"][DEADLINE_UNKNOWN], "VLLMTierNoData")
    assert py and _match(py, pr) == []
    missing = [e for e in verdicts["episodes"][DEADLINE_UNKNOWN] if e.alertname == "VLLMDeadlineMissing"]
    assert missing and all(300 <= e.fired_at_s <= 400 for e in missing)
    assert "VLLMDeadlineMissing" not in {e.alertname for e in verdicts["episodes"][LOST]}


def test_nodata_when_missed_deadlines_are_not_counted(verdicts: dict) -> None:
    py = _only(verdicts["python"][MISSED_UNKNOWN], "VLLMRetrywatchNoData")
    pr = _only(verdicts["prometheus"][MISSED_UNKNOWN], "VLLMRetrywatchNoData")
    assert py and _match(py, pr) == []


def test_other_alerts_when_vllm_series_vanish(verdicts: dict) -> None:
    assert _match(verdicts["python"][LOST], verdicts["prometheus"][LOST]) == []


def test_the_vllm_tier_sees_the_simulated_collapse_and_vllm_alone_in_both(verdicts: dict) -> None:
    collapsed = next(slug for slug in verdicts["python"] if "retries-on-cancel-off" in slug)
    recovered = next(slug for slug in verdicts["python"] if "retries-off-cancel-on" in slug)
    for evaluator in ("python", "prometheus"):
        names = {k[0] for k in verdicts[evaluator][collapsed]}
        assert {"VLLMRetryLoopSuspected", "VLLMRequestsNotAnsweredInTime"} <= names, evaluator
        quiet = {"VLLMRetryLoopSuspected", "VLLMAbandonedWorkSustained"}
        assert not quiet & {k[0] for k in verdicts[evaluator][recovered]}, evaluator
        # vLLM scraped alone: the vLLM tier's scenarios fire their alert, and its NoData stays quiet
        for scenarios in unittests.VLLM_SCENARIOS:
            if scenarios.alertname == "VLLMTierNoData":
                continue
            fired = {k[0] for k in verdicts[evaluator][f"scenario-{scenarios.alertname.lower()}-0"]}
            assert scenarios.alertname in fired and "VLLMTierNoData" not in fired, (evaluator, fired)
    # vLLM's series vanish: the vLLM tier's NoData, in both
    assert _only(verdicts["python"][LOST], "VLLMTierNoData")


def test_the_runs_exercise_every_alert(verdicts: dict) -> None:
    fired = {k[0] for eps in verdicts["prometheus"].values() for k in eps}
    from detector.thresholds import ALERTS

    assert fired >= {a.name for a in ALERTS}


def test_the_fluid_runs_tip_or_drain_as_designed(verdicts: dict) -> None:
    names = {slug: {k[0] for k in eps} for slug, eps in verdicts["prometheus"].items()}
    assert "VLLMMetastableRetryLoop" in names["fluid-collapse-cancel-off"]
    assert "VLLMMetastableRetryLoop" not in names["fluid-small-pulse"]


def test_the_simulated_collapse_is_seen_by_both(verdicts: dict) -> None:
    collapsed = next(slug for slug in verdicts["python"] if "retries-on-cancel-off" in slug)
    assert "VLLMMetastableRetryLoop" in {k[0] for k in verdicts["python"][collapsed]}
    assert "VLLMMetastableRetryLoop" in {k[0] for k in verdicts["prometheus"][collapsed]}
    # the symptom too, whatever the cause, in both, and in the fluid model's collapses
    for slug in (collapsed, "fluid-collapse-cancel-off", "fluid-collapse-cancel-on"):
        for evaluator in ("python", "prometheus"):
            assert "VLLMCallsNotDeliveredInTime" in {k[0] for k in verdicts[evaluator][slug]}, (
                slug,
                evaluator,
            )
    assert "VLLMCallsNotDeliveredInTime" not in {k[0] for k in verdicts["prometheus"]["fluid-small-pulse"]}


def test_prometheus_episodes_carry_the_engine_labels(verdicts: dict) -> None:
    eps: list[RunEpisode] = verdicts["episodes"]["scenario-vllmmetastableretryloop-0"]
    loop = [e for e in eps if e.alertname == "VLLMMetastableRetryLoop"]
    assert loop and dict(loop[0].labels) == {
        "instance": "scenario-vllmmetastableretryloop-0",
        "engine": unittests.ENGINE,
        "model": unittests.MODEL,
    }


def test_run_folder_is_not_needed(tmp_path: Path) -> None:
    # replay_run names the instance after the run folder: the verdict fixture relies on it.
    path = tmp_path / "myrun" / "metrics.jsonl"
    path.parent.mkdir()
    write_series(path, unittests.case_snapshots(unittests.SCENARIOS[1].cases[0]))
    assert {e.labels.instance for e in replay_run(path)} == {"myrun"}
