"""Call keys: how the proxy recognises every attempt of one call, and what the client says of it.

A call key is a hash of the caller's credentials, the call identifier (a header such as
``X-Call-Id`` or ``Idempotency-Key``), the route and the full generation parameters (the
canonical request body): a retry with identical parameters finds its call's live execution, a
request that reuses the id with other parameters does not, and no caller ever finds another
caller's execution. Without a call id the key is either the hash of the credentials and the body
(``body``: it says only that two attempts look alike; the policy attaches such an attempt only
when it is evidently a retry) or absent (``none``: never coalesce). Keys are hashes: prompt text
and credentials never leave this module.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson

DEFAULT_CALL_ID_HEADER = "x-call-id"
IDEMPOTENCY_KEY_HEADER = "idempotency-key"
# The official OpenAI SDKs send this on their own automatic retries (0 on the first attempt).
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"
#: The read timeout (seconds) the same SDKs declare on every attempt.
SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
# Where a caller's credentials travel: Authorization and the API-key headers (Azure OpenAI's
# ``api-key``, ``x-api-key``). Every one present scopes the caller's keys: the OpenAI SDK always
# sends Authorization, often with a placeholder key, beside the API-key header a gateway checks.
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")

# A call id is an opaque client token; anything longer is refused rather than hashed.
MAX_CALL_ID_LENGTH = 256


class KeyWithoutId(StrEnum):
    """What to key an attempt on when it carries no call id."""

    BODY = "body"
    NONE = "none"


class CallIdError(ValueError):
    """The call-id header is unusable (too long or not printable ASCII)."""


def _digest(data: bytes) -> str:
    """A 128-bit BLAKE2b digest in hex: keys and credentials are hashed, never kept.

    NOTE: BLAKE2b, not SHA-256: as strong for this, and on every attempt's path it takes about
    two thirds of SHA-256's time when the process has just woken (9.6 against 13.9 us on the
    benchmark machine, 2 ms after a sleep)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# A float of 1e16 or more in the canonical form (orjson writes them ``1.8446744073709552e+19``):
# it may be an integer beyond 64 bits that orjson read as the nearest float.
_BIG_FLOAT = re.compile(rb"e\+[0-9]")


def canonical_body(body: Mapping[str, Any]) -> bytes:
    """The request body in one canonical byte form: sorted keys, no insignificant whitespace.

    orjson does it about ten times faster than json on big prompts (it is on every attempt's
    path); json covers what orjson refuses (integers beyond 64 bits).
    """
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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


def sdk_says_retry(headers: Mapping[str, str]) -> bool | None:
    """The client's own word from the SDK retry counter: True when it counts this attempt as a
    retry (> 0), False when it counts it a first attempt (0), None when it says nothing usable."""
    value = headers.get(SDK_RETRY_COUNT_HEADER)
    if value is None:
        return None
    try:
        count = int(value.strip())
    except ValueError:
        return None
    return count > 0 if count >= 0 else None


def sdk_read_timeout(headers: Mapping[str, str]) -> float | None:
    """The read timeout the client's SDK declares for this attempt (seconds, as sent: the
    deadline learner bounds it), or None when it declares no number (absent, not one, or longer
    than 32 characters)."""
    value = headers.get(SDK_READ_TIMEOUT_HEADER)
    if value is None or len(value) > 32:
        return None
    try:
        return float(value.strip())
    except ValueError:
        return None


def caller_scope(headers: Mapping[str, str]) -> str | None:
    """A hash of the caller's credentials (every one of ``CREDENTIAL_HEADERS`` present), or None
    for a caller without any. Keys are scoped by it, so callers never share an execution; the
    credentials themselves go nowhere but into this hash.

    ``headers`` must be case-insensitive or lower-cased (Starlette's are).
    """
    parts = [
        b"%b\0%d\0%b" % (name.encode(), len(value), value.encode("utf-8", "surrogatepass"))
        for name in CREDENTIAL_HEADERS
        if (value := headers.get(name))
    ]
    return _digest(b"\0".join(parts)) if parts else None


def call_key(
    call_id: str | None,
    route: str,
    body: Mapping[str, Any],
    without_id: KeyWithoutId = KeyWithoutId.BODY,
    caller: str | None = None,
    raw: bytes | None = None,
) -> str | None:
    """The key under which attempts of one call coalesce; None means "never coalesce".

    ``caller`` is ``caller_scope`` of the attempt's headers (None: a caller without credentials).
    ``raw`` is the request body as it came, of which ``body`` was parsed (``parse_body``).

    NOTE: orjson reads an integer beyond 64 bits as the nearest float, while the engine (Python's
    json) reads it exactly: two bodies that differ only in such integers parse alike. When the
    canonical form may hold one (a float of 1e16 or more), the key takes the body's bytes as they
    came (a retry resends them); the check is a ``memchr`` for ``+`` on every other body.
    """
    if call_id is None and without_id is KeyWithoutId.NONE:
        return None
    canonical = canonical_body(body)
    parts = [
        b"caller:%b\0" % (caller or "").encode(),
        b"id:%b\0" % call_id.encode() if call_id is not None else b"body:\0",
        route.encode(),
        b"\0",
        canonical,
    ]
    if raw is not None and b"+" in canonical and _BIG_FLOAT.search(canonical):
        parts += (b"\0raw:", raw)
    return _digest(b"".join(parts))
