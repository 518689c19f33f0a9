"""The proxy end to end, against the test upstream running as a real process on loopback."""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from foundation.processes import free_port
from tests.exporter.support import RunningProxy, Upstream, balance

StartProxy = Callable[..., RunningProxy]


def _body(max_tokens: int = 5, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "test-model",
        "prompt": [1, 2, 3, 4],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def _headers(call_id: str | None = None, **test: str) -> dict[str, str]:
    h = {f"x-test-{k.replace('_', '-')}": v for k, v in test.items()}
    if call_id is not None:
        h["x-call-id"] = call_id
    return h


def _tokens(sse: bytes) -> list[str]:
    """The texts of a completion stream's events, and "[DONE]"."""
    out: list[str] = []
    for event in sse.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data: "):
            continue
        payload = event[6:]
        if payload == b"[DONE]":
            out.append("[DONE]")
            continue
        obj = json.loads(payload)
        if "error" in obj:
            out.append("error:" + str(obj["error"]["code"]))
        else:
            out.append(obj["choices"][0]["text"])
    return out


def _expected(n: int) -> list[str]:
    return [f" t{i}" for i in range(n)] + ["[DONE]"]


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _value(p: RunningProxy, name: str, **labels: str) -> float:
    return p.metrics()[(name, tuple(sorted(labels.items())))]


def _start_then_leave(
    url: str, body: dict[str, Any], headers: dict[str, str], after_chunks: int = 1
) -> float:
    """Stream, read ``after_chunks`` chunks, then close the connection; returns when it left."""
    with httpx.Client(timeout=10) as client, client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200
        it = r.iter_raw()
        for _ in range(after_chunks):
            next(it)
    return time.time()


# --- plain relaying -------------------------------------------------------------------------


def test_streaming_and_non_streaming_completions_are_relayed(start_proxy: StartProxy) -> None:
    p = start_proxy()
    r = httpx.post(f"{p.url}/v1/completions", json=_body(6), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert _tokens(r.content) == _expected(6)
    r = httpx.post(f"{p.url}/v1/completions", json=_body(3, stream=False), timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1 t2"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{p.url}/v1/chat/completions", json=chat, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " t0 t1"
    r = httpx.post(f"{p.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=10)
    events = [json.loads(e[6:]) for e in r.content.split(b"\n\n") if e.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == " t0 t1"
    assert r.content.endswith(b"data: [DONE]\n\n")
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_calls_delivered_total", (("within_deadline", "true"),))] == 4


def test_other_routes_pass_through(start_proxy: StartProxy) -> None:
    p = start_proxy()
    assert httpx.get(f"{p.url}/v1/models", timeout=5).json()["data"][0]["id"] == "test-model"
    assert httpx.get(f"{p.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{p.url}/version", timeout=5).json() == {"version": "test-upstream"}
    assert httpx.get(f"{p.url}/no/such/route", timeout=5).status_code == 404


# --- coalescing -----------------------------------------------------------------------------


def test_an_attached_retry_gets_the_replay_then_the_live_chunks(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(cancellation="on")
    call = uuid.uuid4().hex
    body = _body(12)
    headers = _headers(call, token_interval="0.01", stall_after="4", stall="0.8")
    got: dict[str, bytes] = {}

    def first() -> None:
        got["first"] = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10).content

    t = threading.Thread(target=first)
    t.start()
    _wait_for(lambda: any(r["tokens_sent"] >= 4 for r in upstream.requests(call_id=call)))
    retry = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10)
    t.join()
    assert _tokens(retry.content) == _expected(12)
    assert _tokens(got["first"]) == _expected(12)
    assert len(upstream.requests(call_id=call)) == 1  # one execution served both attempts
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_attached_total", ())] == 1
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] == 1
    # Both attempts were answered, but they are one call: it is delivered once.
    delivered = {
        w: _value(p, "retrywatch_calls_delivered_total", within_deadline=w) for w in ("true", "false")
    }
    assert delivered == {"true": 1, "false": 0}


def test_without_coalescing_a_retry_creates_its_own_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(coalesce=False)
    call = uuid.uuid4().hex
    for _ in range(2):
        r = httpx.post(f"{p.url}/v1/completions", json=_body(2), headers=_headers(call), timeout=10)
        assert _tokens(r.content) == _expected(2)
    assert len(upstream.requests(call_id=call)) == 2


# --- cancellation modes ---------------------------------------------------------------------


def test_cancellation_on_closes_the_upstream_connection(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(cancellation="on")
    call = uuid.uuid4().hex
    left = _start_then_leave(f"{p.url}/v1/completions", _body(200), _headers(call, token_interval="0.02"))
    _wait_for(lambda: upstream.requests(call_id=call)[0]["aborted"])
    record = upstream.requests(call_id=call)[0]
    assert record["aborted_at"] - left < 2.0
    assert not record["completed"]
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "cancelled"),))] == 1


