"""How long the proxy's per-attempt work takes hot, and after the process has been idle.

Run: ``python bench/bench_attempt_path.py`` (a few seconds). In one process, with no server and
no upstream, it times ``Proxy.generate_asgi`` for a streaming completion with its own call id
(reading the body, parsing, validation, the call key, the policy's decision, the relay and
subscription): back to back, and after the event loop sat idle for 0.5, 2 and 10 ms before each
attempt. The policy's effects (the upstream request) are not carried out, and each execution is
completed and delivered right after its attempt, so the policy stays the same size throughout.

A proxy in front of an engine sits idle between most requests. The gap between the hot figure
and the idle ones is what the CPU's cold caches cost the same code: the part of the added time
to first token (``bench/bench_proxy.py``) that no change to the work done per attempt can remove
by making the hot loop faster.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

import orjson

from exporter.policy import Cancellation, Effect
from exporter.proxy import Proxy, SubscriberResponse
from exporter.settings import ProxySettings

BODY = orjson.dumps({"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": 50, "stream": True})


class DecisionOnly(Proxy):
    """The proxy with the policy's effects left undone: nothing is sent upstream."""

    def apply(self, effects: list[Effect]) -> None:
        return None


def scope() -> MutableMapping[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8100"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"x-call-id", uuid.uuid4().hex.encode()),
    ]
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


async def receive() -> MutableMapping[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


async def timings(proxy: Proxy, gap_s: float, attempts: int) -> list[float]:
    out: list[float] = []
    for _ in range(attempts):
        request = scope()
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = time.perf_counter_ns()
        response = await proxy.generate_asgi(request, receive)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        assert isinstance(response, SubscriberResponse), "the attempt was not admitted"
        proxy._complete(response.relay)
        proxy.subscriber_delivered(response.subscription, proxy.now())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=300, help="attempts timed per gap")
    args = parser.parse_args()
    proxy = DecisionOnly(ProxySettings(upstream="http://127.0.0.1:9", cancellation=Cancellation.ON))

    async def run() -> None:
        await timings(proxy, 0.0, 200)  # warm up
        for gap_s in (0.0, 0.0005, 0.002, 0.010):
            xs = sorted(await timings(proxy, gap_s, args.attempts))
            label = "back to back" if not gap_s else f"after {gap_s * 1e3:g} ms idle"
            print(
                f"per-attempt work, {label:>18}: median {statistics.median(xs):6.1f} us,"
                f" p90 {xs[int(0.9 * (len(xs) - 1))]:6.1f} us ({len(xs)} attempts)"
            )

    asyncio.run(run())


if __name__ == "__main__":
    main()
