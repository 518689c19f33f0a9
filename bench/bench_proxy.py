"""Benchmark of the proxy against the test upstream: prints figures, asserts nothing.

Run: ``python bench/bench_proxy.py`` (about three minutes). It starts the test upstream
(``tests/exporter/upstream.py``), ``retrywatch proxy``, the floor forwarder
(``bench/asgi_floor.py``: an ASGI app under uvicorn that only forwards) and Debian's nginx (one
worker, the configuration of ``bench/bench_floor.py``; skipped if nginx is not installed) as
processes on free loopback ports and measures, side by side in one run:

* time to first token with 100 concurrent streams (clients staggered, each streaming 50 tokens
  in 0.5 s, six times, cycling through the direct path, the proxy, the floor and nginx, so all
  are measured interleaved, at the same concurrency and machine load): p50 and p99 of each, and
  the differences from the direct path (the added TTFT); every stream has its own call id; the
  CPU time of the proxy's and nginx's processes per chunk they relayed in those rounds; and the
  three ratios of the targets: added p50 / max(nginx's added p50, 0.25 ms), added p99 /
  max(nginx's added p99, 1 ms), CPU per chunk / nginx's (each <= 2 meets its target);
* relay throughput (chunks/s) with 100 concurrent streams at full speed, and the proxy's CPU
  time per chunk relayed (from /proc);
* one execution fanned out to 10 subscribers (same call id): their time to first token and
  that the upstream saw one request;
* the proxy's resident memory holding 1,000 live executions with 400-token replay buffers.

The client is a minimal HTTP/1.1 client on asyncio streams, so its own overhead stays small and
is the same on both paths. Each figure is printed with the machine's load average (1 min) at
its start and end and the number of cores: on a shared machine, figures taken under load are
not comparable with figures taken on an idle one, and only the side-by-side differences are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
from bench_floor import NGINX_CONF

from exporter.policy import Cancellation
from exporter.settings import ProxySettings
from foundation.processes import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parents[1]  # the repository: ``python -m tests...`` runs from it

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children (nginx's master and worker)."""
    total = cpu_seconds(pid)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return total + sum(cpu_seconds(c) for c in children)


def load() -> str:
    """The 1-minute load average now, as printed beside each figure."""
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class StreamResult:
    ttft_s: float
    total_s: float
    chunks: int
    ok: bool


async def stream_once(
    port: int, body: bytes, headers: dict[str, str], hold: asyncio.Event | None = None
) -> StreamResult:
    """POST a streaming completion, time the first body bytes, count SSE events to the end."""
    head = [
        "POST /v1/completions HTTP/1.1",
        f"host: 127.0.0.1:{port}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        status_line = await reader.readline()
        ok = b" 200 " in status_line
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        ttft = None
        events = 0
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            events += data.count(b"data: ")
            if hold is not None:
                await hold.wait()
        total = time.perf_counter() - t0
        return StreamResult(ttft if ttft is not None else total, total, events, ok)
    finally:
        writer.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def completion(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "stream": True}
    ).encode()


async def _client(
    paths: list[tuple[str, int]], body: bytes, headers: dict[str, str], start_s: float, n: int, first: int
) -> list[tuple[str, StreamResult]]:
    """``n`` streams one after the other, cycling through the paths from ``paths[first]``."""
    await asyncio.sleep(start_s)
    out: list[tuple[str, StreamResult]] = []
    for k in range(n):
        name, port = paths[(first + k) % len(paths)]
        out.append((name, await stream_once(port, body, {**headers, "x-call-id": uuid.uuid4().hex})))
    return out


