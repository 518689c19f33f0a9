"""Request checks: what the proxy refuses before the policy or the engine sees it.

A generation request that fails a check gets a 400 (or 413 for a body over the limit) and never
reaches the policy or the engine. With ``--vocab-size N``, token-ID prompts holding an ID outside
``[0, N)`` are refused here: a vLLM started with ``--skip-tokenizer-init`` dies on them. A body
nested deeper than ``MAX_JSON_DEPTH`` is refused when it is parsed, so nothing downstream (the
call key's canonical form among them) ever walks one. A path to pass through to the upstream
is checked too (``check_forwarded_path``).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from foundation.errors import error_body, error_type

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATION_ROUTES = (COMPLETIONS, CHAT_COMPLETIONS)

# Arrays and objects nested in a request body, the body itself included. Real requests (JSON
# schemas of tools and structured outputs among them) stay far below it; orjson refuses to
# serialise past 254 and Python's json recurses into its limit near 1,000.
MAX_JSON_DEPTH = 128


class RequestError(Exception):
    """A request the proxy refuses, with its HTTP status and OpenAI-style error fields."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(
            self.message, error_type(self.status, "invalid_request_error"), self.code, self.param
        )


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> RequestError:
    return RequestError(400, message, code, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# Optional fields with the JSON types they must have when present.
_COMMON_TYPES: dict[str, tuple[str, Any]] = {
    "stream": ("a boolean", lambda v: isinstance(v, bool)),
    "max_tokens": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "max_completion_tokens": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "n": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "temperature": ("a number", _is_number),
    "top_p": ("a number", _is_number),
    "seed": ("an integer", _is_int),
    "ignore_eos": ("a boolean", lambda v: isinstance(v, bool)),
    "stop": (
        "a string or a list of strings",
        lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
    ),
    "stream_options": ("an object", lambda v: isinstance(v, dict)),
}


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    if not raw:
        # NOTE: often a body sent without Content-Length (or chunked), which HTTP/1.1 reads as
        # no body at all; the server then refuses the body's bytes as the next request.
        raise _bad("request body is empty: send a JSON object, with its Content-Length", code="invalid_json")
    try:
        body = orjson.loads(raw)  # several times faster than json on big prompts
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", code="invalid_json")
    # Nesting needs at least as many brackets as levels: counting them (in C) spares almost every
    # request the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _too_deep(body, MAX_JSON_DEPTH):
        raise _bad(f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep")
    return body


def _too_deep(body: dict[str, Any], limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels (iterative: no recursion)."""
    level: list[Any] = [body]
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))  # in C: a list of token IDs costs no Python loop
            if list in kinds or dict in kinds:
                below.extend(v for v in items if type(v) is list or type(v) is dict)
        level = below
        depth += 1
    return False


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_forwarded_path(path: str) -> None:
    """A path passed through to the upstream begins with ``/`` (not the asterisk form of
    ``OPTIONS *``, which names no resource: appended to the upstream's URL it made no URL at all,
    and the proxy failed with a 500), holds no control character (the upstream client cannot send
    one) and no ``.`` or ``..`` segment (resolved on the way, it would reach another route than the
    one allowed); else a 400."""
    if not path.startswith("/"):
        raise RequestError(400, "the request path must begin with '/'", "invalid_path")
    if _CONTROL.search(path):
        raise RequestError(400, "the request path holds a control character", "invalid_path")
    if "/." in path and any(s in (".", "..") for s in path.split("/")):
        raise RequestError(400, "the request path holds a '.' or '..' segment", "invalid_path")


def validate(route: str, body: dict[str, Any], vocab_size: int | None = None) -> int:
    """Check a generation request; return its prompt length in tokens (estimated for text).

    Token-ID prompts count their IDs; text prompts and chat messages are estimated at one token
    per four bytes (only the length is used, never the text).
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a non-empty string", "model")
    for name, (what, ok) in _COMMON_TYPES.items():
        if name in body and body[name] is not None and not ok(body[name]):
            raise _bad(f"'{name}' must be {what}", name)
    if route == CHAT_COMPLETIONS:
        return _validate_messages(body.get("messages"))
    return _validate_prompt(body.get("prompt", _MISSING), vocab_size)


_MISSING = object()


def _validate_prompt(prompt: Any, vocab_size: int | None) -> int:
    if prompt is _MISSING or prompt is None:
        raise _bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return len(prompt.encode()) // 4
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("'prompt' must not be empty", "prompt")
        if _all_ints(prompt):
            _check_ids(prompt, vocab_size)
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p.encode()) // 4 for p in prompt)
        if all(isinstance(p, list) and p and _all_ints(p) for p in prompt):
            for p in prompt:
                _check_ids(p, vocab_size)
            return sum(len(p) for p in prompt)
    raise _bad(
        "'prompt' must be a string, a list of strings, a list of token IDs or a list of lists of token IDs",
        "prompt",
    )


def _all_ints(items: list[Any]) -> bool:
    # type(), not isinstance: JSON true is no token. One pass in C, not a generator.
    return set(map(type, items)) == _INT_ONLY


_INT_ONLY = {int}


def _check_ids(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise _bad(
            f"token ID {bad} is outside the vocabulary [0, {vocab_size})", "prompt", "token_id_out_of_range"
        )


def _validate_messages(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' is required and must be a non-empty list", "messages")
    n = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            n += len(content.encode()) // 4
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    raise _bad(f"messages[{i}].content parts must be objects", "messages")
                text = part.get("text")
                if isinstance(text, str):
                    n += len(text.encode()) // 4
        elif content is not None:
            raise _bad(f"messages[{i}].content must be a string, a list of parts or null", "messages")
    return n
