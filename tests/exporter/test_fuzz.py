"""Fuzzing a real ``retrywatch proxy`` process with hypothesis: arbitrary JSON bodies on the
generation routes, arbitrary header names and values, odd methods and paths, and malformed
requests written raw on a socket.

The property, for every request: the proxy never answers a client's bad input with a 5xx (the
test upstream answers every request that reaches it with a 200 or a 4xx, so no 502 or 503 is
the upstream's word either), every error the proxy makes is an OpenAI-style JSON error, and
afterwards the proxy is alive, its counters balance, nothing is left live, and a call still gets
its own answer.

CI runs a fixed, derandomized set of examples (``FUZZ_EXAMPLES`` per test). A long local run:
``RETRYWATCH_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest tests/exporter/test_fuzz.py``, which
also draws new examples on every run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httptools
import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from exporter.routes import DEFAULT_ROUTES, ForwardedRoutes
from exporter.validation import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MAX_JSON_DEPTH,
    RequestError,
    parse_body,
    validate,
)
from tests.exporter.support import ProxyProcess, Upstream, balance, errors_logged, proxy_process, scrape
from tests.exporter.upstream import MAX_MODEL_LEN

LONG_RUN = int(os.environ.get("RETRYWATCH_FUZZ_EXAMPLES", "0"))
FUZZ_EXAMPLES = LONG_RUN or 500
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,  # a shared 2-core machine: one slow example is noise, not a failure
    derandomize=not LONG_RUN,  # CI: the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
WAIT_S = 30.0  # an answer later than this is a hang (the proxy's own timeouts are 1 s here)
PROXY_ROUTES = (COMPLETIONS, CHAT_COMPLETIONS, "/metrics")
FORWARDED = ForwardedRoutes((DEFAULT_ROUTES,))


@dataclass
class Fuzzed:
    proxy: ProxyProcess
    log: Path  # its output: nothing in it may tell of an error inside the proxy


@pytest.fixture(scope="module")
def fuzzed(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    args = ("--head-timeout", "1", "--body-timeout", "1", "--keep-alive-timeout", "5", "--drain-timeout", "0")
    log = tmp_path_factory.mktemp("fuzz") / "proxy.log"
    with proxy_process(upstream.url, *args, log=log) as p:
        yield Fuzzed(p, log)


def assert_alive_and_balanced(fuzzed: Fuzzed, upstream: Upstream) -> None:
    p = fuzzed.proxy
    assert p.proc.poll() is None, "the proxy died"
    assert errors_logged(fuzzed.log) == [], fuzzed.log.read_text()[-5000:]
    deadline = time.monotonic() + WAIT_S
    while True:
        m = scrape(p.url)
        balance(m)
        busy = [m[(g, ())] for g in ("retrywatch_executions_live", "retrywatch_executions_queued")]
        if busy == [0, 0] and m[("retrywatch_subscribers", ())] == 0:
            break
        assert time.monotonic() < deadline, f"executions still live or queued: {busy}"
        time.sleep(0.1)
    call = uuid.uuid4().hex
    body = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 3}
    r = httpx.post(f"{p.url}{COMPLETIONS}", json=body, headers={"x-call-id": call}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"cmpl-{upstream.requests(call_id=call)[0]['request_id']}"


def assert_openai_error(status: int, body: bytes) -> None:
    """An error the proxy made: a JSON body ``{"error": {"message", "type", "code", ...}}``."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(
            f"HTTP {status} with a body that is not an OpenAI-style error: {body[:300]!r}"
        ) from None
    assert isinstance(error, dict) and {"message", "type", "code"} <= set(error), body[:300]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), body[:300]


# --- bodies on the generation routes ---------------------------------------------------------

SURROGATES = st.sampled_from(["\ud800", "\udfff", "\ud83d", "\udc00x"])
ODD_TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=20),
    st.sampled_from(["", "\x00", "\ufeff", "\u2028\u2029", "\u202e", "e\u0301", "\U0001f600", "\\", '"']),
    SURROGATES,
)
# Numbers around the edges: JSON's and the parsers' (64-bit integers, doubles).
EDGE_NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, MAX_MODEL_LEN + 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-0.0, 5e-324, 1.7976931348623157e308, 1e-300]),
)
SCALARS = st.one_of(st.none(), st.booleans(), EDGE_NUMBERS, ODD_TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
    max_leaves=20,
)
KNOWN_FIELDS = (
    "model",
    "prompt",
    "messages",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream_options",
    "ignore_eos",
)


