"""How much memory the policy core's retry memory holds when it is filled to its bounds.

Run: ``python bench/bench_policy_memory.py`` (about a minute; ``--keys``, ``--departures`` and
``--calls`` make it smaller). Each scenario runs in a fresh interpreter and prints the resident
set size (RSS) of that process before and after filling, after a full garbage collection:

* ``calls``: ``--calls`` call ids remembered (``Policy._calls_seen``: a call id is remembered
  from its latest attempt, for the retry memory, at most ``max_remembered_calls``);
* ``departures``: ``--keys`` keys without a call id, each with ``--departures`` departures
  (attempts that left before their answer, each licensing one retry), as a flood of identical
  calls that all time out would leave. What is kept is bounded by the policy's own bounds,
  whatever is offered.

The memory is filled through the policy's own bookkeeping (``_classify`` for a call id,
``_depart`` for a departure), not the whole attempt path, which takes about 100 times longer per
entry on a loaded two-core machine and adds nothing to what is remembered. Keys are 32 hex
digits, as ``exporter.callkey`` makes them. No assertion: the figures are printed.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from pathlib import Path

from exporter.policy import Attempt, Policy, PolicyConfig

MIB = 1024 * 1024


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def key(i: int) -> str:
    # A fresh string per key, as each attempt's hash is: 32 hex digits.
    return f"{i:032x}"


def fill_calls(policy: Policy, calls: int) -> None:
    for i in range(calls):
        policy._classify(float(i) * 1e-3, Attempt(key(i), identified=True, prompt_tokens=1))


def fill_departures(policy: Policy, keys: int, departures: int) -> None:
    now = 0.0
    for _ in range(departures):
        for i in range(keys):
            now += 1e-6
            policy._depart(now, key(i), now)


def remembered_departures(policy: Policy) -> int:
    """Departures held now, in either layout (before and after the total bound)."""
    memory = policy._departures
    if hasattr(memory, "total"):
        return int(memory.total)
    return sum(len(v) for _, v in memory._entries.values())


def run_scenario(name: str, args: argparse.Namespace) -> None:
    policy = Policy(PolicyConfig())
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    if name == "calls":
        fill_calls(policy, args.calls)
        offered, kept = args.calls, len(policy._calls_seen._entries)
        what = "call ids"
    else:
        fill_departures(policy, args.keys, args.departures)
        offered, kept = args.keys * args.departures, remembered_departures(policy)
        what = f"departures ({args.keys:,} keys x {args.departures})"
    took = time.perf_counter() - started
    gc.collect()
    grown = rss_bytes() - before
    print(
        f"{name:<10} offered {offered:>10,} {what}, kept {kept:>10,}: RSS {before / MIB:6.1f} -> "
        f"{(before + grown) / MIB:6.1f} MiB (+{grown / MIB:6.1f} MiB, "
        f"{grown / max(kept, 1):6.0f} B each kept) in {took:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=PolicyConfig().max_remembered_calls)
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--departures", type=int, default=32, help="departures offered per key")
    parser.add_argument("--scenario", choices=["calls", "departures"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        run_scenario(args.scenario, args)
        return
    for name in ("calls", "departures"):
        argv = [sys.executable, __file__, "--scenario", name, "--calls", str(args.calls),
                "--keys", str(args.keys), "--departures", str(args.departures)]  # fmt: skip
        subprocess.run(argv, check=True)


if __name__ == "__main__":
    main()
