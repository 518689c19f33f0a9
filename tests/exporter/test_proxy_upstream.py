"""The proxy's path to the engine end to end: interim responses, ``Expect: 100-continue``, and
connections the upstream closes, against the test upstream running as a real process.

Every answer is checked against the request it belongs to: the test upstream names each
completion after the request it recorded (``cmpl-<request_id>``), so an answer delivered to the
wrong client shows up as an id that is not its own call's."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from foundation.errors import error_type
from foundation.timeseries import parse_exposition
from tests.exporter.support import RunningProxy, Upstream, balance, until
from tests.exporter.test_proxy_backpressure import read_until_closed, stalled_client

StartProxy = Callable[..., RunningProxy]
MIB = 1024 * 1024


def _body(max_tokens: int = 3, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "test-model",
        "prompt": [1, 2, 3, 4],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def _answer_id(response: httpx.Response) -> str:
    """The completion id of a JSON answer or of the first event of a stream."""
    if response.headers["content-type"].startswith("text/event-stream"):
        first = response.content.split(b"\n\n")[0]
        assert first.startswith(b"data: {"), response.content[:200]
        return str(json.loads(first[6:])["id"])
    return str(response.json()["id"])


def _assert_own_answer(upstream: Upstream, call: str, response: httpx.Response) -> None:
    """The response is the answer to the one request its call sent to the upstream."""
    assert response.status_code == 200, response.text[:300]
    records = upstream.requests(call_id=call)
    assert len(records) == 1
    assert _answer_id(response) == f"cmpl-{records[0]['request_id']}"
    if records[0]["stream"]:
        assert response.content.endswith(b"data: [DONE]\n\n")


def _call(p: RunningProxy, call_id: str, stream: bool, got: dict[str, httpx.Response]) -> None:
    got[call_id] = httpx.post(
        f"{p.url}/v1/completions", json=_body(3, stream=stream), headers={"x-call-id": call_id}, timeout=10
    )


def _later_calls_get_their_own_answers(p: RunningProxy, upstream: Upstream, rounds: int = 5) -> int:
    """Rounds of 4 concurrent calls (half streaming), so several pooled connections are
    reused; each must get its own answer. Returns the number of calls made."""
    for _ in range(rounds):
        calls = {uuid.uuid4().hex: stream for stream in (False, True, False, True)}
        got: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=_call, args=(p, c, s, got)) for c, s in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for call_id in calls:
            _assert_own_answer(upstream, call_id, got[call_id])
    return 4 * rounds


def _finished(p: RunningProxy, fate: str) -> float:
    return p.metrics()[("retrywatch_executions_finished_total", (("fate", fate),))]


# --- Accept-Encoding ---------------------------------------------------------------------------


def test_the_upstream_is_asked_for_an_unencoded_body_whatever_the_client_accepts(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    """The proxy relays the engine's bytes as they come and reads the first SSE event: the
    client's Accept-Encoding is not forwarded, and every upstream request asks for identity."""
    p = start_proxy()
    for stream in (True, False):
        call = uuid.uuid4().hex
        headers = {"x-call-id": call, "accept-encoding": "gzip, br"}
        r = httpx.post(f"{p.url}/v1/completions", json=_body(3, stream), headers=headers, timeout=30)
        assert r.status_code == 200
        assert "content-encoding" not in r.headers
        assert upstream.requests(call_id=call)[0]["accept_encoding"] == "identity"


# --- Expect: 100-continue -----------------------------------------------------------------------


