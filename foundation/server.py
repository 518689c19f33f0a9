"""retrywatch's HTTP server (the proxy's, the detector's API, the emulated engine's and the
dashboard's): uvicorn with every client-side bound (``foundation.bounds``), and a drained shutdown.

uvicorn's httptools protocol bounds neither the size of a request head nor its number of header
fields, and times out neither a request head or body that stops arriving nor a connection that
never sends a request. ``BoundedProtocol``, a subclass of it passed to uvicorn as ``http=``,
adds per connection (the flags are ``retrywatch proxy``'s; the other servers have their
defaults):

* head bounds: a head over ``--max-head-bytes`` (request line and header fields, counted as the
  bytes arrive, so one endless header is never buffered) or with more than ``--max-headers``
  fields gets 431;
* a head timeout: a head not complete ``--head-timeout`` after its first byte gets 408;
* a body timeout: a body not complete ``--body-timeout`` after its head (a slow sender, a body
  shorter than its Content-Length, a chunked body without its terminator) gets 408, or the
  connection is closed if the answer has begun;
* an idle timeout: a connection that starts no request for ``--keep-alive-timeout`` is closed,
  from its opening as after each answer (uvicorn's own keep-alive timer arms only after one);
* a send timeout: a connection whose writes stay paused for ``--send-timeout`` (its client takes
  none of the answer's bytes) is closed at once, its unsent bytes dropped, whatever its phase
  (a close waiting for such a client's buffer to empty never ends);
* a connection cap: a connection past ``--max-connections`` is kept for GET and HEAD requests
  (a scrape of /metrics, a readiness probe: ``--reserved-connections`` more; any other request on
  it gets 503 once its head is in, unless a place below the cap is free by then: it takes it),
  and one past both gets 503 and is closed at once;
* a request with a body that asks to switch protocols (``Connection: upgrade``) gets 400: the
  server switches to none, and httptools would hand the body to the new protocol (one without a
  body goes on as plain HTTP/1.1);
* a transfer coding other than chunked alone (``Transfer-Encoding: gzip, chunked``) gets 400:
  httptools would undo only the chunking and hand the body on still coded;
* the trailer fields of a chunked body are dropped (never request headers: neither the app nor
  the upstream sees them) and bounded as a head is: over ``--max-head-bytes`` gets 431.

An app may take a request over when its head is complete (``ServerConfig(takeover=)``: the proxy
takes its generation POSTs, the request and its answer carried by callbacks, no ASGI cycle and no
task); the request taken over (an exchange) stands in for
uvicorn's request cycle on the connection, so every bound here, pipelining and the drain apply to
it as to any request. Every other request goes to the ASGI app, on the same port.

A sweep a few times a second checks the deadlines, so the per-request cost is storing one.
The errors the server sends itself are OpenAI-style JSON bodies, like the app's, and end the
connection; after a 4xx the connection lingers a moment reading and discarding, so that a client
still sending its head reads the answer rather than a reset. An error for bytes that follow a
request still being answered (a pipelined request, or a body sent without Content-Length, which
HTTP/1.1 reads as the next request) goes out once that answer is complete.

``DrainingServer`` replaces uvicorn's shutdown. On SIGTERM or SIGINT it stops accepting, closes
idle connections and lets the requests in flight finish for up to ``--drain-timeout``; then it
calls the app's ``on_drain_expired`` hook (the proxy ends each live execution: a stream with an
SSE error event, any other answer with a JSON error), gives those last writes a moment, cancels
what is left (a request not answered yet gets a JSON 503) and returns: the process exits with
status 0. A second signal cuts the drain short. A worker thread still busy then (a WSGI app's
request stuck in a blocking call: cancelling its task does not stop its thread) would hold the
exit forever, as Python joins thread pools' workers at exit: ``serve`` gives them
``EXIT_GRACE_S`` once the main thread is done, then ends the process without them (a warning).

NOTE: the subclass relies on uvicorn's httptools protocol (its parser callbacks and request
cycle); the black-box tests in ``tests/exporter/test_server.py`` pin the behaviour down for any
other server that replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
import math
import os
import resource
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import replace
from types import FrameType
from typing import Any, Protocol, cast

import httptools
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_local_addr, get_remote_addr

from foundation.bounds import HttpBounds
from foundation.errors import error_body, error_type

log = logging.getLogger("retrywatch.server")

LINGER_S = 1.0  # after a 4xx the server sent itself: read and discard this long, then close
FINAL_WRITE_S = 2.0  # after the drain bound: for the last error events and answers to be written
EXIT_GRACE_S = 2.0  # once the main thread is done: for worker threads to end before the process does
SWEEP_MAX_S = 0.5  # the deadline sweep runs at least this often (more often for short timeouts)
FD_HEADROOM = 64  # descriptors beyond those the connections hold (listeners, logs, the database)
RESERVE_METHODS = frozenset({b"GET", b"HEAD"})  # what a connection past --max-connections serves

# A connection's phase: what the deadline, if any, bounds.
IDLE = 0  # waiting for a request to start (--keep-alive-timeout)
HEAD = 1  # reading a request head (--head-timeout)
BODY = 2  # reading a request body (--body-timeout)
BUSY = 3  # the request is in; the app is answering it (no deadline)
LINGER = 4  # answered with an error: discarding what the client still sends (LINGER_S)
REFUSING = 5  # the next request was refused while one is being answered: the error follows it


# The ASGI scope extension through which an app may abort its connection (no answer, no close).
ABORT_EXTENSION = "retrywatch.abort"
# What a request gets when the app failed (a bug, logged: never the answer to anything a client
# sent) or was cut by a drained shutdown, before its answer: from the server, or from the proxy's
# own paths.
PROXY_ERROR = (500, error_body("the proxy failed handling the request", error_type(500), "proxy_error"))
SHUT_DOWN_UNANSWERED = (
    503,
    error_body("the proxy shut down before answering", error_type(503), "proxy_shutting_down"),
)


class Handler(Protocol):
    """A request an app serves in callbacks instead of an ASGI cycle (the proxy's exchange): the
    connection hands it the body as it arrives and tells it when the client can take more, has
    gone, or the server shuts down."""

    @property
    def response_complete(self) -> bool: ...

    def on_body(self, body: bytes) -> None: ...

    def on_message_complete(self) -> None: ...

    def resume(self) -> None: ...

    def client_gone(self) -> None: ...

    def detach(self) -> None: ...

    def shut_down(self) -> None: ...


class TakeOver(Protocol):
    """How an app takes requests over from uvicorn's request cycle (``ServerConfig(takeover=)``):
    ``accepts`` says, once a request's head is complete, whether it does; the call starts serving
    it on ``connection`` (whose ``write``, ``close``, ``abort``, ``writable``,
    ``default_headers`` and ``exchange_done`` it uses)."""

    def accepts(self, method: bytes, path: bytes, http_version: str, expect_continue: bool) -> bool: ...

    def __call__(
        self, connection: Any, route: str, raw_headers: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> Handler: ...


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP response with an OpenAI-style JSON error body; it closes the connection."""
    body = error_body(message, error_type(status), code)
    return b"".join(
        (
            b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode()),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
    )


class _Refused(Exception):
    """Raised in a parser callback: the server refuses the request whose head is being parsed."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


async def _send_json_500(ref: weakref.ref[RequestResponseCycle]) -> None:
    """What a request cycle sends instead of uvicorn's plain-text 500 when the app failed or was
    cancelled before it began its answer: a JSON error (a 503 when cut by a drained shutdown)."""
    cycle = ref()
    if cycle is None:
        return
    task = asyncio.current_task()
    status, body = SHUT_DOWN_UNANSWERED if task is not None and task.cancelling() else PROXY_ERROR
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await cycle.send({"type": "http.response.start", "status": status, "headers": headers})
    await cycle.send({"type": "http.response.body", "body": body, "more_body": False})


class ServerConfig(uvicorn.Config):
    """uvicorn's config with the server's bounds (the protocol reads them there), the hook
    called when the drain bound expires, and the app's way of taking requests over, if any."""

    def __init__(
        self,
        app: Any,
        bounds: HttpBounds,
        on_drain_expired: Callable[[], None] | None = None,
        *,
        takeover: TakeOver | None = None,
        **kwargs: Any,
    ) -> None:
        self.bounds = bounds
        self.on_drain_expired = on_drain_expired
        self.takeover = takeover
        self.protocol_template: dict[str, Any] | None = None  # BoundedProtocol's, once per server
        super().__init__(
            app,
            host=bounds.host,
            port=bounds.port,
            http=BoundedProtocol,
            ws="none",  # no WebSocket is served
            lifespan="on",
            access_log=False,
            proxy_headers=False,  # no route uses the client's address: no per-request rewrite
            timeout_keep_alive=math.ceil(bounds.keep_alive_s),  # the sweep closes them on time
            backlog=4096,
            **kwargs,
        )


class _Reserve:
    """How many of one server's connections are of its reserve (opened past --max-connections):
    shared by its connections, which count apart those below the cap and those of the reserve."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = 0


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head bounds, timeouts and a connection cap."""

    # Opened past --max-connections, within the reserve: serves RESERVE_METHODS only. A class
    # attribute, set on the few connections that are: a new connection's set-up is unchanged.
    reserved = False

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # NOTE: uvicorn's own __init__ looks up its two loggers, their handlers and a dozen of the
        # config's settings again for every connection, and on this machine a new connection's
        # first request pays for every line of code it runs (docs/proxy.md#benchmark). What is the
        # same for every connection is taken once per server from an instance made the usual way
        # (``_template``); a connection then sets only its parser and its pipeline.
        template = cast(ServerConfig, config).protocol_template
        if template is None or template["server_state"] is not server_state:
            template = self._template(config, server_state, app_state, _loop)
            cast(ServerConfig, config).protocol_template = template
        self.__dict__.update(template)
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.pipeline = deque()

    def _template(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None,
    ) -> dict[str, Any]:
        """Every attribute a new connection starts with but its parser and pipeline."""
        super().__init__(config, server_state, app_state, _loop)
        bounds = cast(ServerConfig, config).bounds
        self.max_head_bytes = bounds.max_head_bytes
        self.max_headers = bounds.max_headers
        self.head_timeout_s = bounds.head_timeout_s
        self.body_timeout_s = bounds.body_timeout_s
        self.keep_alive_s = bounds.keep_alive_s
        self.send_timeout_s = bounds.send_timeout_s
        self.max_connections = bounds.max_connections
        self.reserve = _Reserve()  # one per server: the template's is every connection's
        self.scheme = "http"  # no TLS is served
        self.phase = IDLE
        self.deadline = math.inf  # loop time by which the phase must end
        self.write_deadline = math.inf  # loop time by which paused writes must have resumed
        self._received = 0  # bytes received since the last head ended (bounds a head in progress)
        # A chunk header was parsed and none of that chunk's data yet: a whole read through which
        # this holds was the last chunk's trailer section (a chunk with data would have ended it).
        self._chunk_without_data = False
        self._refusal: tuple[int, str, str, bool] = (400, "", "", True)  # sent once REFUSING ends
        # Requests an app takes over are served in callbacks (the proxy's generation POSTs); the
        # one in progress, if any, also stands in for uvicorn's request cycle (``cycle``).
        self.takeover = config.takeover if isinstance(config, ServerConfig) else None
        self.exchange: Handler | None = None
        return {k: v for k, v in self.__dict__.items() if k not in ("parser", "pipeline")}

    # --- connection -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # NOTE: uvicorn's reads both addresses here (system calls); they only go into an ASGI
        # scope, so they are read when one is built (``_asgi_scope``).
        self.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        if len(self.connections) > self.max_connections and not self._within_the_cap():
            # NOTE: past the cap, a connection within the reserve is kept for a scrape or a probe
            # (checked once its request head is in, ``on_headers_complete``), and it idles no
            # longer than a head may take, so idle connections do not hold the reserve long.
            bounds = cast(ServerConfig, self.config).bounds
            if self.reserve.open >= bounds.reserved_connections:
                reserve = bounds.reserved_connections
                more = f" and the {reserve} past it for GET and HEAD requests" if reserve else ""
                message = (
                    f"the server holds its limit of {self.max_connections} connections{more}; retry later"
                )
                self.transport.write(error_response(503, message, "too_many_connections"))
                self.transport.close()
                return
            self.reserved = True
            self.reserve.open += 1
            self.keep_alive_s = min(self.keep_alive_s, self.head_timeout_s)
        self.phase = IDLE
        self.deadline = self.loop.time() + self.keep_alive_s

    def _within_the_cap(self) -> bool:
        """Whether there is a place below the cap for this connection (taken already unless it
        is of the reserve).

        NOTE: the connections of the reserve count apart. Counted with the others, one still open
        (a client's pool, a dashboard polling) once some below the cap had closed left the next
        connections past the cap: their POSTs were refused with places free below it."""
        below = len(self.connections) - self.reserve.open  # this one included unless reserved
        return below < self.max_connections if self.reserved else below <= self.max_connections

    def _leave_the_reserve(self) -> None:
        """The connection is of the reserve no more: it closed, or it takes a place below the cap
        (serving any request, and idling as long as any connection there)."""
        self.reserved = False
        self.reserve.open -= 1
        self.keep_alive_s = cast(ServerConfig, self.config).bounds.keep_alive_s

    def data_received(self, data: bytes) -> None:
        if self.phase >= LINGER:
            return
        if self.phase <= HEAD:
            self._received += len(data)
        trailers = self._chunk_without_data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrade is served (ws="none"): a request without a body (one with a body was
            # refused in ``on_headers_complete``) goes on as plain HTTP.
            pass
        except httptools.HttpParserError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self.refuse(refused.status, refused.message, refused.code)
            else:
                self.refuse(400, "invalid HTTP request", "invalid_http")
            return
        if self.phase <= HEAD and self._received > self.max_head_bytes:
            self.refuse(431, f"the request head is over {self.max_head_bytes} bytes", "head_too_large")
        elif trailers and self._chunk_without_data:
            # NOTE: trailer fields are not counted while the head is, and httptools buffers one
            # field until it ends (concatenating as it grows): an endless trailer filled the
            # memory and stalled the loop for the whole --body-timeout. Counted from the first
            # read after the last chunk's header on (the read that carries that header is not).
            self._received += len(data)
            if self._received > self.max_head_bytes:
                message = f"the trailer fields of the request body are over {self.max_head_bytes} bytes"
                self.refuse(431, message, "head_too_large")

    def check_deadline(self, now: float) -> None:
        """Called by the sweep: act on a phase that outlived its deadline, or on writes paused
        past the send timeout."""
        if now >= self.write_deadline:
            # NOTE: a client that takes none of its answer's bytes. No phase deadline applies to an
            # answer being written, and a stream that ends before the replay bound is passed
            # (``Relay.overrun``) never drops it: it held its connection, its subscriber and the
            # unsent bytes for good; a closing connection waiting for it to read held them too.
            self.write_deadline = math.inf
            self.transport.abort()
            return
        if now < self.deadline or self.transport.is_closing():
            return
        self.deadline = math.inf
        if self.phase == HEAD:
            message = f"the request head did not arrive within {self.head_timeout_s:g} s"
            self.refuse(408, message, "request_timeout", linger=False)
        elif self.phase == BODY and not self.cycle.response_started:
            message = f"the request body did not arrive within {self.body_timeout_s:g} s"
            self.refuse(408, message, "request_timeout", linger=False)
        else:  # idle, done lingering, or a body still arriving after its answer
            self.transport.close()

    def refuse(self, status: int, message: str, code: str, linger: bool = True) -> None:
        """Answer with an error and end the connection (the request's app, if any, sees a
        disconnect and its writes go nowhere)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self.phase != BODY and not self.pipeline:
                # NOTE: the refused bytes come after a request that is still being answered (a
                # pipelined request, or a body sent without Content-Length, which HTTP/1.1 reads
                # as the next request). That answer goes out first, then this error: ending the
                # connection at once left a client with no answer at all.
                self.phase, self.deadline = REFUSING, math.inf
                self._refusal = (status, message, code, linger)
                return
            if cycle.response_started or self.phase != BODY:
                # An answer has begun (it cannot be replaced), or requests are queued behind
                # the one being answered: end the connection without one.
                self.transport.close()
                return
            cycle.disconnected = True  # the app sees a disconnect; its writes go nowhere
            cycle.message_event.set()
        self._send_refusal(status, message, code, linger)

    def _send_refusal(self, status: int, message: str, code: str, linger: bool) -> None:
        self.transport.write(error_response(status, message, code))
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.flow.resume_reading()
            self.phase = LINGER
            self.deadline = self.loop.time() + LINGER_S
        else:
            self.transport.close()

    # --- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # uvicorn's, without the ASGI scope: a generation POST never becomes an ASGI request, so
        # the scope is built only for a request that does (``_asgi_scope``).
        self._unset_keepalive_if_required()
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.phase = HEAD
        self.deadline = self.loop.time() + self.head_timeout_s
        self._chunk_without_data = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.phase == BODY:
            # NOTE: a trailer field of a chunked body (httptools reports them as header fields).
            # uvicorn appended them to the request's headers, with no bound on their number, after
            # the proxy had read the head: the upstream received them as request headers the
            # proxy never saw (an ``x-call-id``, credentials). A recipient may drop trailers
            # (RFC 9110, 6.5.1); here they are dropped, and bounded in ``data_received``.
            return
        super().on_header(name, value)

    def on_chunk_header(self) -> None:
        self._chunk_without_data = True

    def on_chunk_complete(self) -> None:
        self._chunk_without_data = False

    def on_headers_complete(self) -> None:
        # Checked before uvicorn starts the app on the request. The bytes received bound the
        # head as it arrives (``data_received``); the exact size is summed only when they are
        # over the bound, since they may include a body that came with the head.
        if len(self.headers) > self.max_headers:
            raise _Refused(431, f"the request has over {self.max_headers} header fields", "too_many_headers")
        if self._received > self.max_head_bytes and self._head_size() > self.max_head_bytes:
            raise _Refused(431, f"the request head is over {self.max_head_bytes} bytes", "head_too_large")
        if self.parser.should_upgrade() and self._has_body():
            # NOTE: httptools takes everything after the head of a request that asks to switch
            # protocols (``Connection: upgrade``) for the new protocol's bytes: its body never
            # reaches the app, which would see an empty body (uvicorn, which serves vLLM, does the
            # same). The server switches to no protocol, so say so rather than lose the body.
            message = (
                "the server does not switch protocols (Upgrade), and a request that asks to cannot "
                "carry a body here: send it without 'Connection: upgrade'"
            )
            raise _Refused(400, message, "unsupported_upgrade")
        if not self._transfer_coding_is_served():
            # NOTE: httptools reads any coding list that ends in chunked ("gzip, chunked") as
            # chunked alone: the body would reach the app still gzip-coded, and a passed-through
            # request would reach the engine without its coding. nginx answers 501; here what a
            # client sends never gets a 5xx (those say the proxy or the engine failed), so 400.
            message = (
                "the server decodes no transfer coding but chunked: send 'Transfer-Encoding: chunked' or none"
            )
            raise _Refused(400, message, "unsupported_transfer_encoding")
        if self.reserved:
            if self._within_the_cap():
                # A connection below the cap has closed since this one opened (a client's pool
                # sends its next POST on it): it takes that place.
                self._leave_the_reserve()
            elif self.parser.get_method() not in RESERVE_METHODS:
                message = (
                    f"the server holds its limit of {self.max_connections} connections (the "
                    "connections past it serve GET and HEAD requests only); retry later"
                )
                raise _Refused(503, message, "too_many_connections")
        if not self._take_over():
            self.scope = self._asgi_scope()
            super().on_headers_complete()
        self.phase = BODY
        self.deadline = self.loop.time() + self.body_timeout_s
        self._received = 0
        cycle = self.cycle
        if isinstance(cycle, RequestResponseCycle):
            # NOTE: an instance attribute (swapping the cycle's class cost ~9 us per request) that
            # refers to its cycle weakly: a strong reference would leave every cycle to the GC.
            cycle.send_500_response = functools.partial(_send_json_500, weakref.ref(cycle))  # type: ignore[method-assign]

    def _take_over(self) -> bool:
        """Let the app serve the request in callbacks (``ServerConfig(takeover=)``) if it takes it
        and nothing else is in progress on the connection; else uvicorn runs the app."""
        takeover, cycle = self.takeover, self.cycle
        if (
            takeover is None
            or self.exchange is not None
            or (cycle is not None and not cycle.response_complete)
        ):
            return False
        parser = self.parser
        path = self.url.partition(b"?")[0]
        version, expect = parser.get_http_version(), self.expect_100_continue
        if not takeover.accepts(parser.get_method(), path, version, expect):
            return False
        self._unset_keepalive_if_required()
        exchange = takeover(self, path.decode("ascii"), self.headers, parser.should_keep_alive())
        if not exchange.response_complete:  # (a body declared over the bound was answered at once)
            self.exchange = exchange
        self.cycle = cast(RequestResponseCycle, exchange)  # it stands in for uvicorn's cycle
        return True

    def _asgi_scope(self) -> Any:
        """The ASGI scope uvicorn's ``on_message_begin`` builds (its ``on_headers_complete`` adds
        the method, path and query), with the addresses read now."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": get_local_addr(self.transport),
            "client": get_remote_addr(self.transport),
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "extensions": {ABORT_EXTENSION: self.transport.abort},
        }

    # --- what a request taken over needs of its connection ----------------------------------

    @property
    def writable(self) -> bool:
        return not self.flow.write_paused and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()

    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self.server_state.default_headers

    def exchange_done(self, exchange: Handler) -> None:
        """An exchange's answer is complete: as uvicorn's end of a response (the next pipelined
        request, or idle)."""
        if self.exchange is exchange:
            self.exchange = None
        self.on_response_complete()

    def on_body(self, body: bytes) -> None:
        self._chunk_without_data = False
        exchange = self.exchange
        if exchange is not None and self._serving(exchange):
            exchange.on_body(body)
        else:
            super().on_body(body)

    def _serving(self, exchange: Handler) -> bool:
        """Whether the request being read is the exchange's (not one pipelined behind it)."""
        return cast(object, self.cycle) is exchange

    def pause_writing(self) -> None:
        super().pause_writing()
        self.write_deadline = self.loop.time() + self.send_timeout_s

    def resume_writing(self) -> None:
        super().resume_writing()
        self.write_deadline = math.inf
        if self.exchange is not None:
            self.exchange.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reserved:
            self._leave_the_reserve()
        exchange = self.exchange
        super().connection_lost(exc)
        if exchange is not None:
            exchange.client_gone()
        last = cast(object, self.cycle)
        if last is not None and not isinstance(last, RequestResponseCycle):  # a request taken over
            cast(Handler, last).detach()
        self.exchange = None

    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t0")):
                return True
        return False

    def _transfer_coding_is_served(self) -> bool:
        """Whether the request's transfer codings, if any, are chunked alone."""
        codings = [value for name, value in self.headers if name == b"transfer-encoding"]
        return not codings or b",".join(codings).strip(b" \t").lower() == b"chunked"

    def _head_size(self) -> int:
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def on_message_complete(self) -> None:
        exchange = self.exchange
        if exchange is not None and self._serving(exchange):
            exchange.on_message_complete()
        else:
            super().on_message_complete()
        self._received = 0
        if self.cycle.response_complete:  # answered before its body was in (e.g. a 413)
            self._idle()
        else:
            self.phase = BUSY
            self.deadline = math.inf

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.phase == REFUSING:
            if self.cycle.response_complete and not self.pipeline and not self.transport.is_closing():
                self._send_refusal(*self._refusal)
            return
        if self.phase == BUSY and self.cycle.response_complete and not self.transport.is_closing():
            self._idle()

    def _idle(self) -> None:
        self.phase = IDLE
        self.deadline = self.loop.time() + self.keep_alive_s


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the deadline sweep and a drained shutdown (see the module)."""

    config: ServerConfig

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self._sweeper: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        s = self.config.bounds
        shortest = min(s.head_timeout_s, s.body_timeout_s, s.keep_alive_s, s.send_timeout_s)
        interval = max(0.01, min(SWEEP_MAX_S, shortest / 10))
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for connection in list(self.server_state.connections):
                if isinstance(connection, BoundedProtocol):
                    try:
                        connection.check_deadline(now)
                    except Exception:  # one connection's bug must not stop the sweep
                        log.exception("deadline check failed")

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        state = self.server_state
        for server in self.servers:
            server.close()  # stop accepting
        for sock in sockets or []:
            sock.close()
        for connection in list(state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their answer
        bound = self.config.bounds.drain_timeout_s
        if not await self._wait_idle(bound, drain=True):
            busy = sum(1 for c in state.connections if getattr(c, "exchange", None) is not None)
            log.warning("drain: %d requests still in flight; ending them", len(state.tasks) + busy)
            if self.config.on_drain_expired is not None:
                self.config.on_drain_expired()
            await self._wait_idle(FINAL_WRITE_S)
        for connection in list(state.connections):
            if isinstance(connection, BoundedProtocol) and connection.exchange is not None:
                connection.exchange.shut_down()
        if state.tasks:
            for task in list(state.tasks):
                task.cancel()
            await self._wait_idle(FINAL_WRITE_S)
        for connection in list(state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.lifespan.shutdown()

    async def _wait_idle(self, timeout_s: float, drain: bool = False) -> bool:
        """Wait until no request is in flight and no connection is open (True), at most
        ``timeout_s``; a drain ends early at a second signal (False)."""
        state = self.server_state
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while state.tasks or state.connections:
            if (drain and self.force_exit) or loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the signal once served, so the process dies of it (status -15); a
        # drained shutdown is a clean exit instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True  # a second signal: cut the drain short
        else:
            self.should_exit = True


def make_room_for(bounds: HttpBounds, fds_per_connection: int, *, chosen_by: str | None = None) -> HttpBounds:
    """Raise the soft limit on open descriptors to fit every connection the server holds (the cap
    and the reserve, ``HttpBounds.connection_limit``; ``fds_per_connection`` each: the proxy's
    two, a client's and an upstream one; a server without an upstream's one), as far as the hard
    limit allows; the bounds to serve with.

    NOTE: where the hard limit is too low, a cap the operator chose (``chosen_by`` names the
    options that set it) is kept, with one warning naming those options; a default cap is lowered
    to the connections that fit, said at info level: a default start never warns about a default
    it could not have known to change."""
    connection_limit = bounds.connection_limit
    need = fds_per_connection * connection_limit + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return bounds
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= need:
        return bounds
    if chosen_by is not None:
        log.warning(
            "open-file limit %d is below the %d that %d connections need: lower %s or raise the "
            "hard limit (ulimit -Hn)",
            target,
            need,
            connection_limit,
            chosen_by,
        )
        return bounds
    fitted = max(1, (target - FD_HEADROOM) // fds_per_connection - bounds.reserved_connections)
    log.info(
        "open-file limit %d fits %d connections: at most %d clients at once, not the default %d "
        "(raise the hard limit, ulimit -Hn, for more)",
        target,
        fitted + bounds.reserved_connections,
        fitted,
        bounds.max_connections,
    )
    return replace(bounds, max_connections=fitted)


def serve(
    app: Any,
    bounds: HttpBounds,
    on_drain_expired: Callable[[], None] | None,
    log_level: str,
    *,
    fds_per_connection: int = 2,
    chosen_by: str | None = None,
    takeover: TakeOver | None = None,
) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then drain (see the module); the open-file limit is
    raised to fit ``bounds.connection_limit`` of ``fds_per_connection`` descriptors each, or the
    cap fitted to it (``make_room_for``; ``chosen_by``: the options that chose the cap, if any)."""
    bounds = make_room_for(bounds, fds_per_connection, chosen_by=chosen_by)
    # log_config=None: uvicorn's loggers propagate to the command's handler (foundation.logs).
    config = ServerConfig(
        app, bounds, on_drain_expired, takeover=takeover, loop="auto", log_level=log_level, log_config=None
    )
    DrainingServer(config).run()
    _exit_despite_stuck_threads()


def _exit_despite_stuck_threads() -> None:
    """Once the interpreter starts to exit, give the other threads ``EXIT_GRACE_S`` to end, then
    end the process without them: reached only while one still runs (a normal exit ends this
    daemon thread first), e.g. a request's worker blocked for good."""
    exiting = threading.Event()

    def watch() -> None:
        exiting.wait()
        time.sleep(EXIT_GRACE_S)
        main = threading.main_thread()
        stuck = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not main]
        log.warning(
            "exit: threads still busy %g s after the server stopped (%s); exiting without them",
            EXIT_GRACE_S,
            ", ".join(stuck),
        )
        logging.shutdown()  # flushed: os._exit skips the interpreter's own exit
        os._exit(0)

    threading.Thread(target=watch, name="exit-watchdog", daemon=True).start()
    # NOTE: threading's exit hooks (private; concurrent.futures joins its pools' workers in one)
    # run last registered first, so this one is called before any pool's join begins.
    getattr(threading, "_register_atexit")(exiting.set)  # noqa: B009
