"""The server-sent events of an OpenAI-style stream, and the error objects they carry: the one
parser, used by the proxy (its look at a stream's first event) and by the harness's attempts
(``reproduce.harness.attempt``).

An event's payload is its ``data:`` line's text: a JSON object, or ``[DONE]`` at the end of a
stream. vLLM reports an error inside a stream as ``data: {"error": {..., "code": 503}}`` (its
queue-cap refusal of a streaming request), and in a JSON body either so or as a top-level
``{"object": "error", ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["DONE", "DONE_ENDINGS", "DONE_EVENT", "error_code", "error_of", "event_json", "event_payload"]

DONE = "[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"  # the end of an OpenAI-style stream, as sent
#: The last bytes of a stream that has ended, as any SSE writer may send its ``[DONE]`` event: the
#: space after ``data:`` is optional, and a line ends with LF, CRLF or CR.
DONE_ENDINGS = tuple(
    b"data:" + space + b"[DONE]" + eol + eol for space in (b" ", b"") for eol in (b"\n", b"\r\n", b"\r")
)


def event_payload(event: bytes | str) -> str | None:
    """The text after ``data:`` of an event (or of one line of it); None if it has no data."""
    text = event.decode("utf-8", "replace") if isinstance(event, bytes) else event
    text = text.strip()
    if not text.startswith("data:"):
        return None
    return text[5:].strip()


def event_json(payload: str | bytes) -> Any:
    """The JSON value of a payload; ``ValueError`` if it is not JSON."""
    return json.loads(payload)


def error_of(obj: Any) -> Mapping[str, Any] | None:
    """The error object of an event's or a body's JSON (``{"error": {...}}``, or vLLM's
    ``{"object": "error", ...}``); None if it is not an error."""
    if not isinstance(obj, Mapping):
        return None
    error = obj.get("error")
    if isinstance(error, Mapping):
        return error
    if obj.get("object") == "error":
        return obj
    return None


def error_code(error: Mapping[str, Any]) -> int | None:
    """The HTTP-like status an error object carries in ``code`` (an int or digits); None if
    it carries none."""
    code = error.get("code")
    if isinstance(code, bool):
        return None
    if isinstance(code, int):
        return code
    if isinstance(code, str) and code.isdigit():
        return int(code)
    return None
