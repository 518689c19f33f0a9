"""One execution's upstream output, fanned out to its subscribers with a bounded replay buffer.

The upstream reader appends raw bytes (SSE events, or a JSON body) exactly as received; every
subscriber reads from its own byte offset, so an attached retry first receives everything so
far (the replay), then the live bytes. Per chunk the work is O(subscribers): wake the waiters.

NOTE: the replay buffer is stored in zlib-compressed blocks of ``BLOCK_BYTES`` plus an
uncompressed tail. Subscribers that keep up only ever read the tail; compressed blocks are
read by attached retries and lagging subscribers. SSE chunks of one completion repeat the same
JSON skeleton, so blocks compress about tenfold and a thousand live executions holding
400-token replays fit in a few megabytes. Once the stored bytes pass ``limit_bytes`` the
execution stops taking new subscribers (``on_overflow``) and blocks every current subscriber has
read are released.

A streaming subscriber whose unread bytes take more than ``limit_bytes`` to store (compressed, as
the replay is counted) is not reading: it is dropped (``Relay.overrun``), its connection closed as
a client's that went away.
Lag is checked only for a subscriber whose writes are paused (the callback path's ``Exchange``
when its transport is not writable; the ASGI path's ``Subscription.lagging``, run when new bytes
arrive while its task is not waiting for them): one that keeps up costs nothing more per chunk.
"""

from __future__ import annotations

import asyncio
import bisect
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

BLOCK_BYTES = 16 * 1024
#: The most a streaming subscriber's writer takes from the relay at a time: four blocks.
READ_BYTES = 4 * BLOCK_BYTES


class Outcome(StrEnum):
    COMPLETED = "completed"  # the upstream ended normally: deliver what is buffered
    REFUSED = "refused"  # the engine refused it (503 either form)
    FAILED = "failed"  # upstream down, erroring, or broken mid-stream
    CANCELLED = "cancelled"  # closed by the proxy (no subscriber left)
    DROPPED = "dropped"  # dropped from the proxy queue before dispatch


@dataclass
class UpstreamRequest:
    """What the upstream request of an execution is made of (kept until dispatch)."""

    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]  # forwarded as they came


@dataclass(eq=False)
class Subscription:
    """One subscriber's read position and how it is woken: a future its task awaits (the ASGI
    path), or a callback run at once (``notify``, the callback path of ``exporter.exchange``).

    ``lagging`` (the ASGI path) is run instead when there is no future to wake: the task is not
    waiting for new bytes but writing ones it read (its transport paused), so it may be lagging."""

    subscriber_id: int
    offset: int = 0
    left: bool = False  # the client disconnected
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    notify: Callable[[], None] | None = field(default=None, repr=False)
    lagging: Callable[[], None] | None = field(default=None, repr=False)

    def wake(self) -> None:
        if self.notify is not None:
            self.notify()
            return
        w = self.waiter
        if w is None:
            if self.lagging is not None:
                self.lagging()
        elif not w.done():
            w.set_result(None)


