"""Soak of ``retrywatch proxy`` in front of the test upstream: prints figures, and exits 1 if any
check failed.

Run: ``python bench/soak_proxy.py --calls 10000`` (about a minute on two cores). It starts the test
upstream (``tests.exporter.upstream``) and ``retrywatch proxy`` (with
``tests.exporter.soak.SOAK_PROXY_ARGS``) as processes on free loopback ports, then runs the soak
of ``tests.exporter.soak``: a warm-up, then the calls, ``--concurrency`` at a time, of every kind
(streams and not, clients leaving at random moments and retrying, refusals, crashes and hang-ups
of the upstream, interim responses, identical requests without a call id, one call id from two
callers). It prints the calls, attempts and what they got, executions by fate, the proxy's open
descriptors and RSS after the warm-up and after the soak, the duration, and every problem the
checks found (``tests/exporter/test_soak.py`` runs the same soak, smaller, in CI).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.exporter

from foundation.processes import ManagedProcess, free_port
from tests.exporter.soak import SOAK_PROXY_ARGS, run_soak

ROOT = Path(__file__).resolve().parents[1]  # ``python -m tests...`` runs from the repository


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
    up_cmd = [sys.executable, "-m", "tests.exporter.upstream", "--port", str(up_port)]
    px_cmd = [sys.executable, "-m", "retrywatch", "proxy", "--upstream", up_url, "--port", str(px_port)]
    px_cmd += [*SOAK_PROXY_ARGS, "--drain-timeout", "0"]
    with tempfile.TemporaryDirectory(prefix="rw-soak-") as tmp:
        logs = Path(tmp)
        up_log = logs / "upstream.log"
        up = ManagedProcess(up_cmd, log_path=up_log, bound_s=None, cwd=ROOT, name="test upstream")
        px = ManagedProcess(px_cmd, log_path=logs / "proxy.log", bound_s=None, cwd=ROOT, name="proxy")
        with up, px:
            up.wait_ready(f"{up_url}/health", timeout_s=60, poll_s=0.05)
            px.wait_ready(f"{px_url}/metrics", timeout_s=60, poll_s=0.05)
            assert px.pid is not None
            print(f"proxy {' '.join(SOAK_PROXY_ARGS)}; {os.cpu_count()} cores, load {load()} at the start")
            began = time.monotonic()
            report = run_soak(px_url, px.pid, up_url, args.calls, warmup, args.concurrency, args.seed)
            print("\n".join(report.lines()))
            print(f"took {time.monotonic() - began:.1f} s in all; load {load()} at the end")
            return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
