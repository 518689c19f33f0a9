"""A misbehaving HTTP/1.1 upstream for the proxy's tests, run as a real process on loopback.

The test upstream (``tests.exporter.upstream``) is a real uvicorn app and answers only what HTTP
allows; this one writes raw bytes on asyncio streams, so it can break HTTP's rules the way a broken
engine, a buggy gateway or an adversary in front of the engine would. The request header
``x-bad: MODE`` picks the misbehaviour of one request (``--path-mode PATH=MODE`` picks it for every
request to a path, e.g. ``/metrics``, which the proxy fetches itself without the header; a request
naming neither gets ``normal``). ``x-bad-size: N`` and ``x-bad-hold: S`` tune some modes.

Modes (``MODES``: mode -> coroutine; add one by writing a coroutine and naming it there):

* ``normal``: a well-formed answer (a JSON completion, or an SSE stream in chunked coding when the
  request's body asks for ``"stream": true``), kept alive. Its id is ``cmpl-first-CALL``, CALL
  the request's ``x-call-id`` (``none`` without one): whose answer a client got shows.
* ``two-responses``: the answer, then a second whole answer (``cmpl-second-CALL``) nobody asked
  for, in the same write: stray bytes inside one read of the proxy.
* ``two-responses-later``: the same, the second answer written 50 ms after the first.
* ``huge-head``: a 200 whose head carries ``x-bad-size`` bytes (64 MiB by default) of header
  lines (``x-junk-N: aaa...``, 1 KiB each), then the answer.
* ``endless-header-line``: a 200 whose head has one header line ``x-bad-size`` bytes long.
* ``many-fields``: a 200 with ``x-bad-size`` (1,000 by default) small header fields.
* ``huge-trailer``: the answer in chunked coding, then ``x-bad-size`` bytes of trailer lines.
* ``held-answer``: a JSON completion of ``x-bad-size`` bytes (4 MiB by default) whose last byte
  is written only ``x-bad-hold`` seconds (1 by default) after the rest.
* ``repeated-fields``: the answer with repeated fields (two ``set-cookie``, two ``x-multi``),
  each on a line of its own.

``GET /metrics`` answers a small exposition and ``GET /health`` an empty 200, unless a mode is
given for them. ``GET /bad/log`` answers a JSON record of every request served (path, mode, call
id, bytes written, and ``cut_short``: the peer closed the connection before the answer was all
written), so a test can tell what the proxy read and what it gave up on. Prompt text is never
stored.

Run: ``python -m tests.exporter.badupstream --port 8000 [--path-mode /metrics=huge-head]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

MAX_REQUEST_HEAD = 64 * 1024
MAX_REQUEST_BODY = 16 * 1024 * 1024
METRICS_TEXT = b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
MIB = 1024 * 1024


@dataclass
class Request:
    """One request as read, and what was written in answer to it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        try:
            return bool(json.loads(self.body).get("stream", False))
        except (ValueError, AttributeError):
            return False

    def number(self, name: str, default: float) -> float:
        value = self.headers.get(name)
        return float(value) if value is not None else default


class Peer:
    """Writes to one connection, counting what was written; ``Gone`` once the peer closed."""

    class Gone(Exception):
        pass

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    async def send(self, request: Request, data: bytes) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            request.record["cut_short"] = True
            raise Peer.Gone() from None
        request.record["written"] += len(data)


# --- answers ----------------------------------------------------------------------------------


def completion(name: str, pad: int = 0) -> bytes:
    """A JSON completion whose id is ``cmpl-NAME`` (padded with ``pad`` bytes of text)."""
    text = " t0" + "x" * pad
    body = {"id": f"cmpl-{name}", "object": "text_completion", "choices": [{"text": text}]}
    return json.dumps(body).encode()


def events(name: str) -> bytes:
    """An SSE stream of two tokens and ``[DONE]``, each event's id ``cmpl-NAME``."""
    token = b'data: {"id": "cmpl-%b", "object": "text_completion", "choices": [{"text": " t%d"}]}\n\n'
    return token % (name.encode(), 0) + token % (name.encode(), 1) + b"data: [DONE]\n\n"


def answer_id(request: Request, which: str) -> str:
    """The name in the ids of an answer: which answer to the request (``first``, ``second``) and
    the request's call id, so that a test can tell whose answer a client received."""
    return f"{which}-{request.headers.get('x-call-id', 'none')}"


def chunked(body: bytes) -> bytes:
    """``body`` in chunked coding, an event a chunk, with the last chunk (no trailer)."""
    parts = [part + b"\n\n" for part in body.split(b"\n\n") if part]
    return b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


def answer(request: Request, which: str, extra: bytes = b"") -> bytes:
    """A whole well-formed answer to ``request`` (``extra``: more header lines, CRLF-ended)."""
    name = answer_id(request, which)
    if request.path == "/metrics":
        return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%b\r\n%b" % (
            len(METRICS_TEXT),
            extra,
            METRICS_TEXT,
        )
    if request.stream:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        return head + extra + b"\r\n" + chunked(events(name))
    body = completion(name)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return head + extra + b"\r\n" + body


def head_of(request: Request) -> bytes:
    """The status line and framing fields of a well-formed answer, up to its own fields' end."""
    whole = answer(request, "first")
    return whole[: whole.index(b"\r\n\r\n") + 2]


def rest_of(request: Request) -> bytes:
    """The blank line ending a head from ``head_of``, and the body."""
    whole = answer(request, "first")
    return whole[whole.index(b"\r\n\r\n") + 2 :]


# --- the modes --------------------------------------------------------------------------------

