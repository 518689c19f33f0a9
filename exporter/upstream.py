"""The proxy's HTTP clients toward the engine: one upstream request per execution.

Generation requests and the once-a-second refresh of the engine's ``/metrics``
(``UpstreamPool.get_text``) go through ``UpstreamPool``, a lean HTTP/1.1 client on asyncio
protocols and httptools (raw body bytes, one write per request, keep-alive reuse); the other
routes, passed through, use an httpx AsyncClient. Cancelling an execution closes its upstream
response before the end, which closes the connection (it is not returned to the pool), so vLLM
sees the disconnect and aborts the request.

Neither client takes an interim (1xx) response for the final one, reuses a connection whose
response was not read to its end, or sends a request twice: ``UpstreamUnreachable`` says no
connection could be made (nothing was sent), ``UpstreamBroken`` that the upstream broke the
exchange after the request was written.

What the upstream sends is bounded as a trusted proxy bounds it: an answer ends where its framing
says, and bytes past it (which no request asked for) close the connection, never reaching the
answer or another request; a response head (with any interim responses before it and a chunked
answer's trailer fields after it) is at most ``MAX_UPSTREAM_HEAD_BYTES`` and
``MAX_UPSTREAM_HEAD_FIELDS`` (``UpstreamHeadTooLarge``); repeated fields stay separate lines.
Each such fault is logged and reported to the client's ``on_fault`` (the proxy counts them in
``retrywatch_upstream_faults_total``).
"""

from __future__ import annotations

import asyncio
import logging
import select
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

from foundation.bounds import MAX_METRICS_BYTES
from foundation.metricnames import HEAD_TOO_LARGE, STRAY_BYTES

log = logging.getLogger("retrywatch.proxy")

# Request headers never forwarded upstream: hop-by-hop ones, those httpx sets itself, and
# Accept-Encoding (the proxy relays raw bytes and inspects the first SSE event: every request it
# sends asks for ``_IDENTITY`` instead).
_DROP_REQUEST_HEADERS = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"accept-encoding",
        # The proxy reads the whole body before forwarding it: nothing is left to wait for, and
        # the upstream's interim 100 Continue would only be one more response to skip.
        b"expect",
    }
)
_IDENTITY = (b"accept-encoding", b"identity")  # on every upstream request: the body unencoded
_CLOSE = (b"connection", b"close")  # on every request passed through (``UpstreamClient``)
# Longest a kept-alive upstream connection is reused after its last response: below the
# upstream's own keep-alive timeout (5 s in uvicorn, which serves vLLM), so the upstream does not
# close a connection just as a request is written on it. The proxy's --upstream-max-idle sets it
# (``UpstreamPool``; the routes passed through keep no connection alive).
DEFAULT_MAX_IDLE_S = 2.0
# Largest response head read from the upstream, on every path (generation requests, routes passed
# through, the /metrics fetch): the header fields of the final response, of any interim (1xx)
# responses before it and of a chunked answer's trailer, together. nginx's proxy_buffer_size
# (4-8 KiB) bounds the same; an engine's heads take a few hundred bytes. Past either bound the
# answer fails as a broken upstream's (502) and the connection is closed.
MAX_UPSTREAM_HEAD_BYTES = 64 * 1024
MAX_UPSTREAM_HEAD_FIELDS = 100

# Response headers never relayed to a client.
_DROP_RESPONSE_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"date",
        b"server",
    }
)


def connection_listed(values: Iterable[bytes]) -> frozenset[bytes]:
    """The field names a message's Connection header values list (lower case): hop-by-hop
    fields, meant for the next hop only (RFC 9110, 7.6.1)."""
    return frozenset(
        token for value in values for part in value.split(b",") if (token := part.strip(b" \t").lower())
    )


