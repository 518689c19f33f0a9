"""Call keys: same caller, call and parameters coalesce; anything else does not; ids are validated;
the client's own word on retries is read as a tri-state."""

from __future__ import annotations

import pytest

from exporter.callkey import (
    CallIdError,
    KeyWithoutId,
    call_key,
    caller_scope,
    find_call_id,
    sdk_says_retry,
)
from exporter.validation import parse_body

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": True}


def test_same_id_and_body_give_the_same_key_whatever_the_key_order() -> None:
    reordered = {"stream": True, "max_tokens": 16, "prompt": [1, 2, 3], "model": "m"}
    assert call_key("c1", "/v1/completions", BODY) == call_key("c1", "/v1/completions", reordered)


@pytest.mark.parametrize(
    ("call_id", "route", "body"),
    [
        ("c2", "/v1/completions", BODY),
        ("c1", "/v1/chat/completions", BODY),
        ("c1", "/v1/completions", {**BODY, "max_tokens": 17}),
        ("c1", "/v1/completions", {**BODY, "stream": False}),
    ],
)
def test_any_difference_gives_another_key(call_id: str, route: str, body: dict[str, object]) -> None:
    assert call_key(call_id, route, body) != call_key("c1", "/v1/completions", BODY)


def test_without_id_body_or_never() -> None:
    assert call_key(None, "/v1/completions", BODY, KeyWithoutId.BODY) is not None
    assert call_key(None, "/v1/completions", BODY, KeyWithoutId.NONE) is None
    # A body-keyed call never collides with an id-keyed one.
    assert call_key(None, "/v1/completions", BODY) != call_key("", "/v1/completions", BODY)


def test_key_is_a_hash_that_never_contains_the_prompt() -> None:
    key = call_key("c1", "/v1/completions", {"model": "m", "prompt": "secret words"})
    assert key is not None and len(key) == 32 and "secret" not in key


def test_find_call_id_prefers_the_configured_header_then_idempotency_key() -> None:
    assert find_call_id({"x-call-id": "a", "idempotency-key": "b"}) == "a"
    assert find_call_id({"idempotency-key": "b"}) == "b"
    assert find_call_id({"x-request-key": "z"}, "X-Request-Key") == "z"
    assert find_call_id({}) is None
    assert find_call_id({"x-call-id": "  "}) is None


@pytest.mark.parametrize("bad", ["x" * 257, "caf\u00e9", "a\nb"])
def test_unusable_call_id_is_refused(bad: str) -> None:
    with pytest.raises(CallIdError):
        find_call_id({"x-call-id": bad})


@pytest.mark.parametrize(
    ("value", "expected"), [("0", False), (" 0 ", False), ("1", True), ("3", True), ("x", None), ("-1", None)]
)
def test_sdk_retry_count_header_is_the_clients_word(value: str, expected: bool | None) -> None:
    assert sdk_says_retry({"x-stainless-retry-count": value}) is expected
    assert sdk_says_retry({}) is None


ALICE = {"authorization": "Bearer sk-alice-secret"}
BOB = {"authorization": "Bearer sk-bob-secret"}


@pytest.mark.parametrize("call_id", ["c1", None])
def test_keys_are_scoped_by_the_callers_credentials(call_id: str | None) -> None:
    def key(headers: dict[str, str]) -> str | None:
        return call_key(call_id, "/v1/completions", BODY, KeyWithoutId.BODY, caller_scope(headers))

    assert key(ALICE) == key(dict(ALICE))
    assert len({key(ALICE), key(BOB), key({})}) == 3


def test_the_api_key_headers_scope_a_caller_without_authorization() -> None:
    assert caller_scope({}) is None
    assert caller_scope({"api-key": "k1"}) is not None
    assert caller_scope({"api-key": "k1"}) != caller_scope({"api-key": "k2"})
    assert caller_scope({"x-api-key": "k1"}) not in (None, caller_scope({"x-api-key": "k2"}))
    # Beside Authorization, an API-key header still tells callers apart.
    assert caller_scope({**ALICE, "api-key": "k1"}) not in (
        caller_scope(ALICE),
        caller_scope({"api-key": "k1"}),
    )


@pytest.mark.parametrize("name", ["api-key", "x-api-key"])
def test_callers_that_differ_in_any_credential_header_never_share_a_scope(name: str) -> None:
    # The OpenAI SDK always sends Authorization, often with a placeholder key ("EMPTY"), while a
    # gateway in front authenticates by an API-key header.
    placeholder = {"authorization": "Bearer EMPTY"}
    scopes = {caller_scope({**placeholder, name: "k1"}), caller_scope({**placeholder, name: "k2"})}
    assert len(scopes | {caller_scope(placeholder)}) == 3
    # Each header's name counts: the same value in another header is another caller.
    assert caller_scope({"api-key": "k1"}) != caller_scope({"x-api-key": "k1"})


def test_credentials_appear_nowhere_but_inside_the_hash() -> None:
    scope = caller_scope(ALICE)
    assert scope is not None and len(scope) == 32 and "alice" not in scope and "sk-" not in scope
    key = call_key("c1", "/v1/completions", BODY, caller=scope)
    assert key is not None and "alice" not in key


def _key(raw: bytes) -> str | None:
    return call_key("c1", "/v1/completions", parse_body(raw), raw=raw)


def test_integers_beyond_64_bits_that_parse_alike_give_other_keys() -> None:
    # The parser (orjson) reads an integer beyond 64 bits as the nearest float: these bodies read
    # alike, while the engine (Python's json) reads each exactly, a schema allowing only its number.
    template = (
        b'{"model":"m","prompt":"p",'
        b'"response_format":{"type":"json_schema","json_schema":{"schema":{"const":%b}}}}'
    )
    a, b = template % b"18446744073709551616", template % b"18446744073709551617"
    assert parse_body(a) == parse_body(b)
    assert _key(a) != _key(b)
    assert _key(a) == _key(a)  # a retry resends the same bytes
    negative = b'{"model":"m","prompt":"p","logit_bias":{"5":%b}}'
    assert _key(negative % b"-9223372036854775809") != _key(negative % b"-9223372036854775810")


def test_an_ordinary_body_keys_the_same_whatever_its_key_order_or_spacing() -> None:
    raw = b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "stream": true}'
    reordered = b'{"stream":true,"max_tokens":16,"prompt":[1,2,3],"model":"m"}'
    assert _key(raw) == _key(reordered) == call_key("c1", "/v1/completions", BODY)
