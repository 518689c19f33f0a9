"""Prompts of the emulated engine: token IDs or text turned into the engine model's segments.

The engine model sees a prompt only as chained-unique segments ``(segment_id, n_tokens)``
(docs/architecture.md): a segment id stands for its tokens *and everything before them*, so
the prefix cache matches two prompts segment by segment up to their first difference. Here a
segment is a fixed chunk of ``SEGMENT_TOKENS`` token IDs (a multiple of vLLM's 16-token KV
block) and its id chains a hash of the previous id with the chunk's IDs: identical prompts (a
retry) give identical segments, and prompts sharing a prefix share its whole chunks.

Text prompts (a completion string, chat messages) are turned into deterministic pseudo token
IDs by hashing each whitespace-separated word. The text itself is never logged or stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = [
    "SEGMENT_TOKENS",
    "PromptError",
    "chat_token_ids",
    "segments_of",
    "text_token_ids",
    "validate_token_ids",
]

#: Tokens per segment: 4 KV blocks of 16 tokens. A shared prefix is matched up to the last
#: whole segment it covers (at most 63 tokens fewer than vLLM's block-granular match); larger
#: chunks keep the per-request segment list short (a 12,000-token prompt has 188 segments).
SEGMENT_TOKENS = 64


class PromptError(ValueError):
    """A prompt the emulated engine cannot accept; the message says what to fix (HTTP 400)."""


def validate_token_ids(prompt: object, vocab_size: int) -> list[int]:
    """Check a token-ID prompt: a non-empty list of ints in ``[0, vocab_size)``."""
    if not isinstance(prompt, list) or not prompt:
        raise PromptError("prompt must be a non-empty string or a non-empty list of token IDs")
    for token in prompt:
        # bool is an int subclass; a JSON true is not a token ID.
        if not isinstance(token, int) or isinstance(token, bool):
            raise PromptError("a token-ID prompt must hold integers only")
        if not 0 <= token < vocab_size:
            raise PromptError(f"token ID {token} is out of vocabulary (expected 0 <= id < {vocab_size})")
    return prompt


def _word_id(word: str, vocab_size: int) -> int:
    digest = hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % vocab_size


def text_token_ids(text: str, vocab_size: int) -> list[int]:
    """Deterministic pseudo token IDs for ``text``: one per whitespace-separated word."""
    return [_word_id(word, vocab_size) for word in text.split()]


def chat_token_ids(messages: object, vocab_size: int) -> list[int]:
    """Pseudo token IDs for chat ``messages`` (role and text content of each, in order)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects")
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise PromptError("each message must be an object with a string 'role'")
        ids.append(_word_id(f"<|{message['role']}|>", vocab_size))
        content = message.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            ids.extend(text_token_ids(content, vocab_size))
        elif isinstance(content, list):
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise PromptError("message content parts must be {'type': 'text', 'text': str}")
                ids.extend(text_token_ids(part["text"], vocab_size))
        else:
            raise PromptError("message content must be a string, a list of text parts, or null")
    return ids


def segments_of(
    token_ids: Sequence[int], segment_tokens: int = SEGMENT_TOKENS
) -> tuple[tuple[int, int], ...]:
    """The prompt as chained-unique segments ``(segment_id, n_tokens)`` for the engine model."""
    if segment_tokens <= 0:
        raise ValueError("segment_tokens must be positive")
    segments: list[tuple[int, int]] = []
    previous = b"\x00" * 8
    for start in range(0, len(token_ids), segment_tokens):
        chunk = token_ids[start : start + segment_tokens]
        h = hashlib.blake2b(previous, digest_size=8)
        h.update(",".join(map(str, chunk)).encode())
        previous = h.digest()
        # 63-bit ids: the engine model keys its prefix cache by plain ints.
        segments.append((int.from_bytes(previous, "big") >> 1, len(chunk)))
    return tuple(segments)
