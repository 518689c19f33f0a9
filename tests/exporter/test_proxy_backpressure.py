"""A client that reads slowly (its socket full, the server's writes paused) while the upstream
streams on must still get every event once, in order, and count as delivered."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import h11
import httpx
import pytest

from tests.exporter.support import RunningProxy, Upstream, balance, proxy_process, scrape

StartProxy = Callable[..., RunningProxy]


def _slow_stream(url: str, body: dict[str, object], call_id: str, stall_s: float) -> tuple[int, bytes]:
    """POST a streaming completion on a socket with a tiny receive buffer, read nothing for
    ``stall_s`` seconds (the proxy's writes back up), then read the whole response."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.settimeout(30)
        sock.connect((parts.hostname, parts.port))
        request = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("host", parts.netloc),
                ("content-type", "application/json"),
                ("content-length", str(len(payload))),
                ("x-call-id", call_id),
            ],
        )
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        time.sleep(stall_s)
        status = 0
        got = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                got += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, bytes(got)


def test_a_slow_reader_gets_every_event_once_and_in_order(start_proxy: StartProxy) -> None:
    p = start_proxy()
    n = 40_000  # about 8 MB of SSE: more than the client's window and all the proxy's socket buffers
    body = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": n, "stream": True}
    status, sse = _slow_stream(p.url, body, uuid.uuid4().hex, stall_s=1.0)
    assert status == 200
    events = [e for e in sse.split(b"\n\n") if e.strip()]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert texts == [f" t{i}" for i in range(n)]
    assert events[-1] == b"data: [DONE]"
    deadline = time.monotonic() + 5
    while p.metrics()[("retrywatch_subscribers", ())] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "delivered"),))] == 1


def send_completion(url: str, body: dict[str, object], headers: dict[str, str], rcvbuf: int) -> socket.socket:
    """A socket with a receive buffer of ``rcvbuf`` bytes (set before connect) that has sent a
    streaming completion with ``headers``. The caller reads and closes it."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(payload)}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(head.encode() + b"\r\n" + payload)
    return sock


def stalled_client(url: str, body: dict[str, object], headers: dict[str, str]) -> socket.socket:
    """Send a streaming completion on a socket with a tiny receive buffer and read nothing: a
    client that stopped reading. The caller closes it."""
    return send_completion(url, body, headers, rcvbuf=4096)


def fast_reader_body(url: str, body: dict[str, object], headers: dict[str, str]) -> bytes:
    """POST a streaming completion and take every byte as it comes, on a raw socket with a large
    receive buffer (``connection: close``), parsing the response once the server has closed it:
    a reader that keeps up whatever the machine's load (httpx, parsing 12 MB of chunks in Python
    on a busy CI machine, fell behind by more than the replay limit and was rightly dropped)."""
    with send_completion(url, body, {**headers, "connection": "close"}, rcvbuf=8 << 20) as sock:
        sock.settimeout(60)
        raw = bytearray()
        while data := sock.recv(1 << 20):
            raw += data
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v1/completions", headers=[("host", urlsplit(url).netloc)]))
    conn.receive_data(bytes(raw))
    conn.receive_data(b"")
    got = bytearray()
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            assert event.status_code == 200, event
        elif isinstance(event, h11.Data):
            got += event.data
        elif isinstance(event, h11.EndOfMessage):
            return bytes(got)
        else:
            raise AssertionError(f"the response ended early: {event!r}")


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the socket still receives, and whether the server closed it within ``timeout_s``."""
    sock.settimeout(timeout_s)
    got = bytearray()
    try:
        while data := sock.recv(1 << 20):
            got += data
    except ConnectionResetError:
        pass
    except TimeoutError:
        return bytes(got), False
    return bytes(got), True


