"""The proxy's server, black-box: real ``retrywatch proxy`` processes spoken to over real sockets.

Bounded request heads, timeouts for slow and idle clients, the connection cap, hostile bodies and
paths, the route table and the drained shutdown. Nothing here knows which HTTP server the proxy
runs on, so the same tests hold any server that replaces it to these behaviours.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httptools
import httpx
import pytest

from exporter.validation import MAX_JSON_DEPTH
from foundation.processes import free_port
from tests.exporter.support import ProxyProcess, Upstream, errors_logged, proxy_process

SHORT = ("--head-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "1")
MAX_HEAD_BYTES = 16384
MAX_HEADERS = 30
WAIT_S = 15.0  # how long a test waits for the server to answer or close: far above the bounds


@pytest.fixture(scope="module")
def bounded(upstream: Upstream) -> Iterator[ProxyProcess]:
    """One proxy with short timeouts and small head bounds, shared by the tests that only talk."""
    args = (*SHORT, "--max-head-bytes", str(MAX_HEAD_BYTES), "--max-headers", str(MAX_HEADERS))
    with proxy_process(upstream.url, *args, "--drain-timeout", "0") as p:
        yield p


def exchange(port: int, chunks: Iterable[bytes], pause_s: float = 0.0) -> bytes:
    """Send ``chunks`` (stopping as soon as the server answers or stops reading), then read
    until the server closes the connection; what the server sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        for chunk in chunks:
            if select.select([s], [], [], 0)[0]:
                break  # the server has answered (or closed): a client stops sending
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            if pause_s:
                time.sleep(pause_s)
        return read_to_close(s)


def read_to_close(s: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            got = s.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the server held the connection {WAIT_S:g} s; got {data[:200]!r}") from None
        if not got:
            return data
        data += got


def status_and_error(response: bytes) -> tuple[int, dict[str, Any]]:
    """The status of a raw HTTP response and its OpenAI-style error object."""
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), response[:200]
    status = int(head.split()[1])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def request_head(method: str, path: str, *headers: bytes) -> bytes:
    return b"%s %s HTTP/1.1\r\nhost: 127.0.0.1\r\n%s" % (method.encode(), path.encode(), b"".join(headers))


def completion(**extra: Any) -> bytes:
    return json.dumps({"model": "test-model", "prompt": [1, 2], "max_tokens": 2, **extra}).encode()


def post_head(path: str, length: int, *headers: bytes) -> bytes:
    return request_head(
        "POST", path, b"content-type: application/json\r\n", b"content-length: %d\r\n" % length, *headers
    )


def whole_request(method: str, path: str, *headers: bytes) -> bytes:
    """A complete request (a completion's body if it is a POST) that closes its connection."""
    if method == "POST":
        body = completion()
        return post_head(path, len(body), *headers, b"connection: close\r\n\r\n") + body
    return request_head(method, path, *headers, b"connection: close\r\n\r\n")


# --- request heads ----------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("GET", "/v1/models")])
def test_a_head_over_the_size_bound_gets_431_and_is_never_buffered(
    bounded: ProxyProcess, method: str, path: str
) -> None:
    peak_before = bounded.peak_rss_kib()
    header = request_head(method, path) + b"x-big: "
    filler = (b"a" * 65536 for _ in range(512))  # a 32 MiB header, if the server took it all
    response = exchange(bounded.port, [header, *filler])
    status, error = status_and_error(response)
    assert status == 431 and error["code"] == "head_too_large"
    # The head was refused as it arrived, not after it was held: the peak barely moved.
    assert bounded.peak_rss_kib() - peak_before < 16 * 1024
    # A head just under the bound is served.
    fits = b"x-fits: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n"
    assert exchange(bounded.port, [whole_request(method, path, fits)]).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("GET", "/v1/models")])