def relayed_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An upstream answer's header fields that go on to the client (names in lower case, as ASGI
    wants them), each line as it came: neither the hop-by-hop ones nor those its Connection header
    names (RFC 9110, 7.6.1).

    NOTE: a repeated field stays repeated lines: ``Set-Cookie`` may not be folded into one
    (RFC 6265, 3), and the pass-through had merged every repeated field, comma-joined."""
    return _end_to_end([(name.lower(), value) for name, value in raw], _DROP_RESPONSE_HEADERS)


def _end_to_end(fields: list[tuple[bytes, bytes]], hop_by_hop: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """``fields`` as they came, less those named in ``hop_by_hop`` (lower case) and those their
    Connection header names (RFC 9110, 7.6.1)."""
    drop = hop_by_hop
    listed = [value for name, value in fields if name.lower() == b"connection"]
    if listed:
        drop = drop | connection_listed(listed)
    return [(name, value) for name, value in fields if name.lower() not in drop]


def head_over_bounds(fields: int, size: int) -> bool:
    """Whether a response head of ``fields`` header fields taking ``size`` bytes is over the
    proxy's bounds (``MAX_UPSTREAM_HEAD_FIELDS``, ``MAX_UPSTREAM_HEAD_BYTES``)."""
    return fields > MAX_UPSTREAM_HEAD_FIELDS or size > MAX_UPSTREAM_HEAD_BYTES


def _field_bytes(name: bytes, value: bytes) -> int:
    """What a header field takes in a head: its name and value, ``: `` and the line's end."""
    return len(name) + len(value) + 4


HEAD_TOO_LARGE_MESSAGE = (
    f"its response head is over the proxy's bound ({MAX_UPSTREAM_HEAD_BYTES} bytes, "
    f"{MAX_UPSTREAM_HEAD_FIELDS} fields, interim responses and trailer fields included)"
)


def forwardable_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's request headers that go to the upstream (ASGI's byte pairs, names in lower
    case), as they came: neither the hop-by-hop ones nor those its Connection header names.

    NOTE: a field the Connection header names is hop-by-hop too, and a proxy removes it (RFC
    9110, 7.6.1); dropping only a fixed list of names sent on to the engine what a client
    marked as meant for the proxy alone."""
    return _end_to_end(headers, _DROP_REQUEST_HEADERS)


FaultHook = Callable[[str], None]  # told the kind of each fault of the upstream's (metricnames)


def _fault(on_fault: FaultHook | None, kind: str, message: str) -> None:
    log.warning("upstream fault (%s): %s", kind, message)
    if on_fault is not None:
        on_fault(kind)


class UpstreamClient:
    """An httpx AsyncClient bound to the engine's base URL, for the routes passed through: one
    connection per request (see ``open``)."""

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float = 5.0,
        max_connections: int = 100_000,
        on_fault: FaultHook | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.on_fault = on_fault
        # No read timeout: an execution may wait minutes in the engine's queue; the clients'
        # deadline, not the proxy, decides when to give up.
        timeout = httpx.Timeout(None, connect=connect_timeout_s, pool=None)
        # httpx skips interim responses other than 101 (the proxy checks for that one).
        # NOTE: no connection is kept alive. httpx (h11) keeps the bytes it read past the end of
        # an answer and takes them for the answer to the next request on that connection: an
        # upstream that wrote a second response in the same write as the first had it delivered
        # to another client. One connection per request, as nginx's default toward an upstream
        # (HTTP/1.0, no keepalive): the routes passed through are not the generation path.
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)

    def url(self, path: str, query: bytes = b"") -> str:
        return self.base_url + path + (("?" + query.decode("latin-1")) if query else "")

    async def open(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        query: bytes = b"",
        read_timeout_s: float | None = None,
    ) -> httpx.Response:
        """Send a request (asking for ``_IDENTITY``, on a connection closed after its answer) and
        return the response with its body still unread (a stream). ``read_timeout_s`` bounds each
        wait for the upstream's next bytes (``httpx.ReadTimeout``); None: no bound. Raises
        ``UpstreamHeadTooLarge`` for a head over the bounds (the connection closed), and httpx's
        errors otherwise."""
        # NOTE: as bytes, as they arrived: httpx encodes str header values as ASCII, and a value
        # with obs-text (bytes 0x80-0xff, which HTTP allows and clients send) raised inside the
        # proxy, answering a client's header with a 500.
        timeout = self.client.timeout
        if read_timeout_s is not None:
            timeout = httpx.Timeout(None, connect=timeout.connect, read=read_timeout_s, pool=None)
        request = self.client.build_request(
            method,
            self.url(path, query),
            content=body,
            headers=[*headers, _IDENTITY, _CLOSE],
            timeout=timeout,
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.RemoteProtocolError as exc:
            # h11 reads at most 100 KiB of a head before giving up (its max_incomplete_event_size)
            if "buffer too long" not in str(exc):
                raise
            _fault(self.on_fault, HEAD_TOO_LARGE, f"{method} {path}: {HEAD_TOO_LARGE_MESSAGE}")
            raise UpstreamHeadTooLarge(HEAD_TOO_LARGE_MESSAGE) from None
        raw = response.headers.raw
        if head_over_bounds(len(raw), sum(_field_bytes(name, value) for name, value in raw)):
            await response.aclose()
            _fault(self.on_fault, HEAD_TOO_LARGE, f"{method} {path}: {HEAD_TOO_LARGE_MESSAGE}")
            raise UpstreamHeadTooLarge(HEAD_TOO_LARGE_MESSAGE)
        return response

    async def aclose(self) -> None:
        await self.client.aclose()


# --- the generation fast path ----------------------------------------------------------------


class UpstreamError(Exception):
    """The upstream could not be reached, or broke the exchange off."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the upstream could be made: nothing was sent."""


