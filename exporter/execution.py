"""One execution's upstream request, driven by the upstream connection's callbacks (no task).

When the policy dispatches an execution (``exporter.proxy.Proxy.apply``), an ``Execution`` takes
a kept-alive connection from the pool (``exporter.upstream.UpstreamPool``; connecting is the one
step that waits on a future, when no idle connection is fit), writes the request once, and from
then on runs in the connection's ``data_received`` (``_Connection.listener``, called once the
bytes received are parsed): the response head; an error body (read up to ``ERROR_BODY_LIMIT``);
a stream's first event, inspected for vLLM's in-stream refusal; then every chunk goes from the
parser's callback straight into the relay (``_Connection.sink``), which writes it to each
subscriber in the same callback (``exporter.exchange``); a non-streaming answer, held whole until
its end, up to ``--max-answer-bytes`` each and ``--answer-buffer-bytes`` together. At the end the
connection goes back to the pool if its response was read to the end, else it is closed.

Cancelling (``abort``) closes the connection before the end of the response: the engine sees the
disconnect and aborts the request. What each outcome means for the policy and the relay is the
proxy's (``Proxy.body_sink``, ``complete``, ``end_with_error``, ``first_event_is_error``); this
module only drives it. Every entry point is guarded: a fault in the proxy fails the execution
with a 502 its subscribers read, and is logged.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from exporter.relay import Outcome, Relay
from exporter.upstream import UpstreamError, UpstreamUnreachable, _Connection

if TYPE_CHECKING:
    from exporter.proxy import Proxy

log = logging.getLogger("retrywatch.proxy")

FIRST_EVENT_LIMIT = 64 * 1024  # bytes read before the first SSE event must be complete
ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error body kept
# The answers whose Retry-After is passed on to every subscriber (RFC 9110, 10.2.3; RFC 6585, 4):
# an engine's or a gateway's "come back later".
RETRY_AFTER_STATUSES = frozenset({429, 503})
RETRY_AFTER_MAX_BYTES = 64  # a longer Retry-After is not one (an HTTP-date takes 29 bytes)

# What the execution waits for.
_CONNECT, _HEAD, _ERROR_BODY, _FIRST_EVENT, _BODY, _DONE = range(6)


def _first_event_end(data: bytes) -> int:
    """Where the first SSE event in ``data`` ends (the first line end of the blank line after
    it), or -1 while it is incomplete.

    SSE ends a line with LF, CR or CRLF, so an event ends at ``\n\n``, ``\r\r``,
    ``\r\n\r\n`` or a mix of them: a line end directly followed by another always shows as
    LF LF, LF CR or CR CR (a CRLF holds none of these)."""
    end = data.find(b"\n\n")
    if b"\r" not in data:  # what vLLM sends: nothing more to look for
        return end
    found = [i for i in (end, data.find(b"\n\r"), data.find(b"\r\r")) if i >= 0]
    return min(found, default=-1)


def _upstream_message(raw: bytes, default: str) -> str:
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):  # nested past the interpreter's limit: not a message
        return default
    if isinstance(parsed, dict):
        err = parsed.get("error", parsed)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:500]
    return default


def retry_after(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The upstream answer's ``Retry-After``, if it has one valid field (RFC 9110, 10.2.3):
    delta-seconds or an HTTP-date, at most ``RETRY_AFTER_MAX_BYTES``. An invalid one, or several,
    is ignored: what is passed on is a value a client can act on."""
    found: bytes | None = None
    for name, value in headers:
        if name != b"retry-after":
            continue
        if found is not None:
            return None  # two fields: which to believe is not the proxy's to guess
        found = value.strip(b" \t")
    if found is None or not 0 < len(found) <= RETRY_AFTER_MAX_BYTES:
        return None
    if found.isdigit():
        return found
    # An HTTP-date (RFC 9110, 5.6.7), in any of its three forms, passed on as IMF-fixdate.
    try:
        when = email.utils.parsedate_to_datetime(found.decode("ascii"))
    except (ValueError, TypeError, IndexError):  # not a date, or no such day or time (31 Feb)
        return None
    if when.tzinfo is None:  # asctime's form carries no zone: GMT, as every HTTP-date
        when = when.replace(tzinfo=datetime.UTC)
    elif when.utcoffset() != datetime.timedelta(0):
        return None  # not an HTTP-date: those are GMT
    return email.utils.format_datetime(when, usegmt=True).encode("ascii")