def test_a_large_body_sent_with_expect_gets_its_own_answer_and_so_do_later_calls(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    """curl sends ``Expect: 100-continue`` with any body over 1 MiB. Forwarded, the engine's
    server answers ``100 Continue`` first; taken as the final answer, that left the real one
    unread on a pooled connection, and later calls received each other's answers."""
    p = start_proxy()
    call = uuid.uuid4().hex
    big = _body(3, prompt=[7] * 400_000)
    assert len(json.dumps(big)) > MIB
    headers = {"x-call-id": call, "expect": "100-continue"}
    r = httpx.post(f"{p.url}/v1/completions", json=big, headers=headers, timeout=30)
    _assert_own_answer(upstream, call, r)
    assert upstream.requests(call_id=call)[0]["expect"] is None  # the proxy does not forward it
    n = _later_calls_get_their_own_answers(p, upstream)
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1 + n


def _post_waiting_for_continue(
    url: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[bytes, bytes]:
    """POST as curl does a large body: send the head with ``Expect: 100-continue``, wait for the
    server's interim answer, only then send the body. Returns (the interim answer, the final
    response), the final read to its Content-Length."""
    parts = urlsplit(url)
    head = [f"POST {path} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}"]
    head += ["content-type: application/json", "expect: 100-continue"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        received = b""
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            assert data, "the proxy closed the connection instead of answering the Expect"
            received += data
        interim, _, received = received.partition(b"\r\n\r\n")
        sock.sendall(body)
        while b"\r\n\r\n" not in received:
            data = sock.recv(65536)
            assert data
            received += data
        final_head, _, content = received.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in final_head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(content) < length:
            data = sock.recv(65536)
            assert data
            content += data
    return interim, final_head + b"\r\n\r\n" + content


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_waiting_for_100_continue_gets_it_from_the_proxy_then_its_answer(
    start_proxy: StartProxy, upstream: Upstream, path: str
) -> None:
    p = start_proxy()
    call = uuid.uuid4().hex
    body = json.dumps(_body(3, prompt=[7] * 400_000)).encode()
    interim, final = _post_waiting_for_continue(p.url, path, body, {"x-call-id": call})
    assert interim.startswith(b"HTTP/1.1 100")
    if path == "/v1/completions":  # a generation request: the proxy's own route
        assert final.startswith(b"HTTP/1.1 200")
        records = upstream.requests(call_id=call)
        assert len(records) == 1 and records[0]["expect"] is None
        assert json.loads(final.split(b"\r\n\r\n", 1)[1])["id"] == f"cmpl-{records[0]['request_id']}"
    else:  # passed through: the upstream's own answer, to the whole body
        # (an upstream that answers before reading a large body and then closes resets the
        # connection, and the proxy rightly answers 502: nginx does the same)
        assert final.startswith(b"HTTP/1.1 200")
        assert json.loads(final.split(b"\r\n\r\n", 1)[1])["count"] == 400_000


# --- interim responses from the upstream --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_interim_responses_on_a_generation_route_are_skipped(
    start_proxy: StartProxy, upstream: Upstream, stream: bool
) -> None:
    p = start_proxy()
    for _ in range(3):  # the connection each used goes back to the pool, and is reused
        call = uuid.uuid4().hex
        headers = {"x-call-id": call, "x-test-interim": "100,103", "x-test-ttft": "0.05"}
        r = httpx.post(f"{p.url}/v1/completions", json=_body(3, stream=stream), headers=headers, timeout=10)
        _assert_own_answer(upstream, call, r)
    n = _later_calls_get_their_own_answers(p, upstream, rounds=2)
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 3 + n


def test_interim_responses_on_a_passed_through_route_are_skipped(start_proxy: StartProxy) -> None:
    p = start_proxy()
    for _ in range(3):
        r = httpx.get(f"{p.url}/v1/models", headers={"x-test-interim": "100,103"}, timeout=5)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "test-model"
        r = httpx.get(f"{p.url}/version", timeout=5)
        assert r.status_code == 200 and r.json() == {"version": "test-upstream"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_a_101_nobody_asked_for_is_a_broken_upstream(
    start_proxy: StartProxy, upstream: Upstream, path: str
) -> None:
    p = start_proxy()
    headers = {"x-test-interim": "101"}
    if path == "/v1/completions":
        r = httpx.post(f"{p.url}{path}", json=_body(2), headers=headers, timeout=10)
    else:
        r = httpx.get(f"{p.url}{path}", headers=headers, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken"
    _later_calls_get_their_own_answers(p, upstream, rounds=1)
    balance(p.metrics())


# --- connections the upstream closes ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_closing_after_reading_the_request_fails_the_execution_without_resending(
    start_proxy: StartProxy, upstream: Upstream, stream: bool
) -> None:
    p = start_proxy()
    warm = uuid.uuid4().hex  # leaves a kept-alive connection in the pool for the next request
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2), headers={"x-call-id": warm}, timeout=10)
    _assert_own_answer(upstream, warm, r)
    call = uuid.uuid4().hex
    headers = {"x-call-id": call, "x-test-mode": "close", "x-test-ttft": "0.3"}
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2, stream=stream), headers=headers, timeout=10)
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["code"] == "upstream_broken" and "closed the connection" in error["message"]
    assert len(upstream.requests(call_id=call)) == 1  # one execution, one request to the engine
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_created_total", ())] == 2
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 1
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "failed"),))] == 1
    assert m[("retrywatch_upstream_up", ())] == 1  # it was reached: broken, not unreachable
    _later_calls_get_their_own_answers(p, upstream, rounds=1)


