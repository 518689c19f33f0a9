"""The forwarding floor under granian (a Rust HTTP server for Python apps), as ASGI and as RSGI.

``bench/bench_floor.py`` runs these beside the same floor under uvicorn (``bench/asgi_floor.py``),
so the difference is what the server costs. Both forward as that floor does: read the body, send
it upstream on the proxy's own lean client (``exporter.upstream.UpstreamPool``: one write, a
kept-alive connection), relay each body chunk as it is read; nothing else.

* ``asgi``: ``asgi_floor.Floor`` itself, served by granian's ASGI interface;
* ``rsgi``: the same forwarding on granian's own interface (RSGI: the body in one await, the
  response as a stream transport), which skips the ASGI message dictionaries.

The upstream comes from the environment (``FLOOR_UPSTREAM``), as granian imports the app itself.

Run: ``FLOOR_UPSTREAM=http://127.0.0.1:8000 granian --interface rsgi --factory --working-dir bench
--port 8104 --loop uvloop --no-ws granian_floor:rsgi`` (or ``--interface asgi ... granian_floor:asgi``)
"""

from __future__ import annotations

import asyncio
import gc
import os
from typing import Any

from asgi_floor import Floor

from exporter.upstream import UpstreamPool, forwardable_headers

UPSTREAM_ENV = "FLOOR_UPSTREAM"


class RsgiFloor:
    """POST bodies go to the upstream, the response comes back chunk by chunk; any other request
    gets an empty 200 (the benchmark's readiness probe)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.pool: UpstreamPool | None = None

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = UpstreamPool(self.upstream)
        gc.collect()
        gc.freeze()  # as the proxy does at start-up

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.pool is not None:
            self.pool.close()

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        body: bytes = await protocol()
        if scope.method != "POST" or self.pool is None:
            protocol.response_empty(200, [])
            return
        headers = forwardable_headers(
            [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()]
        )
        response = await self.pool.open("POST", scope.path, body, headers)
        try:
            content_type = response.headers.get("content-type", "application/octet-stream")
            transport = protocol.response_stream(response.status_code, [("content-type", content_type)])
            while (chunk := await response.read_chunk()) is not None:
                await transport.send_bytes(chunk)
        finally:
            await response.aclose()


def asgi() -> Floor:
    """The ASGI floor (granian's ``--factory`` target)."""
    return Floor(os.environ[UPSTREAM_ENV])


def rsgi() -> RsgiFloor:
    """The RSGI floor (granian's ``--factory`` target)."""
    return RsgiFloor(os.environ[UPSTREAM_ENV])
