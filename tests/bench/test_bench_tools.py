"""The benchmarks' own instruments run and measure what they claim: the floor forwarder relays a
whole stream with one upstream request, the attempt-path benchmark times admitted attempts, and
the simulator-fidelity figures judge the loop alert as validation does."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from foundation.processes import ManagedProcess, free_port
from tests.exporter.support import Upstream

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_floor_forwards_a_stream_whole_with_one_upstream_request(upstream: Upstream, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, str(BENCH / "asgi_floor.py"), "--upstream", upstream.url, "--port", str(port)]
    with ManagedProcess(cmd, log_path=tmp_path / "floor.log", bound_s=None, name="floor") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/", timeout_s=20, poll_s=0.05, ready=lambda status: status < 500)
        call = uuid.uuid4().hex
        body = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 7, "stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"x-call-id": call}, timeout=10
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            text = b"".join(r.iter_raw()).decode()
        assert text.count("data: ") == 8  # 7 tokens, then [DONE]
        assert text.rstrip().endswith("data: [DONE]")
        assert len(upstream.requests(call_id=call)) == 1


def test_attempt_path_benchmark_times_every_gap() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_attempt_path.py"), "--attempts", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    gaps = ["back to back", "after 0.5 ms idle", "after 2 ms idle", "after 10 ms idle"]
    for work in ("per-attempt work", "a no-op call", "256 reads, one page", "256 reads, 256 pages"):
        lines = [line.strip() for line in out.splitlines() if line.strip().startswith(work)]
        assert [line.split(":")[0].rsplit(",", 1)[1].strip() for line in lines] == gaps
        assert all("(5 calls)" in line for line in lines)


@pytest.fixture(scope="module")
def diagnostic_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated diagnostic pair: retries on (it collapses) and off (it recovers)."""
    out = tmp_path_factory.mktemp("sim") / "out"
    run = [sys.executable, "-m", "retrywatch", "reproduce", "run", "--block", "diagnostic"]
    run += ["--model", "qwen2.5-7b-h100", "--condition", "retries-on-cancel-off", "--condition"]
    run += ["retries-off-cancel-off", "--runs", "1", "--seed", "5", "--no-progress", "--out", str(out)]
    subprocess.run(run, capture_output=True, timeout=300, check=True)
    return out


def sim_fidelity(*args: str) -> list[list[str]]:
    """The rows ``bench/sim_fidelity.py`` prints, split into cells, its header left out."""
    printed = subprocess.run(
        [sys.executable, str(BENCH / "sim_fidelity.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return [[cell.strip() for cell in line.split("|")] for line in printed.splitlines()[1:]]


def test_sim_fidelity_replays_the_loop_alert_over_each_rate_window(diagnostic_pair: Path) -> None:
    rows = sim_fidelity("rate-window", str(diagnostic_pair), "--rate-s", "60", "20")
    assert [(row[1], row[2], row[4]) for row in rows] == [("60", "1.0", "0"), ("20", "1.0", "0")]
    lead_60, lead_20 = (float(row[3].split("/")[0]) for row in rows)  # the collapsed run's lead
    assert lead_20 < lead_60


def test_sim_fidelity_lists_the_loop_alerts_misses_and_late_firings_as_validation_judges_them(
    diagnostic_pair: Path,
) -> None:
    ((_, recall, lead, missed, late, fired),) = sim_fidelity("seeds", str(diagnostic_pair))
    subprocess.run(
        [sys.executable, "-m", "retrywatch", "reproduce", "validate", str(diagnostic_pair)],
        capture_output=True,
        timeout=300,
        check=True,
    )
    validation = json.loads((diagnostic_pair / "validation.json").read_text())["alerts"][
        "VLLMMetastableRetryLoop"
    ]
    assert float(recall) == validation["recall"] == 1.0
    assert lead == f"{validation['lead_time_s']['median']} / {validation['lead_time_s']['max']}"
    assert (missed, late, fired) == ("0", "0", "0")  # it fired in time in the collapsed run only
