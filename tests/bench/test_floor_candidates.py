"""The candidates of ``bench/bench_floor.py`` do what they are measured for: each forwards a
stream whole on one upstream request, the attempt prototype coalesces and refuses as the proxy
does, the stall probe and the step timer report, and the benchmark itself runs end to end on a small
scenario, beside another checkout of the proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from foundation.processes import ManagedProcess, free_port
from tests.exporter.support import Upstream

BENCH = Path(__file__).resolve().parents[2] / "bench"
BODY = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 7, "stream": True}


def ready(status: int) -> bool:
    return status < 500


@contextmanager
def candidate(script: str, upstream: Upstream, log_dir: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, str(BENCH / script), *extra, "--upstream", upstream.url, "--port", str(port)]
    with ManagedProcess(cmd, log_path=log_dir / f"{script}.log", bound_s=None, name=script) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/health", timeout_s=60.0, poll_s=0.05, ready=ready)
        yield url


def stream(url: str, call: str, headers: dict[str, str] | None = None) -> str:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=BODY, headers={"x-call-id": call, **(headers or {})}, timeout=10
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return b"".join(r.iter_raw()).decode()


@pytest.mark.parametrize("script", ["protocol_floor.py", "uvicorn_bypass.py", "protocol_attempt.py"])
def test_candidate_forwards_a_stream_whole_with_one_upstream_request(
    upstream: Upstream, script: str, tmp_path: Path
) -> None:
    with candidate(script, upstream, tmp_path) as url:
        for _ in range(3):  # the second and third go on a kept-alive upstream connection
            call = uuid.uuid4().hex
            text = stream(url, call)
            assert text.count("data: ") == 8  # 7 tokens, then [DONE]
            assert text.rstrip().endswith("data: [DONE]")
            assert len(upstream.requests(call_id=call)) == 1
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200  # another route, same port


def test_attempt_prototype_coalesces_a_retry_and_refuses_a_bad_body(
    upstream: Upstream, tmp_path: Path
) -> None:
    with candidate("protocol_attempt.py", upstream, tmp_path) as url:
        call = uuid.uuid4().hex
        slow = {"x-test-ttft": "0.5", "x-test-token-interval": "0.01"}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(stream, url, call, slow)
            time.sleep(0.2)  # the first attempt's execution is live: the retry attaches to it
            text2 = stream(url, call, slow)
            text1 = first.result(timeout=10)
        assert text1 == text2 and text1.count("data: ") == 8
        assert len(upstream.requests(call_id=call)) == 1
        bad = httpx.post(f"{url}/v1/completions", json={"model": "test-model"}, timeout=10)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "prompt"


def test_granian_floors_forward_a_stream(upstream: Upstream, tmp_path: Path) -> None:
    pytest.importorskip("granian")
    for interface in ("asgi", "rsgi"):
        port = free_port()
        granian = Path(sys.executable).parent / "granian"
        cmd = [str(granian), "--interface", interface, "--factory", "--working-dir", str(BENCH)]
        cmd += ["--port", str(port), "--workers", "1", "--no-ws", f"granian_floor:{interface}"]
        env = {**os.environ, "FLOOR_UPSTREAM": upstream.url}
        log = tmp_path / f"granian-{interface}.log"
        with ManagedProcess(cmd, log_path=log, bound_s=None, env=env, name="granian") as proc:
            url = f"http://127.0.0.1:{port}"
            proc.wait_ready(f"{url}/", timeout_s=60.0, poll_s=0.05, ready=ready)
            call = uuid.uuid4().hex
            assert stream(url, call).count("data: ") == 8
            assert len(upstream.requests(call_id=call)) == 1


@contextmanager
def launched(script: str, upstream: Upstream, log_dir: Path, *own: str) -> Iterator[str]:
    """A launcher of ``bench/`` running ``retrywatch proxy`` with its probes; stopped with SIGTERM
    at the end, so it writes its report at exit."""
    port = free_port()
    cmd = [sys.executable, str(BENCH / script), *own, "--", "--upstream", upstream.url, "--port", str(port)]
    with ManagedProcess(cmd, log_path=log_dir / f"{script}.log", bound_s=None, name=script) as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/metrics", timeout_s=60.0, poll_s=0.05)
        for _ in range(5):
            assert stream(url, uuid.uuid4().hex).count("data: ") == 8
        yield url


def bench_output(script: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=180, check=True
    ).stdout


def test_stall_probe_reports_heartbeats_and_collections(upstream: Upstream, tmp_path: Path) -> None:
    report = tmp_path / "stalls.json"
    with launched("loop_stalls.py", upstream, tmp_path, "--probe", "--report", str(report)):
        time.sleep(1.5)  # at least one per-second sample
    data = json.loads(report.read_text())
    assert data["ticks"] > 100
    assert data["gc_counts"]["2"] >= 1  # the proxy's own full collection at start-up
    assert any(name == "sample" for name, _, _ in data["sections"])
    summary = bench_output("loop_stalls.py", "--summarize", str(report))
    assert "heartbeats" in summary and "collections set off in" in summary


SMALL_SCENARIO = ("--rounds", "1", "--window", "1", "--streams", "5", "--memory", "0")


def test_bench_floor_runs_a_small_scenario_beside_a_baseline_checkout_and_interpreter() -> None:
    pin = ("--pin",) if len(os.sched_getaffinity(0)) >= 2 else ()
    paths = (
        "--paths",
        "protocol-floor,proxy-steps",
        "--baseline",
        str(BENCH.parent),
        "--python",
        sys.executable,
    )
    out = bench_output("bench_floor.py", *paths, *pin, *SMALL_SCENARIO)
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("direct", "protocol", "proxy"))
    }
    assert set(rows) == {"direct", "protocol-floor", "proxy-steps", "proxy-baseline", "proxy-python"}
    assert int(rows["protocol-floor"][1]) >= 40  # probes taken through it in one 1-s window
    assert ("each path on core" in out.splitlines()[0]) == bool(pin)
    assert "the steps of a request's path in the proxy (proxy-steps)" in out
    assert "failed" not in out


def test_step_timer_times_each_step_of_a_request(upstream: Upstream, tmp_path: Path) -> None:
    report = tmp_path / "steps.json"
    with launched("step_times.py", upstream, tmp_path, "--report", str(report)):
        pass  # five streams
    data = json.loads(report.read_text())
    for step in ("Proxy.attempt", "parse_body", "Policy.on_attempt", "Execution._send"):
        assert len(data[step]) == 5, step  # once per request
    assert len(data["Execution._first_event"]) >= 5  # again while the first event is incomplete
    for step in ("Proxy.attempt", "parse_body", "Execution._first_event"):
        assert all(wall > 0 and cpu > 0 for wall, cpu in data[step]), step
    summary = bench_output("step_times.py", "--summarize", str(report))
    names = [line.split()[0] for line in summary.splitlines()[1:]]
    assert names.index("Proxy.attempt") < names.index("parse_body") < names.index("Execution._first_event")


def test_pin_puts_every_thread_of_a_process_tree_on_the_given_cores() -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from bench_floor import pin, split_cores, tree
    finally:
        sys.path.remove(str(BENCH))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning needs two cores")
    others, own = split_cores()
    assert others and own and not others & own
    code = "import subprocess, sys, threading, time; "
    code += "threading.Thread(target=time.sleep, args=(30,)).start(); "
    code += "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = tree(parent.pid)
        assert len(pids) == 2
        pin(pids, own)
        threads = [int(t) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
        assert len(threads) >= 3  # the parent's two threads and the child
        assert all(os.sched_getaffinity(t) == own for t in threads)
    finally:
        for pid in reversed(tree(parent.pid)):
            os.kill(pid, 15)
        parent.wait(timeout=10)
