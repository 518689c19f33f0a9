"""An OpenAI-compatible streaming test upstream, run as a real process on loopback.

It stands in for vLLM where the proxy is tested or benchmarked, and can be told per request
(headers) or for every request (``POST /test/config``) how to behave. On the generation routes:

* ``x-test-ttft``: seconds to the first token; ``x-test-token-interval``: seconds between tokens;
  the number of tokens is the request's ``max_tokens`` (default 16); a ``max_tokens`` over
  ``MAX_MODEL_LEN`` gets a 400, as from a vLLM with that ``--max-model-len``.
* ``x-test-mode``: ``normal``; ``refuse-http`` (HTTP 503, vLLM's queue cap); ``refuse-429``
  (HTTP 429, a gateway's rate limit in front of the engine); ``refuse-stream``
  (HTTP 200 whose stream carries ``data: {"error": {..., "code": 503}}`` then ``data: [DONE]``);
  ``crash`` (the connection closes after ``x-test-crash-after`` tokens: mid-stream when
  streaming, before any response byte when not, as an engine dying mid-generation);
  ``close`` (the request is read and recorded, then after ``x-test-ttft`` seconds the
  connection closes without a byte of answer); ``error-500``.
* ``x-test-retry-after: VALUE``: sent as the ``Retry-After`` field of a ``refuse-http`` or
  ``refuse-429`` answer, exactly as given (a valid value or not); with ``x-test-hold`` such a
  refusal waits for its release, so that retries can attach to the execution it ends.
* Stalls: ``x-test-ttft`` (before the first token, or before ``close`` hangs up);
  ``x-test-stall-after`` / ``x-test-stall`` (pause that many seconds after that many tokens);
  ``x-test-hold: NAME`` (wait before the first token until ``POST /test/release?name=NAME``);
  ``x-test-done-gap`` (seconds between writing ``data: [DONE]`` and ending the response: a real
  vLLM ends its stream in a separate write after ``[DONE]``; clients often close at ``[DONE]``).

``POST /tokenize``, as vLLM's: the whole body is read and its prompt's tokens counted.

On every route:

* ``x-test-interim: 100,103``: interim (1xx) responses written, in that order, as soon as the
  request head is read, before the final response (uvicorn, which serves vLLM, writes
  ``100 Continue`` itself when the app first reads the body of a request that sent
  ``Expect: 100-continue``; a ``101`` nobody asked for is a broken upstream).
* ``x-test-mode: close`` on any other route: the request is read, then the connection closes
  without an answer; ``x-test-mode: refuse-http`` there is a 503 (with ``x-test-retry-after``'s
  ``Retry-After``, if given).
* ``x-test-keep-alive: S``: from the end of this response on, the connection's keep-alive
  timeout is S seconds (the server hangs up once it is idle that long; uvicorn's default, which
  vLLM keeps, is 5 s; this server's own is 30 s).

Interim responses, hanging up and a per-connection keep-alive cannot be expressed in ASGI: the
server gives the app a small hook for them (``ConnectionHook``, in the scope extension
``CONNECTION_EXTENSION``). ``main`` serves the app with uvicorn on ``HookedProtocol``, uvicorn's
own httptools protocol plus that hook, so everything else is what vLLM's server does.

``POST /test/metrics-delay?seconds=S`` makes it answer ``GET /metrics`` S seconds late (a
saturated vLLM answers its scrapes slowly); ``GET /test/metrics-scrapes`` counts the scrapes
begun. ``GET /test/peer`` answers the port the request came from (its client's end of the
connection), so a test can tell whether a client reused a connection.

It records every generation request (call id, ``x-test-tag``, the ``Expect`` header as received,
the port it came from, when it arrived, its first token, its end, and whether and when the client
closed the connection early; a request whose body never arrived whole is recorded too, as
aborted) and serves the records on ``GET /test/requests`` (``?call_id=``, ``?tag=``,
``?tag_prefix=`` select) so tests can assert what reached the engine and what was aborted.
Each completion's id is ``cmpl-<request_id>`` of its record, so a test can tell whose answer a
client received. It also serves ``/metrics`` (a few ``vllm:`` families with vLLM's counting
rules), ``/v1/models``, ``/health`` and ``/version``.
Prompt text is never stored: only its length.

Run: ``python -m tests.exporter.upstream --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MODES = ("normal", "refuse-http", "refuse-429", "refuse-stream", "crash", "close", "error-500")
MAX_RECORDS = 50_000  # generation requests remembered (the oldest are forgotten)
MAX_HOLDS = 10_000
MAX_INTERIM = 8  # interim responses one request may ask for
# A vLLM's --max-model-len: a request asking for more completion tokens gets a 400.
MAX_MODEL_LEN = 65_536
MODEL = "test-model"
CONNECTION_EXTENSION = "retrywatch.test.connection"
_INTERIM_HEADERS = {103: b"link: </style.css>; rel=preload; as=style\r\n"}


class ConnectionHook:
    """What ASGI cannot express, on the connection of one request: interim responses, hanging
    up without an answer, and the connection's keep-alive timeout."""

    def __init__(self, protocol: HttpToolsProtocol) -> None:
        self._protocol = protocol

    def interim(self, status: int) -> None:
        """Write an interim (1xx) response; the final one follows through ASGI."""
        try:
            phrase = HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b"Informational"
        head = b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, phrase, _INTERIM_HEADERS.get(status, b""))
        self._protocol.transport.write(head)

    def hang_up(self) -> None:
        """Close the connection now, whatever was or was not answered on it."""
        self._protocol.transport.close()

    def keep_alive(self, seconds: float) -> None:
        """Close the connection once it has been idle that long after a response (from the end
        of the current one on)."""
        self._protocol.timeout_keep_alive = seconds  # type: ignore[assignment]  # call_later takes float


class HookedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with a ``ConnectionHook`` in every request's scope."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions: dict[str, Any] = {CONNECTION_EXTENSION: ConnectionHook(self)}
        self.scope["extensions"] = extensions


def _connection(scope: Scope) -> ConnectionHook:
    hook = scope.get("extensions", {}).get(CONNECTION_EXTENSION)
    if not isinstance(hook, ConnectionHook):
        raise RuntimeError("the test upstream needs its own server: python -m tests.exporter.upstream")
    return hook


def _keep_alive(value: bytes | None) -> float | None:
    """The seconds of ``x-test-keep-alive``, if given; ValueError unless in [0, 3600]."""
    if value is None:
        return None
    seconds = float(value)
    if not 0 <= seconds <= 3600:
        raise ValueError("x-test-keep-alive takes seconds in [0, 3600]")
    return seconds


def _peer_port(scope: Scope) -> int | None:
    client = scope.get("client")
    return int(client[1]) if client else None


def _interim_codes(value: bytes) -> list[int]:
    """The codes of ``x-test-interim`` (e.g. ``100,103``); ValueError unless all are 1xx."""
    codes = [int(part) for part in value.split(b",") if part.strip()]
    if len(codes) > MAX_INTERIM or not all(100 <= c <= 199 for c in codes):
        raise ValueError(f"x-test-interim takes up to {MAX_INTERIM} codes in [100, 199]")
    return codes


@dataclass
class Behaviour:
    ttft: float = 0.0
    token_interval: float = 0.0
    mode: str = "normal"
    crash_after: int | None = None
    stall_after: int | None = None  # pause for ``stall_s`` once this many tokens were sent
    stall_s: float = 0.0
    done_gap: float = 0.0  # seconds between ``data: [DONE]`` and the end of the response


@dataclass
class RequestRecord:
    request_id: int
    path: str
    call_id: str | None
    tag: str | None
    expect: str | None  # the Expect header as received (a proxy should not forward it)
    accept_encoding: str | None  # the Accept-Encoding header as received
    stream: bool
    prompt_tokens: int
    max_tokens: int
    mode: str
    received_at: float
    peer_port: int | None = None  # the client's end of the connection the request came on
    first_token_at: float | None = None
    ended_at: float | None = None
    tokens_sent: int = 0
    completed: bool = False
    aborted: bool = False  # the client closed the connection before the end
    aborted_at: float | None = None