class Execution:
    """The upstream request of one execution, from dispatch to the end of its response."""

    def __init__(self, proxy: Proxy, relay: Relay) -> None:
        self.proxy = proxy
        self.relay = relay
        self.state = _CONNECT
        self.conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._pending: list[bytes] = []  # a stream's first event, or an error body, as it arrives
        self._size = 0

    # --- entry points (each guarded) ---------------------------------------------------------

    def start(self) -> None:
        """Send the request: on an idle pooled connection at once, else once connected."""
        self._guard(self._start)

    def abort(self) -> None:
        """Cancelled by the policy, or the proxy is shutting down: close the connection before the
        end of the response (the engine aborts the request)."""
        self.state = _DONE
        if self._connecting is not None:
            self._connecting.cancel()
        self._release()

    def _guard(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:
            self._fault()

    def _fault(self) -> None:
        """A step of the proxy's own raised: logged, and the execution fails with a 502."""
        log.exception("execution %d failed in the proxy", self.relay.execution_id)
        if self.state != _DONE:
            self._fail(Outcome.FAILED, 502, "the proxy failed relaying it", "proxy_error")

    # --- the request -------------------------------------------------------------------------

    def _start(self) -> None:
        pool = self.proxy.pool
        conn = pool.take_idle()
        if conn is not None:
            self._send(conn)
            return
        self._connecting = asyncio.ensure_future(pool.connect())
        self._connecting.add_done_callback(self._connected)

    def _connected(self, future: asyncio.Future[_Connection]) -> None:
        self._connecting = None
        if future.cancelled():
            return
        error = future.exception()
        if self.state == _DONE:  # aborted while connecting
            if error is None:
                future.result().close()
            return
        if isinstance(error, UpstreamUnreachable):
            self.proxy.metrics.upstream_up = False
            message = "upstream unreachable: no connection to it could be made"
            self._fail(Outcome.FAILED, 502, message, "upstream_unreachable")
            return
        if error is not None:
            log.error("execution %d: connecting failed", self.relay.execution_id, exc_info=error)
            self._fail(Outcome.FAILED, 502, "the proxy failed relaying it", "proxy_error")
            return
        self._guard(lambda: self._send(future.result()))

    def _send(self, conn: _Connection) -> None:
        relay = self.relay
        request = relay.request
        relay.request = None  # the body is no longer held once sent
        self.conn = conn
        if request is None or conn.transport is None:
            self._fail(
                Outcome.FAILED, 502, "upstream unreachable: the connection was lost", "upstream_unreachable"
            )
            return
        self.state = _HEAD
        conn.listener = self._on_upstream
        pool = self.proxy.pool
        conn.transport.write(pool.request_bytes("POST", request.path, request.body, request.headers))

    # --- the response, in the connection's callbacks -------------------------------------------

    def _on_upstream(self) -> None:
        self._guard(self._step)

    def _step(self) -> None:
        conn = self.conn
        if conn is None or self.state == _DONE:
            return
        if self.state == _HEAD:
            if not conn.headers_done:
                if conn.error is not None:
                    self._broken(conn.error)
                return
            self._head(conn)
        if self.state == _ERROR_BODY:
            self._error_body(conn)
        elif self.state == _FIRST_EVENT:
            self._first_event(conn)
        elif self.state == _BODY:
            if conn.complete:
                self._end()
            elif conn.error is not None:
                self._broken(conn.error)

    def _head(self, conn: _Connection) -> None:
        # NOTE: an upstream that breaks the connection before the response headers (a
        # non-streaming response has none until the end) fails the execution, as one that
        # breaks it mid-stream does: the request is never sent again.
        proxy, relay = self.proxy, self.relay
        proxy.metrics.upstream_up = True
        relay.status = conn.status
        if conn.status != 200:
            self.state = _ERROR_BODY
            return
        for name, value in conn.headers:
            if name == b"content-type":
                relay.content_type = value
                break
        if relay.stream:
            self.state = _FIRST_EVENT
            return
        self.state = _BODY
        self._forward(conn, self._bounded(proxy.body_sink(relay)))

    def _bounded(self, sink: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """``sink`` for a non-streaming answer, held whole until its end: one past
        ``--max-answer-bytes`` is not an engine's (a broken upstream, an endless body), and the
        execution fails before holding more. One that would take the answers held at once past
        ``--answer-buffer-bytes`` fails with a 503 (the others are untouched); what it held is
        given back when its relay is done (``Relay._release``)."""
        proxy, relay = self.proxy, self.relay
        limit = proxy.settings.max_answer_bytes
        total = proxy.settings.answer_buffer_bytes

        def bounded(data: bytes) -> None:
            if self.state == _DONE:
                return
            size = len(data)
            if relay.end + size > limit:
                message = f"upstream broken: its answer is over the proxy's limit of {limit} bytes"
                self._fail(Outcome.FAILED, 502, message, "upstream_broken")
                return
            if proxy.answers_held + size > total:
                log.warning(
                    "execution %d failed: its answer would take the answers held at once past "
                    "--answer-buffer-bytes (%d)",
                    relay.execution_id,
                    total,
                )
                message = (
                    "the proxy is holding as many whole answers as it may (--answer-buffer-bytes, "
                    f"{total} bytes): this one was dropped; retry later"
                )
                self._fail(Outcome.FAILED, 503, message, "answer_buffer_full")
                return
            proxy.answers_held += size
            sink(data)

        return bounded

    def _forward(self, conn: _Connection, sink: Callable[[bytes], None]) -> None:
        """From now on each body chunk goes from the parser's callback straight to ``sink``.

        NOTE: a fault in ``sink`` is the proxy's, not the upstream's: raised inside the parser's
        callback, httptools would report it as a malformed response (``upstream_broken``), so
        the parser's calls are guarded here."""
        while conn.chunks:
            sink(conn.chunks.popleft())

        def guarded(data: bytes) -> None:
            if self.state == _DONE:
                return
            try:
                sink(data)
            except Exception:
                self._fault()

        conn.sink = guarded

    def _take(self, conn: _Connection) -> None:
        while conn.chunks:
            data = conn.chunks.popleft()
            self._pending.append(data)
            self._size += len(data)

    def _error_body(self, conn: _Connection) -> None:
        self._take(conn)
        if self._size < ERROR_BODY_LIMIT and not conn.complete:
            if conn.error is not None:
                self._broken(conn.error)
            return
        raw = b"".join(self._pending)[:ERROR_BODY_LIMIT]
        status = self.relay.status
        if status in RETRY_AFTER_STATUSES:
            # NOTE: an engine's or a gateway's Retry-After is every subscriber's: lost, clients
            # that honour it retried at their own backoff, sooner, feeding the retry loop.
            self.relay.retry_after = retry_after(conn.headers)
        if status == 503:
            message = _upstream_message(raw, "the engine refused the request (queue full)")
            self._fail(Outcome.REFUSED, 503, message, "engine_refused")
        else:
            message = _upstream_message(raw, f"the upstream answered HTTP {status}")
            self._fail(Outcome.FAILED, status if 400 <= status < 500 else 502, message, "upstream_error")

    def _first_event(self, conn: _Connection) -> None:
        """Relay raw SSE bytes; only the first event is inspected (vLLM's in-stream refusal)."""
        self._take(conn)
        pending = b"".join(self._pending) if len(self._pending) != 1 else self._pending[0]
        self._pending = [pending] if pending else []
        cut = _first_event_end(pending)
        if cut < 0 and len(pending) < FIRST_EVENT_LIMIT and not conn.complete:
            if conn.error is not None:
                self._broken(conn.error)
            return
        self._pending = []
        proxy, relay = self.proxy, self.relay
        sink = proxy.body_sink(relay)
        if pending:
            if proxy.first_event_is_error(relay, pending[: cut if cut >= 0 else len(pending)]):
                self._finish()
                return
            sink(pending)  # the first token, accounted by the sink once written
        self.state = _BODY
        self._forward(conn, sink)
        if conn.complete:
            self._end()
        elif conn.error is not None:
            self._broken(conn.error)

    # --- the end -----------------------------------------------------------------------------

    def _end(self) -> None:
        self._finish()
        self.proxy.complete(self.relay)  # a no-op if ``data: [DONE]`` completed it already

    def _broken(self, error: UpstreamError) -> None:
        self._fail(Outcome.FAILED, 502, f"upstream broken: {error}", "upstream_broken")

    def _fail(self, outcome: Outcome, status: int, message: str, code: str) -> None:
        self._finish()
        if self.relay.outcome is None:
            self.proxy.end_with_error(self.relay, outcome, status, message, code)

    def _finish(self) -> None:
        self.state = _DONE
        self._release()

    def _release(self) -> None:
        """The connection back to the pool if its response was read to the end, else closed."""
        self.proxy.executions.pop(self.relay.execution_id, None)
        conn, self.conn = self.conn, None
        if conn is None:
            return
        conn.listener = None
        conn.sink = None
        if conn.reusable():
            self.proxy.pool.release(conn)
        else:
            conn.close()
