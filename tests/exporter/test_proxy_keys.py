"""How the proxy keys and classifies attempts, end to end against the real test upstream: without a
call id only an evident retry attaches (never a concurrent identical first attempt), the client's
own retry counter counts, and no caller ever attaches to another caller's execution."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable

import httpx

from tests.exporter.support import RunningProxy, Upstream, balance

StartProxy = Callable[..., RunningProxy]

# One prompt sampled at temperature 1: identical bodies that are distinct calls.
SAMPLE = {"model": "test-model", "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 1.0}


def _count(p: RunningProxy, name: str, **labels: str) -> float:
    return p.metrics()[(name, tuple(sorted(labels.items())))]


def _attempts(p: RunningProxy) -> float:
    return _count(p, "retrywatch_attempts_total", kind="first") + _count(
        p, "retrywatch_attempts_total", kind="retry"
    )


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _held_together(
    p: RunningProxy,
    upstream: Upstream,
    hold: str,
    requests: list[dict[str, str]],
    bodies: list[bytes] | None = None,
) -> list[httpx.Response]:
    """Send non-streaming requests (``SAMPLE``, or these bodies) with these headers at once, all
    held by the upstream before their first token until the proxy has decided every one of them;
    then release them."""
    before = _attempts(p)
    out: list[httpx.Response | None] = [None] * len(requests)
    raw = bodies or [json.dumps(SAMPLE).encode()] * len(requests)

    def send(i: int) -> None:
        headers = {**requests[i], "x-test-hold": hold, "content-type": "application/json"}
        out[i] = httpx.post(f"{p.url}/v1/completions", content=raw[i], headers=headers, timeout=20)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    _wait_for(lambda: _attempts(p) - before == len(requests))
    upstream.release(hold)
    for t in threads:
        t.join(timeout=20)
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def _answer_id(r: httpx.Response) -> str:
    """The upstream's id of the answer: one per upstream request (``cmpl-<request number>``)."""
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def _stream_ids(sse: bytes) -> set[str]:
    ids = set()
    for event in sse.split(b"\n\n"):
        event = event.strip()
        if event.startswith(b"data: {"):
            ids.add(json.loads(event[6:])["id"])
    return ids


def test_concurrent_identical_samples_without_a_call_id_each_get_their_own_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy()
    tag = uuid.uuid4().hex
    answers = _held_together(p, upstream, tag, [{"x-test-tag": tag}] * 5)
    assert len({_answer_id(r) for r in answers}) == 5  # five answers, none shared
    assert len(upstream.requests(tag=tag)) == 5
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "first"),))] == 5
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 0
    assert m[("retrywatch_attempts_attached_total", ())] == 0
    assert m[("retrywatch_executions_created_total", ())] == 5


def _left_then_retried(
    start_proxy: StartProxy, upstream: Upstream, first: dict[str, str], retry: dict[str, str]
) -> tuple[RunningProxy, httpx.Response, str]:
    """A streaming attempt without a call id that leaves after its first chunk, then its retry."""
    p = start_proxy()
    tag = uuid.uuid4().hex
    body = {**SAMPLE, "max_tokens": 30, "stream": True}
    slow = {
        "x-test-tag": tag,
        "x-test-token-interval": "0.02",
        "x-test-stall-after": "2",
        "x-test-stall": "0.8",
    }
    url = f"{p.url}/v1/completions"
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", url, json=body, headers={**slow, **first}) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())
    _wait_for(lambda: _count(p, "retrywatch_attempt_duration_seconds_count", outcome="disconnected") == 1)
    answer = httpx.post(url, json=body, headers={**slow, **retry}, timeout=10)
    return p, answer, tag


def test_an_sdk_retry_after_its_first_attempt_left_attaches(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p, answer, tag = _left_then_retried(
        start_proxy, upstream, {"x-stainless-retry-count": "0"}, {"x-stainless-retry-count": "1"}
    )
    records = upstream.requests(tag=tag)
    assert len(records) == 1 and _stream_ids(answer.content) == {f"cmpl-{records[0]['request_id']}"}
    assert answer.content.rstrip().endswith(b"data: [DONE]")
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 1
    assert m[("retrywatch_attempts_attached_total", ())] == 1


def test_a_silent_retry_of_the_same_body_after_a_disconnect_attaches(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p, answer, tag = _left_then_retried(start_proxy, upstream, {}, {})
    assert len(upstream.requests(tag=tag)) == 1
    assert answer.content.rstrip().endswith(b"data: [DONE]")
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "first"),))] == 1
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 1
    assert m[("retrywatch_attempts_attached_total", ())] == 1


