"""Prompts and response shapes of the emulated engine (pure functions, no server)."""

from __future__ import annotations

import json

import pytest

from reproduce.emulate.openai_api import ApiError, TokenChunks, chunk, parse_request, token_text
from reproduce.emulate.prompts import (
    SEGMENT_TOKENS,
    PromptError,
    chat_token_ids,
    segments_of,
    text_token_ids,
    validate_token_ids,
)


def test_segments_chain_so_a_shared_prefix_shares_its_whole_segments() -> None:
    shared = list(range(2000))
    a = segments_of([*shared, *range(5000, 9000)])
    b = segments_of([*shared, *range(9000, 12000)])
    whole = 2000 // SEGMENT_TOKENS
    assert a[:whole] == b[:whole]
    assert a[whole] != b[whole]  # the segment straddling the end of the shared prefix differs
    assert sum(n for _, n in a) == 6000 and sum(n for _, n in b) == 5000
    # Same tokens at a later position after a different history: a different segment id.
    assert segments_of([1] * 64 + [2] * 64)[1][0] != segments_of([3] * 64 + [2] * 64)[1][0]
    assert segments_of(list(range(100))) == segments_of(list(range(100)))


def test_text_becomes_deterministic_pseudo_token_ids() -> None:
    ids = text_token_ids("the quick  brown\nfox", 1000)
    assert len(ids) == 4 and ids == text_token_ids("the quick brown fox", 1000)
    assert all(0 <= i < 1000 for i in ids)
    chat = chat_token_ids([{"role": "user", "content": [{"type": "text", "text": "hello world"}]}], 1000)
    assert len(chat) == 3  # role marker + two words
    with pytest.raises(PromptError):
        chat_token_ids([{"role": "user", "content": [{"type": "image_url"}]}], 1000)
    with pytest.raises(PromptError):
        validate_token_ids([1, True], 1000)


def test_pre_encoded_token_chunks_equal_the_plain_json_chunks() -> None:
    body = json.dumps({"prompt": 'say "hi"', "max_tokens": 4, "stream": True}).encode()
    request = parse_request("completions", body, served_model="m", vocab_size=100, max_model_len=50)
    chunks = TokenChunks(request, "cmpl-1", 7)
    for index in range(4):
        plain = chunk(request, "cmpl-1", 7, token_text(request, index), None)
        assert chunks.token(index) == b"data: " + json.dumps(plain, separators=(",", ":")).encode() + b"\n\n"
    assert json.loads(chunks.token(3, "length")[6:])["choices"][0]["finish_reason"] == "length"


def test_completions_default_to_16_tokens_and_chat_to_the_rest_of_the_context() -> None:
    completions = parse_request(
        "completions", b'{"prompt": [1, 2, 3]}', served_model="m", vocab_size=10, max_model_len=100
    )
    assert completions.max_tokens == 16
    chat = parse_request(
        "chat",
        b'{"messages": [{"role": "user", "content": "a b"}]}',
        served_model="m",
        vocab_size=10,
        max_model_len=100,
    )
    assert chat.max_tokens == 100 - 3
    with pytest.raises(ApiError) as info:
        parse_request(
            "completions", b'{"prompt": [[1], [2]]}', served_model="m", vocab_size=10, max_model_len=100
        )
    assert info.value.status == 400
