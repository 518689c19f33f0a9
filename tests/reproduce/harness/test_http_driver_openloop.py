"""The open-loop client over real loopback sockets: its live counts, its bound on calls in
progress (the demo's), and a cancelled run closing every open attempt (the demo's stop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from reproduce.harness.openloop import OpenLoopClient, OpenLoopStats
from reproduce.workloads.calls import PlannedCall
from reproduce.workloads.client import ClientConfig

_DONE = b'data: {"choices": [{"index": 0, "text": " a", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'


class _Server:
    """A loopback HTTP server that answers every completion after ``answer_after_s`` seconds
    (None: never) with a finished stream, and counts the connections its clients closed."""

    def __init__(self, answer_after_s: float | None) -> None:
        self.answer_after_s = answer_after_s
        self.requests = 0
        self.disconnects = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        json.loads(await reader.readexactly(length))
        self.requests += 1
        if self.answer_after_s is None:
            if not await reader.read(1):  # the client closed its end: it gave up
                self.disconnects += 1
            writer.close()
            return
        await asyncio.sleep(self.answer_after_s)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + _DONE
        )
        await writer.drain()
        writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


def _calls(n: int) -> list[PlannedCall]:
    return [PlannedCall(f"c-{i}", 0.01 * i, 8, 2, 1, "pulse") for i in range(n)]


def test_live_counts_and_the_bound_on_calls_in_progress() -> None:
    async def go() -> tuple[OpenLoopStats, int]:
        server = _Server(answer_after_s=0.5)
        url = await server.start()
        stats = OpenLoopStats()
        client = OpenLoopClient(
            url, "m", 100, ClientConfig(deadline_s=5.0, horizon_s=10.0), max_calls_in_progress=4, stats=stats
        )
        await client.run(_calls(6))
        server.server.close()
        return client.stats, server.requests

    stats, requests = asyncio.run(go())
    # Six calls arrive within 50 ms, each answered after 0.5 s: the bound starts four.
    assert (stats.calls_started, stats.calls_skipped, requests) == (4, 2, 4)
    assert (stats.calls_delivered, stats.calls_delivered_in_deadline, stats.calls_failed) == (4, 4, 0)
    assert (stats.attempts_sent, stats.retries_sent, stats.in_progress) == (4, 0, 0)


def test_a_cancelled_run_closes_every_open_attempt_promptly() -> None:
    async def go() -> tuple[OpenLoopStats, _Server, float]:
        server = _Server(answer_after_s=None)
        url = await server.start()
        client = OpenLoopClient(url, "m", 100, ClientConfig(deadline_s=60.0, horizon_s=120.0))
        task = asyncio.create_task(client.run(_calls(3)))
        while server.requests < 3:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stopped = time.monotonic() - started
        for _ in range(100):  # the server reads each close on its own
            if server.disconnects == 3:
                break
            await asyncio.sleep(0.01)
        server.server.close()
        return client.stats, server, stopped

    stats, server, stopped = asyncio.run(go())
    assert stats.calls_started == 3 and stats.in_progress == 3  # none delivered, none given up yet
    assert server.disconnects == 3  # every open attempt was closed: the server saw disconnects
    assert stopped < 2.0