class UpstreamBroken(UpstreamError):
    """The upstream broke the exchange after the request was written: it closed the connection
    before the end of the response, or answered something that is not HTTP/1.1."""


class UpstreamHeadTooLarge(UpstreamBroken):
    """The upstream's response head is over ``MAX_UPSTREAM_HEAD_BYTES`` or
    ``MAX_UPSTREAM_HEAD_FIELDS`` (interim responses and trailer fields included): the connection
    is closed (nginx: "upstream sent too big header")."""


class _StopParsing(Exception):
    """Raised in a parser callback to stop httptools where it is in the bytes it was fed."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the upstream, parsing responses with httptools.

    Interim (1xx) responses are skipped: only a final response (status >= 200) counts. A
    connection is reusable only once its final response was read to the end with nothing after
    it; bytes arriving after the end of the response, in the same read or while it is idle, or an
    end of its stream, make it unusable for good. A head over the bounds
    (``MAX_UPSTREAM_HEAD_BYTES``, ``MAX_UPSTREAM_HEAD_FIELDS``) is ``UpstreamHeadTooLarge``.
    """

    def __init__(self, on_fault: FaultHook | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self._poller: select.poll | None = None  # polls the socket while the connection is idle
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since: float | None = None  # time.monotonic() when it went back to the pool
        self.on_fault = on_fault
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.interim = False  # the message being parsed is an interim (1xx) response
        self.headers_done = False
        self.keep_alive = False
        self.ends_at_close = False  # the final response has no length: its body ends at the close
        self.complete = False
        self.extra = False  # bytes came after the final response: never reuse
        self.error: UpstreamError | None = None
        self.chunks: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], None] | None = None
        # Called once the bytes of each read are parsed, and when the connection is lost: how
        # an execution (``exporter.execution``) is driven without a task.
        self.listener: Callable[[], None] | None = None
        # Header fields of this exchange so far (interim responses', the final one's, trailer
        # fields), and the bytes they take: bounded by MAX_UPSTREAM_HEAD_FIELDS and _BYTES.
        self.fields = 0
        self.head_bytes = 0
        # Bytes read since the last body byte: a head (or a trailer) still arriving. httptools
        # holds an unfinished header line itself, unseen until it ends: counted here, so one
        # endless line is bounded too.
        self.unframed = 0

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def reusable(self) -> bool:
        """Whether the exchange on it ended cleanly and it may carry another request."""
        return self.complete and self.keep_alive and not self.extra and self.error is None and not self.closed

    def alive_when_idle(self) -> bool:
        """Whether an idle connection may carry a request: not closed, and nothing to read.

        NOTE: the event loop reads the socket only between callbacks; an end of stream (the
        upstream's keep-alive timeout) or stray bytes may sit in the kernel unseen by the
        protocol. An idle connection that is readable was closed by the peer or carries bytes
        nobody asked for; either way it must not be written on."""
        if self.closed or self.transport is None or self.transport.is_closing() or self._poller is None:
            return False
        try:
            return not self._poller.poll(0)  # readable: data, an end of stream or an error
        except OSError:
            return False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")  # asyncio's and uvloop's stand-ins have fileno()
        if sock is not None:
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if self.idle_since is not None:  # nothing was asked: a stray response, or garbage
            self._stray("while the connection was idle")
            self.close()
            return
        self.unframed += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:
                # NOTE: bytes after the end of the final response, in the same read: the parser
                # was stopped at them (``on_message_begin``), or refused them (after a
                # ``Connection: close``). Nothing of them reached the answer.
                self._stray("after the end of its answer")
            elif self.error is None:
                self.error = UpstreamBroken(f"malformed upstream response: {exc}")
            self.close()
        else:
            if self.unframed > MAX_UPSTREAM_HEAD_BYTES and not self.complete:
                self._head_too_large()
        self._wake()
        if self.listener is not None:
            self.listener()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.ends_at_close and exc is None and not self.complete and self.error is None:
            # NOTE: a response with neither Content-Length nor chunked coding ends where the
            # upstream closes the connection (RFC 9112, 6.3); httptools cannot be told of the end
            # of the stream, so it never completes such a message itself. Taken for broken, a
            # whole answer was failed with a 502 (and a /metrics fetch counted as down).
            self.complete = True
        if not self.complete and self.error is None:
            self.error = UpstreamBroken("the upstream closed the connection before the end of the response")
        self._wake()
        if self.listener is not None:
            self.listener()
        # NOTE: the parser refers to this protocol (its callbacks) and this protocol to the
        # parser: a cycle only the garbage collector could free, one per closed connection, and
        # collections set off on the request path are a share of the proxy's tail latency. No
        # byte is parsed after the connection is lost.
        del self.parser

    def _stray(self, when: str) -> None:
        """Bytes no request asked for: the connection is out of step, and never used again."""
        self.extra = True
        _fault(
            self.on_fault,
            STRAY_BYTES,
            f"the upstream sent bytes {when}, which no request asked for (more than its answer's "
            "framing said): they are dropped and the connection is closed",
        )

    def _head_too_large(self) -> None:
        if self.error is None:
            self.error = UpstreamHeadTooLarge(HEAD_TOO_LARGE_MESSAGE)
            _fault(self.on_fault, HEAD_TOO_LARGE, HEAD_TOO_LARGE_MESSAGE)
        self.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            # NOTE: a second response to one request. httptools parses every message in the bytes
            # it is fed: going on, the next response's head and body were handed to this one's
            # reader (a client got two JSON bodies in one, or another answer's events after
            # [DONE]). Stopped here, nothing past the end of the answer reaches it.
            raise _StopParsing()
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields += 1
        self.head_bytes += _field_bytes(name, value)
        if head_over_bounds(self.fields, self.head_bytes):
            self._head_too_large()
            raise _StopParsing()
        if not self.headers_done:  # a trailer field is counted, and dropped (RFC 9110, 6.5.1)
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            # An interim response (100 Continue, 103 Early Hints): the final one follows. A 101
            # (switching protocols) was never asked for: the exchange cannot go on.
            self.interim = True
            if status == 101 and self.error is None:
                self.error = UpstreamBroken("the upstream switched protocols (101) unasked")
            return
        self.status = status
        # NOTE: read here; llhttp forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.ends_at_close = status not in (204, 304) and not _framed(self.headers)
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.unframed = 0
        if self.sink is not None:
            self.sink(body)  # forwarding mode: straight to the relay, no task switch
            return
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        self._wake()

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _framed(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's head says where its body ends (Content-Length, or chunked as the last
    transfer coding) rather than leaving it to the end of the connection."""
    codings = b",".join(value for name, value in headers if name == b"transfer-encoding")
    if codings:
        return codings.rsplit(b",", 1)[-1].strip(b" \t").lower() == b"chunked"
    return any(name == b"content-length" for name, _ in headers)


class StreamedResponse:
    """A response whose body is read as it arrives; ``aclose`` before the end aborts it."""

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status_code = conn.status
        self.headers = httpx.Headers(conn.headers)  # every field line as it came, repeated ones too
        self._released = False

    async def read_chunk(self) -> bytes | None:
        """The next body chunk as received; None at the end of the response."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.chunks.popleft()
            if conn.complete:
                return None
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (chunk := await self.read_chunk()) is not None:
            yield chunk

    async def forward(self, sink: Callable[[bytes], None]) -> None:
        """Hand every remaining body chunk to ``sink`` as it is parsed (in the protocol's
        callback, without a task switch per chunk); return at the end of the response."""
        conn = self._conn
        while conn.chunks:
            sink(conn.chunks.popleft())
        conn.sink = sink
        try:
            while not conn.complete:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        finally:
            conn.sink = None

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.reusable():
            self._pool.release(conn)
        else:
            conn.close()  # closing mid-response: the engine sees the disconnect and aborts


