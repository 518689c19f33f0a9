"""Whole HTTP runs: the open-loop client over real sockets, through the real ``retrywatch proxy``
(a subprocess with the condition's flags), to the emulated engine (``retrywatch emulate``), with
the proxy's ``/metrics`` scraped into ``metrics.jsonl`` and the entry built for summary.json.

Runs are short: time scale 20 with token lengths scaled too (``sizes=scaled``) and a short hold.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from foundation import metricnames as mn
from foundation.rundir import read_summary
from foundation.timeseries import read_series
from reproduce.conditions import expand
from reproduce.judge.summary import write_summary
from reproduce.registry import RunJob, get_backend
from reproduce.workloads.clients import PROFILES, with_client
from reproduce.workloads.plan import RunClock

pytestmark = pytest.mark.slow

K = 20.0


def _run(tmp_path: Path, block: str, condition: str, client: str = "study", **options: Any) -> dict[str, Any]:
    (spec,) = expand(block, models="qwen2.5-7b-h100", runs=1, conditions=[condition])
    spec = with_client(spec, PROFILES[client])
    backend = get_backend("emulated", sizes="scaled", **options)
    backend.prepare([spec])
    try:
        return backend.run(RunJob(spec, tmp_path, RunClock(K)))
    finally:
        backend.close()


def _calls(tmp_path: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    folder = tmp_path / Path(entry["series"]).parent
    return [json.loads(line) for line in (folder / "attempts.jsonl").read_text().splitlines()]


def test_low_load_run_delivers_every_call_and_writes_the_series(tmp_path: Path) -> None:
    targets = tmp_path / "targets.json"
    entry = _run(
        tmp_path,
        "diagnostic",
        "retries-on-cancel-off",
        capacity=2.0,
        hold_s=240.0,
        prometheus_targets=targets,
    )
    assert json.loads(targets.read_text()) == []  # the proxy's address, withdrawn with the proxy
    offered = entry["calls"]["offered"]
    assert offered > 10
    assert entry["calls"]["delivered"] == offered
    assert entry["calls"]["attempts"] == offered  # nothing timed out, nothing retried
    assert entry["executions"]["created"] == offered
    assert entry["executions"]["completed"] + entry["executions"]["orphaned"] == offered
    assert entry["backend"] == "emulated" and entry["time_scale"] == K
    assert entry["deadline_s"] == pytest.approx(120.0 / K)
    assert entry["client"]["attempt_outcomes"] == {"delivered": offered}
    lag = entry["client"]["loop_lag"]  # the client's own event loop, watched by a heartbeat
    assert lag["p99_s"] is not None and 0.0 <= lag["p99_s"] <= lag["max_s"]
    # The detector ran live against the proxy and saw no retry loop at low load.
    assert entry["live_alerts"] is not None
    assert "VLLMMetastableRetryLoop" not in {a["alertname"] for a in entry["live_alerts"]}

    snapshots = list(read_series(tmp_path / entry["series"]))
    assert len(snapshots) >= 5
    assert [s.t for s in snapshots] == sorted(s.t for s in snapshots)
    last = snapshots[-1]
    assert last.value(mn.ATTEMPTS, kind="first") == offered
    assert last.value(mn.VLLM_PROMPT_TOKENS) is not None  # vLLM's names pass through the proxy
    # so do vLLM's request histograms, which the series keeps (the proxy passes through the engine's
    # last fetched text: it may lag the run's end by a second); the proxy's own are left out
    finished = last.value(mn.VLLM_E2E_LATENCY + "_count")
    assert finished is not None and offered / 2 < finished <= offered
    assert last.value(mn.VLLM_E2E_LATENCY + "_bucket", le="+Inf") == finished
    assert finished <= (last.value(mn.VLLM_TTFT + "_count") or 0.0) <= offered
    assert not any(n.startswith(mn.TIME_TO_FIRST_TOKEN) for n, _, _ in last.samples)
    assert last.value(mn.CAPACITY) == pytest.approx(2.0)

    calls = _calls(tmp_path, entry)
    assert len(calls) == offered
    assert all(c["delivered_at"] is not None for c in calls)
    # Every planned arrival was kept (open loop): first attempts go out on time.
    assert all(abs(c["attempts"][0]["sent_at"] - c["planned_at"]) < 1.0 for c in calls)

    write_summary(tmp_path, [entry])
    assert read_summary(tmp_path)["runs"][0]["slug"] == entry["slug"]


def test_refused_attempts_are_retried_with_the_same_call_id(tmp_path: Path) -> None:
    # Engine cap Q = 1 on the emulator: overlapping calls are refused (503) and retried; the proxy
    # can only count a retry as one if it carries its call's id. The clients are the OpenAI SDK's:
    # at most two retries, after its exponential backoff.
    entry = _run(
        tmp_path, "engine-cap", "engine-cap-100", "openai-sdk", capacity=10.0, hold_s=120.0, queue_cap=1
    )
    assert entry["engine"]["max_num_queued_reqs"] == 1
    calls = _calls(tmp_path, entry)
    client_retries = sum(len(c["attempts"]) - 1 for c in calls)
    refused = sum(a["outcome"] == "refused" for c in calls for a in c["attempts"])
    assert refused > 0 and client_retries > 0
    assert entry["settings"]["client"] == "openai-sdk" and max(len(c["attempts"]) for c in calls) <= 3
    waits: dict[int, list[float]] = {0: [], 1: []}
    for c in calls:
        for n, (a, b) in enumerate(itertools.pairwise(c["attempts"])):
            assert a["outcome"] == "refused"
            waits[n].append(b["sent_at"] - a["ended_at"])
    for n, found in waits.items():
        # the SDK's wait, scaled: never shorter; longer only by the event loop's lag (2 CPUs shared)
        full = min(0.5 * 2**n, 8.0) / K
        assert found and min(found) >= 0.75 * full - 1e-6 and statistics.median(found) <= full + 0.05, found
    last = list(read_series(tmp_path / entry["series"]))[-1]
    assert last.value(mn.ATTEMPTS, kind="retry") == client_retries
    assert last.value(mn.ATTEMPTS, kind="first") == len(calls)
    assert entry["executions"]["refused_by_engine"] == refused