def _small_max_tokens(value: Any) -> bool:
    """Keeps a valid ``max_tokens`` small: a fuzzed one in (64, MAX_MODEL_LEN] would only make
    the test upstream stream for seconds."""
    return not (type(value) is int and 64 < value <= MAX_MODEL_LEN)


@st.composite
def near_valid_bodies(draw: st.DrawFn, route: str) -> bytes:
    """A valid request, then some known fields replaced by anything, deleted, or joined by
    extra fields."""
    body: dict[str, Any] = {
        "model": "test-model",
        "max_tokens": draw(st.integers(0, 8)),
        "stream": draw(st.booleans()),
    }
    if route == CHAT_COMPLETIONS:
        body["messages"] = [{"role": "user", "content": draw(ODD_TEXT)}]
    else:
        body["prompt"] = draw(st.one_of(ODD_TEXT, st.lists(st.integers(0, 50_000), min_size=1, max_size=8)))
    for name in draw(st.lists(st.sampled_from(KNOWN_FIELDS), max_size=4, unique=True)):
        if draw(st.booleans()):
            body.pop(name, None)
        else:
            body[name] = draw(JSON_VALUES.filter(_small_max_tokens) if name == "max_tokens" else JSON_VALUES)
    body |= draw(st.dictionaries(ODD_TEXT, JSON_VALUES, max_size=3))
    ascii_only = draw(st.booleans())
    text = json.dumps(body, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def deep_bodies(draw: st.DrawFn, route: str) -> bytes:
    """A valid request with one field nested about ``MAX_JSON_DEPTH`` deep (or much deeper)."""
    depth = draw(st.integers(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3) | st.integers(1, 5_000))
    opening, closing = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = opening * depth + "1" + closing * depth
    field = "messages" if route == CHAT_COMPLETIONS else "prompt"
    value = '[{"role": "user", "content": "x"}]' if field == "messages" else "[1]"
    return f'{{"model": "test-model", "max_tokens": 1, "{field}": {value}, "extra": {nested}}}'.encode()


@st.composite
def literal_bodies(draw: st.DrawFn, route: str) -> bytes:
    """Number and string literals written by hand, as no JSON encoder writes them."""
    literal = draw(
        st.sampled_from(
            [
                *("1e400", "-1e400", "NaN", "Infinity", "-0", "1E+2", "0.1e-999", "01", "1.", ".5", "0x10"),
                *(
                    '"\\ud800"',
                    '"\\udfff\\ud800"',
                    '"\\u0000"',
                    '"\\x41"',
                    '"\ud800"',
                    "1_000",
                    "true",
                    "null",
                ),
            ]
        )
    )
    field = draw(st.sampled_from(["max_tokens", "temperature", "n", "seed", "prompt", "model", "extra"]))
    prompt = (
        '"messages": [{"role": "user", "content": "x"}]' if route == CHAT_COMPLETIONS else '"prompt": [1]'
    )
    text = f'{{"model": "test-model", {prompt}, "max_tokens": 1, "{field}": {literal}}}'
    return text.encode("utf-8", "surrogatepass")


def bodies(route: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        near_valid_bodies(route),
        deep_bodies(route),
        literal_bodies(route),
        JSON_VALUES.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass")),
        st.binary(max_size=300),
        st.sampled_from([b"", b"\xef\xbb\xbf{}", b'{"model": "m", "prompt": [1]} trailing', b"{" * 10_000]),
    )


@st.composite
def generation_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    route = draw(st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]))
    headers = {}
    content_type = draw(
        st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"])
    )
    if content_type:
        headers["content-type"] = content_type
    # Call ids a client library can send (the raw-head test below sends any bytes).
    printable = st.characters(codec="latin-1").filter(str.isprintable)
    call_id = draw(st.none() | st.just(uuid.uuid4().hex) | st.text(printable, max_size=300).map(str.strip))
    if call_id is not None:
        headers["x-call-id"] = call_id
    return route, draw(bodies(route)), headers


