"""How much memory the policy core's retry memory holds when it is filled to its bounds.

Run: ``python bench/bench_policy_memory.py`` (about a minute; ``--keys``, ``--departures`` and
``--calls`` make it smaller). Each scenario runs in a fresh interpreter and prints the resident
set size (RSS) of that process before and after filling, after a full garbage collection:

* ``calls``: ``--calls`` call ids remembered (``Policy._calls_seen``: a call id is remembered
  from its latest attempt, for the retry memory, at most ``max_remembered_calls``);
* ``awaiting``: ``--calls`` calls without a call id awaiting delivery within the deadline
  (``Policy._awaiting_delivery``, at most ``max_remembered_calls``), each under a key of its own,
  which only this memory holds;
* ``departures``: ``--keys`` keys without a call id, each with ``--departures`` departures
  (attempts that left before their answer, each licensing one retry), as a flood of identical
  calls that all time out would leave. What is kept is bounded by the policy's own bounds,
  whatever is offered;
* ``everything``: all of the retry memory at its bounds at once, in one process: ``--calls``
  call ids seen, every one of them awaiting delivery (a deadline of 120 s, not passed), then the
  flood of departures. Its growth is the figure to hold against the bound on the whole.

The memory is filled through the policy's own bookkeeping (``_classify`` for a call id,
``_await_delivery`` for a first attempt, ``_depart`` for a departure), not the whole attempt path,
which takes about 100 times longer per entry on a loaded two-core machine and adds nothing to
what is remembered. Keys are 32 hex digits, as ``exporter.callkey`` makes them. No assertion: the
figures are printed, with the time the filling took (the policy's bookkeeping and the keys).
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
DEADLINE_S = 120.0  # the calls awaiting delivery are all within it
SCENARIOS = ("calls", "awaiting", "departures", "everything")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def key(i: int) -> str:
    # A fresh string per key, as each attempt's hash is: 32 hex digits.
    return f"{i:032x}"


def fill_calls(policy: Policy, calls: int, *, awaiting: bool = False) -> None:
    """``calls`` call ids seen, 0.1 ms apart; with ``awaiting`` each a first attempt awaiting
    delivery too (the policy's deadline must be known)."""
    for i in range(calls):
        now, attempt = float(i) * 1e-4, Attempt(key(i), identified=True, prompt_tokens=1)
        policy._classify(now, attempt)
        if awaiting:
            policy._await_delivery(now, attempt.key)


def fill_awaiting(policy: Policy, calls: int) -> None:
    """``calls`` first attempts without a call id awaiting delivery, each under its own key."""
    for i in range(calls):
        policy._await_delivery(float(i) * 1e-4, key(i))


def fill_departures(policy: Policy, keys: int, departures: int) -> None:
    now = 0.0
    for _ in range(departures):
        for i in range(keys):
            now += 1e-6
            policy._depart(now, key(i), now)


def remembered_departures(policy: Policy) -> int:
    """Departures held now."""
    return policy.departures.total


def held(memory: object) -> int:
    """Entries held by a memory, in either layout (its own length, or its ordered dict's)."""
    return len(getattr(memory, "_entries", memory))  # type: ignore[arg-type]


def run_scenario(name: str, args: argparse.Namespace) -> None:
    policy = Policy(PolicyConfig(deadline_s=DEADLINE_S))
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    if name == "calls":
        fill_calls(policy, args.calls)
        offered, kept = args.calls, held(policy._calls_seen)
        what = "call ids"
    elif name == "awaiting":
        fill_awaiting(policy, args.calls)
        offered, kept = args.calls, len(policy._awaiting_delivery)
        what = "calls awaiting"
    elif name == "departures":
        fill_departures(policy, args.keys, args.departures)
        offered, kept = args.keys * args.departures, remembered_departures(policy)
        what = f"departures ({args.keys:,} keys x {args.departures})"
    else:
        fill_calls(policy, args.calls, awaiting=True)
        fill_departures(policy, args.keys, args.departures)
        seen, awaiting = held(policy._calls_seen), len(policy._awaiting_delivery)
        departures = remembered_departures(policy)
        offered = args.calls * 2 + args.keys * args.departures
        kept = seen + awaiting + departures
        what = f"entries ({seen:,} seen, {awaiting:,} awaiting, {departures:,} departures)"
    took = time.perf_counter() - started
    gc.collect()
    grown = rss_bytes() - before
    print(
        f"{name:<10} offered {offered:>10,} {what}, kept {kept:>10,}: RSS {before / MIB:6.1f} -> "
        f"{(before + grown) / MIB:6.1f} MiB (+{grown / MIB:6.1f} MiB, "
        f"{grown / max(kept, 1):6.0f} B each kept) in {took:.1f} s"
    )


def speed(calls: int) -> None:
    """Nanoseconds per operation of the retry memory held at its bound (each new key forgets the
    oldest): a first attempt with a call id (seen and awaiting), a retry of it, a departure
    without a call id and the retry that uses it. Best of three rounds of ``calls`` each."""
    policy = Policy(PolicyConfig(deadline_s=1e9, max_remembered_calls=calls))
    fill_calls(policy, calls, awaiting=True)
    for i in range(calls):
        policy._depart(float(i) * 1e-4, key(calls + i), 0.0)
    rounds: dict[str, float] = {}
    now = 1_000.0
    for round_ in range(3):
        keys = [key((2 + round_) * calls + i) for i in range(calls)]  # new to the memory
        firsts = [Attempt(k, identified=True, prompt_tokens=1) for k in keys]
        timed = {}
        started = time.perf_counter()
        for attempt in firsts:
            now += 1e-6
            policy._classify(now, attempt)
            policy._await_delivery(now, attempt.key)
        timed["first attempt, call id"] = time.perf_counter() - started
        started = time.perf_counter()
        for attempt in firsts:
            now += 1e-6
            policy._classify(now, attempt)
        timed["retry, call id"] = time.perf_counter() - started
        started = time.perf_counter()
        for k in keys:
            now += 1e-6
            policy._depart(now, k, now)
        timed["departure"] = time.perf_counter() - started
        started = time.perf_counter()
        for k in keys:
            now += 1e-6
            policy._use_departure(now, k)
        timed["retry using it"] = time.perf_counter() - started
        for name, took in timed.items():
            rounds[name] = min(rounds.get(name, took), took)
    for name, took in rounds.items():
        print(f"speed      {name:<24} {took / calls * 1e9:7.0f} ns each (at the bound of {calls:,})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=PolicyConfig().max_remembered_calls)
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--departures", type=int, default=32, help="departures offered per key")
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument(
        "--speed", action="store_true", help="only time the operations at the bound (--calls)"
    )
    args = parser.parse_args()
    if args.speed:
        speed(args.calls)
        return
    if args.scenario:
        run_scenario(args.scenario, args)
        return
    for name in SCENARIOS:
        argv = [sys.executable, __file__, "--scenario", name, "--calls", str(args.calls),
                "--keys", str(args.keys), "--departures", str(args.departures)]  # fmt: skip
        subprocess.run(argv, check=True)


if __name__ == "__main__":
    main()
