"""The proxy's HTTP clients toward the engine: one upstream request per execution.

Generation requests go through ``UpstreamPool``, a lean HTTP/1.1 client on asyncio protocols and
httptools (raw body bytes, one write per request, keep-alive reuse); every other route and the
``/metrics`` scrape use an httpx AsyncClient. Cancelling an execution closes its upstream
response before the end, which closes the connection (it is not returned to the pool), so vLLM
sees the disconnect and aborts the request.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools
import httpx

# Request headers never forwarded upstream: hop-by-hop ones, those httpx sets itself, and
# Accept-Encoding (the proxy relays raw bytes and inspects the first SSE event).
_DROP_REQUEST_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "accept-encoding",
    }
)
# Response headers never relayed to a client.
DROP_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "trailer",
        "upgrade",
        "proxy-connection",
        "date",
        "server",
    }
)


def forwardable_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The client's request headers that go to the upstream, as (name, value) strings."""
    out: list[tuple[str, str]] = []
    for name, value in headers:
        n = name.decode("latin-1").lower()
        if n not in _DROP_REQUEST_HEADERS:
            out.append((n, value.decode("latin-1")))
    return out


class UpstreamClient:
    """An httpx AsyncClient bound to the engine's base URL."""

    def __init__(self, base_url: str, connect_timeout_s: float = 5.0, max_connections: int = 100_000) -> None:
        self.base_url = base_url.rstrip("/")
        # No read timeout: an execution may wait minutes in the engine's queue; the clients'
        # deadline, not the proxy, decides when to give up.
        timeout = httpx.Timeout(None, connect=connect_timeout_s, pool=None)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=1_000)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)

    def url(self, path: str, query: bytes = b"") -> str:
        return self.base_url + path + (("?" + query.decode("latin-1")) if query else "")

    async def open(
        self, method: str, path: str, body: bytes, headers: list[tuple[str, str]], query: bytes = b""
    ) -> httpx.Response:
        """Send a request and return the response with its body still unread (a stream)."""
        request = self.client.build_request(method, self.url(path, query), content=body, headers=headers)
        return await self.client.send(request, stream=True)

    async def get_text(self, path: str, timeout_s: float) -> str:
        response = await self.client.get(self.url(path), timeout=timeout_s)
        response.raise_for_status()
        return response.text

    async def aclose(self) -> None:
        await self.client.aclose()


# --- the generation fast path ----------------------------------------------------------------


class UpstreamError(Exception):
    """The upstream could not be reached, or broke the response off."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the upstream, parsing responses with httptools."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.error: Exception | None = None
        self.chunks: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.sink: Callable[[bytes], None] | None = None

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = UpstreamError(f"malformed upstream response: {exc}")
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = UpstreamError("the upstream closed the connection before the end of the response")
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # NOTE: read here; llhttp forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)  # forwarding mode: straight to the relay, no task switch
            return
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
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


class StreamedResponse:
    """A response whose body is read as it arrives; ``aclose`` before the end aborts it."""

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self.status_code = conn.status
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in conn.headers}
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
        if conn.complete and not conn.closed and conn.keep_alive:
            self._pool.release(conn)
        else:
            conn.close()  # closing mid-response: the engine sees the disconnect and aborts


class UpstreamPool:
    """A small HTTP/1.1 client for the generation requests: one write per request, raw body
    bytes out, keep-alive connections reused. Much less work per request and per chunk than a
    general-purpose client, which matters for the proxy's added latency."""

    def __init__(self, base_url: str, connect_timeout_s: float = 5.0, max_idle: int = 1_000) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc.encode("latin-1")
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()

    def release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn._reset()
        self._idle.append(conn)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to the upstream: {exc}") from None
        return conn

    def _request_bytes(self, method: str, path: str, body: bytes, headers: list[tuple[str, str]]) -> bytes:
        lines = [
            method.encode() + b" " + self.prefix + path.encode("latin-1") + b" HTTP/1.1",
            b"host: " + self.host_header,
            b"content-length: " + str(len(body)).encode(),
        ]
        lines.extend(f"{k}: {v}".encode("latin-1") for k, v in headers)
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    async def open(
        self, method: str, path: str, body: bytes, headers: list[tuple[str, str]]
    ) -> StreamedResponse:
        """Send a request; return once the response headers are in."""
        request = self._request_bytes(method, path, body, headers)
        while True:
            reused = False
            conn: _Connection | None = None
            while self._idle:
                candidate = self._idle.pop()
                if (
                    not candidate.closed
                    and candidate.transport is not None
                    and not candidate.transport.is_closing()
                ):
                    conn, reused = candidate, True
                    break
            if conn is None:
                conn = await self._connect()
            if conn.transport is None:
                raise UpstreamError("the upstream connection was not set up")
            conn.transport.write(request)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except UpstreamError:
                conn.close()
                if reused and not conn.got_bytes:
                    continue  # a kept-alive connection the upstream had closed meanwhile: once more
                raise
            except BaseException:
                conn.close()
                raise
            return StreamedResponse(self, conn)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