def test_an_sdk_counter_at_0_after_a_disconnect_is_a_first_attempt(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p, answer, tag = _left_then_retried(
        start_proxy, upstream, {"x-stainless-retry-count": "0"}, {"x-stainless-retry-count": "0"}
    )
    assert len(upstream.requests(tag=tag)) == 2
    assert answer.content.rstrip().endswith(b"data: [DONE]")
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "first"),))] == 2
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 0


def test_callers_with_different_credentials_never_share_an_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy()
    tag, call = uuid.uuid4().hex, uuid.uuid4().hex
    same = {"x-test-tag": tag, "x-call-id": call}
    alice = {**same, "authorization": "Bearer sk-alice"}
    bob = {**same, "authorization": "Bearer sk-bob"}
    answers = _held_together(p, upstream, tag, [alice, bob])
    assert len({_answer_id(r) for r in answers}) == 2  # each caller its own answer
    assert len(upstream.requests(tag=tag)) == 2
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "first"),))] == 2
    assert m[("retrywatch_attempts_attached_total", ())] == 0
    # Only the hash of a credential is kept: the admin listing never shows one.
    listing = httpx.get(f"{p.url}/retrywatch/executions", timeout=5).text
    assert "sk-alice" not in listing and "sk-bob" not in listing


def test_the_same_caller_with_the_same_call_id_attaches_whatever_the_sdk_counter(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    # An application's retry loop around an SDK with max_retries=0: the call id decides.
    p = start_proxy()
    tag, call = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {
        "x-test-tag": tag,
        "x-call-id": call,
        "api-key": "k-carol",
        "x-stainless-retry-count": "0",
    }
    answers = _held_together(p, upstream, tag, [headers, headers])
    assert len({_answer_id(r) for r in answers}) == 1
    assert len(upstream.requests(tag=tag)) == 1
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "first"),))] == 1
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 1
    assert m[("retrywatch_attempts_attached_total", ())] == 1


def test_callers_that_differ_only_in_an_api_key_header_never_share_an_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    # The OpenAI SDK always sends Authorization (vLLM's docs use the placeholder key "EMPTY"); a
    # gateway in front that authenticates by an API-key header tells the callers apart by it.
    p = start_proxy()
    tag, call = uuid.uuid4().hex, uuid.uuid4().hex
    same = {"x-test-tag": tag, "x-call-id": call, "authorization": "Bearer EMPTY"}
    answers = _held_together(p, upstream, tag, [{**same, "api-key": "k-alice"}, {**same, "api-key": "k-bob"}])
    assert len({_answer_id(r) for r in answers}) == 2  # each caller its own answer
    assert len(upstream.requests(tag=tag)) == 2
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_attached_total", ())] == 0


def test_a_call_id_reused_with_another_integer_beyond_64_bits_gets_its_own_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    # The parser reads integers beyond 64 bits as floats: these two schemas (each allows only its
    # own number) read alike, and the engine, which reads them exactly, answers each differently.
    p = start_proxy()
    tag, call = uuid.uuid4().hex, uuid.uuid4().hex
    schema = (
        b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"const": %b}}}'
    )
    bodies = [
        b'{"model": "test-model", "prompt": [7, 8, 9], "max_tokens": 4, %b}' % (schema % number)
        for number in (b"18446744073709551616", b"18446744073709551617")
    ]
    headers = {"x-test-tag": tag, "x-call-id": call}
    answers = _held_together(p, upstream, tag, [headers, headers], bodies)
    assert len({_answer_id(r) for r in answers}) == 2
    assert len(upstream.requests(tag=tag)) == 2
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_attached_total", ())] == 0
    # The same bytes again (held under a fresh name) are retries of the first, and share one
    # execution.
    again = uuid.uuid4().hex
    answers = _held_together(p, upstream, again, [headers, headers], [bodies[0], bodies[0]])
    assert len({_answer_id(r) for r in answers}) == 1
    balance(p.metrics())
