"""How one attempt's end is classified: delivered, disconnected, shed, refused (both forms), failed.

The transport is injected (``httpx.MockTransport``) so every server answer can be produced on
demand; the end-to-end tests against a real proxy and engine live in ``test_http_driver_run``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from reproduce.harness.attempt import AttemptResult, completion_body, parse_retry_after, run_attempt
from reproduce.workloads.client import AttemptOutcome

URL = "http://engine.test/v1/completions"
SSE = {"content-type": "text/event-stream; charset=utf-8"}


def _sse(*events: object) -> bytes:
    lines = [f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events]
    return "".join(lines).encode()


def _chunk(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _attempt(handler: Callable[[httpx.Request], httpx.Response], timeout_s: float = 5.0) -> AttemptResult:
    async def go() -> AttemptResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            body = completion_body("m", [1, 2, 3], 2)
            return await run_attempt(
                client, URL, body, call_id="c-1", deadline_at=time.monotonic() + timeout_s
            )

    return asyncio.run(go())


def test_complete_stream_is_delivered_and_carries_the_call_id() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers=SSE, content=_sse(_chunk(" a"), _chunk(" b", "length"), "[DONE]"))

    result = _attempt(handler)
    assert result.outcome is AttemptOutcome.DELIVERED
    assert result.tokens == 2
    assert result.first_byte_at is not None and result.first_byte_at <= result.ended_at
    assert seen[0].headers["x-call-id"] == "c-1"
    body = json.loads(seen[0].content)
    assert body["prompt"] == [1, 2, 3] and body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == 2


def test_non_streaming_answer_is_delivered_or_refused_by_its_body() -> None:
    answer = {"choices": [{"text": " a b", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}
    result = _attempt(lambda r: httpx.Response(200, json=answer))
    assert (result.outcome, result.tokens) == (AttemptOutcome.DELIVERED, 2)
    refused = _attempt(lambda r: httpx.Response(200, json={"error": {"code": 503}}))
    assert refused.outcome is AttemptOutcome.REFUSED
    assert _attempt(lambda r: httpx.Response(200, json={"id": "x"})).outcome is AttemptOutcome.FAILED


def test_stream_cut_before_done_is_failed() -> None:
    result = _attempt(lambda r: httpx.Response(200, headers=SSE, content=_sse(_chunk(" a"))))
    assert result.outcome is AttemptOutcome.FAILED
    assert result.error == "stream ended early"


def test_done_without_a_finish_reason_is_failed() -> None:
    result = _attempt(lambda r: httpx.Response(200, headers=SSE, content=_sse(_chunk(" a"), "[DONE]")))
    assert result.outcome is AttemptOutcome.FAILED


def test_429_is_shed_with_its_retry_after() -> None:
    result = _attempt(lambda r: httpx.Response(429, headers={"retry-after": "2.5"}, json={"error": {}}))
    assert result.outcome is AttemptOutcome.SHED
    assert result.retry_after_s == 2.5


def test_503_status_is_refused() -> None:
    result = _attempt(lambda r: httpx.Response(503, json={"error": {"code": 503}}))
    assert result.outcome is AttemptOutcome.REFUSED
    assert result.retry_after_s is None


def test_streaming_refusal_in_an_error_event_is_refused() -> None:
    # vLLM's --max-num-queued-reqs refusal of a streaming request: HTTP 200, an error event, [DONE].
    event = {"error": {"message": "busy", "type": "Service Unavailable", "param": None, "code": 503}}
    result = _attempt(lambda r: httpx.Response(200, headers=SSE, content=_sse(event, "[DONE]")))
    assert result.outcome is AttemptOutcome.REFUSED
    assert result.first_byte_at is None


def test_other_error_event_or_status_is_failed() -> None:
    event = {"error": {"message": "boom", "code": 500}}
    assert (
        _attempt(lambda r: httpx.Response(200, headers=SSE, content=_sse(event))).outcome
        is AttemptOutcome.FAILED
    )
    result = _attempt(lambda r: httpx.Response(400, json={"error": {"code": 400}}))
    assert (result.outcome, result.status) == (AttemptOutcome.FAILED, 400)


def test_transport_error_is_failed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    result = _attempt(handler)
    assert result.outcome is AttemptOutcome.FAILED
    assert result.error == "ConnectError"


class _SlowStream(httpx.AsyncByteStream):
    """A stream that sends one token, then nothing: the attempt must give up at its deadline."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield _sse(_chunk(" a"))
        await asyncio.sleep(30)
        yield b""

    async def aclose(self) -> None:
        self.closed = True


