"""A generation request served in callbacks on the server's connection: no ASGI cycle, no task.

The server's protocol (``foundation.server.BoundedProtocol``) hands a POST to a generation route
over to an ``Exchange`` when its head is complete and nothing else is in progress on the
connection (``takes_over`` says which). From then on the request is driven by
callbacks only: its body arrives in ``on_body``; at the end of the message the proxy validates,
keys and decides the attempt (``exporter.proxy.Proxy.attempt``, the same code the ASGI path
runs); the answer is either written at once (bad input, a refusal) or read from the execution's
relay (``exporter.relay``) in the relay's own callback (``Subscription.notify``): every chunk the
upstream appends is framed and written to the client's transport in the upstream's callback.

Flow control: while the client's transport has paused writing, the subscriber lags in the relay's
buffer and catches up when the transport resumes (``resume``); one that lags past the relay's
bound (``Relay.overrun``) has its connection closed at once (``_drop``) and ends as a disconnect.
A client that goes away is the connection's ``connection_lost`` (``client_gone``), noticed at
once, with no watcher task.

The exchange stands in for uvicorn's request cycle on the connection (``self.cycle``): it has the
attributes uvicorn's protocol and ``BoundedProtocol`` read of one (``response_started``,
``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``), so head bounds,
timeouts, pipelining behind it, refusals and the drained shutdown work as for any request. When
its answer is complete it calls the connection's ``exchange_done``.

How an attempt's end is accounted (delivered, disconnected, refused, failed) is the ASGI path's
(``exporter.proxy.SubscriberResponse._finish``), written for callbacks. Every entry point is
guarded: a fault in the proxy answers a JSON 500 if nothing was sent yet, else closes the
connection, and is logged.
"""

from __future__ import annotations

import http
import logging
from collections.abc import Callable
from typing import Protocol

from exporter.proxy import ENDED_WITHOUT_ANSWER, Answer, Ending, Proxy, header_map
from exporter.relay import READ_BYTES, Relay, Subscription
from exporter.validation import GENERATION_ROUTES
from foundation.errors import error_body, error_type
from foundation.server import PROXY_ERROR, SHUT_DOWN_UNANSWERED

log = logging.getLogger("retrywatch.exchange")

GENERATION_PATHS = frozenset(route.encode() for route in GENERATION_ROUTES)
_JSON = b"application/json"
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus}
_LAST_CHUNK = b"0\r\n\r\n"


class _NoEvent:
    """uvicorn sets a request cycle's ``message_event`` when the connection is lost; an exchange
    hears of that through ``client_gone`` instead."""

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


