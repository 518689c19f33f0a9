"""Time to first token through a real proxy whose engine serves a huge ``/metrics``, beside one
whose engine serves a small one, for this tree's proxy and (``--before REV``) an earlier commit's.

A vLLM serving many LoRA adapters or models exports 100k series and more; the proxy fetches the
upstream's ``/metrics`` every second and reads the families its window needs. This starts two
engines (``tests/exporter/oddengine.py``: streaming completions, the first token at once, and a
``/metrics`` of ``--series`` series of the families the proxy reads, the worst case, or of 100),
then for each proxy (this tree's, and the earlier commit's extracted with ``git archive``) and each
engine, a proxy process in front of it, ``--clients`` streaming clients for ``--seconds`` (one call
after another, on a new connection each), and a probe call started every 50 ms whatever the
answers. It prints the probes' time to first token (median, p90, worst) and the calls completed,
per proxy and engine. Phases run one after another; run it on a
quiet machine, and more than once.

    .venv/bin/python bench/bench_big_metrics.py --before HEAD~3 [--series 150000] [--clients 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from foundation.processes import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("exporter", "detector", "dashboard", "reproduce", "rules", "retrywatch")
PROBE_EVERY_S = 0.05
BODY = b'{"model":"m","prompt":"hello","max_tokens":8,"stream":true}'


@contextlib.contextmanager
def heavy_engine(logs: Path, series: int) -> Iterator[str]:
    """``tests/exporter/oddengine.py``'s heavy engine as a process; its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.exporter.oddengine", "--port", str(port), "--series", str(series)]
    log = logs / f"engine-{series}.log"
    with ManagedProcess(cmd, log_path=log, bound_s=None, cwd=ROOT, name="engine") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/health", timeout_s=60, poll_s=0.1)
        yield url


def extract(rev: str, into: Path) -> Path:
    """The packages of commit ``rev`` in a directory of their own (put first on PYTHONPATH)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *PACKAGES], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


async def call(port: int) -> tuple[float | None, bool]:
    """One streaming call on a new connection: (seconds to its first event, completed)."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%b" % (len(BODY), BODY)
        )
        seen = b""
        first: float | None = None
        while chunk := await reader.read(65536):
            seen += chunk
            if first is None and b"data:" in seen:
                first = time.perf_counter() - started
        return first, b"data: [DONE]" in seen
    finally:
        writer.close()


async def load(port: int, clients: int, seconds: float, probe_every_s: float) -> tuple[list[float], int]:
    """``clients`` streaming clients, each one call after another, and a probe that starts a call
    every ``probe_every_s`` whatever the answers (open loop: a closed-loop client falls into step
    with the proxy's stalls and starts its calls just after one, so its own time to first token
    hides them); the probes' times to first token, the calls completed in all."""
    ttfts: list[float] = []
    completed = 0
    until = time.monotonic() + seconds

    async def one() -> tuple[float | None, bool]:
        try:
            return await asyncio.wait_for(call(port), timeout=30)
        except (OSError, TimeoutError):
            return None, False

    async def client() -> None:
        nonlocal completed
        while time.monotonic() < until:
            _, done = await one()  # (read before adding: ``completed += await ...`` loses updates)
            completed += done

    async def probe() -> None:
        nonlocal completed
        first, done = await one()
        completed += done
        ttfts.append(math.inf if first is None else first)

    async def probes() -> None:
        started: list[asyncio.Task[None]] = []
        while time.monotonic() < until:
            started.append(asyncio.ensure_future(probe()))
            await asyncio.sleep(probe_every_s)
        await asyncio.gather(*started)

    await asyncio.gather(probes(), *(client() for _ in range(clients)))
    return ttfts, completed


def measure(code: Path | None, engine: str, clients: int, seconds: float, log: Path) -> str:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETRYWATCH_")}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", engine, "--port", str(port)]
    # From the code's own directory: ``python -m`` puts the working directory first on sys.path.
    cwd = ROOT if code is None else code
    with ManagedProcess(cmd, log_path=log, bound_s=None, cwd=cwd, env=env, name="proxy") as proc:
        # Ready once it answers a route of its own (its /metrics may wait for the upstream's).
        proc.wait_ready(f"http://127.0.0.1:{port}/retrywatch/executions", timeout_s=180, poll_s=0.2)
        asyncio.run(load(port, clients, 2.0, PROBE_EVERY_S))  # warm-up: the first refreshes
        ttfts, completed = asyncio.run(load(port, clients, seconds, PROBE_EVERY_S))
    if not ttfts:
        return "no call reached its first token"
    cuts = statistics.quantiles(ttfts, n=10)
    return (
        f"probe TTFT median {statistics.median(ttfts) * 1e3:7.1f} ms  p90 {cuts[8] * 1e3:7.1f} ms  "
        f"worst {max(ttfts) * 1e3:8.1f} ms  completed {completed:5d} calls"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="an earlier commit whose proxy is measured too")
    parser.add_argument("--series", type=int, default=150_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rw-bench-big-metrics-") as tmp:
        work = Path(tmp)
        trees: list[tuple[str, Path | None]] = []
        if args.before:
            trees.append((f"before ({args.before})", extract(args.before, Path(tempfile.mkdtemp(dir=tmp)))))
        trees.append(("this tree", None))
        with heavy_engine(work, args.series) as big, heavy_engine(work, 100) as small:
            size = len(httpx.get(big + "/metrics", timeout=30).content)
            print(f"engine /metrics: small 100 series; big {args.series} series, {size / 1e6:.1f} MB")
            print(
                f"{args.clients} streaming clients and a probe call every {PROBE_EVERY_S * 1e3:g} ms,"
                f" {args.seconds:g} s a phase"
            )
            for name, code in trees:
                for label, engine in (("small /metrics", small), ("big /metrics", big)):
                    result = measure(code, engine, args.clients, args.seconds, work / "proxy.log")
                    print(f"{name:24s} {label:15s} {result}", flush=True)
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