def test_fuzzed_bodies_on_the_generation_routes(fuzzed: Fuzzed, upstream: Upstream) -> None:
    client = httpx.Client(timeout=WAIT_S)

    @FUZZ
    @given(generation_requests())
    @example((COMPLETIONS, b'{"model": "m", "prompt": [1], "max_tokens": 18446744073709551615}', {}))
    @example((COMPLETIONS, b'{"model": "m", "prompt": [1], "max_tokens": 1, "stop": "\\ud800"}', {}))
    @example((CHAT_COMPLETIONS, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', {}))
    def check(request: tuple[str, bytes, dict[str, str]]) -> None:
        route, body, headers = request
        try:
            encoded = {k.encode(): v.encode("latin-1") for k, v in headers.items()}
            r = client.post(f"{fuzzed.proxy.url}{route}", content=body, headers=encoded)
        except httpx.RemoteProtocolError as exc:
            raise AssertionError(f"the proxy broke the connection: {exc}") from None
        event(f"HTTP {r.status_code}")
        assert r.status_code < 500, (r.status_code, r.content[:300])
        if r.status_code >= 400:
            assert_openai_error(r.status_code, r.content)
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.content.endswith(b"data: [DONE]\n\n"), r.content[-300:]
        else:
            assert "choices" in r.json(), r.content[:300]

    try:
        check()
    finally:
        client.close()
    assert_alive_and_balanced(fuzzed, upstream)


# --- request heads: methods, paths, header names and values ---------------------------------

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Names and values HTTP allows: a token; visible ASCII, obs-text (0x80-0xff), spaces and tabs.
VALID_NAMES = st.one_of(
    st.text(TOKEN_CHARS, min_size=1, max_size=20),
    st.sampled_from(
        [
            "authorization",
            "api-key",
            "x-api-key",
            "x-call-id",
            "idempotency-key",
            "x-stainless-retry-count",
            "expect",
            "upgrade",
            "connection",
            "host",
            "accept-encoding",
            "te",
            "trailer",
            "keep-alive",
            "proxy-authorization",
            "content-type",
            "cookie",
            "forwarded",
            "x-forwarded-for",
        ]
    ),
)
VALID_VALUES = st.one_of(
    st.binary(max_size=40).map(lambda b: bytes(c for c in b if (c >= 0x20 and c != 0x7F) or c == 0x09)),
    st.sampled_from(
        [
            b"",
            b"100-continue",
            b"websocket",
            b"h2c",
            b"close",
            b"keep-alive, upgrade",
            b"Bearer sk-\xe9",
            b"-1",
        ]
    ),
    st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=20).map(str.encode),  # UTF-8 text
).map(lambda b: b.strip(b" \t"))
# And what it does not: separators, spaces and controls in a name; controls in a value (never a
# CR or an LF, which would end the line).
INVALID_NAMES = st.text(st.characters(codec="latin-1"), min_size=1, max_size=10).filter(
    lambda s: ":" not in s
)
INVALID_VALUES = st.binary(min_size=1, max_size=10).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def _ours(name: str) -> bool:
    """Names the fuzz leaves alone: the body's framing (set right by the fuzz itself) and the test
    upstream's control headers (``x-test-*``)."""
    n = name.lower()
    return n.startswith("x-test-") or n in ("content-length", "transfer-encoding")


# Three times in four only what HTTP allows (else most requests would end at the parser).
HEADERS = (
    st.integers(0, 3)
    .flatmap(
        lambda i: (
            st.lists(st.tuples(VALID_NAMES, VALID_VALUES), max_size=12)
            if i
            else st.lists(
                st.tuples(VALID_NAMES | INVALID_NAMES, VALID_VALUES | INVALID_VALUES), min_size=1, max_size=6
            )
        )
    )
    .map(lambda headers: [(n, v) for n, v in headers if not _ours(n)])
)
KNOWN_METHODS = (
    "GET",
    "POST",
    "PUT",
    "DELETE",
    "PATCH",
    "HEAD",
    "OPTIONS",
    "TRACE",
    "PROPFIND",
    "PURGE",
    "QUERY",
)
# Mostly methods the parser knows (the others are refused before anything else is read).
METHODS = st.integers(0, 4).flatmap(
    lambda i: st.sampled_from(KNOWN_METHODS) if i else st.text(TOKEN_CHARS, min_size=1, max_size=10)
)
SEGMENT = st.one_of(
    st.text("abcXYZ09-._~!$&'()*+,;=:@", max_size=8),
    st.sampled_from(
        [".", "..", "%2e%2e", "%2E", "%2F", "%00", "%01", "%20", "%3F", "%23", "%25", "%ff", "%C3%A9", "%"]
    ),
)
PATHS = st.one_of(
    st.sampled_from(
        [
            COMPLETIONS,
            CHAT_COMPLETIONS,
            "/metrics",
            "/retrywatch/executions",
            "/retrywatch/executions?limit=abc",
            "/retrywatch/executions?limit=%D9%A1",
            "/v1/models",
            "/health",
            "/version",
            "/tokenize",
            "/sleep",
            "/v1/models/../../sleep",
            "/v1/completions/",
            "//v1/completions",
            "*",
            "/metrics?x=%ff",
        ]
    ),
    st.builds(
        lambda prefix, segments, query: prefix + "/".join(segments) + query,
        st.sampled_from(["/", "/v1/", "/v1/models/", "/v1/responses/", "/retrywatch/", "//"]),
        st.lists(SEGMENT, max_size=5),
        st.sampled_from(["", "?", "?a=1&b", "?limit=5", "?%ff=%fe", "#frag"]),
    ),
)


def read_response(sock: socket.socket, head_only: bool = False) -> tuple[int | None, bytes]:
    """The final response's status and body (None: the connection closed with no response)."""
    final: dict[str, Any] = {"status": None, "body": bytearray(), "done": False, "headers": False}

    class Callbacks:
        # NOTE: only the first final response counts. A refusal of bytes that followed the
        # request may arrive in the same read; its body was appended to the first one's.
        def on_headers_complete(self) -> None:
            status = parser.get_status_code()
            if status >= 200 and not final["done"]:
                final["status"], final["headers"] = status, True

        def on_body(self, body: bytes) -> None:
            if final["status"] is not None and not final["done"]:
                final["body"] += body

        def on_message_complete(self) -> None:
            if final["status"] is not None:
                final["done"] = True

    parser = httptools.HttpResponseParser(Callbacks())
    sock.settimeout(WAIT_S)
    while not final["done"] and not (head_only and final["headers"]):
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise AssertionError(f"no answer in {WAIT_S:g} s") from None
        if not data:
            break
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise AssertionError(f"the proxy wrote something that is not HTTP: {exc}") from None
        except httptools.HttpParserUpgrade:
            break
    return final["status"], bytes(final["body"])


def send_raw(p: ProxyProcess, data: bytes, head_only: bool = False) -> tuple[int | None, bytes]:
    with socket.create_connection(("127.0.0.1", p.port), timeout=WAIT_S) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # the proxy may answer and close before all of it is sent
        return read_response(sock, head_only)


def forwarded_path(target: str) -> bool:
    """Whether the proxy passes a request for ``target`` to the upstream, whose answer (and its
    body, in the upstream's own form) it relays."""
    path = unquote(target.split("?", 1)[0].split("#", 1)[0])
    return path not in PROXY_ROUTES and FORWARDED.forwards(path)


def check_answer(status: int | None, body: bytes, target: str, what: bytes, with_body: bool = True) -> None:
    event(f"HTTP {status}")  # the spread of answers shows in --hypothesis-show-statistics
    assert status is not None, f"the proxy closed the connection without an answer to {what[:300]!r}"
    assert status < 500, (status, body[:300], what[:300])
    if status >= 400 and with_body and not forwarded_path(target):
        assert_openai_error(status, body)


def raw_request(method: str, target: str, *headers: bytes) -> bytes:
    """A request with these header lines (after ``host``); a POST to a generation route carries
    a valid body, any other request none."""
    body = b""
    if method == "POST" and target in (COMPLETIONS, CHAT_COMPLETIONS):
        chat = target == CHAT_COMPLETIONS
        field = '"messages": [{"role": "user", "content": "x"}]' if chat else '"prompt": [1]'
        body = f'{{"model": "test-model", "max_tokens": 2, {field}}}'.encode()
    lines = [f"{method} {target} HTTP/1.1".encode(), b"host: 127.0.0.1", *headers]
    lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@st.composite
def request_heads(draw: st.DrawFn) -> tuple[str, str, bytes]:
    if draw(st.integers(0, 2)):
        method, target = draw(METHODS), draw(PATHS)
    else:  # a completion request, with a valid body: only its head is fuzzed
        method, target = "POST", draw(st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]))
    headers = [name.encode("latin-1") + b": " + value for name, value in draw(HEADERS)]
    return method, target, raw_request(method, target, *headers)


