"""Benchmark the emulated engine: streaming throughput, server CPU per token, and time fidelity.

Starts ``retrywatch emulate`` as a real process on a free loopback port and sends ``--clients``
concurrent streaming completions (token-ID prompts) that each generate ``--tokens`` tokens.
Prints the tokens (SSE chunks) per second received, the server's CPU seconds per thousand
chunks (from /proc), and how many times the server warned that the engine's clock trailed the
scaled wall clock by over a second (the machine could not keep up). Asserts nothing.

    .venv/bin/python bench/bench_emulate.py [--clients 32] [--tokens 400] [--time-scale 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from foundation.processes import ManagedProcess, free_port


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream(http: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True}
    received = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                received += 1
    return received


async def _run(url: str, clients: int, tokens: int, prompt_len: int) -> tuple[int, float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        start = time.monotonic()
        counts = await asyncio.gather(
            *(_stream(http, url, list(range(i, i + prompt_len)), tokens) for i in range(clients))
        )
        return sum(counts), time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--model", default="qwen2.5-7b-h100")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "retrywatch",
        "emulate",
        "--model",
        args.model,
        "--port",
        str(port),
        "--time-scale",
        str(args.time_scale),
        "--vocab-size",
        "32000",
    ]
    log = Path(tempfile.mkdtemp(prefix="bench-emulate-")) / "emulate.log"  # kept
    with ManagedProcess(command, log_path=log, bound_s=None, name="emulated engine") as server:
        server.wait_ready(url + "/health", timeout_s=30, poll_s=0.1)
        assert server.pid is not None
        cpu0 = _cpu_seconds(server.pid)
        chunks, wall = asyncio.run(_run(url, args.clients, args.tokens, args.prompt_len))
        cpu = _cpu_seconds(server.pid) - cpu0
    lagged = log.read_text(errors="replace").count("trails the scaled wall clock")
    print(
        f"emulated engine {args.model} at time scale {args.time_scale:g}: "
        f"{args.clients} streams x {args.tokens} tokens"
    )
    print(f"  chunks received      {chunks} in {wall:.2f} s = {chunks / wall:,.0f} chunks/s")
    print(f"  server CPU           {cpu:.2f} s = {1000 * cpu / max(chunks, 1):.3f} s per 1,000 chunks")
    print(f"  engine-clock lag warnings: {lagged}")


if __name__ == "__main__":
    main()
