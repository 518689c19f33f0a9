"""The proxy under overload, black-box: real ``retrywatch proxy`` processes and the test upstream.

An engine's (or a gateway's) Retry-After reaches every client it concerns, and at its connection
cap the proxy can still be scraped and probed.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from exporter.execution import retry_after
from tests.exporter.support import ProxyProcess, Upstream, balance, proxy_process, scrape

WAIT_S = 15.0  # how long a test waits for an answer: far above anything here takes
HTTP_DATE = "Wed, 21 Oct 2015 07:28:00 GMT"
BODY = b'{"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": %s}'


@pytest.fixture(scope="module")
def proxy(upstream: Upstream) -> Iterator[ProxyProcess]:
    with proxy_process(upstream.url, "--drain-timeout", "0") as p:
        yield p


def _wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one raw request, read the answer to the connection's close: its status, its header
    fields (lower-cased names) and its body."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


def _post(
    port: int, headers: dict[str, str], stream: bool, version: str = "1.1"
) -> tuple[int, dict[str, str]]:
    """A generation POST: in HTTP/1.1 it is served in callbacks, in HTTP/1.0 by the ASGI app."""
    body = BODY % (b"true" if stream else b"false")
    head = f"POST /v1/completions HTTP/{version}\r\nhost: x\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    status, fields, _ = _raw(port, head.encode() + b"\r\n" + body)
    return status, fields


# --- the upstream's Retry-After ---------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.1", "1.0"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("mode", "status"), [("refuse-http", 503), ("refuse-429", 429)])
@pytest.mark.parametrize("value", ["7", HTTP_DATE])
def test_the_upstreams_retry_after_reaches_the_client(
    proxy: ProxyProcess, mode: str, status: int, stream: bool, version: str, value: str
) -> None:
    headers = {"x-call-id": uuid.uuid4().hex, "x-test-mode": mode, "x-test-retry-after": value}
    got, fields = _post(proxy.port, headers, stream, version)
    assert got == status
    assert fields.get("retry-after") == value


@pytest.mark.parametrize(
    "value", ["soon", "-5", "1.5", "Wed, 32 Oct 2015 07:28:00 GMT", "9" * 65, "Oct 2015"]
)
def test_an_invalid_retry_after_is_not_passed_on(proxy: ProxyProcess, value: str) -> None:
    headers = {"x-call-id": uuid.uuid4().hex, "x-test-mode": "refuse-http", "x-test-retry-after": value}
    got, fields = _post(proxy.port, headers, stream=True)
    assert got == 503 and "retry-after" not in fields


def test_every_subscriber_of_a_refused_execution_gets_its_retry_after(
    proxy: ProxyProcess, upstream: Upstream
) -> None:
    call, hold = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {
        "x-call-id": call,
        "x-test-mode": "refuse-http",
        "x-test-retry-after": "11",
        "x-test-hold": hold,
    }
    results: list[tuple[int, dict[str, str]]] = []

    def attempt(version: str) -> None:
        results.append(_post(proxy.port, headers, True, version))

    first = threading.Thread(target=attempt, args=("1.1",))
    first.start()
    _wait_for(lambda: bool(upstream.requests(call_id=call)))
    # Retries of the same call attach to its execution, on both of the proxy's paths.
    retries = [threading.Thread(target=attempt, args=(version,)) for version in ("1.1", "1.0")]
    before = scrape(proxy.url)[("retrywatch_attempts_attached_total", ())]
    for t in retries:
        t.start()
    _wait_for(lambda: scrape(proxy.url)[("retrywatch_attempts_attached_total", ())] == before + 2)
    upstream.release(hold)
    for t in (first, *retries):
        t.join(WAIT_S)
    assert len(upstream.requests(call_id=call)) == 1
    assert [(status, fields.get("retry-after")) for status, fields in results] == [(503, "11")] * 3
    balance(scrape(proxy.url))


def test_a_passed_through_route_keeps_the_upstreams_retry_after(proxy: ProxyProcess) -> None:
    headers = {"x-test-mode": "refuse-http", "x-test-retry-after": HTTP_DATE}
    r = httpx.get(f"{proxy.url}/health", headers=headers, timeout=WAIT_S)
    assert r.status_code == 503 and r.headers["retry-after"] == HTTP_DATE


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ([(b"retry-after", b"120")], b"120"),
        ([(b"retry-after", b" 0 ")], b"0"),
        # the obsolete forms are passed on as IMF-fixdate
        ([(b"retry-after", HTTP_DATE.encode())], HTTP_DATE.encode()),
        ([(b"retry-after", b"Wednesday, 21-Oct-15 07:28:00 GMT")], HTTP_DATE.encode()),
        ([(b"retry-after", b"Wed Oct 21 07:28:00 2015")], HTTP_DATE.encode()),
        ([], None),
        ([(b"retry-after", b"")], None),
        ([(b"retry-after", b"Thu Oct  1 07:28:00 2015")], b"Thu, 01 Oct 2015 07:28:00 GMT"),
        ([(b"retry-after", b"Wed, 31 Feb 2015 07:28:00 GMT")], None),
        ([(b"retry-after", b"Wed, 21 Oct 2015 25:28:00 GMT")], None),
        ([(b"retry-after", b"Wed, 21 Oct 2015 07:28:00 +0200")], None),  # not GMT
        ([(b"retry-after", b"1e3")], None),
        ([(b"retry-after", b"\xff1")], None),
        ([(b"retry-after", b"1" * 65)], None),
        ([(b"retry-after", b"1"), (b"retry-after", b"2")], None),
    ],
)
def test_which_retry_after_values_are_passed_on(
    fields: list[tuple[bytes, bytes]], expected: bytes | None
) -> None:
    assert retry_after(fields) == expected


# --- at the connection cap ----------------------------------------------------------------------


def _held_stream(url: str, call: str, hold: str, opened: threading.Event) -> threading.Thread:
    """A streaming generation request held by the upstream until ``hold`` is released."""

    def run() -> None:
        headers = {"x-call-id": call, "x-test-hold": hold}
        body: dict[str, Any] = {"model": "test-model", "prompt": [1], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=WAIT_S) as r:
            opened.set()
            r.read()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_metrics_and_health_are_served_at_the_connection_cap(upstream: Upstream) -> None:
    args = ("--max-connections", "3", "--reserved-connections", "2", "--drain-timeout", "0")
    with proxy_process(upstream.url, *args) as p:
        hold, calls = uuid.uuid4().hex, [uuid.uuid4().hex for _ in range(2)]
        opened = [threading.Event() for _ in range(2)]
        streams = [_held_stream(p.url, call, hold, event) for call, event in zip(calls, opened, strict=True)]
        idle: socket.socket | None = None
        try:
            _wait_for(lambda: all(upstream.requests(call_id=call) for call in calls))
            idle = socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S)
            time.sleep(0.3)  # the server has taken it
            # The cap is held (two streams and an idle connection): a scrape and a probe are served.
            m = scrape(p.url)
            assert m[("retrywatch_executions_live", ())] == 2 and m[("retrywatch_subscribers", ())] == 2
            assert httpx.get(f"{p.url}/health", timeout=WAIT_S).status_code == 200
            # A generation request past the cap is refused once its head is in.
            status, _, body = _raw(
                p.port,
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(BODY % b"false"), BODY % b"false"),
            )
            assert status == 503 and b'"too_many_connections"' in body
            # Past the reserve too, a new connection is refused at once.
            reserve = [socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S) for _ in range(2)]
            try:
                time.sleep(0.3)  # the server has taken them
                status, _, body = _raw(p.port, b"")
                assert status == 503 and b'"too_many_connections"' in body
            finally:
                for s in reserve:
                    s.close()
        finally:
            if idle is not None:
                idle.close()
            upstream.release(hold)
            for t in streams:
                t.join(WAIT_S)
        assert all(event.is_set() for event in opened)
        balance(scrape(p.url))
