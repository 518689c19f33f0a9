"""How long the proxy's per-attempt work takes hot, and after the process has been idle.

Run: ``python bench/bench_attempt_path.py`` (a few seconds). In one process, with no server and
no upstream, it times ``Proxy.attempt`` (the code both of the proxy's paths run) for a streaming
completion with its own call id (parsing, validation, the call key, the policy's decision, the
relay and subscription): back to back, and after the event loop sat idle for 0.5, 2 and 10 ms
before each attempt; beside each, a no-op call timed the same way. The policy's effects (the
upstream request) are not carried out, and each execution is completed and delivered right after
its attempt, so the policy stays the same size throughout.

A proxy in front of an engine sits idle between most requests. The gap between the hot figure
and the idle ones is what running the same code in a process that has just woken costs (cold
caches, and on a virtual machine whatever the host did meanwhile); the no-op shows what waking
alone costs. That gap is the part of the added time to first token (``bench/bench_proxy.py``)
that grows with the work done per attempt, whatever the server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable

import orjson

from exporter.policy import Cancellation, Effect
from exporter.proxy import Joined, Proxy, header_map
from exporter.settings import ProxySettings

BODY = orjson.dumps({"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": 50, "stream": True})


class DecisionOnly(Proxy):
    """The proxy with the policy's effects left undone: nothing is sent upstream."""

    def apply(self, effects: list[Effect]) -> None:
        return None


Timed = tuple[float, Callable[[], None]]  # microseconds taken, and what ends it (untimed)


def attempt(proxy: Proxy) -> Timed:
    """One attempt, timed as both of the proxy's paths run it (``Proxy.attempt``, its headers
    read into a map first); its end (completion and delivery) is left to the caller, untimed."""
    raw_headers = [
        (b"host", b"127.0.0.1:8100"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
        (b"x-call-id", uuid.uuid4().hex.encode()),
    ]
    t0 = time.perf_counter_ns()
    outcome = proxy.attempt("/v1/completions", header_map(raw_headers), raw_headers, BODY, proxy.now())
    elapsed_us = (time.perf_counter_ns() - t0) / 1e3
    assert isinstance(outcome, Joined), "the attempt was not admitted"

    def end() -> None:
        proxy._complete(outcome.relay)
        proxy.subscriber_delivered(outcome.subscription, proxy.now())

    return elapsed_us, end


def nothing(proxy: Proxy) -> Timed:
    """The reference: no work at all, timed the same way (what waking alone costs)."""
    t0 = time.perf_counter_ns()
    return (time.perf_counter_ns() - t0) / 1e3, lambda: None


async def timings(proxy: Proxy, work: Callable[[Proxy], Timed], gap_s: float, attempts: int) -> list[float]:
    out: list[float] = []
    for _ in range(attempts):
        if gap_s:
            await asyncio.sleep(gap_s)
        elapsed_us, end = work(proxy)
        out.append(elapsed_us)
        end()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=300, help="attempts timed per gap")
    args = parser.parse_args()
    proxy = DecisionOnly(ProxySettings(upstream="http://127.0.0.1:9", cancellation=Cancellation.ON))

    async def run() -> None:
        await timings(proxy, attempt, 0.0, 200)  # warm up
        for gap_s in (0.0, 0.0005, 0.002, 0.010):
            label = "back to back" if not gap_s else f"after {gap_s * 1e3:g} ms idle"
            for name, work in (("per-attempt work", attempt), ("a no-op call", nothing)):
                xs = sorted(await timings(proxy, work, gap_s, args.attempts))
                print(
                    f"{name:>16}, {label:>18}: median {statistics.median(xs):6.1f} us,"
                    f" p90 {xs[int(0.9 * (len(xs) - 1))]:6.1f} us ({len(xs)} calls)"
                )

    asyncio.run(run())


if __name__ == "__main__":
    main()
