"""Call keys: how the proxy recognises every attempt of one call.

A call key is a hash of the call identifier (a header such as ``X-Call-Id`` or
``Idempotency-Key``) together with the route and the full generation parameters (the canonical
request body), so a retry with identical parameters finds its call's live execution while a
request that reuses the id with other parameters does not. Without a call id the key is either
the hash of the body alone (``body``) or absent (``none``: never coalesce). Keys are hashes:
prompt text never leaves this module.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson

DEFAULT_CALL_ID_HEADER = "x-call-id"
IDEMPOTENCY_KEY_HEADER = "idempotency-key"
# The official OpenAI SDKs send this on their own automatic retries (0 on the first attempt).
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"

# A call id is an opaque client token; anything longer is refused rather than hashed.
MAX_CALL_ID_LENGTH = 256


class KeyWithoutId(StrEnum):
    """What to key an attempt on when it carries no call id."""

    BODY = "body"
    NONE = "none"


class CallIdError(ValueError):
    """The call-id header is unusable (too long or not printable ASCII)."""


def canonical_body(body: Mapping[str, Any]) -> bytes:
    """The request body in one canonical byte form: sorted keys, no insignificant whitespace.

    orjson does it about ten times faster than json on big prompts (it is on every attempt's
    path); json covers what orjson refuses (integers beyond 64 bits).
    """
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def body_digest(body: Mapping[str, Any]) -> str:
    """A short hash of the full generation parameters."""
    return hashlib.sha256(canonical_body(body)).hexdigest()[:32]


def find_call_id(headers: Mapping[str, str], call_id_header: str = DEFAULT_CALL_ID_HEADER) -> str | None:
    """The call id from the configured header, else from ``Idempotency-Key``; None if neither.

    ``headers`` must be case-insensitive or lower-cased (Starlette's are).
    """
    for name in (call_id_header.lower(), IDEMPOTENCY_KEY_HEADER):
        value = headers.get(name)
        if value is None:
            continue
        value = value.strip()
        if not value:
            continue
        if len(value) > MAX_CALL_ID_LENGTH or not value.isascii() or not value.isprintable():
            raise CallIdError(
                f"header {name!r} must be printable ASCII of at most {MAX_CALL_ID_LENGTH} characters"
            )
        return value
    return None


def retry_hint(headers: Mapping[str, str]) -> bool:
    """True when the client says this attempt is a retry (the OpenAI SDK's retry counter > 0)."""
    value = headers.get(SDK_RETRY_COUNT_HEADER)
    if value is None:
        return False
    try:
        return int(value.strip()) > 0
    except ValueError:
        return False


def call_key(
    call_id: str | None,
    route: str,
    body: Mapping[str, Any],
    without_id: KeyWithoutId = KeyWithoutId.BODY,
) -> str | None:
    """The key under which attempts of one call coalesce; None means "never coalesce"."""
    if call_id is None and without_id is KeyWithoutId.NONE:
        return None
    h = hashlib.sha256()
    h.update(b"id:" if call_id is not None else b"body:")
    if call_id is not None:
        h.update(call_id.encode())
    h.update(b"\0")
    h.update(route.encode())
    h.update(b"\0")
    h.update(canonical_body(body))
    return h.hexdigest()[:32]