def test_a_head_over_the_count_bound_gets_431(bounded: ProxyProcess, method: str, path: str) -> None:
    fixed = 4 if method == "POST" else 2  # host, connection (+ content-type, content-length)

    def head(count: int) -> bytes:
        return whole_request(method, path, *(b"x-h%d: v\r\n" % i for i in range(count - fixed)))

    assert exchange(bounded.port, [head(MAX_HEADERS)]).startswith(b"HTTP/1.1 200 ")
    status, error = status_and_error(exchange(bounded.port, [head(MAX_HEADERS + 1)]))
    assert status == 431 and error["code"] == "too_many_headers"
    status, _ = status_and_error(exchange(bounded.port, [head(50_000)]))
    assert status == 431
    assert httpx.get(f"{bounded.url}/v1/models", timeout=10).status_code == 200  # still serving


# --- slow, incomplete and idle clients ---------------------------------------------------------


def trickle(start: bytes, seconds: float = 20.0, every_s: float = 0.2) -> Iterator[bytes]:
    """``start``, then one byte every ``every_s`` for ``seconds`` (a slow client)."""
    yield start
    for _ in range(int(seconds / every_s)):
        yield b"a"


def test_a_slow_request_head_gets_408(bounded: ProxyProcess) -> None:
    chunks = trickle(request_head("GET", "/v1/models") + b"x-slow: ")
    status, error = status_and_error(exchange(bounded.port, chunks, pause_s=0.2))
    assert status == 408 and error["code"] == "request_timeout"
    assert "head" in error["message"]


def test_a_slow_request_body_gets_408(bounded: ProxyProcess) -> None:
    body = completion()
    chunks = trickle(post_head("/v1/completions", len(body) + 1000, b"\r\n") + body[:1])
    status, error = status_and_error(exchange(bounded.port, chunks, pause_s=0.2))
    assert status == 408 and "body" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_a_body_shorter_than_its_content_length_gets_408(bounded: ProxyProcess, path: str) -> None:
    body = completion()
    short = post_head(path, len(body) + 10, b"\r\n") + body
    status, error = status_and_error(exchange(bounded.port, [short]))
    assert status == 408 and error["code"] == "request_timeout"
    # A route passed through logged the client's leaving as a fault of its own, with a traceback.
    assert errors_logged(bounded.proc.log_path) == []


def test_a_chunked_body_without_its_terminator_gets_408(bounded: ProxyProcess) -> None:
    body = completion()
    head = request_head("POST", "/v1/completions", b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (len(body), body)  # the whole body, but no closing 0-chunk
    status, _ = status_and_error(exchange(bounded.port, [head + chunk]))
    assert status == 408


def test_idle_connections_are_closed(bounded: ProxyProcess) -> None:
    # A connection that never sends a request.
    assert exchange(bounded.port, []) == b""
    # A kept-alive connection after its answer: it is answered once, then closed.
    got = exchange(bounded.port, [request_head("GET", "/health", b"\r\n")])
    assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1


def test_connections_past_the_cap_get_503(upstream: Upstream) -> None:
    # No reserve: past the cap, every new connection is refused (test_proxy_overload.py has the
    # reserve kept for scrapes and probes).
    args = ("--max-connections", "3", "--reserved-connections", "0", "--drain-timeout", "0")
    with proxy_process(upstream.url, *args) as p:
        held = [socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S) for _ in range(3)]
        try:
            time.sleep(0.3)  # the server has taken them
            status, error = status_and_error(exchange(p.port, []))  # answered before it asks
            assert status == 503 and error["code"] == "too_many_connections"
            # A held connection is served; once the held ones close, new ones are accepted again.
            held[0].sendall(request_head("GET", "/health", b"connection: close\r\n\r\n"))
            assert read_to_close(held[0]).startswith(b"HTTP/1.1 200 ")
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + WAIT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{p.url}/health", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.1)