def test_a_pooled_connection_the_upstream_closed_while_idle_is_not_used(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy()
    first = uuid.uuid4().hex
    headers = {"x-call-id": first, "x-test-keep-alive": "0.2"}  # the upstream hangs up once idle 0.2 s
    _assert_own_answer(
        upstream, first, httpx.post(f"{p.url}/v1/completions", json=_body(2), headers=headers, timeout=10)
    )
    time.sleep(0.8)
    for stream in (False, True):
        call = uuid.uuid4().hex
        r = httpx.post(
            f"{p.url}/v1/completions", json=_body(2, stream=stream), headers={"x-call-id": call}, timeout=10
        )
        _assert_own_answer(upstream, call, r)  # answered, and sent to the engine once
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 3
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 0


def test_an_upstream_dying_mid_generation_without_streaming_is_broken_not_unreachable(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    """A non-streaming answer has no headers until the end: an engine dying mid-generation
    breaks the connection before any response byte, which is not a failed connect."""
    p = start_proxy()
    call = uuid.uuid4().hex
    headers = {"x-call-id": call, "x-test-mode": "crash", "x-test-crash-after": "2"}
    headers["x-test-token-interval"] = "0.05"
    r = httpx.post(f"{p.url}/v1/completions", json=_body(6), headers=headers, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken"
    records = upstream.requests(call_id=call)
    assert len(records) == 1 and records[0]["tokens_sent"] == 2
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 1
    _later_calls_get_their_own_answers(p, upstream, rounds=1)


def test_a_passed_through_request_the_upstream_hangs_up_on_is_broken_not_unreachable(
    start_proxy: StartProxy,
) -> None:
    p = start_proxy()
    assert httpx.get(f"{p.url}/health", timeout=5).status_code == 200  # a kept-alive connection
    r = httpx.get(f"{p.url}/v1/models", headers={"x-test-mode": "close"}, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken"
    assert httpx.get(f"{p.url}/v1/models", timeout=5).json()["data"][0]["id"] == "test-model"


def test_a_fault_in_the_proxy_on_a_passed_through_route_is_an_openai_style_500(
    start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No client input may cause one (the fuzz in test_fuzz.py holds the proxy to that), so the
    fault is injected: the upstream client raising something it should not. Starlette's own
    answer was a plain-text 500."""
    p = start_proxy()

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(p.proxy.upstream, "open", broken)
    r = httpx.get(f"{p.url}/v1/models", timeout=10)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "proxy_error"
    assert httpx.get(f"{p.url}/metrics", timeout=10).status_code == 200  # still serving


# --- upstreams that answer in odd but possible ways ----------------------------------------------


RawAnswer = Callable[[bytes], "bytes | Iterable[bytes]"]


class RawUpstream:
    """A bare HTTP/1.1 server in a thread that answers every request with ``answer(path)``'s
    bytes, written as they are (or each piece an iterable yields, as it yields them), then closes
    the connection: for answers the test upstream (a real uvicorn, as vLLM's) never gives.
    ``cut_short`` lists the paths whose answer the proxy closed before it was all written."""

    def __init__(self, answer: RawAnswer) -> None:
        self.answer = answer
        self.cut_short: list[bytes] = []
        self.heads: list[bytes] = []  # the head of every request received, as it came
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, body = data.partition(b"\r\n\r\n")
            self.heads.append(head)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                body += conn.recv(65536)
            target = head.split(b" ")[1]
            answer = self.answer(target)
            try:
                for piece in [answer] if isinstance(answer, bytes) else answer:
                    conn.sendall(piece)
            except OSError:  # the proxy closed the connection
                self.cut_short.append(target)

    def close(self) -> None:
        self.listener.close()


StartRaw = Callable[[RawAnswer], RawUpstream]


@pytest.fixture
def raw_upstream() -> Iterator[StartRaw]:
    started: list[RawUpstream] = []

    def start(answer: RawAnswer) -> RawUpstream:
        started.append(RawUpstream(answer))
        return started[-1]

    yield start
    for server in started:
        server.close()


METRICS_TEXT = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 7\n"
METRICS_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(METRICS_TEXT), METRICS_TEXT)


def test_an_answer_without_a_length_ends_where_the_upstream_closes_the_connection(
    start_proxy: StartProxy, raw_upstream: StartRaw
) -> None:
    """A response with neither Content-Length nor chunked coding ends when the server closes the
    connection (RFC 9112, 6.3). The proxy's client never took such a body as complete: a whole
    answer was failed with a 502 ``upstream_broken``, and the upstream's /metrics counted it down."""
    completion = b'{"id": "cmpl-close", "object": "text_completion", "choices": []}'

    def answer(path: bytes) -> bytes:
        body = METRICS_TEXT if path == b"/metrics" else completion
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n" + body

    p = start_proxy(raw_upstream(answer).url)
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2), timeout=10)
    assert r.status_code == 200, r.text
    assert r.content == completion
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 0
    assert m[("retrywatch_upstream_up", ())] == 1
    assert httpx.get(f"{p.url}/metrics", timeout=10).text.endswith(METRICS_TEXT.decode())


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_error_nested_past_the_recursion_limit_is_the_upstreams_not_a_fault(
    start_proxy: StartProxy,
    raw_upstream: StartRaw,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    """The proxy reads the message of an upstream's error body, and looks for vLLM's refusal in a
    stream's first event. JSON nested deeper than the interpreter's recursion limit raised
    RecursionError there, not ValueError: the refusal became a fault in the proxy (a traceback,
    a 502 ``proxy_error``, the execution counted failed instead of refused)."""
    nested = b"[" * 20_000 + b"]" * 20_000
    if stream:
        event = b'data: {"error": {"code": 503, "message": "full", "detail": ' + nested + b"}}\n\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        answer = head + b"content-length: %d\r\n\r\n" % len(event) + event
    else:
        body = b'{"error": ' + nested + b"}"
        head = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        answer = head + b"content-length: %d\r\n\r\n" % len(body) + body
    p = start_proxy(raw_upstream(lambda path: METRICS_ANSWER if path == b"/metrics" else answer).url)
    with caplog.at_level(logging.ERROR, logger="retrywatch.proxy"):
        r = httpx.post(f"{p.url}/v1/completions", json=_body(2, stream=stream), timeout=10)
    assert not [rec for rec in caplog.records if "failed in the proxy" in rec.message]
    m = p.metrics()
    balance(m)
    if stream:  # no error object the proxy can read: relayed as the engine sent it
        assert r.status_code == 200 and r.content == event
    else:
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_refused"
        assert m[("retrywatch_executions_finished_total", (("fate", "refused"),))] == 1


@pytest.mark.parametrize("path", ["callbacks", "asgi"])
def test_an_upstream_breaking_off_mid_event_still_ends_the_stream_with_a_readable_error_event(
    start_proxy: StartProxy, raw_upstream: StartRaw, path: str
) -> None:
    """An upstream that closes the connection in the middle of an SSE event left the client that
    event's first bytes, and the proxy's error event was written straight after them: it joined
    the unfinished ``data:`` line, and the stream ended with no error event a client could read.
    (``Expect: 100-continue`` takes a generation request off the callback path, to the ASGI one.)"""
    whole = b'data: {"id": "cmpl-raw", "choices": [{"text": " t0"}]}\n\n'
    cut = b'data: {"id": "cmpl-raw", "cho'
    stream = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (whole, cut))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    p = start_proxy(
        raw_upstream(lambda target: METRICS_ANSWER if target == b"/metrics" else head + stream).url
    )
    headers = {"expect": "100-continue"} if path == "asgi" else {}
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2, stream=True), headers=headers, timeout=10)
    assert r.status_code == 200 and r.content.startswith(whole + cut)
    events = r.content.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert json.loads(events[-3].removeprefix(b"data: "))["error"]["code"] == "upstream_broken"
    balance(p.metrics())


# --- bounds on what the upstream sends ---------------------------------------------------------


@pytest.mark.parametrize("path", ["callbacks", "asgi"])
def test_a_non_streaming_answer_over_the_limit_fails_the_execution_and_closes_the_connection(
    start_proxy: StartProxy, raw_upstream: StartRaw, path: str
) -> None:
    """A non-streaming answer is held whole until its end, and nothing bounded it: a broken
    upstream answering an endless body grew the proxy's memory without limit (600 MiB held 1.9 GB
    of RSS), ``--replay-limit-bytes`` only stopping new retries from attaching. Past
    ``--max-answer-bytes`` the execution fails with a 502 and its connection is closed; an answer
    of the limit exactly is whole."""
    limit = MIB
    answers: list[int] = []

    def answer(target: bytes) -> bytes | Iterable[bytes]:
        if target == b"/metrics":
            return METRICS_ANSWER
        answers.append(len(answers))
        size = limit if len(answers) == 1 else 64 * MIB  # far more than the sockets' buffers hold
        return _json_answer(size)

    up = raw_upstream(answer)
    p = start_proxy(up.url, max_answer_bytes=limit)
    headers = {"expect": "100-continue"} if path == "asgi" else {}
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2), headers=headers, timeout=30)
    assert r.status_code == 200 and len(r.content) == limit
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2), headers=headers, timeout=30)
    assert r.status_code == 502 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "upstream_broken" and f"limit of {limit} bytes" in error["message"]
    assert until(lambda: up.cut_short == [b"/v1/completions"])  # closed, not read to its end
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 1
    assert m[("retrywatch_executions_live", ())] == 0