@pytest.mark.parametrize("stalled_path", ["callback", "asgi"])
def test_a_client_that_stops_reading_is_dropped_past_the_replay_limit(
    upstream: Upstream, stalled_path: str
) -> None:
    """A subscriber lagging the stream by more than --replay-limit-bytes is closed and counted as
    disconnected; the reader coalesced on the same execution gets its whole stream, and the
    proxy does not keep (nor later decompress at once) the stalled client's backlog.

    With a reader fast enough to let the stream run ahead, the stalled client's writer found
    megabytes waiting when it first read, took them all at once into its transport's buffer
    (its offset at the end, so its lag was never seen), and was left open holding them: its
    reads are now bounded (``relay.READ_BYTES``)."""
    n = 60_000  # about 12 MB of SSE: far past the limit, the client's window and the socket buffers
    limit = 64 * 1024
    with proxy_process(upstream.url, "--replay-limit-bytes", str(limit), "--drain-timeout", "0") as p:
        warm = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2000, "stream": True}
        httpx.post(f"{p.url}/v1/completions", json=warm, timeout=10).raise_for_status()
        peak_before = p.peak_rss_kib()
        call, hold = uuid.uuid4().hex, uuid.uuid4().hex
        body = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": n, "stream": True}
        stalled_headers = {"x-call-id": call, "x-test-hold": hold}
        if stalled_path == "asgi":  # the callback path leaves these to the ASGI app
            stalled_headers["expect"] = "100-continue"
        stalled = stalled_client(p.url, body, stalled_headers)
        try:
            deadline = time.monotonic() + 10
            while not upstream.requests(call_id=call) and time.monotonic() < deadline:
                time.sleep(0.02)
            got: dict[str, bytes] = {}

            def read() -> None:
                got["reader"] = fast_reader_body(p.url, body, {"x-call-id": call})

            reader = threading.Thread(target=read)
            reader.start()
            while scrape(p.url)[("retrywatch_attempts_attached_total", ())] < 1:
                assert time.monotonic() < deadline, "the reader did not attach"
                time.sleep(0.02)
            upstream.release(hold)
            reader.join(60)
            events = [e for e in got["reader"].split(b"\n\n") if e.strip()]
            texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
            assert texts == [f" t{i}" for i in range(n)]
            assert events[-1] == b"data: [DONE]"
            rest, closed = read_until_closed(stalled, timeout_s=10)
        finally:
            stalled.close()
        assert closed, "the stalled client's connection was left open"
        assert b"data: [DONE]" not in rest  # dropped: its backlog was not sent
        peak_growth_kib = p.peak_rss_kib() - peak_before
        assert peak_growth_kib < 16 * 1024, peak_growth_kib
        deadline = time.monotonic() + 5
        while scrape(p.url)[("retrywatch_subscribers", ())] != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        m = scrape(p.url)
        balance(m)
        assert len(upstream.requests(call_id=call)) == 1  # one execution served both
        assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 2
        assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "disconnected"),))] == 1
        assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "delivered"),))] == 2
        print(f"peak RSS growth: {peak_growth_kib} KiB")


@pytest.mark.parametrize("path", ["callback", "asgi"])
def test_a_client_that_takes_no_bytes_for_the_send_timeout_is_closed(
    start_proxy: StartProxy, upstream: Upstream, path: str
) -> None:
    """A client that stops reading before the replay bound is reached (its answer ends first)
    held its connection, its subscriber and the answer's unsent bytes for good: no timeout
    applies once a request is in, and the bytes bound is never passed. Past --send-timeout with
    its writes paused, its connection is closed and the attempt counts as disconnected. (A
    whole JSON answer left unread: ``test_proxy_upstream.py``.)"""
    p = start_proxy(send_timeout_s=1.0)
    # About 8 MB of SSE: more than the client's window and the proxy's socket buffers, far less
    # than --replay-limit-bytes once compressed.
    body = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 40_000, "stream": True}
    headers = {"x-call-id": uuid.uuid4().hex}
    if path == "asgi":
        headers["expect"] = "100-continue"
    stalled = stalled_client(p.url, body, headers)
    try:
        deadline = time.monotonic() + 30
        while p.metrics()[("retrywatch_executions_finished_total", (("fate", "completed"),))] < 1:
            assert time.monotonic() < deadline, "the execution did not complete"
            time.sleep(0.05)
        while p.metrics()[("retrywatch_subscribers", ())] != 0:
            assert time.monotonic() < deadline, "the stalled client is still held"
            time.sleep(0.05)
        _, closed = read_until_closed(stalled, timeout_s=10)
    finally:
        stalled.close()
    assert closed
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "disconnected"),))] == 1
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "delivered"),))] == 0
