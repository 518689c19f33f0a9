"""The forwarding floor inside uvicorn's own protocol, bypassing the ASGI cycle for generation POSTs.

A candidate between the two others ``bench/bench_floor.py`` measures: the proxy keeps uvicorn (its
protocol subclass ``foundation/server.py`` bounds heads, times out slow clients, caps connections
and drains), but a POST to a generation route never becomes an ASGI request. ``BypassProtocol``
(uvicorn's httptools protocol) takes it over when its head is complete: no scope for the app, no
``RequestResponseCycle``, no task; the body is collected in ``on_body``, and at the end of the
message the request is forwarded and answered in callbacks exactly as ``bench/protocol_floor.py``
does (its ``UpstreamPool``). Every other request goes through uvicorn to the ASGI app
(``asgi_floor.Floor`` here), so one listening port serves both.

Compared with ``protocol-floor`` it shows what uvicorn's protocol itself costs per request
(building each request's scope and header list, ``getsockname``/``getpeername`` per connection,
the keep-alive timer) once the ASGI cycle is out of the way. A measuring instrument: pipelined
requests behind a bypassed one are not supported, and a graceful shutdown closes a bypassed
request's connection without waiting for its answer.

Run: ``python bench/uvicorn_bypass.py --upstream http://127.0.0.1:8000 --port 8105``
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn
from asgi_floor import Floor
from protocol_floor import DROP_RESPONSE_HEADERS, UpstreamConnection, UpstreamPool, response_head
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from exporter.validation import GENERATION_ROUTES

BYPASSED = frozenset(route.encode() for route in GENERATION_ROUTES)


class BypassProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol; generation POSTs are forwarded in callbacks (an ``Exchange``
    of ``protocol_floor.UpstreamPool``)."""

    pool: UpstreamPool  # set by ``main`` before the server starts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bypassing = False
        self.body: list[bytes] = []
        self.head: bytes | None = None
        self.started = False
        self.keep = True
        self.upstream: UpstreamConnection | None = None
        self.left = False

    # the request, from uvicorn's parser callbacks
    def on_headers_complete(self) -> None:
        if self.parser.get_method() == b"POST" and self.url.split(b"?", 1)[0] in BYPASSED:
            self.bypassing, self.body, self.head, self.started = True, [], None, False
            self.keep = self.parser.should_keep_alive()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.bypassing:
            self.body.append(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self.bypassing:
            super().on_message_complete()
            return
        self.flow.pause_reading()  # one request at a time
        request = self.pool.request_bytes(b"POST", self.url, self.headers, b"".join(self.body))
        self.pool.send(self, request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.left = True
        if self.bypassing and self.upstream is not None:
            self.upstream.abort()
        super().connection_lost(exc)

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
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        if self.head is not None:
            frame, self.head = self.head + frame, None
        self.started = True
        self.transport.write(frame)

    def upstream_end(self) -> None:
        end = b"0\r\n\r\n"
        if self.head is not None:
            end, self.head = self.head + end, None
        self.transport.write(end)
        self._bypass_done()

    def upstream_failed(self, reason: str) -> None:
        if self.left or not self.bypassing:
            return
        self.keep = False
        if not self.started:
            body = b'{"error": "upstream failed"}'
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            self.transport.write(response_head(502, headers, chunked=False) + body)
        self._bypass_done()

    def _bypass_done(self) -> None:
        """As uvicorn's ``on_response_complete``: close, or wait for the next request."""
        self.bypassing, self.upstream = False, None
        self.server_state.total_requests += 1
        if not self.keep:
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream", required=True, help="base URL of the upstream, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8105)
    args = parser.parse_args()
    BypassProtocol.pool = UpstreamPool(args.upstream)
    uvicorn.run(  # the settings of `retrywatch proxy`, as bench/asgi_floor.py
        Floor(args.upstream),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=BypassProtocol,
        log_level="warning",
        access_log=False,
        lifespan="on",
        proxy_headers=False,
        timeout_keep_alive=75,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
