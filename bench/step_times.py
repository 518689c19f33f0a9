"""Run ``retrywatch proxy`` with the steps of a generation request's path timed, wall and CPU.

Bench only: like ``bench/loop_stalls.py``, the timers are installed from outside, at start-up, by
wrapping the proxy's methods and the functions it calls; nothing in ``exporter`` changes.
``bench/bench_floor.py`` runs the proxy through this launcher for its ``proxy-steps`` path and
prints the summary: for each step, the calls, and the median and 90th percentile of the wall time
and of the loop thread's CPU time (``time.thread_time_ns``) a call took, in the order a request
meets them. A step's figures include those of the steps listed under it.

What it is for: on a small machine a just-woken process runs its code many times slower than the
same code run back to back (``bench/bench_attempt_path.py``), so the time a request spends in the
proxy under load is not what a micro-benchmark of each function says. This measures it where it
is spent, per step, under the load of ``bench_floor.py``'s scenario.

Each timed call costs the timer about two system calls (thread CPU time is not read through the
vDSO): a step's figures carry 1-3 us of it, and an outer step carries its inner steps' timers too.

Run: ``python bench/step_times.py --report steps.json -- --upstream URL --port 8100`` (after
``--``: the options of ``retrywatch proxy``); ``python bench/step_times.py --summarize
steps.json`` prints the summary.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from loop_stalls import parse_launcher, report_at_exit, run_proxy

# (module, owner or None for a module-level function, attribute, depth): the request's path in
# the order a request meets it; depth says what includes what (a step at depth d is part of the
# step above it at depth d - 1).
STEPS: tuple[tuple[str, str | None, str, int], ...] = (
    ("foundation.server", "BoundedProtocol", "__init__", 0),
    ("foundation.server", "BoundedProtocol", "connection_made", 0),
    ("foundation.server", "BoundedProtocol", "on_headers_complete", 0),
    ("exporter.exchange", "Exchange", "__init__", 1),
    ("exporter.proxy", "Proxy", "attempt", 0),
    ("exporter.proxy", None, "parse_body", 1),
    ("exporter.proxy", None, "validate", 1),
    ("exporter.proxy", None, "find_call_id", 1),
    ("exporter.proxy", None, "caller_scope", 1),
    ("exporter.proxy", None, "call_key", 1),
    ("exporter.proxy", None, "sdk_says_retry", 1),
    ("exporter.policy", "Policy", "on_attempt", 1),
    ("exporter.proxy", None, "forwardable_headers", 1),
    ("exporter.execution", "Execution", "start", 1),
    ("exporter.execution", "Execution", "_send", 2),
    ("exporter.execution", "Execution", "_head", 0),
    ("exporter.execution", "Execution", "_first_event", 0),
    ("exporter.proxy", "Proxy", "_first_token", 1),
    ("exporter.exchange", "Exchange", "_end", 0),
    ("exporter.execution", "Execution", "_end", 0),
    ("foundation.server", "BoundedProtocol", "connection_lost", 0),
)

Timings = dict[str, list[tuple[int, int]]]  # step -> (wall ns, CPU ns) per call


def step_name(owner: str | None, attribute: str) -> str:
    return f"{owner}.{attribute}" if owner else attribute


def install(timings: Timings) -> None:
    """Wrap every step so each call adds its wall and CPU time to ``timings``."""
    import importlib

    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    for module_name, owner_name, attribute, _ in STEPS:
        module = importlib.import_module(module_name)
        owner: Any = getattr(module, owner_name) if owner_name else module
        original: Callable[..., Any] = getattr(owner, attribute)
        calls = timings[step_name(owner_name, attribute)]

        def timed(
            *args: Any, _original: Callable[..., Any] = original, _calls: list[Any] = calls, **kwargs: Any
        ) -> Any:
            w0, c0 = wall(), cpu()
            try:
                return _original(*args, **kwargs)
            finally:
                c1 = cpu()
                _calls.append((wall() - w0, c1 - c0))

        setattr(owner, attribute, timed)


def summarize(timings: dict[str, list[list[int]]]) -> str:
    lines = [f"{'step':<42} {'calls':>7} {'wall p50':>9} {'p90':>7} {'CPU p50':>8} {'p90':>7}  (us)"]
    for _, owner_name, attribute, depth in STEPS:
        name = step_name(owner_name, attribute)
        calls = timings.get(name) or []
        label = "  " * depth + name
        if not calls:
            lines.append(f"{label:<42} {0:>7}")
            continue
        walls = sorted(c[0] / 1e3 for c in calls)
        cpus = sorted(c[1] / 1e3 for c in calls)

        def p90(xs: list[float]) -> float:
            return xs[int(0.9 * (len(xs) - 1))]

        lines.append(
            f"{label:<42} {len(calls):>7} {statistics.median(walls):>9.1f} {p90(walls):>7.1f}"
            f" {statistics.median(cpus):>8.1f} {p90(cpus):>7.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parsed = parse_launcher(argparse.ArgumentParser(description=__doc__.splitlines()[0]), summarize)
    if parsed is None:
        return
    args, proxy_args = parsed
    timings: Timings = defaultdict(list)
    install(timings)
    report_at_exit(args.report, lambda: timings)
    run_proxy(proxy_args)


if __name__ == "__main__":
    main()
