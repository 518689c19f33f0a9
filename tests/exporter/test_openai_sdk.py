"""A real client nobody here wrote: the official ``openai`` SDK, with a per-call id header. Its own
automatic retry after a timeout attaches to the live execution under coalescing; the timeout it
declares on every attempt is the deadline the proxy learns, before any client gives up."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import openai

from exporter.deadlines import MIN_ABANDONS
from foundation import metricnames as mn
from tests.exporter.support import RunningProxy, Upstream, balance, until


def test_sdk_retries_after_a_timeout_attach_to_the_live_execution(
    start_proxy: Callable[..., RunningProxy], upstream: Upstream
) -> None:
    p = start_proxy()  # the default policy: coalescing on, cancellation deferred by 10 s
    call = uuid.uuid4().hex
    client = openai.OpenAI(
        base_url=f"{p.url}/v1",
        api_key="unused",
        timeout=0.8,  # the first attempt times out waiting for its first token (1.2 s)
        max_retries=2,
        default_headers={"X-Call-Id": call, "x-test-ttft": "1.2", "x-test-token-interval": "0.1"},
    )
    with client:
        stream = client.completions.create(model="test-model", prompt=[1, 2, 3], max_tokens=20, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == "".join(f" t{i}" for i in range(20))
    records = upstream.requests(call_id=call)
    assert len(records) == 1 and records[0]["completed"] and not records[0]["aborted"]
    m = p.metrics()
    balance(m)
    assert m[("retrywatch_attempts_total", (("kind", "retry"),))] >= 1
    assert m[("retrywatch_attempts_attached_total", ())] >= 1
    assert m[("retrywatch_executions_created_total", ())] == 1


def test_the_sdks_declared_timeout_is_the_deadline_before_any_abandon(
    start_proxy: Callable[..., RunningProxy], upstream: Upstream
) -> None:
    p = start_proxy()  # no deadline stated
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="unused", timeout=42.5, max_retries=0)
    with client:
        for i in range(MIN_ABANDONS):
            assert client.completions.create(model="test-model", prompt=[i, 2, 3], max_tokens=2).choices
    assert until(lambda: p.metrics()[(mn.CLIENT_DEADLINE_SOURCE, (("source", "learned"),))] == 1.0, 10.0)
    m = p.metrics()
    assert m[(mn.CLIENT_DEADLINE, ())] == 42.5 == p.proxy.policy.deadline_s
    assert m[(mn.CLIENT_DEADLINE_LEARNED, (("class", "1"),))] == 42.5
    assert m[(mn.CLIENT_DEADLINE_ABANDONS, (("class", "1"),))] == 0.0  # nobody gave up
