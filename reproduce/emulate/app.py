"""The emulated engine's HTTP server: a small ASGI app with vLLM's OpenAI API.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming SSE with one
chunk per generated token, or one JSON body), ``GET /v1/models``, ``GET /health``,
``GET /metrics``. Like vLLM, a client disconnect (noticed from ASGI's ``http.disconnect``
even while nothing is being sent) aborts the request in the engine, and the engine's queue cap
refuses in both of vLLM's forms: HTTP 503 for a non-streaming request, HTTP 200 carrying
``data: {"error": {..., "code": 503}}`` then ``data: [DONE]`` for a streaming one.

Bounds: request body size (413 beyond it) and live requests (:class:`~.driver.TooManyLive`,
answered as a 503). Prompt text is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from reproduce.emulate.driver import EngineDriver, EngineRefused, Execution, TooManyLive
from reproduce.emulate.exposition import CONTENT_TYPE_LATEST, render
from reproduce.emulate.openai_api import (
    ApiError,
    Endpoint,
    GenerationRequest,
    TokenChunks,
    chunk,
    error_body,
    final_body,
    models_body,
    parse_request,
    response_id,
    usage_chunk,
)

__all__ = ["EmulatorApp", "EmulatorSettings"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_GENERATION_ROUTES: dict[str, Endpoint] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    """What the HTTP layer needs to know about the served model and its bounds."""

    served_model: str
    vocab_size: int
    max_model_len: int
    max_body_bytes: int = 4 * 1024 * 1024
    engine_label: str = "0"


class _BodyTooLarge(Exception):
    pass


class _Disconnect:
    """Watches ``receive`` for ``http.disconnect`` and wakes the request's consumer."""

    def __init__(self, receive: Receive) -> None:
        self.happened = False
        self.execution: Execution | None = None
        self._task = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.happened = True
                if self.execution is not None:
                    self.execution.changed.set()
                return

    def close(self) -> None:
        self._task.cancel()


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_bytes(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send_bytes(send, status, _dumps(payload), b"application/json")


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _sse(payload: Any) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _report_stop(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engine loop stopped", exc_info=task.exception())


class EmulatorApp:
    """ASGI app serving ``driver``'s engine; starts the stepping task on lifespan startup."""

    def __init__(self, driver: EngineDriver, settings: EmulatorSettings) -> None:
        self.driver = driver
        self.settings = settings
        self._stepper: asyncio.Task[None] | None = None
        self._labels = {"engine": settings.engine_label, "model_name": settings.served_model}

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._stepper is None:
            self._stepper = asyncio.create_task(self.driver.run(), name="emulated-engine-stepper")
            self._stepper.add_done_callback(_report_stop)

    async def stop(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
            self._stepper = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self.start()
        if self._stepper is not None and self._stepper.done():
            await _send_json(
                send, 500, error_body(HTTPStatus.INTERNAL_SERVER_ERROR, "the engine loop has stopped")
            )
            return
        path, method = scope["path"], scope["method"]
        if path in _GENERATION_ROUTES:
            if method != "POST":
                await _send_json(send, 405, {"detail": "Method Not Allowed"})
                return
            await self._generate(_GENERATION_ROUTES[path], receive, send)
        elif path in ("/health", "/v1/models", "/metrics"):
            if method not in ("GET", "HEAD"):
                await _send_json(send, 405, {"detail": "Method Not Allowed"})
            elif path == "/health":
                await _send_bytes(send, 200, b"", b"application/json")
            elif path == "/v1/models":
                await _send_json(
                    send, 200, models_body(self.settings.served_model, self.settings.max_model_len)
                )
            else:
                body = render(lambda: self.driver.engine.metrics_samples(self._labels))
                await _send_bytes(send, 200, body, CONTENT_TYPE_LATEST.encode())
        else:
            await _send_json(send, 404, {"detail": "Not Found"})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- generation ----------------------------------------------------------------------------
    async def _generate(self, endpoint: Endpoint, receive: Receive, send: Send) -> None:
        try:
            raw = await _read_body(receive, self.settings.max_body_bytes)
        except _BodyTooLarge:
            message = f"the request body exceeds {self.settings.max_body_bytes} bytes"
            await _send_json(send, 413, error_body(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message))
            return
        except ConnectionResetError:
            return
        try:
            request = parse_request(
                endpoint,
                raw,
                served_model=self.settings.served_model,
                vocab_size=self.settings.vocab_size,
                max_model_len=self.settings.max_model_len,
            )
        except ApiError as exc:
            await _send_json(send, int(exc.status), exc.body())
            return
        del raw  # a long stream must not pin the request body (the prompt) in memory
        disconnect = _Disconnect(receive)
        try:
            if request.stream:
                await self._stream(request, disconnect, send)
            else:
                await self._complete(request, disconnect, send)
        finally:
            disconnect.close()

    def _submit(self, request: GenerationRequest) -> Execution:
        return self.driver.submit(request.segments, request.prompt_tokens, request.max_tokens)

    async def _wait(self, execution: Execution, disconnect: _Disconnect) -> bool:
        """Wait for progress; False (after aborting the execution) if the client has left."""
        if not disconnect.happened:
            await execution.changed.wait()
            execution.changed.clear()
        if disconnect.happened:
            self.driver.abort(execution)
            return False
        return True

    async def _complete(self, request: GenerationRequest, disconnect: _Disconnect, send: Send) -> None:
        try:
            execution = self._submit(request)
        except (EngineRefused, TooManyLive) as exc:
            message = _QUEUE_FULL if isinstance(exc, EngineRefused) else str(exc)
            await _send_json(send, 503, error_body(HTTPStatus.SERVICE_UNAVAILABLE, message))
            return
        except ValueError as exc:  # the engine model cannot take it (e.g. more KV blocks than it has)
            await _send_json(send, 400, error_body(HTTPStatus.BAD_REQUEST, str(exc)))
            return
        disconnect.execution = execution
        while not execution.done:
            if not await self._wait(execution, disconnect):
                return
        if execution.aborted:
            await _send_json(
                send, 500, error_body(HTTPStatus.INTERNAL_SERVER_ERROR, "the request was aborted")
            )
            return
        body = final_body(request, response_id(request), int(time.time()), execution.tokens)
        await _send_json(send, 200, body)

    async def _stream(self, request: GenerationRequest, disconnect: _Disconnect, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            execution = self._submit(request)
        except (EngineRefused, TooManyLive) as exc:
            message = _QUEUE_FULL if isinstance(exc, EngineRefused) else str(exc)
            body = _sse(error_body(HTTPStatus.SERVICE_UNAVAILABLE, message)) + _DONE
            await send({"type": "http.response.body", "body": body})
            return
        except ValueError as exc:
            body = _sse(error_body(HTTPStatus.BAD_REQUEST, str(exc))) + _DONE
            await send({"type": "http.response.body", "body": body})
            return
        disconnect.execution = execution
        rid, created = response_id(request), int(time.time())
        tokens = TokenChunks(request, rid, created)
        sent = 0
        while True:
            if not await self._wait(execution, disconnect):
                return
            parts: list[bytes] = []
            if sent == 0 and execution.tokens > 0 and request.endpoint == "chat":
                parts.append(_sse(chunk(request, rid, created, None, None)))
            last = execution.max_tokens - 1
            for index in range(sent, execution.tokens):
                reason = "length" if index == last and execution.finished else None
                parts.append(tokens.token(index, reason))
            sent = execution.tokens
            if execution.aborted:
                parts.append(_sse(error_body(HTTPStatus.INTERNAL_SERVER_ERROR, "the request was aborted")))
            if execution.done:
                if execution.finished and request.include_usage:
                    parts.append(_sse(usage_chunk(request, rid, created, sent)))
                parts.append(_DONE)
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": not execution.done}
                )
            if execution.done:
                return
