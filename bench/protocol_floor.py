"""The floor of a proxy built on asyncio protocols: uvloop and httptools, forwarding in callbacks.

A candidate for the proxy's generation path, measured by ``bench/bench_floor.py`` beside nginx,
the ASGI floor (``bench/asgi_floor.py``) under uvicorn and granian, and the proxy itself. It
forwards, and does nothing else: no validation, key, policy, fan-out or metrics (the same work
with those added is ``bench/protocol_attempt.py``).

Everything happens in protocol callbacks, without a task per request or per chunk:

* ``ClientConnection`` parses a request with httptools; at the end of its body it writes the
  request upstream, in one write, on a kept-alive pooled connection (``UpstreamPool``);
* ``UpstreamConnection`` parses the response with httptools and hands its head and every body
  chunk to the exchange that asked for it (``Exchange``), in the parser's callback;
* the client connection writes each chunk to its transport as it comes (chunked framing; the
  response head goes out with the first chunk, in one write), and ends the response.

A task runs only to open a new upstream connection (rare once the pool is warm). Reading from
the client pauses while its request is answered (no pipelining). It is a measuring instrument,
not a proxy: it bounds nothing (head size, body size, timeouts), applies no backpressure from a
slow client to the upstream, and answers any path with the upstream's answer.

Run: ``python bench/protocol_floor.py --upstream http://127.0.0.1:8000 --port 8102``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import select
import socket
import time
from collections import deque
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
import uvloop

from exporter.upstream import forwardable_headers

# Response headers not relayed to the client (the framing is the forwarder's own).
DROP_RESPONSE_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"date",
        b"server",
    }
)
MAX_IDLE_S = 2.0  # below uvicorn's keep-alive timeout (5 s), as exporter.upstream does
REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 429: b"Too Many Requests", 502: b"Bad Gateway"}


class Exchange(Protocol):
    """What an upstream connection reports to, in its parser's callbacks."""

    @property
    def abandoned(self) -> bool:
        """Nobody waits for the answer any more (checked before a new connection is used)."""
        ...

    def bind_upstream(self, conn: UpstreamConnection) -> None: ...

    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def upstream_body(self, data: bytes) -> None: ...

    def upstream_end(self) -> None: ...

    def upstream_failed(self, reason: str) -> None: ...