def test_fuzzed_request_heads_on_every_route(fuzzed: Fuzzed, upstream: Upstream) -> None:
    upgrade = (b"connection: upgrade", b"upgrade: h2c")

    @FUZZ
    @given(request_heads())
    @example(("GET", "/v1/models", raw_request("GET", "/v1/models", b"x-h: a\x80b")))
    @example(("GET", "/health", raw_request("GET", "/health", b"x-h: \xff\xfe")))
    @example(("GET", "/v1/models", raw_request("GET", "/v1/models", b"host: x/sleep?")))
    @example(("POST", COMPLETIONS, raw_request("POST", COMPLETIONS, *upgrade)))
    def check(request: tuple[str, str, bytes]) -> None:
        method, target, data = request
        head_only = method == "HEAD"  # an answer to HEAD has no body
        status, body = send_raw(fuzzed.proxy, data, head_only)
        check_answer(status, body, target if not head_only else "", data, with_body=not head_only)
        if method == "POST" and target in (COMPLETIONS, CHAT_COMPLETIONS) and status != 200:
            # Its body is a valid completion request: whatever the head said, it must arrive whole.
            code = json.loads(body)["error"]["code"]
            assert code not in ("invalid_json", "invalid_request", "json_too_deep"), (code, data[:300])

    check()
    assert_alive_and_balanced(fuzzed, upstream)


