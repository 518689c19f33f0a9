"""One attempt over a real socket: a streaming completion with a deadline on the whole attempt
and, for clients that have one, a read timeout (a limit on each wait for a byte: the first one
from when the attempt was sent, then each gap between lines of the stream).

The request carries the call's id header (the same for every attempt of a call) and a token-ID
prompt. The attempt is classified the way the client model needs (``reproduce.workloads.client``):

* ``delivered``: the stream reached ``[DONE]`` after a choice with a ``finish_reason`` (or, for
  a non-streaming request, the JSON body carries the choices);
* ``disconnected``: the deadline or the read timeout struck first; the connection is closed at
  once, which is what lets the proxy (or vLLM) see the client leave;
* ``shed``: HTTP 429, with its Retry-After (the proxy's retry budget); every error status
  carries its Retry-After (``retry-after-ms`` first, as the SDKs read it) and ``x-should-retry``;
* ``refused``: HTTP 503, or a streaming HTTP 200 whose first event is an error with code 503
  (vLLM's ``--max-num-queued-reqs`` refusal of a streaming request);
* ``failed``: anything else (another status, an error event, a broken stream).

Prompt and completion text are never logged or kept: only counts and times.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from exporter import sse
from reproduce.workloads.client import AttemptOutcome

__all__ = ["AttemptResult", "completion_body", "parse_retry_after", "run_attempt"]


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """How one attempt ended (times on the monotonic clock)."""

    outcome: AttemptOutcome
    first_byte_at: float | None
    ended_at: float
    status: int | None = None
    retry_after_s: float | None = None
    tokens: int = 0  # streamed chunks with output (one token each, unless the server batches)
    error: str | None = None  # a short reason for ``failed``; never prompt text
    should_retry: bool | None = None  # the answer's ``x-should-retry: true|false``, if any


def completion_body(model: str, token_ids: list[int], max_tokens: int) -> bytes:
    """The JSON body of a streaming completion that generates exactly ``max_tokens`` tokens."""
    body = {
        "model": model,
        "prompt": token_ids,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.0,
    }
    return json.dumps(body, separators=(",", ":")).encode()


_STATUS_OUTCOMES = {429: AttemptOutcome.SHED, 503: AttemptOutcome.REFUSED}


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delta form; an HTTP date is not used by the proxy)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < math.inf else None


def _retry_hints(headers: httpx.Headers) -> tuple[float | None, bool | None]:
    """An error answer's wait (``retry-after-ms``, else ``retry-after``) and ``x-should-retry``."""
    ms = parse_retry_after(headers.get("retry-after-ms"))
    wait = ms / 1000.0 if ms is not None else parse_retry_after(headers.get("retry-after"))
    flag = headers.get("x-should-retry")
    return wait, {"true": True, "false": False}.get(flag) if flag is not None else None


def _error_outcome(obj: object) -> tuple[AttemptOutcome, int | None] | None:
    """How an error in an event or a body ends the attempt (refused for code 503, else failed)
    and the code it carried; None if ``obj`` is not an error."""
    error = sse.error_of(obj)
    if error is None:
        return None
    code = sse.error_code(error)
    return (AttemptOutcome.REFUSED if code == 503 else AttemptOutcome.FAILED), code


async def _read_json_answer(response: httpx.Response, clock: Callable[[], float]) -> AttemptResult:
    """A non-streaming answer: one JSON body with the whole completion, or an error."""
    raw = await response.aread()
    first_byte_at = clock()
    try:
        body = json.loads(raw)
    except ValueError:
        return AttemptResult(
            AttemptOutcome.FAILED, first_byte_at, clock(), response.status_code, error="bad body"
        )
    if isinstance(body, dict):
        error = _error_outcome(body)
        if error is not None:
            outcome, code = error
            return AttemptResult(outcome, None, clock(), response.status_code, error=f"error body {code}")
        choices = body.get("choices")
        if isinstance(choices, list) and choices:
            usage = body.get("usage")
            tokens = int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0
            return AttemptResult(
                AttemptOutcome.DELIVERED, first_byte_at, clock(), response.status_code, None, tokens
            )
    return AttemptResult(
        AttemptOutcome.FAILED, first_byte_at, clock(), response.status_code, error="no choices"
    )


async def run_attempt(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    *,
    call_id: str,
    deadline_at: float,
    call_id_header: str = "x-call-id",
    read_timeout_s: float | None = None,
    on_first_byte: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> AttemptResult:
    """Send one attempt to ``url`` and follow it until it ends, ``deadline_at`` (``clock`` time;
    infinity: no limit on the whole attempt) or ``read_timeout_s`` without a byte."""
    headers = {"content-type": "application/json", call_id_header: call_id}
    first_byte_at: float | None = None
    tokens = 0
    status: int | None = None
    loop = asyncio.get_running_loop()

    def give_up_at() -> float | None:  # on the loop's clock
        left = [deadline_at - clock()] if math.isfinite(deadline_at) else []
        if read_timeout_s is not None:
            left.append(read_timeout_s)
        return loop.time() + max(0.0, min(left)) if left else None

    try:
        async with asyncio.timeout_at(give_up_at()) as limit:
            async with client.stream("POST", url, content=body, headers=headers) as response:
                status = response.status_code
                if status != 200:
                    retry_after, should_retry = _retry_hints(response.headers)
                    answer = _STATUS_OUTCOMES.get(status, AttemptOutcome.FAILED)
                    reason = None if answer is not AttemptOutcome.FAILED else f"HTTP {status}"
                    return AttemptResult(
                        answer, None, clock(), status, retry_after, error=reason, should_retry=should_retry
                    )
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    return await _read_json_answer(response, clock)
                finished = False
                async for line in response.aiter_lines():
                    if read_timeout_s is not None:
                        limit.reschedule(give_up_at())
                    data = sse.event_payload(line)
                    if data is None:
                        continue
                    if data == sse.DONE:
                        if finished:
                            return AttemptResult(
                                AttemptOutcome.DELIVERED, first_byte_at, clock(), status, None, tokens
                            )
                        break
                    try:
                        event = sse.event_json(data)
                    except ValueError:
                        return AttemptResult(
                            AttemptOutcome.FAILED, first_byte_at, clock(), status, error="bad event"
                        )
                    if not isinstance(event, dict):
                        continue
                    error = _error_outcome(event)
                    if error is not None:
                        outcome, code = error
                        return AttemptResult(
                            outcome, first_byte_at, clock(), status, error=f"error event {code}"
                        )
                    choices = event.get("choices")
                    if isinstance(choices, list) and choices:
                        if first_byte_at is None:
                            first_byte_at = clock()
                            if on_first_byte is not None:
                                on_first_byte(first_byte_at)
                        tokens += 1
                        if any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
                            finished = True
                return AttemptResult(
                    AttemptOutcome.FAILED, first_byte_at, clock(), status, None, tokens, "stream ended early"
                )
    except TimeoutError:
        # Leaving the ``stream`` block above closed the connection: the far side sees us leave.
        return AttemptResult(AttemptOutcome.DISCONNECTED, first_byte_at, clock(), status, None, tokens)
    except httpx.HTTPError as exc:
        return AttemptResult(
            AttemptOutcome.FAILED, first_byte_at, clock(), status, None, tokens, type(exc).__name__
        )
