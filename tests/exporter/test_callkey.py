"""Call keys: same call and parameters coalesce; anything else does not; ids are validated."""

from __future__ import annotations

import pytest

from exporter.callkey import (
    CallIdError,
    KeyWithoutId,
    call_key,
    find_call_id,
    retry_hint,
)

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


@pytest.mark.parametrize(("value", "expected"), [("0", False), ("1", True), ("3", True), ("x", False)])
def test_sdk_retry_count_header(value: str, expected: bool) -> None:
    assert retry_hint({"x-stainless-retry-count": value}) is expected
    assert retry_hint({}) is False