async def ttft_rounds(
    paths: list[tuple[str, int]],
    rounds: int,
    concurrency: int,
    per_client: int,
    pids: dict[str, int] | None = None,
    tokens: int = 50,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each round runs ``concurrency`` clients (staggered over one stream's length, so about that
    many streams are in flight) doing ``per_client`` streams each. Every client cycles through
    the paths (the clients' starting paths rotate), so all paths are measured at the same time,
    at the same concurrency, on the same machine load. Every stream has its own call id, as
    real calls do (identical bodies would otherwise coalesce)."""
    body = completion(tokens)
    headers = {"x-test-token-interval": "0.01"}
    stream_s = tokens * 0.01
    out: dict[str, list[float]] = {name: [] for name, _ in paths}
    pids = pids or {}
    cpu = dict.fromkeys(pids, 0.0)
    for r in range(rounds):
        starts = [stream_s * i / concurrency for i in range(concurrency)]
        cpu0 = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        clients = (
            _client(paths, body, headers, s, per_client, (i + r) % len(paths)) for i, s in enumerate(starts)
        )
        per = await asyncio.gather(*clients)
        for name, pid in pids.items():
            cpu[name] += tree_cpu_seconds(pid) - cpu0[name]
        results = [x for xs in per for x in xs]
        failed = sorted({name for name, x in results if not (x.ok and x.chunks == tokens + 1)})
        assert not failed, f"a stream failed on {failed}"
        for name, x in results:
            out[name].append(x.ttft_s)
    return out, cpu


async def throughput(port: int, concurrency: int, tokens: int) -> tuple[float, int]:
    body = completion(tokens)
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(stream_once(port, body, {"x-call-id": uuid.uuid4().hex}) for _ in range(concurrency))
    )
    wall = time.perf_counter() - t0
    chunks = sum(x.chunks for x in results)
    return chunks / wall, chunks


async def fan_out(px: int, up_url: str, subscribers: int) -> tuple[list[StreamResult], int]:
    body = completion(100)
    call = f"fanout-{time.time_ns()}"
    headers = {"x-call-id": call, "x-test-ttft": "0.2", "x-test-token-interval": "0.005"}
    results = list(await asyncio.gather(*(stream_once(px, body, headers) for _ in range(subscribers))))
    async with httpx.AsyncClient() as client:
        seen = (await client.get(f"{up_url}/test/requests", params={"call_id": call})).json()["requests"]
    return results, len(seen)


async def memory(px: int, up_url: str, pid: int, executions: int) -> tuple[float, float]:
    base = rss_mb(pid)
    body = completion(401)
    tag = f"mem-{time.time_ns()}"
    headers = {"x-test-stall-after": "400", "x-test-stall": "60", "x-test-tag": tag}
    hold = asyncio.Event()
    tasks = [asyncio.create_task(stream_once(px, body, headers, hold)) for _ in range(executions)]
    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = (await client.get(f"{up_url}/test/requests", params={"tag": tag}, timeout=30)).json()[
                "requests"
            ]
            if len(rows) >= executions and all(r["tokens_sent"] >= 400 for r in rows):
                break
            await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # let the proxy read what the upstream wrote
    held = rss_mb(pid)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return base, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=500, help="tokens per stream in the throughput phase")
    parser.add_argument("--executions", type=int, default=1000, help="live executions in the memory phase")
    args = parser.parse_args()

    up_port, px_port, floor_port, nginx_port = free_port(), free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    logs = Path(tempfile.mkdtemp(prefix="bench-proxy-"))  # kept: the processes' logs
    nginx = shutil.which("nginx")
    if nginx is None:
        print("nginx: skipped, it is not installed (the ratios need it)")
    commands = {
        "test upstream": [sys.executable, "-m", "tests.exporter.upstream", "--port", str(up_port)],
        "floor": [sys.executable, str(ROOT / "bench" / "asgi_floor.py"), "--upstream", upstream,
                  "--port", str(floor_port)],
        "proxy": [sys.executable, "-m", "retrywatch", "proxy",
                  *ProxySettings(upstream=upstream, port=px_port, cancellation=Cancellation.ON).to_argv()],
    }  # fmt: skip
    if nginx is not None:
        (logs / "nginx").mkdir()
        conf = logs / "nginx" / "nginx.conf"
        conf.write_text(NGINX_CONF.format(d=logs / "nginx", upstream=up_port, port=nginx_port))
        commands["nginx"] = [nginx, "-p", str(logs / "nginx"), "-c", str(conf), "-e", "stderr"]
    procs = {
        name: ManagedProcess(argv, log_path=logs / f"{name}.log", bound_s=None, cwd=ROOT, name=name).start()
        for name, argv in commands.items()
    }
    up, floor, px = procs["test upstream"], procs["floor"], procs["proxy"]
    try:
        ready = [
            (up, f"{upstream}/health"),
            (px, f"http://127.0.0.1:{px_port}/metrics"),
            (floor, f"http://127.0.0.1:{floor_port}/"),
        ]
        if "nginx" in procs:
            ready.append((procs["nginx"], f"http://127.0.0.1:{nginx_port}/health"))
        for proc, url in ready:
            proc.wait_ready(url, timeout_s=60.0, poll_s=0.05, ready=lambda status: status < 500)
        paths = [("direct", up_port), ("proxy", px_port), ("floor", floor_port)]
        assert px.pid is not None
        pids = {"proxy": px.pid}
        nginx_pid = procs["nginx"].pid if "nginx" in procs else None
        if nginx_pid is not None:
            paths.append(("nginx", nginx_port))
            pids["nginx"] = nginx_pid
        asyncio.run(ttft_rounds(paths, 1, 10, 3, tokens=2))  # warm up every path

        print(f"machine: {os.cpu_count()} cores; load average (1 min) {load()} at the start")
        before = load()
        seq, _ = asyncio.run(ttft_rounds(paths, 10, 1, 42, tokens=2))
        d50, p50, f50 = (pct(seq[name], 0.5) for name in ("direct", "proxy", "floor"))
        print(
            f"TTFT of one stream at a time (load {before} -> {load()}), {len(seq['proxy'])} per path:"
            f" direct p50 {d50 * 1e3:.2f} ms; proxy p50 {p50 * 1e3:.2f} ms, added {(p50 - d50) * 1e3:.2f} ms;"
            f" floor p50 {f50 * 1e3:.2f} ms, added {(f50 - d50) * 1e3:.2f} ms"
        )
        before = load()
        ttft, cpu = asyncio.run(ttft_rounds(paths, args.rounds, args.concurrency, 6, pids))
        paced_cpu = cpu["proxy"]
        d50, d99 = pct(ttft["direct"], 0.5), pct(ttft["direct"], 0.99)
        p50, p99 = pct(ttft["proxy"], 0.5), pct(ttft["proxy"], 0.99)
        f50, f99 = pct(ttft["floor"], 0.5), pct(ttft["floor"], 0.99)
        print(
            f"TTFT at {args.concurrency} concurrent streams (paths interleaved; load {before} -> {load()}),"
            f" {len(ttft['proxy'])} streams per path:"
        )
        print(f"  direct  p50 {d50 * 1e3:7.2f} ms   p99 {d99 * 1e3:7.2f} ms")
        print(f"  proxy   p50 {p50 * 1e3:7.2f} ms   p99 {p99 * 1e3:7.2f} ms")
        print(f"  floor   p50 {f50 * 1e3:7.2f} ms   p99 {f99 * 1e3:7.2f} ms   (forwarding only)")
        print(
            f"  added by the proxy   p50 {(p50 - d50) * 1e3:5.2f} ms   p99 {(p99 - d99) * 1e3:5.2f} ms"
            "   (targets 0.5 / 2 ms)"
        )
        print(f"  added by the floor   p50 {(f50 - d50) * 1e3:5.2f} ms   p99 {(f99 - d99) * 1e3:5.2f} ms")
        print(f"  the proxy's own work p50 {(p50 - f50) * 1e3:5.2f} ms   (proxy - floor)")
        paced_chunks = len(ttft["proxy"]) * 51
        print(f"  proxy CPU per paced chunk (one event per read) {paced_cpu / paced_chunks * 1e6:.1f} us,")
        print(f"  per stream (request + 51 chunks) {paced_cpu / len(ttft['proxy']) * 1e3:.2f} ms")
        if "nginx" in ttft:
            n50, n99 = pct(ttft["nginx"], 0.5), pct(ttft["nginx"], 0.99)
            nginx_cpu = cpu["nginx"] / (len(ttft["nginx"]) * 51)
            proxy_cpu = paced_cpu / paced_chunks
            print(f"  nginx   p50 {n50 * 1e3:7.2f} ms   p99 {n99 * 1e3:7.2f} ms")
            print(
                f"  added by nginx       p50 {(n50 - d50) * 1e3:5.2f} ms   p99 {(n99 - d99) * 1e3:5.2f} ms;"
                f" nginx CPU per paced chunk {nginx_cpu * 1e6:.1f} us"
            )
            r50 = (p50 - d50) / max(n50 - d50, 0.25e-3)
            r99 = (p99 - d99) / max(n99 - d99, 1e-3)
            print(
                f"  ratios (targets <= 2): added p50 {r50:.2f} (proxy / max(nginx, 0.25 ms));"
                f" added p99 {r99:.2f} (proxy / max(nginx, 1 ms)); CPU per chunk {proxy_cpu / nginx_cpu:.2f}"
            )

        before = load()
        direct_rate, _ = asyncio.run(throughput(up_port, args.concurrency, args.tokens))
        cpu0 = cpu_seconds(px.pid)
        proxy_rate, chunks = asyncio.run(throughput(px_port, args.concurrency, args.tokens))
        cpu = cpu_seconds(px.pid) - cpu0
        print(
            f"relay throughput, {args.concurrency} streams x {args.tokens} tokens at full speed"
            f" (load {before} -> {load()}):"
        )
        print(f"  direct {direct_rate:9.0f} chunks/s   proxy {proxy_rate:9.0f} chunks/s")
        print(f"  proxy CPU per chunk at full speed (events coalesce in reads) {cpu / chunks * 1e6:.1f} us")

        before = load()
        fan, upstream_requests = asyncio.run(fan_out(px_port, f"http://127.0.0.1:{up_port}", 10))
        ttfts = [x.ttft_s for x in fan]
        print(
            f"fan-out, 1 execution to {len(fan)} subscribers"
            f" (upstream TTFT 200 ms; load {before} -> {load()}):"
        )
        print(
            f"  all complete: {all(x.ok and x.chunks == 101 for x in fan)};"
            f" upstream requests: {upstream_requests};"
            f" TTFT min {min(ttfts) * 1e3:.1f} ms, max {max(ttfts) * 1e3:.1f} ms,"
            f" spread {statistics.pstdev(ttfts) * 1e3:.2f} ms"
        )

        before = load()
        base, held = asyncio.run(memory(px_port, f"http://127.0.0.1:{up_port}", px.pid, args.executions))
        print(
            f"memory: proxy RSS {base:.1f} MB before, {held:.1f} MB holding {args.executions} live executions"
            f" with 400-token replay buffers (target <= 100 MB; load {before} -> {load()})"
        )
    finally:
        for proc in reversed(procs.values()):
            proc.stop(grace_s=10.0)


if __name__ == "__main__":
    main()