def test_deadline_on_the_whole_attempt_disconnects_and_closes_the_stream() -> None:
    stream = _SlowStream()

    async def go() -> AttemptResult:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, stream=stream))
        async with httpx.AsyncClient(transport=transport) as client:
            return await run_attempt(
                client, URL, completion_body("m", [1], 5), call_id="c", deadline_at=time.monotonic() + 0.3
            )

    start = time.monotonic()
    result = asyncio.run(go())
    assert result.outcome is AttemptOutcome.DISCONNECTED
    assert result.first_byte_at is not None and result.tokens == 1
    assert stream.closed
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("raw", "expected"), [("3", 3.0), (" 0.5 ", 0.5), ("-1", None), ("soon", None), (None, None)]
)
def test_parse_retry_after(raw: str | None, expected: float | None) -> None:
    assert parse_retry_after(raw) == expected


class _PacedStream(httpx.AsyncByteStream):
    """Tokens ``gap_s`` apart (the last one finishing), then ``[DONE]``; ``stall_s`` before the
    second token."""

    def __init__(self, tokens: int, gap_s: float, stall_s: float = 0.0) -> None:
        self.tokens, self.gap_s, self.stall_s = tokens, gap_s, stall_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.stall_s if i == 1 and self.stall_s else self.gap_s)
            yield _sse(_chunk(" a", "length" if i == self.tokens - 1 else None))
        yield _sse("[DONE]")


def _read_timeout_attempt(stream: httpx.AsyncByteStream, read_timeout_s: float) -> AttemptResult:
    async def go() -> AttemptResult:
        transport = httpx.MockTransport(lambda r: httpx.Response(200, headers=SSE, stream=stream))
        async with httpx.AsyncClient(transport=transport) as client:
            body = completion_body("m", [1], 8)
            return await run_attempt(
                client, URL, body, call_id="c", deadline_at=float("inf"), read_timeout_s=read_timeout_s
            )

    return asyncio.run(go())


def test_a_read_timeout_bounds_each_gap_between_tokens_not_the_attempt() -> None:
    # Eight tokens 0.1 s apart: 0.7 s in all, longer than the 0.3-s read timeout, and delivered.
    result = _read_timeout_attempt(_PacedStream(8, 0.1), 0.3)
    assert (result.outcome, result.tokens) == (AttemptOutcome.DELIVERED, 8)
    assert result.first_byte_at is not None and result.ended_at - result.first_byte_at > 0.3
    # A 1-s stall after the first token: given up one read timeout after it, not at the stall's end.
    stalled = _read_timeout_attempt(_PacedStream(8, 0.1, stall_s=1.0), 0.3)
    assert (stalled.outcome, stalled.tokens) == (AttemptOutcome.DISCONNECTED, 1)
    assert stalled.first_byte_at is not None and 0.25 < stalled.ended_at - stalled.first_byte_at < 0.9


def test_an_error_status_carries_its_retry_hints() -> None:
    headers = {"retry-after-ms": "1500", "retry-after": "9", "x-should-retry": "false"}
    refused = _attempt(lambda r: httpx.Response(503, headers=headers))
    assert (refused.outcome, refused.retry_after_s, refused.should_retry) == (
        AttemptOutcome.REFUSED,
        1.5,
        False,
    )
    other = _attempt(lambda r: httpx.Response(409, headers={"retry-after": "2", "x-should-retry": "true"}))
    assert (other.outcome, other.status, other.retry_after_s, other.should_retry) == (
        AttemptOutcome.FAILED, 409, 2.0, True
    )  # fmt: skip
    assert _attempt(lambda r: httpx.Response(429)).should_retry is None