def test_a_disconnect_is_noticed_while_no_chunk_flows(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(cancellation="on")
    call = uuid.uuid4().hex
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{p.url}/v1/completions", json=_body(3), headers=_headers(call, ttft="5"), timeout=0.3)
    left = time.time()
    _wait_for(lambda: upstream.requests(call_id=call)[0]["aborted"], timeout_s=3)
    assert upstream.requests(call_id=call)[0]["aborted_at"] - left < 2.0
    assert _value(p, "retrywatch_attempt_duration_seconds_count", outcome="disconnected") == 1


def test_cancellation_off_drains_the_orphan(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(cancellation="off")
    call = uuid.uuid4().hex
    _start_then_leave(f"{p.url}/v1/completions", _body(20), _headers(call, token_interval="0.01"))
    _wait_for(lambda: upstream.requests(call_id=call)[0]["ended_at"] is not None)
    record = upstream.requests(call_id=call)[0]
    assert record["completed"] and not record["aborted"]
    _wait_for(lambda: _value(p, "retrywatch_executions_finished_total", fate="orphaned") == 1)
    balance(p.metrics())


def test_deferred_cancellation_waits_w_then_aborts(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(cancellation="deferred", cancel_after_s=0.6)
    call = uuid.uuid4().hex
    left = _start_then_leave(f"{p.url}/v1/completions", _body(300), _headers(call, token_interval="0.01"))
    _wait_for(lambda: upstream.requests(call_id=call)[0]["aborted"], timeout_s=4)
    waited = upstream.requests(call_id=call)[0]["aborted_at"] - left
    assert 0.5 <= waited < 3.0  # deferred by W, not at once (upper bound generous for slow machines)
    balance(p.metrics())


def test_a_retry_within_w_attaches_and_nothing_is_aborted(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(cancellation="deferred", cancel_after_s=1.0)
    call = uuid.uuid4().hex
    body, headers = _body(30), _headers(call, token_interval="0.01", stall_after="2", stall="0.8")
    _start_then_leave(f"{p.url}/v1/completions", body, headers)
    time.sleep(0.2)
    retry = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert _tokens(retry.content) == _expected(30)
    time.sleep(1.2)  # past W: the timer must not cancel an execution a retry attached to
    records = upstream.requests(call_id=call)
    assert len(records) == 1 and records[0]["completed"] and not records[0]["aborted"]
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "completed"),))] == 1
    assert m[("retrywatch_executions_finished_total", (("fate", "cancelled"),))] == 0


# --- engine refusals and failures -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["refuse-http", "refuse-stream"])
def test_engine_refusals_in_both_forms_give_503(start_proxy: StartProxy, mode: str) -> None:
    p = start_proxy()
    r = httpx.post(f"{p.url}/v1/completions", json=_body(3), headers=_headers(mode=mode), timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_refused"
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "refused"),))] == 1
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "refused"),))] == 1


