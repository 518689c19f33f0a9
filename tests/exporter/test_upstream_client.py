"""The generation client (``UpstreamPool``) against the test upstream: keep-alive reuse, raw
bytes, closing mid-response aborts, interim responses skipped, a request never sent twice, dead
idle connections never written on, and errors when the upstream is gone or breaks off."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import time
import uuid

import pytest

from exporter.upstream import UpstreamBroken, UpstreamPool, UpstreamUnreachable
from foundation.bounds import MAX_METRICS_BYTES
from foundation.processes import free_port
from tests.exporter.support import Upstream

BODY = json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 3, "stream": True}).encode()


def test_sequential_requests_reuse_one_kept_alive_connection(upstream: Upstream) -> None:
    async def scenario() -> list[bytes]:
        pool = UpstreamPool(upstream.url)
        bodies = []
        connections = set()
        for _ in range(3):
            response = await pool.open(
                "POST", "/v1/completions", BODY, [(b"content-type", b"application/json")]
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
        headers = [(b"x-call-id", call.encode()), (b"x-test-token-interval", b"0.05")]
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


def test_unreachable_and_broken_upstreams_raise_their_own_errors(upstream: Upstream) -> None:
    async def unreachable() -> None:
        await UpstreamPool(f"http://127.0.0.1:{free_port()}").open("POST", "/v1/completions", BODY, [])

    with pytest.raises(UpstreamUnreachable):
        asyncio.run(unreachable())

    async def broken() -> None:
        pool = UpstreamPool(upstream.url)
        headers = [(b"x-test-mode", b"crash"), (b"x-test-crash-after", b"1")]
        response = await pool.open("POST", "/v1/completions", BODY, headers)
        try:
            async for _ in response.aiter_raw():
                pass
        finally:
            await response.aclose()
            pool.close()

    with pytest.raises(UpstreamBroken):
        asyncio.run(broken())


async def _complete(pool: UpstreamPool, call: str, *extra: tuple[bytes, bytes]) -> tuple[bytes, object]:
    """One whole request: (its body, the connection that carried it)."""
    response = await pool.open("POST", "/v1/completions", BODY, [(b"x-call-id", call.encode()), *extra])
    assert response.status_code == 200
    body = b"".join([chunk async for chunk in response.aiter_raw()])
    await response.aclose()
    return body, response._conn


def _own(upstream: Upstream, call: str, body: bytes) -> bool:
    """The body answers the one request this call sent to the upstream."""
    records = upstream.requests(call_id=call)
    return len(records) == 1 and f'"id":"cmpl-{records[0]["request_id"]}"'.encode() in body


def test_interim_responses_are_skipped_and_the_connection_stays_in_step(upstream: Upstream) -> None:
    calls = [uuid.uuid4().hex for _ in range(4)]

    async def scenario() -> list[tuple[bytes, object]]:
        pool = UpstreamPool(upstream.url)
        interim = [(b"x-test-interim", b"100,103"), (b"x-test-ttft", b"0.05")]
        out = [await _complete(pool, calls[0], *interim), await _complete(pool, calls[1], *interim)]
        out += [await _complete(pool, c) for c in calls[2:]]
        pool.close()
        return out

    results = asyncio.run(scenario())
    assert all(conn is results[0][1] for _, conn in results)  # one connection, reused each time
    for call, (body, _) in zip(calls, results, strict=True):
        assert _own(upstream, call, body) and body.endswith(b"data: [DONE]\n\n")


def test_a_101_is_a_broken_exchange_and_the_connection_is_not_reused(upstream: Upstream) -> None:
    async def scenario() -> None:
        pool = UpstreamPool(upstream.url)
        with pytest.raises(UpstreamBroken, match="101"):
            await pool.open("POST", "/v1/completions", BODY, [(b"x-test-interim", b"101")])
        assert not pool._idle
        pool.close()

    asyncio.run(scenario())


def test_a_request_is_sent_once_even_if_its_reused_connection_closes(upstream: Upstream) -> None:
    """The upstream reads the request, works 0.3 s, then closes the connection without a byte
    of answer: the request must not be sent again on another connection."""
    warm, call = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> None:
        pool = UpstreamPool(upstream.url)
        await _complete(pool, warm)  # a kept-alive connection in the pool: the next one reuses it
        headers = [(b"x-call-id", call.encode()), (b"x-test-mode", b"close"), (b"x-test-ttft", b"0.3")]
        with pytest.raises(UpstreamBroken, match="closed the connection"):
            await pool.open("POST", "/v1/completions", BODY, headers)
        assert not pool._idle
        pool.close()

    asyncio.run(scenario())
    assert len(upstream.requests(call_id=call)) == 1


def test_an_idle_connection_the_upstream_closed_is_not_written_on(upstream: Upstream) -> None:
    """The upstream hangs up an idle connection while the proxy's loop is busy (so the loop has
    not yet seen the end of the stream): the next request must go out on a fresh connection,
    once, and be answered."""
    first, second = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario() -> tuple[object, bytes, object]:
        pool = UpstreamPool(upstream.url, max_idle_s=60)  # not expired: the poll must see it
        _, used = await _complete(pool, first, (b"x-test-keep-alive", b"0.1"))
        # NOTE: blocks the loop on purpose until the hang-up has reached the kernel, unseen by
        # the connection's protocol (the loop has not run since).
        transport = pool._idle[0].transport
        assert transport is not None
        sock = transport.get_extra_info("socket")
        assert sock is not None and select.select([sock], [], [], 10)[0]
        body, conn = await _complete(pool, second)
        pool.close()
        return used, body, conn

    used, body, conn = asyncio.run(scenario())
    assert conn is not used
    assert _own(upstream, second, body)


def test_a_connection_idle_past_max_idle_is_closed_not_reused(upstream: Upstream) -> None:
    async def scenario() -> None:
        pool = UpstreamPool(upstream.url, max_idle_s=1.0)
        _, used = await _complete(pool, uuid.uuid4().hex)
        stale = pool._idle[0]
        assert (await _complete(pool, uuid.uuid4().hex))[1] is used  # young enough: reused
        await asyncio.sleep(1.5)
        assert (await _complete(pool, uuid.uuid4().hex))[1] is not used
        assert stale.transport is not None and stale.transport.is_closing()
        pool.close()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="max_idle_s"):
        UpstreamPool(upstream.url, max_idle_s=0)


def test_a_connection_that_receives_bytes_while_idle_is_not_reused() -> None:
    """A server that sends a second, unasked-for response after the first: whatever comes after
    the end of an answer puts the connection out of step, and it is never reused."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"

    async def scenario() -> list[object]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while await reader.readuntil(b"\r\n\r\n"):
                    writer.write(answer)
                    await asyncio.sleep(0.05)
                    writer.write(answer)  # nobody asked for this one
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(f"http://127.0.0.1:{port}")
        used: list[object] = []
        for _ in range(2):
            response = await pool.open("GET", "/", b"", [])
            assert b"".join([c async for c in response.aiter_raw()]) == b"hi"
            await response.aclose()
            used.append(response._conn)
            await asyncio.sleep(0.2)
        pool.close()
        server.close()
        return used

    first, second = asyncio.run(scenario())
    assert second is not first


def test_a_text_answer_over_its_bound_is_a_broken_exchange_and_the_connection_is_closed(
    upstream: Upstream,
) -> None:
    """``get_text`` (the upstream's /metrics) read a whole answer, however large; past its bound
    (``MAX_METRICS_BYTES`` unless told) it raises ``UpstreamBroken`` (a connection whose answer
    was not read to its end is closed: ``test_proxy_upstream.py`` has an endless one)."""

    async def scenario() -> None:
        pool = UpstreamPool(upstream.url)
        whole = await pool.get_text("/metrics", 5)
        assert "vllm:" in whole and len(whole) < MAX_METRICS_BYTES
        with pytest.raises(UpstreamBroken, match=f"over {len(whole) - 1} bytes"):
            await pool.get_text("/metrics", 5, max_bytes=len(whole) - 1)
        assert await pool.get_text("/metrics", 5, max_bytes=len(whole)) == whole
        pool.close()

    asyncio.run(scenario())
