"""The benchmarks' own instruments run and measure what they claim: the floor forwarder relays a
whole stream with one upstream request, and the attempt-path benchmark times admitted attempts."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.exporter.support import Upstream, free_port, stop_process, wait_http

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_floor_forwards_a_stream_whole_with_one_upstream_request(upstream: Upstream) -> None:
    port = free_port()
    cmd = [sys.executable, str(BENCH / "asgi_floor.py"), "--upstream", upstream.url, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/", proc=proc)
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
    finally:
        stop_process(proc)


def test_attempt_path_benchmark_times_every_gap() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_attempt_path.py"), "--attempts", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = [line for line in out.splitlines() if line.startswith("per-attempt work")]
    assert [line.split(":")[0].split(",")[1].strip() for line in lines] == [
        "back to back",
        "after 0.5 ms idle",
        "after 2 ms idle",
        "after 10 ms idle",
    ]
    assert all("(5 attempts)" in line for line in lines)