# --- malformed requests, raw ------------------------------------------------------------------

LINE_ENDS = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n", b"\n\r"])


@st.composite
def malformed_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    method = draw(METHODS.map(str.encode) | st.binary(min_size=1, max_size=8))
    target = draw(PATHS.map(str.encode) | st.binary(max_size=30).map(lambda b: b.replace(b"\r\n", b"")))
    version = draw(
        st.sampled_from(
            [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.2", b"HTTPS/1.1", b"http/1.1", b""]
        )
        | st.binary(max_size=10)
    )
    separator = draw(st.sampled_from([b" ", b"  ", b"\t", b""]))
    end = draw(LINE_ENDS)
    line = method + separator + target + (separator + version if version else b"")
    headers = draw(
        st.lists(
            st.one_of(
                HEADERS.filter(bool).map(
                    lambda hs: b"\r\n".join(n.encode("latin-1") + b": " + v for n, v in hs)
                ),
                st.sampled_from(
                    [
                        b" folded continuation",
                        b"\tfolded",
                        b"no colon here",
                        b": no name",
                        b"content-length: 5",
                        b"content-length: -1",
                        b"content-length: 1e3",
                        b"content-length: 99999999999999999999",
                        b"transfer-encoding: chunked",
                        b"transfer-encoding: chunked, identity",
                        b"transfer-encoding: gzip",
                        b"host:",
                        b"expect: 100-continue",
                    ]
                ),
            ),
            max_size=6,
        )
    )
    body = draw(
        st.sampled_from([b"", b"hello", b"0\r\n\r\n", b"zz\r\n\r\n", b"ffffffffffffffffff\r\nx\r\n0\r\n\r\n"])
    )
    data = line + end + b"".join(h + end for h in headers) + end + body
    return target.decode("latin-1"), data


def test_malformed_requests_written_raw(fuzzed: Fuzzed, upstream: Upstream) -> None:
    @FUZZ
    @given(malformed_requests() | st.binary(min_size=1, max_size=200).map(lambda b: ("", b + b"\r\n\r\n")))
    @example(("*", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
    @example(("/", b"GET /\r\n\r\n"))
    @example(("/v1/models", b"GET http://example.com/v1/models HTTP/1.1\r\nhost: a\r\n\r\n"))
    @example(("", b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n"))
    @example(("*", b"OPTIONS * HTTP/1.1\r\nhost: a\r\n\r\n"))
    @example(("/metrics", b"GET /metrics HTTP/1.1\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab"))
    @example(
        (
            COMPLETIONS,
            b"POST /v1/completions HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
            b"0\r\n\r\nGET /sleep HTTP/1.1\r\n\r\n",
        )
    )
    @example(("/health", b"GET /health HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"))
    @example(("/health", b"GET /health HTTP/1.1\r\n\r\nGARBAGE\r\n\r\n"))
    @example((COMPLETIONS, b'POST /v1/completions HTTP/1.1\r\n\r\n{"model": "m", "prompt": [1]}\r\n\r\n'))
    def check(request: tuple[str, bytes]) -> None:
        target, data = request
        head_only = data.startswith(b"HEAD ")  # an answer to HEAD has no body
        status, body = send_raw(fuzzed.proxy, data, head_only)
        if status is None:  # only blank lines, which HTTP says to skip, go unanswered (idle)
            assert not data.strip(b"\r\n"), (
                f"the proxy closed the connection without an answer to {data[:300]!r}"
            )
            return
        check_answer(status, body, target, data, with_body=not head_only)

    check()
    assert_alive_and_balanced(fuzzed, upstream)


# --- make sure the examples are not all refused at the door ----------------------------------


def test_the_fuzzed_bodies_reach_every_outcome() -> None:
    """The strategies produce valid requests as well as broken ones (else the fuzz would only
    ever test the parser's first check)."""
    outcomes: set[str] = set()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(
        st.sampled_from([COMPLETIONS, CHAT_COMPLETIONS]).flatmap(lambda r: st.tuples(st.just(r), bodies(r)))
    )
    def classify(request: tuple[str, bytes]) -> None:
        route, body = request
        try:
            validate(route, parse_body(body))
        except RequestError as exc:
            outcomes.add(exc.code)
        else:
            outcomes.add("valid")

    classify()
    assert {"valid", "invalid_request", "invalid_json", "json_too_deep"} <= outcomes, outcomes
