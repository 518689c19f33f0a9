"""The proxy under timing that once broke it: a slow upstream /metrics, and many concurrent calls
whose clients close at ``[DONE]`` before the upstream's stream has ended."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import Callable

import httpx

from tests.exporter.support import RunningProxy, Upstream, balance

StartProxy = Callable[..., RunningProxy]
WAITING = 'vllm:num_requests_waiting{model_name="test-model"}'
DONE = b"data: [DONE]\n\n"


def _scrape(url: str) -> tuple[float, str]:
    t0 = time.monotonic()
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return time.monotonic() - t0, text


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_a_slow_upstream_metrics_serves_the_last_good_scrape_then_drops_it(
    start_proxy: StartProxy, upstream: Upstream
) -> None:
    p = start_proxy(upstream_metrics_timeout_s=0.2, upstream_metrics_max_staleness_s=3.0)
    _, text = _scrape(p.url)
    assert WAITING in text
    upstream.set_metrics_delay(3.5)  # each upstream scrape now takes 3.5 s
    try:
        good_at = p.proxy.metrics.upstream_good_at  # the proxy's clock is time.monotonic
        time.sleep(max(0.0, good_at + 1.2 - time.monotonic()))  # past the 1-s cache: refreshes start
        scrapes_before = upstream.metrics_scrapes()
        # The staleness bound leaves these scrapes 1.8 s, so a loaded machine does not fail them.
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            results = list(pool.map(_scrape, [p.url] * 5))
        for elapsed, text in results:
            assert elapsed < 1.5  # waited ~0.2 s for the refresh, not the upstream's 3.5 s
            assert WAITING in text  # the last good scrape, 1.2 s old, is still served
        assert "retrywatch_upstream_up 1.0" in results[0][1]
        assert upstream.metrics_scrapes() - scrapes_before <= 1  # one refresh in flight, never more
        assert p.proxy.metrics.upstream_good_at == good_at
        time.sleep(max(0.0, good_at + 3.2 - time.monotonic()))
        elapsed, text = _scrape(p.url)
        assert elapsed < 1.5
        assert "vllm:" not in text  # past the staleness bound: dropped, so the gap is visible
        assert "retrywatch_executions_live" in text
    finally:
        upstream.set_metrics_delay(0.0)
    # The slow refresh times out at the staleness bound; the next one gets a fresh scrape.
    _wait_for(lambda: WAITING in _scrape(p.url)[1])
    assert "retrywatch_upstream_up 1.0" in _scrape(p.url)[1]


async def _call(client: httpx.AsyncClient, url: str, i: int, style: str) -> bool:
    """One call; True if its whole response arrived. ``style``: stream read to the end, stream
    closed as soon as ``[DONE]`` arrives (what the OpenAI SDK and most SSE clients do), or
    non-streaming."""
    body = {"model": "test-model", "prompt": [1, 2, 3, i], "max_tokens": 4, "stream": style != "json"}
    headers = {"x-call-id": uuid.uuid4().hex, "x-test-done-gap": "0.05", "x-test-token-interval": "0.002"}
    if style == "json":
        r = await client.post(url, json=body, headers=headers)
        return r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
    async with client.stream("POST", url, json=body, headers=headers) as r:
        got = b""
        async for data in r.aiter_raw():
            got += data
            if style == "close-at-done" and got.endswith(DONE):
                return True  # leaving the block closes the connection mid-response
    return r.status_code == 200 and got.endswith(DONE)


async def _calls(url: str, n: int) -> list[bool]:
    styles = ("to-end", "close-at-done", "json")
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        return await asyncio.gather(*(_call(client, url, i, styles[i % 3]) for i in range(n)))


def test_every_waited_for_execution_is_completed_never_orphaned(start_proxy: StartProxy) -> None:
    p = start_proxy()
    n = 90
    assert all(asyncio.run(_calls(f"{p.url}/v1/completions", n)))
    _wait_for(lambda: p.metrics()[("retrywatch_executions_live", ())] == 0)
    m = p.metrics()
    balance(m)

    def fate(f: str) -> float:
        return m[("retrywatch_executions_finished_total", (("fate", f),))]

    assert m[("retrywatch_executions_created_total", ())] == n
    assert fate("orphaned") == 0
    assert fate("completed") == n
    delivered = sum(
        m[("retrywatch_calls_delivered_total", (("within_deadline", w),))] for w in ("true", "false")
    )
    assert delivered == n
    assert m[("retrywatch_attempt_duration_seconds_count", (("outcome", "delivered"),))] == n
    assert m[("retrywatch_subscribers", ())] == 0