def _readable(sock: socket.socket) -> bool:
    """Whether an idle socket has something to read (the peer closed it, or sent stray bytes)."""
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class UpstreamConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to the upstream; interim (1xx) responses are skipped."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.socket: socket.socket | None = None
        self.exchange: Exchange | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.interim = False
        self.keep_alive = False
        self.closed = False
        self.idle_since = 0.0

    def send(self, exchange: Exchange, request: bytes) -> None:
        self.exchange = exchange
        self.headers = []
        cast(asyncio.Transport, self.transport).write(request)

    def abort(self) -> None:
        """Close mid-response (the upstream sees the disconnect); never reused."""
        self.exchange = None
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def alive_when_idle(self) -> bool:
        if self.closed or self.transport is None or self.transport.is_closing() or self.socket is None:
            return False
        return not _readable(self.socket)

    def _fail(self, reason: str) -> None:
        exchange, self.exchange = self.exchange, None
        self.close()
        if exchange is not None:
            exchange.upstream_failed(reason)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.socket = cast("socket.socket | None", transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # nothing was asked: a stray response
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed upstream response: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            self._fail("the upstream closed the connection before the end of the response")

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.interim = True
            self.headers = []
            return
        self.keep_alive = self.parser.should_keep_alive()
        if self.exchange is not None:
            self.exchange.upstream_head(status, self.headers)

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.upstream_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        exchange, self.exchange = self.exchange, None
        if self.keep_alive and not self.closed:
            self.pool.release(self)
        else:
            self.close()
        if exchange is not None:
            exchange.upstream_end()


class UpstreamPool:
    """Kept-alive upstream connections, the most recently used first; a request is written once."""

    def __init__(self, base_url: str, max_idle: int = 1_000) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode("latin-1")
        self.max_idle = max_idle
        self._idle: deque[UpstreamConnection] = deque()
        self._connecting: set[asyncio.Task[None]] = set()

    def request_bytes(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> bytes:
        parts = [
            method + b" " + target + b" HTTP/1.1\r\nhost: " + self.host_header,
            b"content-length: " + str(len(body)).encode(),
        ]
        parts.extend(n + b": " + v for n, v in forwardable_headers(headers))
        return b"\r\n".join(parts) + b"\r\n\r\n" + body

    def send(self, exchange: Exchange, request: bytes) -> None:
        """Write ``request`` on an idle connection now, or on a new one once it is open (a task
        opens it); the exchange is told which connection carries it (``bind_upstream``)."""
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if now - conn.idle_since <= MAX_IDLE_S and conn.alive_when_idle():
                exchange.bind_upstream(conn)
                conn.send(exchange, request)
                return
            conn.close()
        task = asyncio.get_running_loop().create_task(self._connect_and_send(exchange, request))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, exchange: Exchange, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port)
        except OSError as exc:
            exchange.upstream_failed(f"upstream unreachable: {exc}")
            return
        if exchange.abandoned:  # its client left while the connection was opened
            self.release(conn)
            return
        exchange.bind_upstream(conn)
        conn.send(exchange, request)

    def release(self, conn: UpstreamConnection) -> None:
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


def response_head(status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Unknown"))]
    lines.extend(n + b": " + v for n, v in headers)
    if chunked:
        lines.append(b"transfer-encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


class ClientConnection(asyncio.Protocol):
    """One client connection: a request at a time, forwarded upstream, the answer relayed back in
        the upstream's callbacks (``Exchange``). A client that reads slower than the upstream writes
    pauses the upstream connection (its transport's flow control), so nothing piles up here."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None
        self.left = False  # the client closed the connection
        self.paused = False  # the client's transport asked us to stop writing
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.keep_alive = True
        self.head: bytes | None = None  # the response head, written with the first chunk
        self.answering = False  # a request is being answered
        self.started = False  # bytes of the answer were written

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.keep_alive = False
            self.respond(400, b'{"error": "upgrade not supported"}')
        except httptools.HttpParserError:
            self.keep_alive = False
            self.respond(400, b'{"error": "malformed request"}')

    def connection_lost(self, exc: Exception | None) -> None:
        self.left = True
        if self.answering and self.upstream is not None:
            self.upstream.abort()  # the engine sees the disconnect

    def pause_writing(self) -> None:
        self.paused = True
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.answering = True
        self.write_transport().pause_reading()  # one request at a time
        self.handle(self.parser.get_method(), b"".join(self.body))

    def handle(self, method: bytes, body: bytes) -> None:
        """Forward the request as it is."""
        self.pool.send(self, self.pool.request_bytes(method, self.url, self.headers, body))

    # Exchange: the upstream's answer, in its parser's callbacks
    @property
    def abandoned(self) -> bool:
        return self.left

    def bind_upstream(self, conn: UpstreamConnection) -> None:
        self.upstream = conn

    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        kept = [(n, v) for n, v in headers if n not in DROP_RESPONSE_HEADERS]
        self.head = response_head(status, kept, chunked=True)

    def upstream_body(self, data: bytes) -> None:
        self.write_chunk(data)

    def upstream_end(self) -> None:
        self.end_chunks()

    def upstream_failed(self, reason: str) -> None:
        if self.left or not self.answering:
            return
        self.keep_alive = False
        if self.started:  # mid-stream: the client sees the chunked body cut short
            self.finish()
        else:
            self.respond(502, b'{"error": "upstream failed"}')

    # answering
    def write_transport(self) -> asyncio.Transport:
        return cast(asyncio.Transport, self.transport)

    def write_chunk(self, data: bytes) -> None:
        """One chunk of a chunked response (after the head, if it has not gone out yet)."""
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        if self.head is not None:
            frame, self.head = self.head + frame, None
        self.started = True
        self.write_transport().write(frame)

    def end_chunks(self) -> None:
        end = b"0\r\n\r\n"
        if self.head is not None:
            end, self.head = self.head + end, None
        self.write_transport().write(end)
        self.finish()

    def respond(self, status: int, body: bytes) -> None:
        """A whole response from the forwarder itself."""
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        self.write_transport().write(response_head(status, headers, chunked=False) + body)
        self.finish()

    def finish(self) -> None:
        """The answer is complete: on to the next request, or close."""
        self.answering = False
        self.upstream = None
        transport = self.write_transport()
        if not self.keep_alive:
            transport.close()
        elif not transport.is_closing():
            transport.resume_reading()


async def serve(port: int, host: str, pool: UpstreamPool, factory: type[ClientConnection]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: factory(pool), host, port, backlog=4096)
    gc.collect()
    gc.freeze()  # as the proxy does at start-up
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream", required=True, help="base URL of the upstream, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8102)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.host, UpstreamPool(args.upstream), ClientConnection))


if __name__ == "__main__":
    main()
