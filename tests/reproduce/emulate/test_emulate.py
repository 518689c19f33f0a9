"""The emulated engine over real HTTP: a real ``retrywatch emulate`` process on loopback.

Covers vLLM's API (streaming with one chunk per token, non-streaming, token-ID, text and chat
prompts), its errors, vLLM's metric names and counting rules as seen through ``/metrics``, a
client disconnect aborting the execution, and the queue cap's two refusal forms.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from foundation import metricnames
from foundation.processes import free_port
from foundation.timeseries import parse_exposition
from foundation.vllmbuckets import SERIES_HISTOGRAMS
from tests.exporter.support import endless_head

PRESET = "qwen2.5-7b-h100"


@contextlib.contextmanager
def emulator(*args: str, startup_s: float = 30.0) -> Iterator[str]:
    """Run ``retrywatch emulate ARGS`` on a free port; yield its URL; stop it by PID."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "retrywatch",
        "emulate",
        "--model",
        PRESET,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace") if process.stdout else ""
                raise RuntimeError(f"emulate exited with {process.returncode}: {output[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("emulate did not become healthy")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            _last_output[:] = process.stdout.read().decode(errors="replace").splitlines()
            process.stdout.close()


_last_output: list[str] = []  # the output of the last emulator() once stopped


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` as {name or name{labels}: value}; the bare name sums over its labels."""
    response = httpx.get(url + "/metrics", timeout=5.0)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        out[name] = out.get(name, 0.0) + value
        out[name + labels] = value
    return out


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval_s)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # 10x faster than the H100: decodes take a few milliseconds of wall time.
    with emulator("--time-scale", "10", "--vocab-size", "32000", "--max-body-bytes", "65536") as url:
        yield url


# --- API shape -----------------------------------------------------------------------------


def test_health_and_models(server: str) -> None:
    assert httpx.get(server + "/health").status_code == 200
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == PRESET and card["owned_by"] == "vllm" and card["max_model_len"] >= 32_768


def test_non_streaming_completion_generates_max_tokens(server: str) -> None:
    before = scrape(server)
    body = {"model": PRESET, "prompt": list(range(1000, 1700)), "max_tokens": 25, "ignore_eos": True}
    response = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "text_completion"
    [choice] = data["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 25
    assert data["usage"] == {
        "prompt_tokens": 700,
        "completion_tokens": 25,
        "total_tokens": 725,
        "prompt_tokens_details": None,
    }
    after = scrape(server)
    assert after[metricnames.VLLM_GENERATION_TOKENS] - before[metricnames.VLLM_GENERATION_TOKENS] == 25
    assert after[metricnames.VLLM_PROMPT_TOKENS] - before[metricnames.VLLM_PROMPT_TOKENS] == 700
    assert after[metricnames.VLLM_PREFIX_CACHE_QUERIES] - before[metricnames.VLLM_PREFIX_CACHE_QUERIES] == 700
    success = metricnames.VLLM_REQUEST_SUCCESS
    assert after[success] - before[success] == 1


def test_streaming_sends_one_chunk_per_token_then_done(server: str) -> None:
    body = {
        "prompt": list(range(2000, 2300)),
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 40
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 40


def test_chat_streaming_and_not(server: str) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count the steps"}]
    response = httpx.post(
        server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 12}, timeout=30
    )
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert len(data["choices"][0]["message"]["content"].split()) == 12
    with httpx.stream(
        "POST",
        server + "/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 7, "stream": True},
        timeout=30,
    ) as r:
        events = sse_events(r.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 8
    assert sum("content" in c["choices"][0]["delta"] for c in chunks[1:]) == 7
    # A retry of the same call gets the same output.
    again = httpx.post(
        server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 12}, timeout=30
    )
    assert again.json()["choices"][0]["message"]["content"] == data["choices"][0]["message"]["content"]


def test_identical_text_prompts_hit_the_prefix_cache(server: str) -> None:
    prompt = " ".join(f"word{i}" for i in range(600))  # 600 pseudo tokens
    first = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] == 600
    before = scrape(server)
    second = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
    assert second.status_code == 200
    hits = scrape(server)[metricnames.VLLM_PREFIX_CACHE_HITS] - before[metricnames.VLLM_PREFIX_CACHE_HITS]
    assert hits >= 512  # every whole cached block of the repeated prompt


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": [1, 2, 32000], "max_tokens": 2}, 400, "out of vocabulary"),
        ({"prompt": [1, 2, 3], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1, 2, 3], "max_tokens": 40_000}, 400, "maximum context length"),
        ({"prompt": [], "max_tokens": 2}, 400, "prompt"),
        ({"prompt": [1, 2], "model": "other-model"}, 404, "does not exist"),
        ({"prompt": [1, "x"], "max_tokens": 2}, 400, "integers"),
        ({"prompt": [1, 2], "n": 2}, 400, "n=1"),
    ],
)
def test_bad_input_gets_vllm_style_errors(
    server: str, body: dict[str, object], status: int, fragment: str
) -> None:
    response = httpx.post(server + "/v1/completions", json=body, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == status


def test_malformed_json_and_oversized_bodies(server: str) -> None:
    bad = httpx.post(server + "/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    big = httpx.post(server + "/v1/completions", content=b"[" + b"1," * 40_000 + b"1]", timeout=10)
    assert big.status_code == 413
    assert httpx.get(server + "/v1/nothing").status_code == 404
    assert httpx.get(server + "/v1/completions").status_code == 405


def test_an_endless_request_head_gets_431_not_the_servers_memory(server: str) -> None:
    """It ran on stock uvicorn, which buffers a request head of any size."""
    answer = endless_head(int(server.rsplit(":", 1)[1]), "/health")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_metrics_carry_vllm_names_help_and_types(server: str) -> None:
    text = httpx.get(server + "/metrics").text
    for name, kind in [
        (metricnames.VLLM_PROMPT_TOKENS, "counter"),
        (metricnames.VLLM_PREFIX_CACHE_QUERIES, "counter"),
        (metricnames.VLLM_PREFIX_CACHE_HITS, "counter"),
        (metricnames.VLLM_GENERATION_TOKENS, "counter"),
        (metricnames.VLLM_REQUEST_SUCCESS, "counter"),
        (metricnames.VLLM_NUM_PREEMPTIONS, "counter"),
        (metricnames.VLLM_ADMISSION_REJECTIONS, "counter"),
        (metricnames.VLLM_NUM_WAITING, "gauge"),
        (metricnames.VLLM_NUM_RUNNING, "gauge"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text
        assert f"# HELP {name} " in text
        assert re.search(rf'^{re.escape(name)}\{{[^}}]*model_name="{PRESET}"', text, re.M), name
    assert 'engine="0"' in text
    # vLLM's request histograms, served as histograms: a series records their buckets
    for name in sorted(SERIES_HISTOGRAMS):
        assert f"# TYPE {name} histogram\n" in text
        assert f"# HELP {name} " in text
    samples = parse_exposition(text, keep_histograms=SERIES_HISTOGRAMS)
    ttft = [lb["le"] for n, lb, _ in samples if n == metricnames.VLLM_TTFT + "_bucket"]
    assert ttft[0] == "0.001" and ttft[-1] == "+Inf" and len(ttft) == 23
    assert {tuple(sorted(lb)) for n, lb, _ in samples if n == metricnames.VLLM_E2E_LATENCY + "_count"} == {
        ("engine", "model_name")
    }


# --- disconnects abort as in vLLM ------------------------------------------------------------


def test_disconnect_before_first_token_is_admitted_but_never_counted_as_prompt() -> None:
    # 5x slower than the H100: each 8,192-token prefill chunk takes about a second of wall time.
    with emulator("--time-scale", "0.2", "--vocab-size", "32000") as url:
        before = scrape(url)
        prompt = [7] * 30_000  # four prefill steps
        queries = metricnames.VLLM_PREFIX_CACHE_QUERIES
        body = {"prompt": prompt, "max_tokens": 50, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            wait_for(lambda: scrape(url)[queries] > before[queries])  # admitted: prefill started
        # The client left during prefill: the engine aborts after the steps in flight.
        wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_RUNNING] == 0)
        after = scrape(url)
        assert after[queries] - before[queries] == 30_000
        assert after[metricnames.VLLM_PROMPT_TOKENS] == before[metricnames.VLLM_PROMPT_TOKENS]
        assert after[metricnames.VLLM_GENERATION_TOKENS] == before[metricnames.VLLM_GENERATION_TOKENS]
        # A client abort is not a finished request in vLLM's counter.
        assert after[metricnames.VLLM_REQUEST_SUCCESS] == before[metricnames.VLLM_REQUEST_SUCCESS]
        # The step in flight at the abort still ran: a retry finds at least two chunks cached.
        retry = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert retry.status_code == 200
        hits = scrape(url)[metricnames.VLLM_PREFIX_CACHE_HITS] - after[metricnames.VLLM_PREFIX_CACHE_HITS]
        assert 2 * 8192 <= hits < 30_000


def test_disconnect_during_decode_stops_generation() -> None:
    with emulator("--time-scale", "0.5", "--vocab-size", "32000") as url:
        before = scrape(url)
        body = {"prompt": list(range(500)), "max_tokens": 5000, "stream": True}
        received = 0
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 5:
                    break
        wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_RUNNING] == 0)
        after = scrape(url)
        # Counted at the first token: the whole prompt, in both counters.
        assert after[metricnames.VLLM_PROMPT_TOKENS] - before[metricnames.VLLM_PROMPT_TOKENS] == 500
        assert (
            after[metricnames.VLLM_PREFIX_CACHE_QUERIES] - before[metricnames.VLLM_PREFIX_CACHE_QUERIES]
            == 500
        )
        generated = after[metricnames.VLLM_GENERATION_TOKENS] - before[metricnames.VLLM_GENERATION_TOKENS]
        assert 5 <= generated < 200  # stopped long before max_tokens
        time.sleep(0.5)
        assert scrape(url)[metricnames.VLLM_GENERATION_TOKENS] == after[metricnames.VLLM_GENERATION_TOKENS]
        assert after[metricnames.VLLM_REQUEST_SUCCESS] == before[metricnames.VLLM_REQUEST_SUCCESS]


def test_non_streaming_client_timeout_aborts_too() -> None:
    with emulator("--time-scale", "0.5", "--vocab-size", "32000") as url:
        body = {"prompt": list(range(400)), "max_tokens": 5000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=1.0))
        wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_RUNNING] == 0)
        generated = scrape(url)[metricnames.VLLM_GENERATION_TOKENS]
        assert 0 < generated < 1000
        assert scrape(url)[metricnames.VLLM_REQUEST_SUCCESS] == 0


def test_disconnect_while_waiting_leaves_no_trace() -> None:
    with emulator("--time-scale", "0.5", "--vocab-size", "32000", "--max-num-batched-tokens", "512") as url:
        # Hold the engine busy with a long prefill so the second request waits.
        blocker = {"prompt": [3] * 20_000, "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=blocker, timeout=60):
            wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_RUNNING] == 1)
            before = scrape(url)
            waiting = {"prompt": [5] * 3000, "max_tokens": 10, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=waiting, timeout=30):
                wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_WAITING] == 1)
            wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_WAITING] == 0)
            after = scrape(url)
        assert after[metricnames.VLLM_PREFIX_CACHE_QUERIES] == before[metricnames.VLLM_PREFIX_CACHE_QUERIES]
        assert after[metricnames.VLLM_PROMPT_TOKENS] == before[metricnames.VLLM_PROMPT_TOKENS]


# --- the queue cap refuses in both of vLLM's forms -------------------------------------------


def test_queue_cap_refuses_with_503_and_with_an_error_event() -> None:
    with emulator("--time-scale", "0.2", "--vocab-size", "32000", "--max-num-queued-reqs", "2") as url:
        long = {"prompt": list(range(300)), "max_tokens": 20_000, "stream": True}
        with contextlib.ExitStack() as stack:
            for _ in range(2):
                response = stack.enter_context(
                    httpx.stream("POST", url + "/v1/completions", json=long, timeout=30)
                )
                assert response.status_code == 200
            wait_for(
                lambda: (
                    scrape(url)[metricnames.VLLM_NUM_RUNNING] + scrape(url)[metricnames.VLLM_NUM_WAITING] == 2
                )
            )
            refused = httpx.post(
                url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=10
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == 503
            assert "retry-after" not in refused.headers
            streamed = httpx.post(
                url + "/v1/completions",
                json={"prompt": [1, 2, 3], "max_tokens": 3, "stream": True},
                timeout=10,
            )
            assert streamed.status_code == 200
            events = sse_events(streamed.text)
            assert events[-1] == "[DONE]" and len(events) == 2
            assert json.loads(events[0])["error"]["code"] == 503
            metrics = scrape(url)
            assert metrics[metricnames.VLLM_ADMISSION_REJECTIONS] == 2
        # Once the two long requests are aborted, the engine accepts again.
        wait_for(lambda: scrape(url)[metricnames.VLLM_NUM_RUNNING] == 0)
        ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200


def test_unknown_preset_and_taken_port_fail_clearly() -> None:
    unknown = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrywatch",
            "emulate",
            "--model",
            "no-such-model",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode != 0 and "no-such-model" in unknown.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "retrywatch", "emulate", "--model", PRESET, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    # Checked before the engine is built: one line naming the option, a usage error.
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): pick another with --port"
    ]


def test_it_says_once_what_it_serves_and_logs_nothing_more_by_default() -> None:
    with emulator("--time-scale", "10") as url:
        assert httpx.post(
            url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=30
        ).is_success
    # The process is stopped: its whole output is the start line.
    assert _last_output == [
        f"emulated engine {PRESET} (time scale 10) on {url} (OpenAI API, /metrics, /health); "
        "state: in memory only"
    ]