def _json_answer(size: int) -> Iterator[bytes]:
    yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size
    piece = b"x" * 65536
    for _ in range(size // len(piece)):
        yield piece
    yield piece[: size % len(piece)]


def test_a_stream_is_relayed_as_it_arrives_even_one_endless_line(
    start_proxy: StartProxy, raw_upstream: StartRaw
) -> None:
    """A stream is not held: past its first event (inspected for vLLM's refusal, up to 64 KiB)
    every chunk goes to the client as it arrives, a line that never ends too, and the bound on a
    non-streaming answer does not apply to it."""
    release = threading.Event()

    def answer(target: bytes) -> bytes | Iterable[bytes]:
        if target == b"/metrics":
            return METRICS_ANSWER
        return endless_line()

    def endless_line() -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        yield b'data: {"text": "'
        while not release.is_set():
            yield b"a" * 65536
            time.sleep(0.001)
        yield b'"}\n\ndata: [DONE]\n\n'

    p = start_proxy(raw_upstream(answer).url, max_answer_bytes=MIB)
    got = 0
    with httpx.stream("POST", f"{p.url}/v1/completions", json=_body(2, stream=True), timeout=30) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += len(chunk)
            if got > 4 * MIB:
                release.set()
    assert release.is_set() and got > 4 * MIB
    balance(p.metrics())


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("refusal", [False, True], ids=["token", "refusal"])
def test_a_first_event_ended_by_cr_or_crlf_reaches_the_client_at_once(
    start_proxy: StartProxy, raw_upstream: StartRaw, eol: bytes, refusal: bool
) -> None:
    """SSE ends lines with LF, CRLF or CR. The look at a stream's first event (for vLLM's
    refusal) waited for ``\\n\\n`` only: an upstream ending its lines with CRLF or CR had its
    first token (or its refusal) held until 64 KiB had come, or the end of the answer; and a
    refusal read together with the events after it was not one (relayed as a 200 stream)."""
    release, rest_sent = threading.Event(), threading.Event()
    if refusal:
        first = b'data: {"error": {"message": "queue full", "code": 503}}' + eol + eol
    else:
        first = b'data: {"id": "cmpl-raw", "choices": [{"text": " t0"}]}' + eol + eol

    def answer(target: bytes) -> bytes | Iterable[bytes]:
        if target == b"/metrics":
            return METRICS_ANSWER
        return stream()

    def stream() -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + first
        release.wait(5)  # the rest comes once the client has had the first event
        rest_sent.set()
        yield b"data: [DONE]" + eol + eol

    p = start_proxy(raw_upstream(answer).url)
    with httpx.stream("POST", f"{p.url}/v1/completions", json=_body(2, stream=True), timeout=30) as r:
        chunks = r.iter_raw()
        head = next(chunks)
        held = rest_sent.is_set()
        release.set()
        rest = b"".join(chunks)
    assert not held  # it came while the upstream was still holding the rest
    if refusal:
        assert r.status_code == 503 and json.loads(head + rest)["error"]["code"] == "engine_refused"
    else:
        assert r.status_code == 200 and head == first and rest == b"data: [DONE]" + eol + eol
    m = p.metrics()
    balance(m)
    fate = "refused" if refusal else "completed"
    assert m[("retrywatch_executions_finished_total", (("fate", fate),))] == 1


def test_an_upstream_metrics_answer_over_the_bound_counts_as_a_failed_fetch(
    start_proxy: StartProxy, raw_upstream: StartRaw
) -> None:
    """The proxy's fetch of the upstream's /metrics read its whole answer, however large: a broken
    upstream answering an endless /metrics grew the proxy's memory (300 MiB held 1.2 GB of RSS)
    and had it served on the proxy's /metrics. Past 16 MiB (as the detector reads a /metrics) the
    fetch fails as an unreachable endpoint's would: the upstream is down, its families are not
    served, and the connection is closed."""

    def answer(target: bytes) -> bytes | Iterable[bytes]:
        if target == b"/metrics":
            return endless_metrics()
        return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    def endless_metrics() -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n" + METRICS_TEXT
        for _ in range(64 * 16):  # 64 MiB of comments
            yield b"#" * 65535 + b"\n"

    up = raw_upstream(answer)
    p = start_proxy(up.url)
    assert until(lambda: b"/metrics" in up.cut_short)  # closed, not read to its end
    text = httpx.get(f"{p.url}/metrics", timeout=30).text
    assert "retrywatch_upstream_up 0.0" in text and "vllm:" not in text
    assert len(text) < MIB


@pytest.mark.parametrize(
    "done", [b"data: [DONE]\r\n\r\n", b"data: [DONE]\r\r", b"data:[DONE]\n\n"], ids=["crlf", "cr", "no-space"]
)
def test_a_stream_completes_at_done_whatever_ends_its_lines(
    start_proxy: StartProxy, raw_upstream: StartRaw, done: bytes
) -> None:
    """An execution completes when ``[DONE]`` arrives, not when the upstream's answer ends: the
    client closes at ``[DONE]``. It was recognised only as vLLM writes it (``data: [DONE]`` and LF
    LF): from an upstream ending its lines with CRLF or CR, or leaving out the optional space, the
    execution was still running when its client closed, and was counted orphaned."""
    release = threading.Event()

    def answer(target: bytes) -> bytes | Iterable[bytes]:
        if target == b"/metrics":
            return METRICS_ANSWER
        return stream()

    def stream() -> Iterator[bytes]:
        yield b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        yield b'data: {"id": "cmpl-raw", "choices": [{"text": " t0"}]}\n\n' + done
        release.wait(5)  # the answer ends only after the client has gone

    p = start_proxy(raw_upstream(answer).url)
    got = b""
    with httpx.stream("POST", f"{p.url}/v1/completions", json=_body(2, stream=True), timeout=30) as r:
        for chunk in r.iter_raw():
            got += chunk
            if got.endswith(done):
                break  # leaving the block closes the connection mid-answer
    try:
        assert got.endswith(done)
        deadline = time.monotonic() + 10
        while p.metrics()[("retrywatch_executions_live", ())] and time.monotonic() < deadline:
            time.sleep(0.05)
        m = p.metrics()
        balance(m)
        assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    finally:
        release.set()


# --- hop-by-hop fields ---------------------------------------------------------------------------


def _head_fields(head: bytes) -> dict[bytes, bytes]:
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    return fields


@pytest.mark.parametrize("route", ["callback", "asgi", "passthrough"])
def test_fields_the_connection_header_names_are_not_forwarded_either_way(
    start_proxy: StartProxy, raw_upstream: StartRaw, route: str
) -> None:
    """A field the Connection header names is hop-by-hop (RFC 9110, 7.6.1): a proxy removes it
    with the Connection field itself. The proxy dropped only a fixed list of names, so a field a
    client (or the upstream, on a passed-through answer) marked as meant for the next hop alone
    travelled on to the engine (or to the client)."""
    completion = b'{"id": "cmpl-hop", "object": "text_completion", "choices": []}'

    def answer(target: bytes) -> bytes:
        body = METRICS_TEXT if target == b"/metrics" else completion
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close, X-Up-Hop\r\nx-up-hop: 1\r\nx-up-kept: 1\r\n\r\n%b" % (len(body), body)
        )

    up = raw_upstream(answer)
    p = start_proxy(up.url)
    headers = {
        "connection": "keep-alive, X-Hop,Another-Hop",
        "x-hop": "secret",
        "another-hop": "1",
        "x-kept": "1",
    }
    if route == "asgi":
        headers["expect"] = "100-continue"
    if route == "passthrough":
        r = httpx.get(f"{p.url}/v1/models", headers=headers, timeout=10)
        assert "x-up-hop" not in r.headers and r.headers["x-up-kept"] == "1"
    else:
        r = httpx.post(f"{p.url}/v1/completions", json=_body(2), headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.content == completion
    sent = [_head_fields(head) for head in up.heads if not head.startswith(b"GET /metrics ")]
    assert len(sent) == 1
    assert sent[0][b"x-kept"] == b"1"
    assert b"x-hop" not in sent[0] and b"another-hop" not in sent[0], sent[0]
    balance(p.metrics())


# --- the upstream's /metrics --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        b"<!doctype html><html><body>sign in</body></html>\n",  # a gateway's page, answered 200
        b'{"status": "ok"}\n',
        b"vllm:num_requests_waiting 7\nvllm:num_requests_running seven\n",
        b"# TYPE vllm:num_requests_waiting gauges\nvllm:num_requests_waiting 7\n",
    ],
)
def test_an_upstream_metrics_answer_that_is_no_exposition_leaves_the_proxys_own_metrics_readable(
    start_proxy: StartProxy, raw_upstream: StartRaw, text: bytes
) -> None:
    """The proxy appends the upstream's /metrics text to its own. A text that is not a
    Prometheus exposition (a gateway's sign-in page answered 200, JSON, a value that is no
    number) was appended as it came, and a scrape of the proxy failed whole: Prometheus and the
    detector lost every ``retrywatch_`` counter with it. Such a text is not passed through."""
    completion = b'{"id": "cmpl-m", "object": "text_completion", "choices": []}'

    def answer(target: bytes) -> bytes:
        if target == b"/metrics":
            return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(text), text)
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
            len(completion),
            completion,
        )

    p = start_proxy(raw_upstream(answer).url)
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2), timeout=10)
    assert r.status_code == 200, r.text
    exposition = httpx.get(f"{p.url}/metrics", timeout=10).text
    samples = parse_exposition(exposition)  # the detector's parser: raises on a malformed line
    assert text.decode() not in exposition
    names = {name for name, _, _ in samples}
    assert "retrywatch_executions_created_total" in names
    assert not any(name.startswith("vllm:") for name in names)
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_upstream_up", ())] == 1  # it answered: reachable, its text unusable


