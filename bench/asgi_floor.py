"""The floor under the proxy's added latency: an ASGI forwarder under uvicorn that does nothing else.

``bench/bench_proxy.py`` measures it beside the direct path and the proxy, interleaved in one run,
so the proxy's added time to first token splits into what any ASGI proxy under uvicorn pays on
this machine (two more loopback hops, uvicorn's request parsing, task and writes) and what the
proxy's own work costs (validation, call key, policy, fan-out, disconnect watching, metrics).

It forwards a generation request's body to the upstream on the proxy's own lean client
(``exporter.upstream.UpstreamPool``: one write per request, kept-alive connections) and relays
each body chunk as it is read. It validates nothing, decides nothing, counts nothing: it is a
measuring instrument, not a proxy. It runs under stock uvicorn with the settings of
``retrywatch proxy``; the proxy's bounded protocol (``foundation/server.py``: head bounds, timeouts,
connection cap) counts as part of the proxy's own work.

Run: ``python bench/asgi_floor.py --upstream http://127.0.0.1:8000 --port 8101``
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from exporter.upstream import UpstreamPool, forwardable_headers

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Floor:
    """POST bodies go to the upstream, the response comes back chunk by chunk; any other
    request gets an empty 200 (the benchmark's readiness probe)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.pool: UpstreamPool | None = None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        parts: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if scope["method"] != "POST" or self.pool is None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        response = await self.pool.open(
            "POST", scope["path"], b"".join(parts), forwardable_headers(scope["headers"])
        )
        try:
            content_type = response.headers.get("content-type", "application/octet-stream")
            headers = [(b"content-type", content_type.encode("latin-1"))]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            while (chunk := await response.read_chunk()) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.pool = UpstreamPool(self.upstream)
                gc.collect()
                gc.freeze()  # as the proxy does at start-up
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.pool is not None:
                    self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream", required=True, help="base URL of the upstream, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    args = parser.parse_args()
    uvicorn.run(  # the settings of `retrywatch proxy` (foundation/server.py's ServerConfig)
        Floor(args.upstream),
        host=args.host,
        port=args.port,
        loop="auto",
        http="auto",
        log_level="warning",
        access_log=False,
        lifespan="on",
        proxy_headers=False,
        timeout_keep_alive=75,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