def test_a_crash_mid_stream_reaches_every_subscriber_as_an_error(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy()
    call = uuid.uuid4().hex
    headers = _headers(call, mode="crash", crash_after="5", token_interval="0.05")
    results: list[bytes] = []

    def attempt() -> None:
        results.append(
            httpx.post(f"{p.url}/v1/completions", json=_body(10), headers=headers, timeout=10).content
        )

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    threads[0].start()
    _wait_for(lambda: bool(upstream.requests(call_id=call)))
    threads[1].start()
    for t in threads:
        t.join()
    for content in results:
        assert _tokens(content) == [f" t{i}" for i in range(5)] + ["error:upstream_broken", "[DONE]"]
    m = p.metrics()
    balance(m)
    # one execution for both attempts, unless (on a slow machine) the second came after the crash
    executions = len(upstream.requests(call_id=call))
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == executions
    assert m[("retrywatch_attempts_attached_total", ())] == 2 - executions
    # ...and the proxy goes on serving
    assert _tokens(httpx.post(f"{p.url}/v1/completions", json=_body(2), timeout=10).content) == _expected(2)


def test_upstream_down_gives_502_and_counts_failed(start_proxy: StartProxy) -> None:
    p = start_proxy(upstream_url=f"http://127.0.0.1:{free_port()}")
    for stream in (True, False):
        r = httpx.post(f"{p.url}/v1/completions", json=_body(2, stream=stream), timeout=10)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unreachable"
    r = httpx.get(f"{p.url}/v1/models", timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_executions_finished_total", (("fate", "failed"),))] == 2
    assert m[("retrywatch_upstream_up", ())] == 0


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "prompt": [1, 2', None),
        (b'["not", "an", "object"]', None),
        (b'{"prompt": [1, 2]}', "model"),
        (b'{"model": "m"}', "prompt"),
        (b'{"model": "m", "prompt": [1, "x"]}', "prompt"),
        (b'{"model": "m", "prompt": [1], "max_tokens": "ten"}', "max_tokens"),
        (b'{"model": "m", "prompt": [1], "stream": "yes"}', "stream"),
    ],
)
def test_bad_input_gets_400_and_never_reaches_the_engine(
    start_proxy: StartProxy, upstream: Upstream, raw: bytes, param: str | None
) -> None:
    p = start_proxy()
    tag = uuid.uuid4().hex
    r = httpx.post(f"{p.url}/v1/completions", content=raw, headers={"x-test-tag": tag}, timeout=5)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert upstream.requests(tag=tag) == []
    assert _value(p, "retrywatch_attempts_total", kind="first") == 0


def test_chat_without_messages_and_a_bad_call_id_get_400(start_proxy: StartProxy) -> None:
    p = start_proxy()
    r = httpx.post(f"{p.url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{p.url}/v1/completions", json=_body(1), headers={"x-call-id": "x" * 300}, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_call_id"


def test_a_body_over_the_limit_gets_413(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(max_body_bytes=4096)
    tag = uuid.uuid4().hex
    r = httpx.post(
        f"{p.url}/v1/completions",
        json=_body(1, prompt=list(range(3000))),
        headers={"x-test-tag": tag},
        timeout=5,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks() -> Any:  # no Content-Length: the limit holds while reading
        yield b'{"model": "m", "prompt": ['
        for _ in range(2000):
            yield b"1, "
        yield b"1]}"

    r = httpx.post(f"{p.url}/v1/completions", content=chunks(), headers={"x-test-tag": tag}, timeout=5)
    assert r.status_code == 413
    assert upstream.requests(tag=tag) == []


def test_vocab_size_refuses_out_of_range_token_ids(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(vocab_size=1000)
    tag = uuid.uuid4().hex
    for prompt in ([5, 1000], [-1], [[1, 2], [3, 4000]]):
        r = httpx.post(
            f"{p.url}/v1/completions", json=_body(1, prompt=prompt), headers={"x-test-tag": tag}, timeout=5
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "token_id_out_of_range"
    assert upstream.requests(tag=tag) == []
    r = httpx.post(f"{p.url}/v1/completions", json=_body(1, prompt=[0, 999]), timeout=5)
    assert r.status_code == 200


# --- retry budget -----------------------------------------------------------------------------


def test_budget_lookup_first_lets_a_retry_attach_but_sheds_one_that_would_create(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(retry_budget=0.0, budget_order="lookup-first", cancellation="off")
    call = uuid.uuid4().hex
    body, headers = _body(20), _headers(call, token_interval="0.01", stall_after="2", stall="0.8")
    _start_then_leave(f"{p.url}/v1/completions", body, headers)
    retry = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert _tokens(retry.content) == _expected(20)  # attached: the budget never saw it
    late = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert late.status_code == 429  # no live execution left: a retry that would create one
    assert late.json()["error"]["code"] == "retry_budget"
    assert int(late.headers["retry-after"]) >= 1
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_shed_total", (("reason", "retry_budget"),))] == 1
    assert m[("retrywatch_attempts_attached_total", ())] == 1


def test_budget_first_refuses_a_retry_even_with_a_live_execution(start_proxy: StartProxy) -> None:
    p = start_proxy(retry_budget=0.0, budget_order="budget-first", cancellation="off")
    call = uuid.uuid4().hex
    body, headers = _body(20), _headers(call, token_interval="0.01", stall_after="2", stall="0.8")
    _start_then_leave(f"{p.url}/v1/completions", body, headers)
    retry = httpx.post(f"{p.url}/v1/completions", json=body, headers=headers, timeout=10)
    assert retry.status_code == 429 and retry.headers["retry-after"].isdigit()
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_attached_total", ())] == 0


# --- the proxy queue --------------------------------------------------------------------------


def _post_async(
    url: str, body: dict[str, Any], headers: dict[str, str], out: dict[str, httpx.Response]
) -> threading.Thread:
    def run() -> None:
        out[headers.get("x-call-id", "")] = httpx.post(url, json=body, headers=headers, timeout=15)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("order", ["fifo", "lifo"])
def test_the_proxy_queue_serves_in_order_and_sheds_when_full(
    start_proxy: StartProxy, upstream: Upstream, order: str
) -> None:
    p = start_proxy(max_outstanding=1, max_queued=2, queue_order=order, lifo_threshold=0)
    url = f"{p.url}/v1/completions"
    ids = [uuid.uuid4().hex for _ in range(3)]
    out: dict[str, httpx.Response] = {}
    hold = uuid.uuid4().hex
    threads = [_post_async(url, _body(3), _headers(ids[0], hold=hold), out)]
    _wait_for(lambda: bool(upstream.requests(call_id=ids[0])))
    for call in ids[1:]:
        threads.append(_post_async(url, _body(3), _headers(call), out))
        _wait_for(lambda: p.proxy.policy.gauges().executions_queued >= ids.index(call))  # noqa: B023
    shed = httpx.post(url, json=_body(3), headers=_headers(uuid.uuid4().hex), timeout=5)
    assert shed.status_code == 503 and shed.json()["error"]["code"] == "proxy_queue"
    assert int(shed.headers["retry-after"]) >= 1  # the estimated wait, as a 429's: SDKs honour it
    upstream.release(hold)
    for t in threads:
        t.join()
    assert all(_tokens(out[c].content) == _expected(3) for c in ids)
    started = {c: upstream.requests(call_id=c)[0]["received_at"] for c in ids[1:]}
    first, second = (ids[1], ids[2]) if order == "fifo" else (ids[2], ids[1])
    assert started[first] < started[second]
    balance(p.metrics())


def test_a_queued_execution_whose_client_leaves_is_dropped(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(max_outstanding=1)
    url = f"{p.url}/v1/completions"
    busy, queued = uuid.uuid4().hex, uuid.uuid4().hex
    out: dict[str, httpx.Response] = {}
    hold = uuid.uuid4().hex
    t = _post_async(url, _body(2), _headers(busy, hold=hold), out)
    _wait_for(lambda: bool(upstream.requests(call_id=busy)))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=_body(2), headers=_headers(queued), timeout=0.3)
    _wait_for(lambda: _value(p, "retrywatch_executions_finished_total", fate="dropped") == 1)
    upstream.release(hold)
    t.join()
    assert upstream.requests(call_id=queued) == []  # never reached the engine
    balance(p.metrics())


def test_the_deadline_check_sheds_an_attempt_that_would_miss_it(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(deadline_check=True, deadline_s=1.0)
    tag = uuid.uuid4().hex
    # 40,000 prompt tokens at the prior of 20,000 prefill tokens/s: an estimated 2 s > 1 s.
    r = httpx.post(
        f"{p.url}/v1/completions", json=_body(1, prompt=[1] * 40_000), headers={"x-test-tag": tag}, timeout=5
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline"
    assert r.headers["retry-after"] == "2"  # the estimated wait: come back when it can make it
    assert upstream.requests(tag=tag) == []
    assert httpx.post(f"{p.url}/v1/completions", json=_body(1), timeout=5).status_code == 200
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_shed_total", (("reason", "deadline"),))] == 1
    assert m[("retrywatch_client_deadline_seconds", ())] == 1.0


# --- metrics and admin ----------------------------------------------------------------------


def test_under_lifo_the_deadline_check_admits_a_new_attempt_served_before_the_queue(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(
        max_outstanding=1, queue_order="lifo", lifo_threshold=0, deadline_check=True, deadline_s=1.0
    )
    url = f"{p.url}/v1/completions"
    busy, old, new = (uuid.uuid4().hex for _ in range(3))
    out: dict[str, httpx.Response] = {}
    hold = uuid.uuid4().hex
    threads = [_post_async(url, _body(2), _headers(busy, hold=hold), out)]
    _wait_for(lambda: bool(upstream.requests(call_id=busy)))
    # At the prior of 20,000 prefill tokens/s: 15,000 tokens queued (0.75 s, admitted), then
    # 10,000 more, which LIFO sends before them: 0.5 s, not 1.25 s, to its first token.
    threads.append(_post_async(url, _body(2, prompt=[1] * 15_000), _headers(old), out))
    _wait_for(lambda: p.proxy.policy.gauges().executions_queued == 1)
    threads.append(_post_async(url, _body(2, prompt=[1] * 10_000), _headers(new), out))
    _wait_for(lambda: p.proxy.policy.gauges().executions_queued == 2 or new in out)
    upstream.release(hold)
    for t in threads:
        t.join()
    assert out[new].status_code == 200 and _tokens(out[new].content) == _expected(2)
    received = {c: upstream.requests(call_id=c)[0]["received_at"] for c in (old, new)}
    assert received[new] < received[old]  # served first, as LIFO does
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_shed_total", (("reason", "deadline"),))] == 0


def test_metrics_are_plain_text_with_every_label_and_the_vllm_passthrough(start_proxy: StartProxy) -> None:
    p = start_proxy(capacity=2.5)
    r = httpx.get(f"{p.url}/metrics", timeout=5)
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for fate in ("completed", "orphaned", "cancelled", "dropped", "refused", "failed"):
        assert f'retrywatch_executions_finished_total{{fate="{fate}"}} 0.0' in text
    assert 'retrywatch_attempts_shed_total{reason="deadline"} 0.0' in text
    assert "retrywatch_capacity_calls_per_second 2.5" in text
    assert 'vllm:num_requests_waiting{model_name="test-model"}' in text  # colons survive
    assert "retrywatch_upstream_up 1.0" in text
    off = start_proxy(metrics_passthrough=False)
    assert "vllm:" not in httpx.get(f"{off.url}/metrics", timeout=5).text


def test_admin_lists_live_executions_behind_a_token(start_proxy: StartProxy, upstream: Upstream) -> None:
    p = start_proxy(admin_token="s3cret")
    admin = f"{p.url}/retrywatch/executions"
    assert httpx.get(admin, timeout=5).status_code == 401
    assert httpx.get(admin, headers={"authorization": "Bearer wrong"}, timeout=5).status_code == 401
    call = uuid.uuid4().hex
    out: dict[str, httpx.Response] = {}
    body = _body(3, prompt="a secret prompt text")
    hold = uuid.uuid4().hex
    t = _post_async(f"{p.url}/v1/completions", body, _headers(call, hold=hold), out)
    _wait_for(lambda: bool(upstream.requests(call_id=call)))
    r = httpx.get(admin, headers={"authorization": "Bearer s3cret"}, timeout=5)
    assert httpx.get(admin, headers={"authorization": "bearer s3cret"}, timeout=5).status_code == 200
    assert httpx.get(admin, headers={"authorization": "Basic s3cret"}, timeout=5).status_code == 401
    upstream.release(hold)
    t.join()
    assert r.status_code == 200
    listing = r.json()
    assert listing["total"] == 1
    row = listing["executions"][0]
    assert row["state"] == "dispatched" and row["subscribers"] == 1 and len(row["key_hash"]) == 16
    assert "secret prompt" not in r.text


def test_past_the_replay_limit_a_retry_creates_a_new_execution(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(replay_limit_bytes=1024, cancellation="off")
    call = uuid.uuid4().hex
    body, headers = _body(400), _headers(call, stall_after="350", stall="1.0")
    _start_then_leave(f"{p.url}/v1/completions", body, headers)
    _wait_for(lambda: upstream.requests(call_id=call)[0]["tokens_sent"] >= 350)
    time.sleep(0.2)  # the proxy has read what was sent: well past one 16 KiB block
    listing = httpx.get(f"{p.url}/retrywatch/executions", timeout=5).json()
    assert listing["executions"][0]["attachable"] is False
    retry = httpx.post(f"{p.url}/v1/completions", json=body, headers=_headers(call), timeout=10)
    assert _tokens(retry.content) == _expected(400)
    assert len(upstream.requests(call_id=call)) == 2
    balance(p.metrics())


def test_derived_gauges_follow_the_upstream_counters(start_proxy: StartProxy) -> None:
    p = start_proxy(cancellation="on", deadline_s=10.0, capacity=2.0)
    first = p.metrics()
    assert math.isnan(first[("retrywatch_prompt_token_gap_ratio", ())])
    # One execution aborted before its first token (admitted, never counted by the engine's
    # prompt-token counter), one completed: half the admitted prompt tokens are missing.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{p.url}/v1/completions", json=_body(1), headers=_headers(ttft="3"), timeout=0.3)
    assert (
        httpx.post(f"{p.url}/v1/completions", json=_body(1, prompt=[5, 6, 7, 8]), timeout=5).status_code
        == 200
    )
    time.sleep(1.2)  # past the passthrough cache
    m = p.metrics()
    assert m[("retrywatch_prompt_token_gap_ratio", ())] == pytest.approx(0.5)
    assert m[("retrywatch_attempt_rate", ())] > 0
    assert m[("retrywatch_creation_capacity_ratio", ())] == pytest.approx(
        m[("retrywatch_execution_creation_rate", ())] / 2.0
    )
    assert m[("retrywatch_waiting_littles_law_ratio", ())] >= 0