# --- an engine's error inside a stream ----------------------------------------------------------


@pytest.mark.parametrize("path", ["callback", "asgi"])
@pytest.mark.parametrize(
    ("code", "status"), [(400, 400), ("422", 422), (500, 502), (None, 502)], ids=["400", "422", "500", "none"]
)
def test_an_engine_error_as_a_streams_first_event_keeps_its_client_error_status(
    start_proxy: StartProxy, raw_upstream: StartRaw, path: str, code: int | str | None, status: int
) -> None:
    """vLLM checks a streaming request's input as its stream begins: a prompt over the model's
    context, say, is an HTTP 200 whose first event is ``data: {"error": {..., "code": 400}}``.
    The proxy answered every such error but the refusal (503) with a 502, though the HTTP form
    of the same error reaches the client as its 400: a client's own mistake read as a broken
    upstream, which the OpenAI SDKs retry (each retry a new execution, refused the same way)."""
    message = "This model's maximum context length is 8 tokens"
    error = {"message": message, "type": "BadRequestError", "code": code}
    first = b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"

    def answer(target: bytes) -> bytes:
        if target == b"/metrics":
            return METRICS_ANSWER
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + first

    p = start_proxy(raw_upstream(answer).url)
    headers = {"expect": "100-continue"} if path == "asgi" else {}
    r = httpx.post(f"{p.url}/v1/completions", json=_body(2, stream=True), headers=headers, timeout=10)
    assert r.status_code == status, r.text
    got = r.json()["error"]
    assert got["code"] == "upstream_error" and got["message"] == error["message"]
    assert got["type"] == error_type(status)
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 1