class Relay:
    """The fan-out of one execution."""

    def __init__(
        self,
        execution_id: int,
        request: UpstreamRequest | None,
        stream: bool,
        created_at: float,
        limit_bytes: int,
        on_overflow: Callable[[int], None] | None = None,
        on_release: Callable[[int], None] | None = None,
    ) -> None:
        self.execution_id = execution_id
        self.request = request
        self.stream = stream
        self.created_at = created_at
        self.limit_bytes = limit_bytes
        self._on_overflow = on_overflow
        # Told once how many bytes were appended (``end``) when they are no longer needed: the
        # execution ended without an answer, or its answer was read by every subscriber (the
        # proxy's bound on non-streaming answers held at once, ``exporter.execution``).
        self._on_release = on_release
        self.content_type = b"text/event-stream; charset=utf-8" if stream else b"application/json"
        self.status = 200
        self.chunks = 0  # chunks received from the upstream
        self.end = 0  # raw bytes received
        self.outcome: Outcome | None = None
        self.error: tuple[int, bytes] | None = None  # (status, OpenAI-style body) for REFUSED/FAILED
        # The upstream's Retry-After on its 429 or 503 (``exporter.execution``): every subscriber's
        # error answer carries it.
        self.retry_after: bytes | None = None
        self.attachable = True
        self.subscriptions: dict[int, Subscription] = {}
        self._blocks: list[bytes | None] = []  # compressed; None once released
        self._block_starts: list[int] = []
        self._stored_before: list[int] = []  # compressed bytes sealed before each block
        self._sealed_stored = 0  # compressed bytes of every block sealed, released ones too
        self._stored = 0  # bytes held: compressed blocks + tail
        self._tail = bytearray()
        self._tail_start = 0
        self._sealed_end = b""  # the last bytes of the last sealed block (the tail may be empty)

    # --- the upstream side ------------------------------------------------------------

    def append(self, data: bytes) -> None:
        if not data:
            return
        self._tail += data
        self.end += len(data)
        self._stored += len(data)
        self.chunks += 1
        if len(self._tail) >= BLOCK_BYTES:
            self._seal_tail()
        for sub in list(self.subscriptions.values()):
            sub.wake()

    def finish(self, outcome: Outcome, error: tuple[int, bytes] | None = None) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.error = error
        self.request = None
        for sub in list(self.subscriptions.values()):
            sub.wake()
        if outcome is not Outcome.COMPLETED or not self.subscriptions:
            self._release()

    def _release(self) -> None:
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release(self.end)

    def error_headers(self) -> dict[str, str] | None:
        """The header fields of the error answer besides the server's own (None: no more)."""
        value = self.retry_after
        return None if value is None else {"retry-after": value.decode("ascii")}

    def _seal_tail(self) -> None:
        raw = bytes(self._tail)
        self._sealed_end = raw[-4:]
        block = zlib.compress(raw, 1)
        self._blocks.append(block)
        self._block_starts.append(self._tail_start)
        self._stored_before.append(self._sealed_stored)
        self._sealed_stored += len(block)
        self._stored += len(block) - len(raw)
        self._tail_start += len(raw)
        self._tail = bytearray()
        if self._stored > self.limit_bytes:
            if self.attachable:
                self.attachable = False
                if self._on_overflow is not None:
                    self._on_overflow(self.execution_id)
            self._release_read_blocks()

    def _release_read_blocks(self) -> None:
        low = min((s.offset for s in self.subscriptions.values()), default=self.end)
        for i, block in enumerate(self._blocks):
            if block is None:
                continue
            block_end = self._block_starts[i + 1] if i + 1 < len(self._block_starts) else self._tail_start
            if block_end > low:
                break
            self._stored -= len(block)
            self._blocks[i] = None

    # --- the subscriber side ----------------------------------------------------------

    def subscribe(self, subscriber_id: int) -> Subscription:
        sub = Subscription(subscriber_id)
        self.subscriptions[subscriber_id] = sub
        return sub

    def unsubscribe(self, subscriber_id: int) -> None:
        self.subscriptions.pop(subscriber_id, None)
        if self.outcome is not None and not self.subscriptions:
            self._release()  # the last subscriber of a finished execution has what it needed

    def overrun(self, sub: Subscription) -> bool:
        """Whether what ``sub`` has yet to read takes more than ``limit_bytes`` to store (the
        compressed blocks from its offset on, and the tail): a client that is not reading, to be
        dropped (the relay would otherwise keep every block from its offset on, and send them all
        at once when it resumed). O(log blocks); run only for a subscriber whose writes are
        paused."""
        offset = sub.offset
        if not self.stream or offset >= self._tail_start:
            return False  # within the tail: less than a block behind
        i = bisect.bisect_right(self._block_starts, offset) - 1
        return self._sealed_stored - self._stored_before[i] + len(self._tail) > self.limit_bytes

    def read(self, sub: Subscription, max_bytes: int | None = None) -> bytes:
        """From the subscriber's offset to the end, or at most ``max_bytes`` of it; advances the
        offset by what it returns. A writer bounds its reads (``READ_BYTES``) so that what a
        client has not taken stays in the relay, where its lag is seen (``overrun``), and never
        all at once in a transport's buffer."""
        offset = sub.offset
        end = self.end if max_bytes is None else min(self.end, offset + max_bytes)
        if offset >= end:
            return b""
        sub.offset = end
        if offset >= self._tail_start:
            return bytes(self._tail[offset - self._tail_start : end - self._tail_start])
        return self._read_blocks(offset, end)

    def _read_blocks(self, offset: int, end: int) -> bytes:
        i = bisect.bisect_right(self._block_starts, offset) - 1
        parts: list[bytes] = []
        first_start = self._block_starts[i]
        for j in range(i, len(self._blocks)):
            if self._block_starts[j] >= end:
                break
            block = self._blocks[j]
            if block is None:
                raise RuntimeError("replay block released while a subscriber still needed it")
            parts.append(zlib.decompress(block))
        if end > self._tail_start:
            parts.append(bytes(self._tail[: end - self._tail_start]))
        return b"".join(parts)[offset - first_start : end - first_start]

    async def wait(self, sub: Subscription) -> None:
        """Until there is something new for ``sub``, the execution ends, or the client leaves."""
        if sub.left or self.outcome is not None or (self.stream and sub.offset < self.end):
            return
        loop = asyncio.get_running_loop()
        sub.waiter = loop.create_future()
        try:
            await sub.waiter
        finally:
            sub.waiter = None

    def error_end(self, error: bytes) -> bytes:
        """What ends a stream already begun with ``error`` (an OpenAI-style error body): an SSE
        error event, then ``data: [DONE]``.

        NOTE: an upstream that broke off in the middle of an event left its subscribers that
        event's first bytes; the error event written right after them joined that unfinished
        line, and no client could read it. The unfinished event is ended first."""
        end = (self._sealed_end + bytes(self._tail[-4:]))[-4:]
        between = self.end == 0 or end.endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))
        return (b"" if between else b"\n\n") + b"data: " + error + b"\n\ndata: [DONE]\n\n"

    def stored_bytes(self) -> int:
        return self._stored

    def describe(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "bytes": self.end, "stored_bytes": self._stored}