@dataclass
class Counters:
    prompt_tokens: int = 0
    prefix_cache_queries: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    waiting: int = 0
    running: int = 0


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):
            return sum(len(p) for p in prompt)
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        return sum(len(str(p).encode()) // 4 for p in prompt)
    if isinstance(prompt, str):
        return len(prompt.encode()) // 4
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", "")).encode()) // 4 for m in messages if isinstance(m, dict))
    return 0


class TestUpstream:
    """The ASGI app. One instance per process."""

    def __init__(self, default: Behaviour | None = None) -> None:
        self.default = default or Behaviour()
        self.records: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
        self.counters = Counters()
        self._ids = itertools.count(1)
        self._holds: dict[str, asyncio.Event] = {}
        self.metrics_delay = 0.0
        self.metrics_scrapes = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        headers = dict(scope["headers"])
        try:
            interim = _interim_codes(headers.get(b"x-test-interim", b""))
            keep_alive = _keep_alive(headers.get(b"x-test-keep-alive"))
        except ValueError as exc:
            await _respond_json(send, 400, {"error": {"message": str(exc), "code": 400}})
            return
        if interim or keep_alive is not None:
            hook = _connection(scope)
            for status in interim:
                hook.interim(status)
            if keep_alive is not None:
                hook.keep_alive(keep_alive)
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(scope, receive, send)
        elif headers.get(b"x-test-mode") == b"close":
            await _read_body(receive)
            _connection(scope).hang_up()
            await receive()  # the server has seen the connection go
        elif headers.get(b"x-test-mode") == b"refuse-http":
            await _read_body(receive)
            error = {"error": {"message": "unavailable", "type": "ServiceUnavailableError", "code": 503}}
            await _respond_json(send, 503, error, _retry_after(headers))
        elif method == "GET" and path == "/metrics":
            self.metrics_scrapes += 1
            if self.metrics_delay > 0:
                await asyncio.sleep(self.metrics_delay)
            await _respond(
                send, 200, metrics_text(self.counters).encode(), b"text/plain; version=0.0.4; charset=utf-8"
            )
        elif method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]}
            await _respond_json(send, 200, models)
        elif method == "GET" and path == "/health":
            await _respond(send, 200, b"", b"text/plain")
        elif method == "GET" and path == "/version":
            await _respond_json(send, 200, {"version": "test-upstream"})
        elif method == "GET" and path == "/test/requests":
            query = parse_qs(scope.get("query_string", b"").decode())
            call_id = query.get("call_id", [None])[0]
            tag = query.get("tag", [None])[0]
            prefix = query.get("tag_prefix", [None])[0]
            rows = [
                asdict(r)
                for r in self.records
                if (call_id is None or r.call_id == call_id)
                and (tag is None or r.tag == tag)
                and (prefix is None or (r.tag or "").startswith(prefix))
            ]
            await _respond_json(send, 200, {"requests": rows})
        elif method == "POST" and path == "/test/config":
            body = json.loads(await _read_body(receive) or b"{}")
            self.default = Behaviour(
                ttft=float(body.get("ttft", 0.0)),
                token_interval=float(body.get("token_interval", 0.0)),
                mode=str(body.get("mode", "normal")),
                crash_after=body.get("crash_after"),
            )
            await _respond_json(send, 200, asdict(self.default))
        elif method == "POST" and path == "/test/metrics-delay":
            query = parse_qs(scope.get("query_string", b"").decode())
            self.metrics_delay = max(0.0, float(query.get("seconds", ["0"])[0]))
            await _respond_json(send, 200, {"metrics_delay": self.metrics_delay})
        elif method == "GET" and path == "/test/metrics-scrapes":
            await _respond_json(send, 200, {"scrapes": self.metrics_scrapes})
        elif method == "POST" and path == "/tokenize":  # vLLM's: reads the whole body, counts its prompt
            try:
                count = _prompt_tokens(json.loads(await _read_body(receive) or b"{}"))
            except (ValueError, AttributeError) as exc:
                await _respond_json(send, 400, {"error": {"message": str(exc), "code": 400}})
                return
            await _respond_json(send, 200, {"count": count, "max_model_len": 1 << 20, "tokens": []})
        elif method == "GET" and path == "/test/peer":
            await _respond_json(send, 200, {"port": _peer_port(scope)})
        elif method == "POST" and path == "/test/release":
            query = parse_qs(scope.get("query_string", b"").decode())
            name = query.get("name", [""])[0]
            self._hold(name).set()
            await _respond_json(send, 200, {"released": name})
        elif method == "POST" and path == "/test/reset":
            self.records.clear()
            await _respond_json(send, 200, {})
        else:
            raw_path = scope.get("raw_path") or b""  # as received, so a test sees what a proxy forwarded
            error = {"message": "not found", "code": 404, "path": raw_path.decode("latin-1")}
            await _respond_json(send, 404, {"error": error})

    def _hold(self, name: str) -> asyncio.Event:
        event = self._holds.get(name)
        if event is None:
            if len(self._holds) >= MAX_HOLDS:
                self._holds.pop(next(iter(self._holds)))
            event = self._holds[name] = asyncio.Event()
        return event

    def _behaviour(self, headers: dict[bytes, bytes]) -> Behaviour:
        b = self.default
        crash = headers.get(b"x-test-crash-after")
        stall_after = headers.get(b"x-test-stall-after")
        return Behaviour(
            ttft=float(headers.get(b"x-test-ttft", b"") or b.ttft),
            token_interval=float(headers.get(b"x-test-token-interval", b"") or b.token_interval),
            mode=(headers.get(b"x-test-mode", b"") or b.mode.encode()).decode(),
            crash_after=int(crash) if crash else b.crash_after,
            stall_after=int(stall_after) if stall_after else b.stall_after,
            stall_s=float(headers.get(b"x-test-stall", b"") or b.stall_s),
            done_gap=float(headers.get(b"x-test-done-gap", b"") or b.done_gap),
        )

    async def _generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.lower(): v for k, v in scope["headers"]}
        behaviour = self._behaviour(headers)
        raw = await _read_whole_body(receive)
        record = RequestRecord(
            request_id=next(self._ids),
            path=scope["path"],
            call_id=_header_text(headers, b"x-call-id"),
            tag=_header_text(headers, b"x-test-tag"),
            expect=_header_text(headers, b"expect"),
            accept_encoding=_header_text(headers, b"accept-encoding"),
            stream=False,
            prompt_tokens=0,
            max_tokens=0,
            mode=behaviour.mode,
            received_at=time.time(),
            peer_port=_peer_port(scope),
        )
        self.records.append(record)
        if raw is None:  # the client left before the whole request was in: it reached us all the same
            record.aborted, record.aborted_at = True, record.received_at
            record.ended_at = record.received_at
            return
        try:
            body = json.loads(raw)
        except ValueError:
            record.ended_at = time.time()
            await _respond_json(send, 400, {"error": {"message": "bad json", "code": 400}})
            return
        chat = scope["path"].endswith("/chat/completions")
        record.stream = stream = bool(body.get("stream", False))
        record.max_tokens = max_tokens = int(body.get("max_tokens") or 16)
        record.prompt_tokens = _prompt_tokens(body)
        if max_tokens > MAX_MODEL_LEN:  # as vLLM refuses a completion longer than its context: a 400
            record.ended_at = time.time()
            message = f"max_tokens must be at most {MAX_MODEL_LEN}, the model's context length"
            error = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
            await _respond_json(send, 400, error)
            return
        hold = headers.get(b"x-test-hold")
        if hold and behaviour.mode in ("refuse-http", "refuse-429"):
            await self._hold(hold.decode()).wait()
        if behaviour.mode == "refuse-http":
            record.ended_at = time.time()
            error = {"error": {"message": "queue full", "type": "ServiceUnavailableError", "code": 503}}
            await _respond_json(send, 503, error, _retry_after(headers))
            return
        if behaviour.mode == "refuse-429":
            record.ended_at = time.time()
            error = {"error": {"message": "rate limited", "type": "RateLimitError", "code": 429}}
            await _respond_json(send, 429, error, _retry_after(headers))
            return
        if behaviour.mode == "error-500":
            record.ended_at = time.time()
            await _respond_json(send, 500, {"error": {"message": "engine error", "code": 500}})
            return
        disconnected = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch())
        self.counters.prefix_cache_queries += record.prompt_tokens
        self.counters.waiting += 1
        state = {"waiting": True, "running": False}
        try:
            if hold:
                released = asyncio.create_task(self._hold(hold.decode()).wait())
                left = asyncio.create_task(disconnected.wait())
                await asyncio.wait({released, left}, return_when=asyncio.FIRST_COMPLETED)
                released.cancel()
                left.cancel()
                if disconnected.is_set():
                    record.aborted, record.aborted_at = True, time.time()
                    return
            await self._run(record, behaviour, chat, stream, send, disconnected, state, _connection(scope))
        finally:
            watcher.cancel()
            if state["waiting"]:
                self.counters.waiting -= 1
            if state["running"]:
                self.counters.running -= 1
            record.ended_at = time.time()

    async def _run(
        self,
        record: RequestRecord,
        behaviour: Behaviour,
        chat: bool,
        stream: bool,
        send: Send,
        disconnected: asyncio.Event,
        state: dict[str, bool],
        connection: ConnectionHook,
    ) -> None:
        created = int(time.time())
        rid = f"cmpl-{record.request_id}"

        async def pause(seconds: float) -> bool:
            """Sleep; True if the client left meanwhile."""
            if disconnected.is_set():
                return True
            if seconds <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(disconnected.wait(), seconds)
            return disconnected.is_set()

        def aborted() -> None:
            record.aborted = True
            record.aborted_at = time.time()

        async def hang_up() -> None:
            connection.hang_up()
            await disconnected.wait()  # the server has seen the connection go

        if await pause(behaviour.ttft):
            aborted()
            return
        if behaviour.mode == "close":
            await hang_up()
            return
        if stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
                }
            )
            if behaviour.mode == "refuse-stream":
                error = {"error": {"message": "queue full", "type": "ServiceUnavailableError", "code": 503}}
                await _send_body(send, f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode(), more=False)
                return
        elif behaviour.mode in ("refuse-stream",):
            error = {"error": {"message": "queue full", "type": "ServiceUnavailableError", "code": 503}}
            await _respond_json(send, 503, error)
            return
        state["waiting"], state["running"] = False, True
        self.counters.waiting -= 1
        self.counters.running += 1
        texts: list[str] = []
        for i in range(record.max_tokens):
            if i > 0 and await pause(behaviour.token_interval):
                aborted()
                return
            if i > 0 and i == behaviour.stall_after and await pause(behaviour.stall_s):
                aborted()
                return
            if disconnected.is_set():
                aborted()
                return
            if behaviour.mode == "crash" and i >= (behaviour.crash_after or record.max_tokens // 2):
                await hang_up()
                return
            if i == 0:
                record.first_token_at = time.time()
                self.counters.prompt_tokens += record.prompt_tokens
            text = f" t{i}"
            texts.append(text)
            record.tokens_sent += 1
            self.counters.generation_tokens += 1
            last = i == record.max_tokens - 1
            if stream:
                await _send_body(send, _sse_chunk(rid, created, chat, text, i, last), more=True)
        record.completed = True
        self.counters.success["length"] += 1
        if stream and behaviour.done_gap > 0:
            await _send_body(send, b"data: [DONE]\n\n", more=True)
            await asyncio.sleep(behaviour.done_gap)
            await _send_body(send, b"", more=False)
        elif stream:
            await _send_body(send, b"data: [DONE]\n\n", more=False)
        else:
            await _respond_json(send, 200, _full_body(rid, created, chat, "".join(texts), record))


def _sse_chunk(rid: str, created: int, chat: bool, text: str, i: int, last: bool) -> bytes:
    finish = "length" if last else None
    if chat:
        delta: dict[str, Any] = {"content": text}
        if i == 0:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = {"id": rid, "object": "text_completion", "created": created, "model": MODEL}
    obj["choices"] = [choice]
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _full_body(rid: str, created: int, chat: bool, text: str, record: RequestRecord) -> dict[str, Any]:
    usage = {
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.tokens_sent,
        "total_tokens": record.prompt_tokens + record.tokens_sent,
    }
    if chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": MODEL,
            "choices": [choice],
            "usage": usage,
        }
    choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": MODEL,
        "choices": [choice],
        "usage": usage,
    }