def test_a_whole_answer_its_client_never_reads_is_not_held_past_the_send_timeout(
    start_proxy: StartProxy, raw_upstream: StartRaw
) -> None:
    """A non-streaming answer is written whole at once; a client that never reads it left it
    in the connection's buffer, and closing the idle connection waited for that buffer to empty:
    the connection and the answer were held for good. Past --send-timeout they are not."""
    completion = b'{"id": "cmpl-big", "object": "text_completion", "choices": [{"text": "%b"}]}' % (
        b"x" * (12 * MIB)
    )

    def answer(target: bytes) -> bytes:
        if target == b"/metrics":
            return METRICS_ANSWER
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        return head % len(completion) + completion

    p = start_proxy(raw_upstream(answer).url, send_timeout_s=1.0, keep_alive_s=1.0)
    stalled = stalled_client(p.url, _body(2), {})
    try:
        deadline = time.monotonic() + 30
        while p.metrics()[("retrywatch_attempt_duration_seconds_count", (("outcome", "delivered"),))] < 1:
            assert time.monotonic() < deadline, "the answer was not written"
            time.sleep(0.05)
        time.sleep(3)  # past the keep-alive and send timeouts
        got, closed = read_until_closed(stalled, timeout_s=10)
    finally:
        stalled.close()
    assert closed and len(got) < len(completion)  # closed, not flushed after all
    balance(p.metrics())