# --- hostile bodies and paths ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["extra", "stream_options"])
def test_json_nested_too_deep_gets_400_and_the_bound_is_served(bounded: ProxyProcess, field: str) -> None:
    def nested(levels: int) -> str:  # a value that makes the body ``levels`` objects deep
        return '{"a":' * (levels - 1) + "1" + "}" * (levels - 1)

    def post(levels: int) -> httpx.Response:
        body = f'{{"model":"test-model","prompt":[1],"max_tokens":1,"{field}":{nested(levels)}}}'
        return httpx.post(
            f"{bounded.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json", "x-call-id": uuid.uuid4().hex},
            timeout=10,
        )

    for levels in (MAX_JSON_DEPTH + 1, 1000, 5000):
        r = post(levels)
        assert r.status_code == 400 and r.json()["error"]["code"] in ("json_too_deep", "invalid_json")
    assert post(MAX_JSON_DEPTH + 1).json()["error"]["code"] == "json_too_deep"
    assert post(MAX_JSON_DEPTH).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models%00", "/v1/models/%01", "/health%7f", "/v1/models/../sleep"])
def test_unforwardable_paths_get_400(bounded: ProxyProcess, path: str) -> None:
    status, error = status_and_error(exchange(bounded.port, [request_head("GET", path, b"\r\n")]))
    assert status == 400 and error["code"] == "invalid_path"


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"), ("GET", "/v1/models")])
def test_header_values_with_bytes_beyond_ascii_are_forwarded(
    bounded: ProxyProcess, method: str, path: str
) -> None:
    """HTTP allows obs-text (bytes 0x80-0xff) in a header value, and clients send it (a name in
    Latin-1, a token in UTF-8). On a passed-through route it raised inside the proxy (its HTTP
    client took header values for ASCII text): a 500, in plain text."""
    for value in (b"caf\xe9", b"\xe2\x9c\x93 ok", b"\xff\xfe"):
        response = exchange(bounded.port, [whole_request(method, path, b"x-note: " + value + b"\r\n")])
        assert response.startswith(b"HTTP/1.1 200 "), response[:300]


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """The responses in what a server sent on one connection: (status, body) each."""
    out: list[tuple[int, bytes]] = []
    body = bytearray()

    class Callbacks:
        def on_body(self, data: bytes) -> None:
            body.extend(data)

        def on_message_complete(self) -> None:
            out.append((parser.get_status_code(), bytes(body)))
            body.clear()

    parser = httptools.HttpResponseParser(Callbacks())
    parser.feed_data(raw)
    return out