async def _read_whole_body(receive: Receive) -> bytes | None:
    """The request body, or None if the client left before its end."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header_text(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value else None


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send_body(send: Send, body: bytes, more: bool) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


def _retry_after(headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """The ``Retry-After`` field ``x-test-retry-after`` asks for, if any."""
    value = headers.get(b"x-test-retry-after")
    return [] if value is None else [(b"retry-after", value)]


async def _respond(
    send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await _send_body(send, body, more=False)


async def _respond_json(
    send: Send, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _respond(send, status, json.dumps(obj).encode(), b"application/json", extra)


def metrics_text(counters: Counters) -> str:
    """The ``vllm:`` families this upstream exports, in the Prometheus text format."""
    label = f'model_name="{MODEL}"'
    lines = [
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {counters.waiting}",
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {counters.running}",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{label}}} {counters.prompt_tokens}",
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{{{label}}} {counters.prefix_cache_queries}",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{label}}} {counters.generation_tokens}",
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason, n in counters.success.items():
        lines.append(f'vllm:request_success_total{{finished_reason="{reason}",{label}}} {n}')
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="OpenAI-compatible streaming test upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--token-interval", type=float, default=0.0)
    parser.add_argument("--mode", choices=MODES, default="normal")
    args = parser.parse_args(argv)
    app = TestUpstream(Behaviour(ttft=args.ttft, token_interval=args.token_interval, mode=args.mode))
    uvicorn.run(
        app,
        http=HookedProtocol,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=30,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
