"""Request checks: what is refused, with which status, param and code."""

from __future__ import annotations

import pytest

from exporter.callkey import call_key, canonical_body
from exporter.validation import CHAT_COMPLETIONS, COMPLETIONS, RequestError, parse_body, validate


def test_prompt_lengths_count_ids_and_estimate_text() -> None:
    assert validate(COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}) == 3
    assert validate(COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]}) == 3
    assert validate(COMPLETIONS, {"model": "m", "prompt": "x" * 40}) == 10
    assert validate(COMPLETIONS, {"model": "m", "prompt": ["abcd", "abcdefgh"]}) == 3
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "x" * 8}, {"role": "system", "content": None}],
    }
    assert validate(CHAT_COMPLETIONS, chat) == 2


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": 3, "prompt": "x"}, "model", "invalid_request"),
        ({"model": "m", "prompt": []}, "prompt", "invalid_request"),
        ({"model": "m", "prompt": [True]}, "prompt", "invalid_request"),
        ({"model": "m", "prompt": "x", "n": 0}, "n", "invalid_request"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "invalid_request"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop", "invalid_request"),
        ({"model": "m", "prompt": [1, 70_000]}, "prompt", "token_id_out_of_range"),
    ],
)
def test_refused_bodies(body: dict[str, object], param: str, code: str) -> None:
    with pytest.raises(RequestError) as info:
        validate(COMPLETIONS, body, vocab_size=32_000)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code)


def test_chat_messages_must_have_roles() -> None:
    with pytest.raises(RequestError):
        validate(CHAT_COMPLETIONS, {"model": "m", "messages": [{"content": "x"}]})
    with pytest.raises(RequestError):
        validate(CHAT_COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": 5}]})


def test_parse_body_refuses_non_objects_and_bad_json() -> None:
    for raw in (b"[1]", b"{", b"\xff\xfe", b"null"):
        with pytest.raises(RequestError) as info:
            parse_body(raw)
        assert info.value.status == 400 and info.value.code == "invalid_json"
    assert parse_body(b'{"a": 1}') == {"a": 1}


def test_integers_beyond_64_bits_are_refused_and_never_break_the_call_key() -> None:
    # The parser (orjson) reads an integer beyond 64 bits as a float, so such a seed is refused
    # like any non-integer (vLLM refuses seeds outside int64 too).
    body = parse_body(b'{"model": "m", "prompt": [1, 2], "seed": 123456789012345678901234567890}')
    with pytest.raises(RequestError) as info:
        validate(COMPLETIONS, body)
    assert info.value.status == 400 and info.value.param == "seed"
    # A body built in Python with one still gets a canonical form (json takes over from orjson).
    huge = {"model": "m", "prompt": [1], "seed": 2**80}
    assert canonical_body(huge) == b'{"model":"m","prompt":[1],"seed":1208925819614629174706176}'
    assert call_key("c", COMPLETIONS, huge) == call_key("c", COMPLETIONS, dict(reversed(huge.items())))
