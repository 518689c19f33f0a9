"""OpenAI-style error bodies: what every retrywatch server answers an error with, and the error
type each HTTP status maps to."""

from __future__ import annotations

import json

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable_error",
}


def error_body(message: str, type_: str, code: str | int, param: str | None = None) -> bytes:
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def error_type(status: int, default: str = "api_error") -> str:
    """The error ``type`` of an answer with this status (``default`` for one not listed)."""
    return _ERROR_TYPES.get(status, default)