def test_a_body_sent_without_its_length_gets_a_clear_answer_not_a_silent_close(bounded: ProxyProcess) -> None:
    """Without Content-Length (or chunked) a request has no body in HTTP/1.1: its body's bytes are
    the next request, which is not HTTP. The connection was closed at once, and the client got
    no answer at all, not even to its request."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n\r\n"
    got = responses(exchange(bounded.port, [head + completion()]))
    assert [status for status, _ in got] == [400, 400]
    first, then = (json.loads(body)["error"] for _, body in got)
    assert first["code"] == "invalid_json" and "Content-Length" in first["message"]
    assert then["code"] == "invalid_http"


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_a_request_followed_by_garbage_is_answered_before_the_garbage_is_refused(
    bounded: ProxyProcess, path: str
) -> None:
    got = responses(exchange(bounded.port, [request_head("GET", path, b"\r\n") + b"GARBAGE\r\n\r\n"]))
    assert [status for status, _ in got] == [200, 400]
    assert json.loads(got[1][1])["error"]["code"] == "invalid_http"


def test_pipelined_requests_behind_a_generation_request_are_answered_in_order(bounded: ProxyProcess) -> None:
    """A generation request is served in callbacks (``exporter.exchange``); requests pipelined
    behind it on the same connection (another completion, a streamed one, a passed-through GET)
    wait for its answer and are answered in order, each whole."""
    first, streamed = completion(max_tokens=3), completion(max_tokens=2, stream=True)
    data = b"".join(
        (
            post_head("/v1/completions", len(first), b"\r\n") + first,
            post_head("/v1/completions", len(streamed), b"\r\n") + streamed,
            request_head("GET", "/v1/models", b"connection: close\r\n\r\n"),
        )
    )
    got = responses(exchange(bounded.port, [data]))
    assert [status for status, _ in got] == [200, 200, 200]
    assert json.loads(got[0][1])["choices"][0]["text"] == " t0 t1 t2"
    assert got[1][1].count(b"data: ") == 3 and got[1][1].endswith(b"data: [DONE]\n\n")
    assert b"test-model" in got[2][1]


UPGRADE_H2C = (
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_request_with_a_body_that_asks_to_switch_protocols_gets_400_not_an_empty_body(
    bounded: ProxyProcess, path: str
) -> None:
    """httptools hands everything after the head of a request asking to upgrade (``Connection:
    upgrade``, as an HTTP/2 client trying h2c sends) to the new protocol: its body never reached
    the app, which answered a valid completion with "not valid JSON" and passed an empty body on
    to the engine."""
    status, error = status_and_error(exchange(bounded.port, [whole_request("POST", path, UPGRADE_H2C)]))
    assert status == 400 and error["code"] == "unsupported_upgrade"
    assert "Upgrade" in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("codings", [[b"gzip, chunked"], [b"gzip", b"chunked"], [b"x-custom , Chunked"]])
def test_a_transfer_coding_other_than_chunked_gets_400_not_a_body_still_coded(
    bounded: ProxyProcess, path: str, codings: list[bytes]
) -> None:
    """httptools takes any list of codings that ends in chunked for chunked alone: the proxy
    undid the chunking and read a gzip-coded body as if it were plain (a passed-through request
    reached the engine with its coding dropped)."""
    body = completion()
    fields = b"".join(b"transfer-encoding: %b\r\n" % coding for coding in codings)
    head = request_head(
        "POST", path, b"content-type: application/json\r\n", fields, b"connection: close\r\n\r\n"
    )
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    status, error = status_and_error(exchange(bounded.port, [head + chunked]))
    assert status == 400 and error["code"] == "unsupported_transfer_encoding"
    assert "chunked" in error["message"]


@pytest.mark.parametrize("coding", [b"chunked", b"Chunked", b" chunked "])
def test_a_chunked_body_is_served(bounded: ProxyProcess, coding: bytes) -> None:
    body = completion()
    head = request_head(
        "POST",
        "/v1/completions",
        b"content-type: application/json\r\n",
        b"transfer-encoding: %b\r\n" % coding,
    )
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    response = exchange(bounded.port, [head + b"connection: close\r\n\r\n" + chunked])
    assert response.startswith(b"HTTP/1.1 200 "), response[:300]


def chunked_head(path: str, *headers: bytes) -> bytes:
    return request_head(
        "POST",
        path,
        b"content-type: application/json\r\n",
        b"transfer-encoding: chunked\r\n",
        *headers,
        b"\r\n",
    )


def test_trailer_fields_are_dropped_not_forwarded_as_request_headers(
    bounded: ProxyProcess, upstream: Upstream
) -> None:
    """httptools reports a chunked body's trailer fields as header fields, and they were appended
    to the request's headers after the proxy had read the head: the engine received them as
    request headers the proxy never saw (here a call id; as well credentials)."""
    call = uuid.uuid4().hex
    body = completion()
    trailer = b"x-call-id: %b\r\nx-test-tag: %b\r\n\r\n" % (call.encode(), call.encode())
    chunked = b"%x\r\n%b\r\n0\r\n%b" % (len(body), body, trailer)
    response = exchange(bounded.port, [chunked_head("/v1/completions", b"connection: close\r\n") + chunked])
    assert response.startswith(b"HTTP/1.1 200 "), response[:300]
    assert upstream.requests(call_id=call) == [] and upstream.requests(tag=call) == []


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
@pytest.mark.parametrize("shape", ["one endless field", "endless fields"])
def test_trailer_fields_over_the_head_bound_get_431(bounded: ProxyProcess, path: str, shape: str) -> None:
    """Trailer fields were counted by no bound: one endless field was buffered (and concatenated
    as it grew, stalling every other request) and endless fields were kept, until the body
    timeout. They are bounded as a head is."""
    body = completion()
    start = chunked_head(path) + b"%x\r\n%b\r\n0\r\n" % (len(body), body)
    if shape == "one endless field":
        more = (b"x-junk: " if i == 0 else b"a" * 4096 for i in range(16384))  # up to 64 MiB
    else:
        more = (b"x-junk-%d: %b\r\n" % (i, b"a" * 100) for i in range(655360))
    status, error = status_and_error(exchange(bounded.port, itertools.chain([start], more)))
    assert status == 431 and error["code"] == "head_too_large", error
    assert "trailer" in error["message"]


def test_a_body_in_tiny_chunks_is_held_at_its_size(upstream: Upstream) -> None:
    """A generation request's body was kept as the list of the pieces the parser handed over: a
    4 MiB body sent in 2-byte chunks took 276 MiB (within the 8 MiB body bound, per connection)."""
    with proxy_process(upstream.url, "--drain-timeout", "0") as p:
        before = p.peak_rss_kib()
        body = b'{"model": "test-model", "prompt": "' + b"ab" * (2 * 1024 * 1024) + b'", "max_tokens": 1}'
        pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
        framed = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
        head = chunked_head("/v1/completions", b"connection: close\r\n")
        response = exchange(p.port, [head, *(framed[i : i + 65536] for i in range(0, len(framed), 65536))])
        assert response.startswith(b"HTTP/1.1 200 "), response[:300]
        growth_mib = (p.peak_rss_kib() - before) / 1024
        assert growth_mib < 48, f"a 4 MiB body took {growth_mib:.0f} MiB"


def test_a_request_without_a_body_that_asks_to_switch_protocols_is_served_as_http_1_1(
    bounded: ProxyProcess,
) -> None:
    with socket.create_connection(("127.0.0.1", bounded.port), timeout=WAIT_S) as s:
        s.sendall(request_head("GET", "/v1/models", UPGRADE_H2C, b"\r\n"))
        first = b""
        while b"test-model" not in first:
            got = s.recv(65536)
            assert got, first
            first += got
        assert first.startswith(b"HTTP/1.1 200 ")
        s.sendall(whole_request("GET", "/version"))  # the connection goes on as HTTP/1.1
        second = read_to_close(s)
        assert second.startswith(b"HTTP/1.1 200 ") and b"test-upstream" in second


# --- the route table ---------------------------------------------------------------------------

ENGINE_CONTROL_ROUTES = [
    ("POST", "/reset_prefix_cache"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("POST", "/collective_rpc"),
    ("POST", "/start_profile"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/pause"),
    ("POST", "/update_weights"),
    ("GET", "/server_info"),
]


def test_the_route_table(bounded: ProxyProcess, upstream: Upstream) -> None:
    url = bounded.url
    # The proxy's own routes answer 405 to other methods, with an Allow header.
    for method, path in [
        ("POST", "/metrics"),
        ("POST", "/retrywatch/executions"),
        ("DELETE", "/retrywatch/executions"),
        ("GET", "/v1/completions"),
        ("PUT", "/v1/chat/completions"),
    ]:
        r = httpx.request(method, url + path, timeout=10)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", (method, path)
        assert r.headers["allow"]
    # The engine's control routes are not forwarded; nor are unknown paths, nor the proxy's space.
    for method, path in [*ENGINE_CONTROL_ROUTES, ("GET", "/no/such/route"), ("GET", "/retrywatch/nope")]:
        r = httpx.request(method, url + path, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found", (method, path)
    # What an OpenAI client or a health checker needs is forwarded.
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "test-model"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/version", timeout=10).json() == {"version": "test-upstream"}
    assert httpx.get(f"{url}/v1/models/test-model", timeout=10).status_code == 404  # the upstream's
    assert httpx.get(f"{url}/v1/models/test-model", timeout=10).json()["error"]["code"] == 404


@pytest.mark.parametrize(("method", "path"), [("GET", "/metrics/"), ("POST", "/v1/completions/")])
def test_a_path_one_slash_off_a_route_of_the_proxy_is_not_redirected(
    bounded: ProxyProcess, method: str, path: str
) -> None:
    """Starlette's default redirected it (a 307 whose Location came from the Host header): a path
    that is not a route is passed through or gets a 404, like any other."""
    r = httpx.request(method, bounded.url + path, headers={"host": "elsewhere.example"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
    assert "location" not in r.headers


@pytest.mark.parametrize("host", [b"127.0.0.1", b"x/sleep?", b"x/v1/models/other#"])
def test_a_passed_through_path_reaches_the_upstream_as_written_whatever_the_host(
    bounded: ProxyProcess, host: bytes
) -> None:
    """The path forwarded is the one the route table checked, escapes and all: it was rebuilt as
    a URL from the request (decoding %2F, and taking its authority from the Host header, which
    older Starlettes did not check: ``Host: x/sleep?`` forwarded /sleep)."""
    path = b"/v1/models/a%2Fb%3Fc%20d"
    head = b"GET %s HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % (path, host)
    response = exchange(bounded.port, [head])
    assert response.startswith(b"HTTP/1.1 404 "), response[:300]  # the test upstream's own 404
    assert json.loads(response.partition(b"\r\n\r\n")[2])["error"]["path"] == path.decode()


def test_the_forwarded_routes_are_configurable(upstream: Upstream) -> None:
    env = {"RETRYWATCH_PASSTHROUGH": "default /test/*"}
    with proxy_process(upstream.url, "--drain-timeout", "0", env=env) as p:
        assert httpx.get(f"{p.url}/test/requests", timeout=10).status_code == 200
        assert httpx.get(f"{p.url}/v1/models", timeout=10).status_code == 200
        assert httpx.post(f"{p.url}/sleep", timeout=10).json()["error"]["code"] == "route_not_found"
    with proxy_process(upstream.url, "--passthrough", "none", "--drain-timeout", "0") as p:
        assert httpx.get(f"{p.url}/v1/models", timeout=10).status_code == 404
        assert httpx.post(f"{p.url}/v1/completions", content=completion(), timeout=10).status_code == 200
    with proxy_process(upstream.url, "--passthrough", "*", "--drain-timeout", "0") as p:
        r = httpx.post(f"{p.url}/sleep", timeout=10)  # forwarded: the upstream's own 404
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        assert httpx.get(f"{p.url}/retrywatch/nope", timeout=10).json()["error"]["code"] == "route_not_found"


@pytest.mark.parametrize("passthrough", ["*", "default"])
def test_an_asterisk_request_target_gets_400_whatever_is_forwarded(
    upstream: Upstream, tmp_path: Path, passthrough: str
) -> None:
    """``OPTIONS *`` (HTTP's asterisk form) names no path. With every path forwarded, the proxy
    appended it to the upstream's URL, which made no URL at all: a 500 and a traceback for what a
    client sent."""
    log = tmp_path / "proxy.log"
    with proxy_process(upstream.url, "--passthrough", passthrough, "--drain-timeout", "0", log=log) as p:
        for method in ("OPTIONS", "GET"):
            request = request_head(method, "*", b"connection: close\r\n\r\n")
            status, error = status_and_error(exchange(p.port, [request]))
            assert status == 400 and error["code"] == "invalid_path", (method, error)
    assert errors_logged(log) == []


# --- the drained shutdown ----------------------------------------------------------------------


def _stream(url: str, body: dict[str, Any], headers: dict[str, str], out: dict[str, Any], name: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            out[name] = (r.status_code, b"".join(r.iter_raw()))
    except httpx.HTTPError as exc:
        out[name] = (None, repr(exc).encode())


def test_sigterm_drains_then_ends_live_streams_with_an_sse_error_and_exits_0(upstream: Upstream) -> None:
    with proxy_process(upstream.url, "--drain-timeout", "3") as p:
        tag = uuid.uuid4().hex
        stalled = {"x-test-stall-after": "2", "x-test-stall": "60", "x-test-tag": tag}
        body = {"model": "test-model", "prompt": [1, 2], "max_tokens": 6}
        calls: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
            "stream-a": ({**body, "stream": True}, stalled),
            "stream-b": ({**body, "stream": True}, stalled),
            "plain": ({**body, "stream": False}, {"x-test-ttft": "60", "x-test-tag": tag}),
            "short": ({**body, "stream": True}, {"x-test-token-interval": "0.2", "x-test-tag": tag}),
        }
        out: dict[str, Any] = {}
        threads = []
        for name, (b, h) in calls.items():
            headers = {**h, "x-call-id": f"{tag}-{name}"}
            threads.append(threading.Thread(target=_stream, args=(p.url, b, headers, out, name)))
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        while len(upstream.requests(tag=tag)) < len(calls):  # all four reached the engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # the stalled streams have sent their first tokens
        p.proc.send_signal(signal.SIGTERM)
        # It stops accepting at once.
        refused = False
        while not refused and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", p.port), timeout=1).close()
                time.sleep(0.05)
            except ConnectionRefusedError:
                refused = True
        assert refused
        assert p.proc.wait(timeout=30) == 0
        for t in threads:
            t.join(timeout=10)
    # The short stream finished within the drain, untouched.
    status, raw = out["short"]
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
    # Each stream still live at the bound got its tokens so far, an SSE error event, then [DONE].
    for name in ("stream-a", "stream-b"):
        status, raw = out[name]
        events = [e for e in raw.split(b"\n\n") if e]
        assert status == 200 and events[-1] == b"data: [DONE]", (name, raw[-300:])
        error = json.loads(events[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == "proxy_shutting_down"
        assert b'"text"' in events[0]  # the tokens streamed before the shutdown
    # A non-streaming attempt got a JSON error.
    status, raw = out["plain"]
    assert status == 503 and json.loads(raw)["error"]["code"] == "proxy_shutting_down"
    # The engine was told: the cut executions were aborted.
    rows = {r["call_id"]: r for r in upstream.requests(tag=tag)}
    assert all(rows[f"{tag}-{n}"]["aborted"] for n in ("stream-a", "stream-b", "plain"))


def test_a_second_signal_cuts_the_drain_short(upstream: Upstream) -> None:
    with proxy_process(upstream.url, "--drain-timeout", "60") as p:
        out: dict[str, Any] = {}
        tag = uuid.uuid4().hex
        headers = {"x-test-ttft": "60", "x-test-tag": tag}
        body = {"model": "test-model", "prompt": [1], "max_tokens": 2, "stream": True}
        t = threading.Thread(target=_stream, args=(p.url, body, headers, out, "s"))
        t.start()
        deadline = time.monotonic() + WAIT_S
        while not upstream.requests(tag=tag):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        p.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.proc.poll() is None  # draining
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(timeout=WAIT_S) == 0
        t.join(timeout=10)
    status, raw = out["s"]  # the client saw its attempt end, with an error
    assert status == 503 and json.loads(raw)["error"]["code"] == "proxy_shutting_down"


_LIMITS = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
from foundation.bounds import HttpBounds
from foundation.server import FD_HEADROOM, make_room_for
bounds = HttpBounds(port=1, max_connections=int(sys.argv[1]), reserved_connections=int(sys.argv[2]))
fitted = make_room_for(bounds, int(sys.argv[3]), chosen_by=sys.argv[4] or None)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_HEADROOM, fitted.max_connections)
"""


@pytest.mark.parametrize(
    ("connections", "reserve", "per_connection", "chosen_by", "room", "cap"),
    [
        (1000, 0, 2, "", 2000, 1000),
        (1000, 0, 1, "", 1000, 1000),
        (10, 0, 2, "", 256 - 64, 10),  # a soft limit already large enough is left as it is
        (3000, 0, 2, "--max-connections", 4096 - 64, 3000),  # chosen: kept, and warned
        (3000, 32, 2, "", 4096 - 64, (4096 - 64) // 2 - 32),  # the default: fitted to the limit
    ],
)
def test_the_open_file_limit_is_raised_to_fit_the_connection_cap_or_a_default_cap_is_fitted_to_it(
    connections: int, reserve: int, per_connection: int, chosen_by: str, room: int, cap: int
) -> None:
    argv = [sys.executable, "-c", _LIMITS, str(connections), str(reserve), str(per_connection), chosen_by]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(room), str(cap)]
    warned = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    if chosen_by:
        assert warned == [
            "WARNING open-file limit 4096 is below the 6064 that 3000 connections need: lower "
            "--max-connections or raise the hard limit (ulimit -Hn)"
        ]
    else:
        assert warned == []
    if cap < connections:
        assert (
            f"INFO open-file limit 4096 fits {cap + reserve} connections: at most {cap} clients"
            in done.stderr
        )


def test_a_default_proxy_start_under_a_low_open_file_limit_warns_of_nothing(
    upstream: Upstream, tmp_path: Path
) -> None:
    """The default cap (10,000 connections and the reserve: 20,128 descriptors) under a hard limit
    of 4,096: the proxy serves, fitted to the limit, and its default log level shows nothing; a cap
    given with --max-connections is kept and its warning names the option."""
    log = tmp_path / "default.log"
    with proxy_process(upstream.url, log=log, open_files=(1024, 4096)) as p:
        assert httpx.get(f"{p.url}/metrics", timeout=WAIT_S).status_code == 200
    assert "open-file limit" not in log.read_text()
    chosen = tmp_path / "chosen.log"
    with proxy_process(upstream.url, "--max-connections", "5000", log=chosen, open_files=(1024, 4096)) as p:
        assert httpx.get(f"{p.url}/metrics", timeout=WAIT_S).status_code == 200
    assert "lower --max-connections or raise the hard limit" in chosen.read_text()


_STUCK_WSGI = """
import logging, sys, threading
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from a2wsgi import WSGIMiddleware
from foundation.bounds import HttpBounds
from foundation.server import serve
def app(environ, start_response):  # a request stuck for good in its worker thread
    print("stuck", flush=True)
    threading.Event().wait()
serve(WSGIMiddleware(app, workers=2), HttpBounds(port=int(sys.argv[1]), drain_timeout_s=0.5), None, "info")
"""


def test_sigterm_ends_a_wsgi_app_whose_request_is_stuck_in_its_worker_thread(tmp_path: Path) -> None:
    """A request blocked for good in a WSGI worker (the dashboard's callbacks run in a2wsgi's
    thread pool) is cut at the drain bound; the process then exits, status 0, instead of waiting
    at exit for that worker forever, and says which thread it left."""
    port = free_port()
    log = tmp_path / "stuck.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_WSGI, str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT
    )
    try:
        answer: dict[str, int] = {}
        client = threading.Thread(
            target=lambda: answer.update(
                status=httpx.get(f"http://127.0.0.1:{port}/", timeout=WAIT_S).status_code
            ),
            daemon=True,
        )
        deadline = time.monotonic() + WAIT_S
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        client.start()
        while b"stuck" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0, log.read_text()
        client.join(timeout=WAIT_S)
    finally:
        proc.kill()
        proc.wait()
    assert answer == {"status": 503}
    assert "exiting without them" in log.read_text() and "(WSGI_0)" in log.read_text()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True