class Connection(Protocol):
    """What an exchange needs of its connection (``foundation.server.BoundedProtocol``)."""

    @property
    def writable(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def default_headers(self) -> list[tuple[bytes, bytes]]: ...

    def exchange_done(self, exchange: Exchange) -> None: ...


class _Gone:
    """The connection of an exchange once it is lost: nothing more goes anywhere."""

    writable = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return []

    def exchange_done(self, exchange: Exchange) -> None:
        pass


_GONE = _Gone()


def takes_over(proxy: Proxy, method: bytes, path: bytes, http_version: str, expect_continue: bool) -> bool:
    """Whether a request whose head is complete is served in callbacks: a POST to a generation
    route, in HTTP/1.1, without ``Expect: 100-continue``, while the proxy is not closing. Every
    other request (and these in the other cases) goes through the ASGI app as before."""
    return (
        method == b"POST"
        and path in GENERATION_PATHS
        and http_version == "1.1"
        and not expect_continue
        and not proxy.closing
    )


class ProxyTakeOver:
    """The proxy's takeover (``foundation.server.TakeOver``): the server hands it each request
    whose head is complete, and it serves those :func:`takes_over` names as an :class:`Exchange`."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    def accepts(self, method: bytes, path: bytes, http_version: str, expect_continue: bool) -> bool:
        return takes_over(self.proxy, method, path, http_version, expect_continue)

    def __call__(
        self, connection: Connection, route: str, raw_headers: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> Exchange:
        return Exchange(self.proxy, connection, route, raw_headers, keep_alive)


class Exchange:
    """One generation request on one client connection, from its head to the end of its answer."""

    message_event = _NO_EVENT
    _dropped = False  # closed for lagging past the replay bound (``_drop``)

    def __init__(
        self,
        proxy: Proxy,
        connection: Connection,
        route: str,
        raw_headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> None:
        self.proxy = proxy
        self.connection = connection
        self.route = route
        self.raw_headers = raw_headers
        self.headers = header_map(raw_headers)
        self.keep_alive = keep_alive
        self.started = proxy.now()
        # the request cycle's attributes uvicorn and BoundedProtocol read
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        # NOTE: the body as one buffer, not a list of the parser's pieces: a chunked body sent in
        # 2-byte chunks made a list of millions of bytes objects, tens of times the body's size
        # in memory (a 4 MiB body held 276 MiB, within --max-body-bytes).
        self._body: bytes | bytearray = b""
        self._size = 0
        self._relay: Relay | None = None
        self._sub: Subscription | None = None
        self._ended = False  # the subscriber's end ran (accounting and last writes)
        self._accounted = False
        self._guard(self._head)

    # --- entry points (each guarded) ---------------------------------------------------------

    def on_body(self, data: bytes) -> None:
        self._guard(self._on_body, data)

    def on_message_complete(self) -> None:
        self._guard(self._decide)

    def resume(self) -> None:
        """New bytes in the relay, its end, or the client's transport resumed writing: catch up
        from the relay."""
        self._guard(self._pump)

    def client_gone(self) -> None:
        """The client's connection was lost."""
        self.disconnected = True
        sub = self._sub
        if sub is not None:
            sub.left = True
            self._guard(self._pump)

    def shut_down(self) -> None:
        """The drain bound expired with this request not answered yet (its body still arriving):
        a JSON 503, as the ASGI path's request gets when its task is cancelled."""
        if self.response_started or self.response_complete:
            return
        self.keep_alive = False
        self._guard(lambda: self._write_answer(*SHUT_DOWN_UNANSWERED))

    def detach(self) -> None:
        """The connection is gone: drop the reference to it (the connection refers to its last
        exchange; without this, each would be garbage only the collector frees)."""
        self.connection = _GONE

    def _guard(self, step: Callable[..., None], *args: bytes) -> None:
        try:
            step(*args)
        except Exception:
            log.exception("generation request failed in the proxy")
            self._fault()

    def _fault(self) -> None:
        """A bug in the proxy: answer a JSON 500 if nothing was sent, else close; the attempt is
        accounted as gone if it had subscribed."""
        sub = self._sub
        try:
            if sub is not None and not self._accounted:
                self._accounted = True
                self._ended = True
                sub.notify = None
                if self._relay is not None:
                    self._relay.unsubscribe(sub.subscriber_id)
                self.proxy.subscriber_left(sub, self.started)
        except Exception:
            log.exception("accounting a failed generation request failed")
        if self.response_complete:
            return
        if not self.response_started and self.connection.writable:
            self.keep_alive = False
            self._write_answer(*PROXY_ERROR)
        else:
            self.response_complete = True
            self.connection.close()
            self.connection.exchange_done(self)

    # --- the request ---------------------------------------------------------------------------

    def _head(self) -> None:
        too_large = self.proxy.body_too_large(self.headers.get("content-length"))
        if too_large is not None:
            self._write_answer(too_large.status, too_large.body())

    def _on_body(self, data: bytes) -> None:
        if self.response_complete or self._relay is not None:
            return  # answered already (413): the rest of the body is read and dropped
        self._size += len(data)
        limit = self.proxy.settings.max_body_bytes
        if self._size > limit:
            self._body = b""
            message = f"request body is over the limit of {limit} bytes"
            self._write_answer(413, error_body(message, error_type(413), "body_too_large"))
            return
        if not self._body:
            self._body = data  # most bodies arrive in one piece: kept as it came, not copied
        elif isinstance(self._body, bytes):
            self._body = bytearray(self._body) + data
        else:
            self._body += data

    def _decide(self) -> None:
        if self.response_complete:
            return
        body = self._body
        raw = body if isinstance(body, bytes) else bytes(body)
        self._body = b""
        outcome = self.proxy.attempt(self.route, self.headers, self.raw_headers, raw, self.started)
        if isinstance(outcome, Answer):
            self._write_answer(outcome.status, outcome.body, outcome.headers)
            return
        self._relay, self._sub = outcome.relay, outcome.subscription
        self._sub.notify = self.resume
        self._pump()

    # --- the answer, from the relay -----------------------------------------------------------

    def _pump(self) -> None:
        """Write what the relay has for this subscriber; at the execution's end, finish."""
        relay, sub = self._relay, self._sub
        if self._ended or relay is None or sub is None:
            return
        if not sub.left:
            if not self.connection.writable:
                # paused: the subscriber lags in the relay and catches up on resume, unless it
                # lags past the bound (a client that is not reading): then it is dropped
                if relay.overrun(sub) and not self._dropped:
                    self._drop(relay, sub)
                return
            # bounded reads while the connection takes them: what it does not take stays in the
            # relay, where its lag is seen, instead of all at once in the transport's buffer
            while relay.stream and self.connection.writable and (data := relay.read(sub, READ_BYTES)):
                frame = b"%x\r\n%b\r\n" % (len(data), data)
                if not self.response_started:
                    frame = self._head_bytes(200, relay.content_type, None, True) + frame
                self.connection.write(frame)
            if relay.outcome is None or (relay.stream and sub.offset < relay.end):
                return  # more to come, or the rest to write on resume
        self._end(relay, sub)

    def _drop(self, relay: Relay, sub: Subscription) -> None:
        """Close the connection of a client that lags past the bound at once (its unsent bytes
        dropped); the connection's loss (``client_gone``) then ends the attempt as any
        disconnect's, outside the upstream's callback this runs in."""
        self._dropped = True
        self.keep_alive = False
        self.proxy.log_overrun(relay, sub)
        self.connection.abort()

    def _end(self, relay: Relay, sub: Subscription) -> None:
        """The subscriber's end: account the attempt and write the end of its answer."""
        self._ended = True
        sub.notify = None
        try:
            self._settle(relay, sub)
        finally:
            relay.unsubscribe(sub.subscriber_id)
            if not self._accounted:
                self._accounted = True
                self.proxy.subscriber_left(sub, self.started)

    def _settle(self, relay: Relay, sub: Subscription) -> None:
        ending = self.proxy.settle(relay, sub, self.started, self.response_started)
        self._accounted = ending is not Ending.BODY
        if ending is Ending.LEFT:
            self._finished()
            return
        if ending is Ending.STREAM_END:
            if not sub.left:
                end = _LAST_CHUNK
                if not self.response_started:
                    end = self._head_bytes(200, relay.content_type, None, True) + end
                self.connection.write(end)
            self._finished()
            return
        if ending is Ending.BODY:
            body = relay.read(sub)
            head = self._head_bytes(relay.status, relay.content_type, len(body), True)
            self.connection.write(head + body)
            self._accounted = True
            self.proxy.body_written(sub, self.started)
            self._finished()
            return
        status, body = relay.error or ENDED_WITHOUT_ANSWER
        if self.response_started:  # mid-stream: an SSE error event, then the end of the stream
            event = relay.error_end(body)
            self.connection.write(b"%x\r\n%b\r\n" % (len(event), event) + _LAST_CHUNK)
            self._finished()
        else:
            self._write_answer(status, body, relay.error_headers(), no_cache=True)

    # --- writing -----------------------------------------------------------------------------

    def _head_bytes(self, status: int, content_type: bytes, length: int | None, no_cache: bool) -> bytes:
        """A response head as the ASGI path's would be written by uvicorn (its default headers
        first); chunked when ``length`` is None."""
        self.response_started = True
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        for name, value in self.connection.default_headers():
            parts.append(b"%b: %b\r\n" % (name, value))
        parts.append(b"content-type: %b\r\n" % content_type)
        if no_cache:
            parts.append(b"cache-control: no-cache\r\n")
        if length is None:
            parts.append(b"transfer-encoding: chunked\r\n")
        else:
            parts.append(b"content-length: %d\r\n" % length)
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _write_answer(
        self, status: int, body: bytes, headers: dict[str, str] | None = None, no_cache: bool = False
    ) -> None:
        """A whole JSON answer, then the end of the exchange."""
        head = self._head_bytes(status, _JSON, len(body), no_cache)
        if headers:
            extra = b"".join(
                b"%b: %b\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
            )
            head = head[:-2] + extra + b"\r\n"
        self.connection.write(head + body)
        self._finished()

    def _finished(self) -> None:
        if self.response_complete:
            return
        self.response_complete = True
        if not self.keep_alive or self.disconnected:
            self.connection.close()
        self.connection.exchange_done(self)
        # The connection keeps its last exchange (as uvicorn keeps its last request cycle) until
        # the next request: let it hold nothing more.
        self._body = b""
        self._relay = self._sub = None
        self.raw_headers = []
        self.headers = {}
