"""Soak of ``retrywatch proxy`` in front of the test upstream: prints figures, and exits 1 if any
check failed.

Run: ``python bench/soak_proxy.py --calls 10000`` (about a minute on two cores). It starts the test
upstream (``exporter.testing.upstream``) and ``retrywatch proxy`` (with
``exporter.testing.soak.SOAK_PROXY_ARGS``) as processes on free loopback ports, then runs the soak
of ``exporter.testing.soak``: a warm-up, then the calls, ``--concurrency`` at a time, of every kind
(streams and not, clients leaving at random moments and retrying, refusals, crashes and hang-ups
of the upstream, interim responses, identical requests without a call id, one call id from two
callers). It prints the calls, attempts and what they got, executions by fate, the proxy's open
descriptors and RSS after the warm-up and after the soak, the duration, and every problem the
checks found (``tests/exporter/test_soak.py`` runs the same soak, smaller, in CI).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx

from exporter.testing.soak import SOAK_PROXY_ARGS, run_soak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer")


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=10_000, help="calls in the soak (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=None, help="calls in the warm-up (default: calls / 4)")
    parser.add_argument("--concurrency", type=int, default=100, help="units of calls in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mix of calls")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else max(100, args.calls // 4)
    up_port, px_port = free_port(), free_port()
    up_url, px_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
    quiet = subprocess.DEVNULL
    up_cmd = [sys.executable, "-m", "exporter.testing.upstream", "--port", str(up_port)]
    up = subprocess.Popen(up_cmd, stdout=quiet, stderr=quiet)
    px = None
    try:
        wait_http(f"{up_url}/health", up)
        cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", up_url, "--port", str(px_port)]
        px = subprocess.Popen([*cmd, *SOAK_PROXY_ARGS, "--drain-timeout", "0"], stdout=quiet, stderr=quiet)
        wait_http(f"{px_url}/metrics", px)
        print(f"proxy {' '.join(SOAK_PROXY_ARGS)}; {os.cpu_count()} cores, load {load()} at the start")
        began = time.monotonic()
        report = run_soak(px_url, px.pid, up_url, args.calls, warmup, args.concurrency, args.seed)
        print("\n".join(report.lines()))
        print(f"took {time.monotonic() - began:.1f} s in all; load {load()} at the end")
        return 1 if report.problems else 0
    finally:
        for proc in (px, up):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
