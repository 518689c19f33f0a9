"""vLLM's OpenAI-compatible request and response shapes, as plain dicts (no I/O).

Parsing turns a ``/v1/completions`` or ``/v1/chat/completions`` body into a
:class:`GenerationRequest` (token IDs, ``max_tokens``, ``stream``) or raises
:class:`ApiError` with vLLM's status and error type; the builders produce the bodies and SSE
chunks vLLM 0.3x sends. Generated text is made of pseudo-words (the emulated engine has no
weights); it is deterministic for a prompt, so a retry receives the same output.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from reproduce.emulate.prompts import (
    PromptError,
    chat_token_ids,
    segments_of,
    text_token_ids,
    validate_token_ids,
)

__all__ = [
    "ApiError",
    "Endpoint",
    "GenerationRequest",
    "TokenChunks",
    "chunk",
    "error_body",
    "final_body",
    "models_body",
    "parse_request",
    "token_text",
    "usage_chunk",
]

Endpoint = Literal["completions", "chat"]

#: vLLM's default ``max_tokens`` for the legacy completions API (chat defaults to the context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_WORDS = (
    " the",
    " engine",
    " step",
    " token",
    " queue",
    " retry",
    " call",
    " cache",
    " block",
    " batch",
    " prefill",
    " decode",
    " attempt",
    " answer",
    " model",
    " stream",
)


_WORD_JSON = {word: json.dumps(word).encode() for word in _WORDS}


class ApiError(Exception):
    """An error answered with vLLM's body ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: HTTPStatus, message: str, err_type: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or _default_type(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def _default_type(status: HTTPStatus) -> str:
    if status == HTTPStatus.BAD_REQUEST:
        return "BadRequestError"
    if status == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    # GracefulHTTPError in vLLM: the status phrase ("Service Unavailable", ...).
    return status.phrase


def error_body(
    status: HTTPStatus, message: str, err_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type or _default_type(status),
            "param": param,
            "code": int(status),
        }
    }


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the engine needs from a request body (the prompt only as token IDs)."""

    endpoint: Endpoint
    model: str
    prompt_tokens: int
    segments: tuple[tuple[int, int], ...]  # the prompt as the engine sees it (token IDs are dropped)
    max_tokens: int
    stream: bool
    include_usage: bool
    text_seed: int


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param)


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer", name)
    return value


def parse_request(
    endpoint: Endpoint, raw: bytes, *, served_model: str, vocab_size: int, max_model_len: int
) -> GenerationRequest:
    """Validate a request body as vLLM does; raise :class:`ApiError` on anything wrong."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model", served_model)
    if model is not None and model != served_model:
        raise ApiError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model")
    n = _int_field(body, "n", 1)
    if n != 1:
        raise _bad("the emulated engine serves n=1 only", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    if "ignore_eos" in body and not isinstance(body["ignore_eos"], bool):
        raise _bad("ignore_eos must be a boolean", "ignore_eos")
    try:
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise PromptError("prompt must not be empty")
                token_ids = text_token_ids(prompt, vocab_size)
            elif isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
                raise PromptError("the emulated engine serves one prompt per request")
            else:
                token_ids = validate_token_ids(prompt, vocab_size)
            default_max: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
        else:
            token_ids = chat_token_ids(body.get("messages"), vocab_size)
            default_max = None
    except PromptError as exc:
        raise _bad(str(exc), "prompt" if endpoint == "completions" else "messages") from None
    max_tokens = _int_field(body, "max_completion_tokens", None) if endpoint == "chat" else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", default_max)
    room = max_model_len - len(token_ids)
    if room <= 0:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{len(token_ids)} input tokens. Please reduce the length of the input messages.",
            "input_tokens",
        )
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise _bad("max_tokens must be at least 1", "max_tokens")
    if max_tokens > room:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{max_tokens} output tokens and your prompt contains {len(token_ids)} input tokens, for a "
            f"total of {max_tokens + len(token_ids)} tokens. Please reduce the length of the input "
            "prompt or the number of requested output tokens.",
            "max_tokens",
        )
    segments = segments_of(token_ids)
    return GenerationRequest(
        endpoint=endpoint,
        model=served_model,
        prompt_tokens=len(token_ids),
        segments=segments,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        # The last segment id chains the whole prompt: identical prompts, identical output text.
        text_seed=segments[-1][0] & 0xFFFF_FFFF,
    )


def token_text(request: GenerationRequest, index: int) -> str:
    """The text of generated token ``index`` (deterministic for the prompt)."""
    return _WORDS[(request.text_seed + index * 7) % len(_WORDS)]


def response_id(request: GenerationRequest) -> str:
    prefix = "cmpl" if request.endpoint == "completions" else "chatcmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def chunk(
    request: GenerationRequest, rid: str, created: int, text: str | None, finish_reason: str | None
) -> dict[str, Any]:
    """One SSE chunk: a token's text (or, for chat, the role when ``text`` is None)."""
    if request.endpoint == "completions":
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ],
        }
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None else {"content": text}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
    }


class TokenChunks:
    """Pre-encoded SSE events of one streaming response: a token costs a concatenation.

    Equivalent to ``b"data: " + json(chunk(request, rid, created, text, None)) + b"\n\n"``;
    only the finishing chunk goes through :func:`chunk`.
    """

    def __init__(self, request: GenerationRequest, rid: str, created: int) -> None:
        self.request, self.rid, self.created = request, rid, created
        marker = "\x00TOKEN\x00"
        template = json.dumps(chunk(request, rid, created, marker, None), separators=(",", ":"))
        head, tail = template.split(json.dumps(marker))
        self._head = b"data: " + head.encode()
        self._tail = tail.encode() + b"\n\n"

    def token(self, index: int, finish_reason: str | None = None) -> bytes:
        text = token_text(self.request, index)
        if finish_reason is not None:
            payload = chunk(self.request, self.rid, self.created, text, finish_reason)
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
        return self._head + _WORD_JSON[text] + self._tail


def usage_chunk(request: GenerationRequest, rid: str, created: int, completion_tokens: int) -> dict[str, Any]:
    """The final ``stream_options.include_usage`` chunk (empty choices, usage filled)."""
    return {
        "id": rid,
        "object": "text_completion" if request.endpoint == "completions" else "chat.completion.chunk",
        "created": created,
        "model": request.model,
        "choices": [],
        "usage": _usage(request.prompt_tokens, completion_tokens),
    }


def final_body(request: GenerationRequest, rid: str, created: int, completion_tokens: int) -> dict[str, Any]:
    """The non-streaming response once generation has finished (``finish_reason`` "length")."""
    text = "".join(token_text(request, i) for i in range(completion_tokens))
    usage = _usage(request.prompt_tokens, completion_tokens)
    if request.endpoint == "completions":
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": request.model,
            "choices": [choice],
            "usage": usage,
        }
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "reasoning": None},
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": [choice],
        "usage": usage,
    }


def models_body(served_model: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models``: the one served model, as vLLM lists it."""
    t = int(time.time()) if created is None else created
    card = {
        "id": served_model,
        "object": "model",
        "created": t,
        "owned_by": "vllm",
        "root": served_model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
    return {"object": "list", "data": [card]}
