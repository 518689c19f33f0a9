"""A client that reads slowly (its socket full, the server's writes paused) while the upstream
streams on must still get every event once, in order, and count as delivered."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import h11

from tests.exporter.support import RunningProxy, balance

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