Mode = Callable[[Request, Peer], Awaitable[None]]


async def normal(request: Request, peer: Peer) -> None:
    await peer.send(request, answer(request, "first"))


async def two_responses(request: Request, peer: Peer) -> None:
    await peer.send(request, answer(request, "first") + answer(request, "second"))


async def two_responses_later(request: Request, peer: Peer) -> None:
    await peer.send(request, answer(request, "first"))
    await asyncio.sleep(0.05)
    await peer.send(request, answer(request, "second"))


async def huge_head(request: Request, peer: Peer) -> None:
    size = int(request.number("x-bad-size", 64 * MIB))
    await peer.send(request, head_of(request))
    line = b"x-junk-%08d: " + b"a" * 1000 + b"\r\n"
    batch = 64
    for i in range(0, size // len(line % 0), batch):
        await peer.send(request, b"".join(line % n for n in range(i, i + batch)))
    await peer.send(request, rest_of(request))


async def endless_header_line(request: Request, peer: Peer) -> None:
    size = int(request.number("x-bad-size", 64 * MIB))
    await peer.send(request, head_of(request) + b"x-junk: ")
    piece = b"a" * 65536
    for _ in range(size // len(piece)):
        await peer.send(request, piece)
    await peer.send(request, b"\r\n" + rest_of(request))


async def many_fields(request: Request, peer: Peer) -> None:
    count = int(request.number("x-bad-size", 1000))
    fields = b"".join(b"x-f%d: %d\r\n" % (n, n) for n in range(count))
    await peer.send(request, head_of(request) + fields + rest_of(request))


async def huge_trailer(request: Request, peer: Peer) -> None:
    size = int(request.number("x-bad-size", 64 * MIB))
    name = answer_id(request, "first")
    body = events(name) if request.stream else completion(name)
    kind = b"text/event-stream" if request.stream else b"application/json"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: %b\r\ntransfer-encoding: chunked\r\n\r\n" % kind
    await peer.send(request, head + b"%x\r\n%b\r\n0\r\n" % (len(body), body))
    line = b"x-trailer-%08d: " + b"a" * 1000 + b"\r\n"
    batch = 64
    for i in range(0, size // len(line % 0), batch):
        await peer.send(request, b"".join(line % n for n in range(i, i + batch)))
    await peer.send(request, b"\r\n")


async def held_answer(request: Request, peer: Peer) -> None:
    size = int(request.number("x-bad-size", 4 * MIB))
    name = answer_id(request, "first")
    body = completion(name, pad=max(0, size - len(completion(name))))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    await peer.send(request, head + body[:-1])
    await asyncio.sleep(request.number("x-bad-hold", 1.0))
    await peer.send(request, body[-1:])


async def repeated_fields(request: Request, peer: Peer) -> None:
    extra = b"set-cookie: a=1; Path=/\r\nset-cookie: b=2; Path=/\r\nx-multi: one\r\nx-multi: two\r\n"
    await peer.send(request, answer(request, "first", extra))


MODES: dict[str, Mode] = {
    "normal": normal,
    "two-responses": two_responses,
    "two-responses-later": two_responses_later,
    "huge-head": huge_head,
    "endless-header-line": endless_header_line,
    "many-fields": many_fields,
    "huge-trailer": huge_trailer,
    "held-answer": held_answer,
    "repeated-fields": repeated_fields,
}


# --- the server -------------------------------------------------------------------------------


class BadUpstream:
    """The server: reads requests (kept alive), answers each in the mode it names."""

    def __init__(self, path_modes: dict[str, str]) -> None:
        self.path_modes = path_modes
        self.log: deque[dict[str, Any]] = deque(maxlen=10_000)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(writer)
        try:
            while (request := await self._read(reader)) is not None:
                if request.path == "/bad/log":
                    body = json.dumps({"requests": list(self.log)}).encode()
                    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                    writer.write(head % len(body) + body)
                    await writer.drain()
                    continue
                mode = request.headers.get("x-bad") or self.path_modes.get(request.path, "normal")
                request.record = {
                    "path": request.path,
                    "mode": mode,
                    "call_id": request.headers.get("x-call-id"),
                    "written": 0,
                    "cut_short": False,
                }
                self.log.append(request.record)
                if mode not in MODES:
                    body = b"unknown x-bad mode; one of: " + ", ".join(MODES).encode()
                    head = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n" % len(body)
                    await peer.send(request, head + body)
                    continue
                await MODES[mode](request, peer)
        except (Peer.Gone, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def _read(self, reader: asyncio.StreamReader) -> Request | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None  # the peer closed between requests
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if length > MAX_REQUEST_BODY:
            raise ConnectionError("request body over the bound")
        body = await reader.readexactly(length)
        return Request(method, target.split("?", 1)[0], headers, body)


async def _main(host: str, port: int, path_modes: dict[str, str]) -> None:
    upstream = BadUpstream(path_modes)
    server = await asyncio.start_server(upstream.serve, host, port, limit=MAX_REQUEST_HEAD)
    async with server:
        await server.serve_forever()


def _path_mode(text: str) -> tuple[str, str]:
    path, sep, mode = text.partition("=")
    if not sep or not path.startswith("/") or mode not in MODES:
        raise argparse.ArgumentTypeError(f"expected PATH=MODE with MODE one of {', '.join(MODES)}")
    return path, mode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A misbehaving HTTP/1.1 upstream for the proxy's tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--path-mode", type=_path_mode, action="append", default=[], help="PATH=MODE: the mode for a path"
    )
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.host, args.port, dict(args.path_mode)))


if __name__ == "__main__":
    main()
