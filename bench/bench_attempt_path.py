"""How long the proxy's per-attempt work takes hot, and after the process has been idle.

Run: ``python bench/bench_attempt_path.py`` (a few seconds). In one process, with no server and
no upstream, it times ``Proxy.attempt`` (the code both of the proxy's paths run) for a streaming
completion with its own call id (parsing, validation, the call key, the policy's decision, the
relay and subscription): back to back, and after the event loop sat idle for 0.5, 2 and 10 ms
before each attempt; beside each, a no-op call timed the same way. The policy's effects (the
upstream request) are not carried out, and each execution is completed and delivered right after
its attempt, so the policy stays the same size throughout.

Beside them, after the same gaps, 256 one-byte reads in a Python loop: within one page, then one
per 4-KiB page of a 64-MiB buffer (pages the previous call did not read), then the same on a
buffer the kernel backs with transparent huge pages (``madvise``; left out where it refuses).
They show how much of a just-woken process's slowness is the data it touches and the TLB.

With ``--record``, two rows more: an attempt and its end (completion and delivery) timed
together, by the proxy as above and by one recording its traffic (``--record DIR``, in a temporary
directory): what the recorder adds to the event loop's work per attempt (its writer thread's work
is not on the loop).

A proxy in front of an engine sits idle between most requests. The gap between the hot figure
and the idle ones is what running the same code in a process that has just woken costs (cold
caches, and on a virtual machine whatever the host did meanwhile); the no-op shows what waking
alone costs. That gap is the part of the added time to first token (``bench/bench_proxy.py``)
that grows with the work done per attempt, whatever the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import statistics
import tempfile
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
        proxy.complete(outcome.relay)
        proxy.subscriber_delivered(outcome.subscription, proxy.now())

    return elapsed_us, end


def attempt_and_end(proxy: Proxy) -> Timed:
    """One attempt and its end (completion and delivery), timed together."""
    t0 = time.perf_counter_ns()
    _, end = attempt(proxy)
    end()
    return (time.perf_counter_ns() - t0) / 1e3, lambda: None


def nothing(proxy: Proxy) -> Timed:
    """The reference: no work at all, timed the same way (what waking alone costs)."""
    t0 = time.perf_counter_ns()
    return (time.perf_counter_ns() - t0) / 1e3, lambda: None


READS = 256
PAGE = 4096
PROBE_BYTES = 64 << 20


class Reads:
    """``READS`` one-byte reads of a buffer, ``stride`` bytes apart, each call past the last."""

    def __init__(self, stride: int, huge_pages: bool = False) -> None:
        self.buf = mmap.mmap(-1, PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages:
            self.buf.madvise(mmap.MADV_HUGEPAGE)  # OSError where the kernel has no THP
        self.view = memoryview(self.buf)
        for offset in range(0, PROBE_BYTES, PAGE):
            self.view[offset] = 1  # fault every page in before timing
        self.stride = stride
        self.span = READS * stride + PAGE
        self.base = 0

    def __call__(self, _proxy: Proxy) -> Timed:
        view, stride = self.view, self.stride
        base = self.base = (self.base + self.span) % (PROBE_BYTES - self.span)
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(READS):
            total += view[base + i * stride]
        return (time.perf_counter_ns() - t0) / 1e3, lambda: None


def works() -> list[tuple[str, Callable[[Proxy], Timed]]]:
    """What is timed after each gap, by name: the attempt, a no-op, and the memory reads."""
    out: list[tuple[str, Callable[[Proxy], Timed]]] = [
        ("per-attempt work", attempt),
        ("a no-op call", nothing),
        (f"{READS} reads, one page", Reads(1)),
        (f"{READS} reads, {READS} pages", Reads(PAGE + 64)),
    ]
    with contextlib.suppress(OSError, AttributeError):  # no THP here, or no MADV_HUGEPAGE
        out.append((f"{READS} reads, huge pages", Reads(PAGE + 64, huge_pages=True)))
    return out


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
    parser.add_argument("--record", action="store_true", help="also time an attempt and its end, recording")
    args = parser.parse_args()
    proxy = DecisionOnly(ProxySettings(upstream="http://127.0.0.1:9", cancellation=Cancellation.ON))

    timed = works()
    if args.record:
        record_dir = tempfile.mkdtemp(prefix="bench-record-")
        recording = DecisionOnly(
            ProxySettings(upstream="http://127.0.0.1:9", cancellation=Cancellation.ON, record=record_dir)
        )
        timed += [
            ("attempt + end", attempt_and_end),
            ("attempt + end, recording", lambda _proxy: attempt_and_end(recording)),
        ]

    async def run() -> None:
        await timings(proxy, attempt, 0.0, 200)  # warm up
        for gap_s in (0.0, 0.0005, 0.002, 0.010):
            label = "back to back" if not gap_s else f"after {gap_s * 1e3:g} ms idle"
            for name, work in timed:
                xs = sorted(await timings(proxy, work, gap_s, args.attempts))
                print(
                    f"{name:>25}, {label:>18}: median {statistics.median(xs):6.1f} us,"
                    f" p90 {xs[int(0.9 * (len(xs) - 1))]:6.1f} us ({len(xs)} calls)"
                )

    asyncio.run(run())


if __name__ == "__main__":
    main()