class UpstreamPool:
    """A small HTTP/1.1 client for the generation requests: one write per request, raw body
    bytes out, keep-alive connections reused. Much less work per request and per chunk than a
    general-purpose client, which matters for the proxy's added latency.

    NOTE: a request is written once, on one connection, and never again. The engine may have
    worked on it for minutes when a connection breaks, and sending it again would be the very
    duplicate work the proxy exists to prevent: a connection that breaks after the request was
    written raises ``UpstreamBroken`` and the client's own retry is the retry. So a dead idle
    connection must be found before writing on it: one idle longer than ``max_idle_s`` (kept
    below the upstream's keep-alive timeout, 5 s in uvicorn, which serves vLLM) is closed, and
    one the upstream closed or wrote on while idle is seen by a zero-timeout poll of its socket
    (``_Connection.alive_when_idle``).
    """

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float = 5.0,
        max_idle: int = 1_000,
        max_idle_s: float = DEFAULT_MAX_IDLE_S,
        on_fault: FaultHook | None = None,
    ) -> None:
        if not max_idle_s > 0:
            raise ValueError("max_idle_s must be > 0 seconds")
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.encode("latin-1")
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.max_idle_s = max_idle_s
        self.on_fault = on_fault
        self._idle: deque[_Connection] = deque()  # oldest on the left

    def release(self, conn: _Connection) -> None:
        now = time.monotonic()
        self._expire(now)
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn._reset()
        conn.idle_since = now
        self._idle.append(conn)

    def _expire(self, now: float) -> None:
        """Close the idle connections older than ``max_idle_s`` (the oldest are on the left)."""
        idle = self._idle
        while idle and now - cast(float, idle[0].idle_since) > self.max_idle_s:
            idle.popleft().close()

    def take_idle(self) -> _Connection | None:
        """The most recently used idle connection that is fit to carry a request, if any."""
        self._expire(time.monotonic())
        while self._idle:
            conn = self._idle.pop()
            if conn.alive_when_idle():
                conn.idle_since = None
                return conn
            conn.close()
        return None

    async def connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        on_fault = self.on_fault
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(on_fault), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(f"cannot connect to the upstream: {exc}") from None
        return conn

    def request_bytes(self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
        """A request, head and body, as written on a connection of this pool (asking for
        ``_IDENTITY``)."""
        head = [
            b"%b %b%b HTTP/1.1\r\nhost: %b\r\ncontent-length: %d\r\n"
            % (method.encode(), self.prefix, path.encode("latin-1"), self.host_header, len(body))
        ]
        head.extend(b"%b: %b\r\n" % pair for pair in (*headers, _IDENTITY))
        head.append(b"\r\n")
        head.append(body)
        return b"".join(head)

    async def open(
        self, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> StreamedResponse:
        """Send a request, once; return when the final response's headers are in. Raises
        ``UpstreamUnreachable`` if no connection could be made, ``UpstreamBroken`` if the
        connection broke after the request was written."""
        request = self.request_bytes(method, path, body, headers)
        conn = self.take_idle() or await self.connect()
        try:
            if conn.transport is None:
                raise UpstreamUnreachable("the upstream connection was not set up")
            conn.transport.write(request)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        return StreamedResponse(self, conn)

    async def get_text(self, path: str, timeout_s: float, max_bytes: int = MAX_METRICS_BYTES) -> str:
        """GET ``path`` on a pooled connection and return its body as text (the upstream's
        ``/metrics``), within ``timeout_s`` in all. Raises ``UpstreamError`` for a failure, a
        status other than 200 or a body over ``max_bytes`` (read no further: a connection whose
        answer was not read to its end is closed), ``TimeoutError`` past the bound."""
        async with asyncio.timeout(timeout_s):
            response = await self.open("GET", path, b"", [])
            try:
                parts: list[bytes] = []
                size = 0
                while (chunk := await response.read_chunk()) is not None:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UpstreamBroken(f"the upstream's answer to GET {path} is over {max_bytes} bytes")
                    parts.append(chunk)
            finally:
                await response.aclose()
        if response.status_code != 200:
            raise UpstreamBroken(f"the upstream answered HTTP {response.status_code} to GET {path}")
        return b"".join(parts).decode()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
