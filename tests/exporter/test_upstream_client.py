"""The generation client (``UpstreamPool``) against the test upstream: keep-alive reuse, raw
bytes, closing mid-response aborts, and errors when the upstream is gone or breaks off."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from exporter.upstream import UpstreamError, UpstreamPool
from tests.exporter.support import Upstream, free_port

BODY = json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True}).encode()


def test_sequential_requests_reuse_one_kept_alive_connection(upstream: Upstream) -> None:
    async def scenario() -> list[bytes]:
        pool = UpstreamPool(upstream.url)
        bodies = []
        connections = set()
        for _ in range(3):
            response = await pool.open(
                "POST", "/v1/completions", BODY, [("content-type", "application/json")]
            )
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            bodies.append(b"".join([chunk async for chunk in response.aiter_raw()]))
            connections.add(id(response._conn))
            await response.aclose()
        pool.close()
        assert len(connections) == 1
        return bodies

    for body in asyncio.run(scenario()):
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")


def test_closing_mid_response_closes_the_connection_and_the_upstream_sees_it(upstream: Upstream) -> None:
    call = uuid.uuid4().hex

    async def scenario() -> float:
        pool = UpstreamPool(upstream.url)
        headers = [("x-call-id", call), ("x-test-token-interval", "0.05")]
        body = BODY.replace(b'"max_tokens": 3', b'"max_tokens": 100')
        response = await pool.open("POST", "/v1/completions", body, headers)
        async for _ in response.aiter_raw():
            break
        await response.aclose()
        left = time.time()
        assert not pool._idle  # an unfinished connection is never reused
        pool.close()
        return left

    left = asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not upstream.requests(call_id=call)[0]["aborted"]:
        time.sleep(0.02)
    record = upstream.requests(call_id=call)[0]
    assert record["aborted"] and record["aborted_at"] - left < 2.0


def test_unreachable_and_broken_upstreams_raise_upstream_error(upstream: Upstream) -> None:
    async def unreachable() -> None:
        await UpstreamPool(f"http://127.0.0.1:{free_port()}").open("POST", "/v1/completions", BODY, [])

    with pytest.raises(UpstreamError):
        asyncio.run(unreachable())

    async def broken() -> None:
        pool = UpstreamPool(upstream.url)
        headers = [("x-test-mode", "crash"), ("x-test-crash-after", "1")]
        response = await pool.open("POST", "/v1/completions", BODY, headers)
        try:
            async for _ in response.aiter_raw():
                pass
        finally:
            await response.aclose()
            pool.close()

    with pytest.raises(UpstreamError):
        asyncio.run(broken())
