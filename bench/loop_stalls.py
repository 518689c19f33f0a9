"""Run ``retrywatch proxy`` with an event-loop stall probe: which stalls last over 2 ms, and why.

Bench only: the probe is installed from outside, at start-up, by wrapping a few of the proxy's
methods; nothing in ``exporter`` changes. ``bench/bench_floor.py`` runs the proxy through this
launcher for its ``proxy-probe`` path (and the ``proxy-nogc`` / ``proxy-nosampler`` variants that
test a suspected cause by removing it) and prints the summary.

The probe:

* a heartbeat on the proxy's event loop (a ``call_later`` chain every millisecond) records when it
  runs, and the loop thread's time on a CPU and waiting for one (``/proc/thread-self/schedstat``):
  a gap longer than the timer's period plus ``STALL_S`` is a stall, spent running (the loop ran
  code), waiting for a CPU (the machine was busy) or neither (blocked);
* a watchdog thread samples the loop thread's Python stack every millisecond while a stall is
  under way (``sys.setswitchinterval`` is lowered to 2 ms so it gets the GIL; a garbage
  collection or a long C call holds the GIL, so those are seen by the other probes);
* ``gc.callbacks`` time every collection, by generation;
* the proxy's per-second sampling (``Proxy._sample``), the upstream ``/metrics`` fetch
  (``Proxy._fetch_upstream_metrics``, a span in wall time) and every log record handled are
  timed as sections.

Each stall is put down to what overlapped it: a collection; else waiting for a CPU, if that took
most of it; else the frames sampled during it (httpx, prometheus_client, logging, uvicorn, the
proxy's own modules), or uvloop's own C code when no Python frame was running. The report (JSON)
is written at exit.

Run: ``python bench/loop_stalls.py --report stalls.json --probe -- --upstream URL --port 8100``
(after ``--``: the options of ``retrywatch proxy``); ``python bench/loop_stalls.py --summarize
stalls.json`` prints the summary. ``--no-gc`` disables the garbage collector after start-up,
``--gc-threshold N`` sets its youngest generation's threshold (700 by default),
``--no-sampler`` stops the per-second sampling and upstream ``/metrics`` refresh (a scrape of
``/metrics`` still refreshes). ``--census`` keeps the cyclic garbage instead of freeing it
(``gc.DEBUG_SAVEALL``) and reports what it is made of, by type: where the collector's work comes
from (its timings are then not the proxy's).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import gc
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

TICK_S = 0.001  # the heartbeat's period
STALL_S = 0.002  # a heartbeat later than its period by more than this is a stall
WATCH_S = 0.001  # the watchdog's polling period
# NOTE: the watchdog needs the GIL to look. The loop thread hands it over when it waits in epoll
# (often) or after the switch interval of running bytecode: lowered from 5 ms to this, the
# watchdog sees stalls of Python code from 2 ms on, and in normal running never forces a switch.
SWITCH_INTERVAL_S = 0.002
MAX_EVENTS = 200_000
GC_RECORD_S = 0.0002  # collections shorter than this are only counted
GAP_BUCKETS_MS = (2, 3, 5, 10, 20, 50, 100)

# Where a sampled frame's code lives -> what the stall is put down to (innermost frame first).
CAUSES: tuple[tuple[str, str], ...] = (
    ("/logging/", "logging"),
    ("/httpx/", "upstream /metrics refresh (httpx)"),
    ("/httpcore/", "upstream /metrics refresh (httpx)"),
    ("/h11/", "upstream /metrics refresh (httpx)"),
    ("/anyio/", "upstream /metrics refresh (httpx)"),
    ("/prometheus_client/", "metrics (prometheus_client)"),
    ("exporter/metrics.py", "per-second sampling (exporter.metrics)"),
    ("foundation/server.py", "server (deadline sweep, bounded protocol)"),
    ("/uvicorn/", "uvicorn"),
    ("/starlette/", "starlette"),
    ("exporter/", "the proxy's request work (exporter)"),
)


def _stack(frame: Any, depth: int = 16) -> tuple[str, ...]:
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{code.co_filename}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(out)


# Where a collection was set off: the first frame (innermost first) in one of these.
SITES = (
    ("exporter/proxy.py", "the proxy's request or relay code (exporter/proxy.py)"),
    ("exporter/policy.py", "the policy (exporter/policy.py)"),
    ("exporter/relay.py", "the relay (exporter/relay.py)"),
    ("exporter/upstream.py", "the upstream client (exporter/upstream.py)"),
    ("exporter/metrics.py", "metrics (exporter/metrics.py)"),
    ("/prometheus_client/", "metrics (prometheus_client)"),
    ("/httpx/", "the upstream /metrics refresh (httpx)"),
    ("/httpcore/", "the upstream /metrics refresh (httpx)"),
    ("/anyio/", "the upstream /metrics refresh (httpx)"),
    ("/uvicorn/", "uvicorn (request parsing, ASGI cycle)"),
    ("/starlette/", "starlette"),
    ("/asyncio/", "asyncio"),
)


def gc_site(frame: Any) -> str:
    while frame is not None:
        filename = frame.f_code.co_filename
        if "loop_stalls.py" not in filename:
            for needle, site in SITES:
                if needle in filename:
                    return site
        frame = frame.f_back
    return "the event loop (C code)"


def cause_of_stack(stack: Iterable[str]) -> str:
    for entry in stack:
        for needle, cause in CAUSES:
            if needle in entry:
                return cause
    first = next(iter(stack), "?")
    return "other: " + first.rsplit("/", 1)[-1]


@dataclass
class Recorder:
    """Everything the probes saw, in ``time.perf_counter`` seconds (CLOCK_MONOTONIC: comparable
    with the benchmark's clock on the same machine)."""

    last_tick: float = 0.0
    last_run: float = 0.0  # the loop thread's seconds on a CPU, and waiting for one
    last_wait: float = 0.0
    ticks: int = 0
    gaps: Counter[str] = field(default_factory=Counter)
    # (start, end, seconds on a CPU, seconds waiting for one)
    stalls: deque[tuple[float, float, float, float]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    # (start, end, generation, objects freed)
    gc_events: deque[tuple[float, float, int, int]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    gc_counts: Counter[int] = field(default_factory=Counter)
    gc_seconds: dict[int, float] = field(default_factory=dict)
    gc_freed: Counter[int] = field(default_factory=Counter)
    gc_sites: Counter[str] = field(default_factory=Counter)
    sections: deque[tuple[str, float, float]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    stacks: dict[tuple[str, ...], int] = field(default_factory=dict)  # each stack once, by id
    _gc_start: float = 0.0
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _watchdog: threading.Thread | None = None
    _schedstat: int = -1

    def _sched(self) -> tuple[float, float]:
        """The loop thread's seconds on a CPU and waiting for one, so far."""
        run, wait, _ = os.pread(self._schedstat, 128, 0).split()
        return int(run) / 1e9, int(wait) / 1e9

    # the heartbeat
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        self.last_tick = time.perf_counter()
        self.last_run, self.last_wait = self._sched()
        loop.call_later(TICK_S, self._tick)
        self._watchdog = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._watchdog.start()

    def _tick(self) -> None:
        now = time.perf_counter()
        run, wait = self._sched()
        gap = now - self.last_tick
        self.ticks += 1
        late_ms = (gap - TICK_S) * 1e3
        self.gaps[next((f"<{b}" for b in GAP_BUCKETS_MS if late_ms < b), f">={GAP_BUCKETS_MS[-1]}")] += 1
        if gap > TICK_S + STALL_S:
            self.stalls.append((self.last_tick, now, run - self.last_run, wait - self.last_wait))
        self.last_tick, self.last_run, self.last_wait = now, run, wait
        assert self._loop is not None
        self._loop.call_later(TICK_S, self._tick)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(WATCH_S):
            now = time.perf_counter()
            if now - self.last_tick > TICK_S + STALL_S / 2:
                frame = sys._current_frames().get(main or 0)
                if frame is not None:
                    stack = _stack(frame)
                    self.samples.append((now, self.stacks.setdefault(stack, len(self.stacks))))
                del frame

    # garbage collections
    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            # What allocated the object that set the collection off (collections run inside
            # an allocation, so on whatever path allocates the most).
            self.gc_sites[gc_site(sys._getframe(1))] += 1
            self._gc_start = time.perf_counter()
            return
        end = time.perf_counter()
        gen = info["generation"]
        self.gc_counts[gen] += 1
        self.gc_seconds[gen] = self.gc_seconds.get(gen, 0.0) + end - self._gc_start
        self.gc_freed[gen] += info["collected"]
        if end - self._gc_start >= GC_RECORD_S:
            self.gc_events.append((self._gc_start, end, gen, info["collected"]))

    # timed sections
    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sections.append((name, t0, time.perf_counter()))

        return wrapper

    def timed_async(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.sections.append((name, t0, time.perf_counter()))

        return wrapper

    def report(self) -> dict[str, Any]:
        self._stop.set()
        if self._watchdog is not None:  # no sample may name a stack the report has not got
            self._watchdog.join(timeout=5)
        # What a full collection walks by now (the objects frozen at start-up excluded).
        gen2 = len(gc.get_objects(generation=2))
        t0 = time.perf_counter()
        gc.collect()
        full_s = time.perf_counter() - t0
        stacks = sorted(list(self.stacks.items()), key=lambda kv: kv[1])
        return {
            "tick_s": TICK_S,
            "stall_s": STALL_S,
            "ticks": self.ticks,
            "gaps_ms_late": dict(self.gaps),
            "stalls": list(self.stalls),
            "gc_events": list(self.gc_events),
            "gc_counts": {str(k): v for k, v in self.gc_counts.items()},
            "gc_seconds": {str(k): v for k, v in self.gc_seconds.items()},
            "gc_freed": {str(k): v for k, v in self.gc_freed.items()},
            "gc_frozen": gc.get_freeze_count(),
            "gc_sites": self.gc_sites.most_common(),
            "gc_gen2_at_exit": gen2,
            "gc_full_at_exit_s": full_s,
            "sections": list(self.sections),
            "stacks": [list(stack) for stack, _ in stacks],
            "samples": list(self.samples),
        }


def _in_loop(stack: list[str]) -> bool:
    """Whether a sampled stack is the event loop itself, running no Python callback."""
    return not stack or "asyncio/runners.py" in stack[0] or "asyncio/base_events.py" in stack[0]


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def attribute(
    report: dict[str, Any], windows: list[tuple[float, float]] | None = None
) -> list[dict[str, Any]]:
    """Each stall (in ``windows``, if given) with what it is put down to."""
    out: list[dict[str, Any]] = []
    gcs = report["gc_events"]
    sections = report["sections"]
    samples = [(t, report["stacks"][i]) for t, i in report["samples"]]
    for start, end, run, wait in report["stalls"]:
        if windows is not None and not any(w0 <= start < w1 for w0, w1 in windows):
            continue
        wall = end - start
        late = wall - TICK_S
        gc_s = sum(_overlap(start, end, g0, g1) for g0, g1, _, _ in gcs)
        gens = sorted({gen for g0, g1, gen, _ in gcs if _overlap(start, end, g0, g1) > 0})
        freed = sum(n for g0, g1, _, n in gcs if _overlap(start, end, g0, g1) > 0)
        in_sections = {name for name, s0, s1 in sections if _overlap(start, end, s0, s1) > 0}
        stacks = [s for t, s in samples if start <= t <= end + WATCH_S]
        # Python frames running during the stall (a sample taken inside the bare loop is not one)
        running = [s for s in stacks if not _in_loop(s)]
        if gc_s >= 0.5 * late:
            cause = f"garbage collection (generation {max(gens)})"
        elif wait >= 0.5 * late:
            cause = "waiting for a CPU (the machine was busy)"
        elif run < 0.5 * late:
            cause = "off CPU, not waiting for one (blocked)"
        elif running:
            cause = Counter(cause_of_stack(s) for s in running).most_common(1)[0][0]
        elif "sample" in in_sections:
            cause = "per-second sampling (exporter.metrics)"
        else:
            cause = "uvloop's C code (no Python frame running: I/O, transports)"
        out.append(
            {
                "start": start,
                "wall_ms": wall * 1e3,
                "run_ms": run * 1e3,
                "wait_ms": wait * 1e3,
                "gc_ms": gc_s * 1e3,
                "gc_freed": freed,
                "sections": sorted(in_sections),
                "cause": cause,
                "stack": running[0][:8] if running else [],
            }
        )
    return out


def summarize(report: dict[str, Any], windows: list[tuple[float, float]] | None = None) -> str:
    stalls = attribute(report, windows)
    lines = [
        f"heartbeats {report['ticks']}; lateness beyond the {report['tick_s'] * 1e3:g} ms period (ms):"
        f" {dict(sorted(report['gaps_ms_late'].items()))}",
        "collections (all run): "
        + ", ".join(
            f"gen {g}: {report['gc_counts'].get(g, 0)} taking {report['gc_seconds'].get(g, 0.0) * 1e3:.0f} ms"
            f" and freeing {report['gc_freed'].get(g, 0)} objects"
            for g in ("0", "1", "2")
        ),
        f"at exit: {report['gc_frozen']} objects frozen at start-up, {report['gc_gen2_at_exit']} in the"
        f" oldest generation; a full collection took {report['gc_full_at_exit_s'] * 1e3:.1f} ms",
        "collections set off in: " + "; ".join(f"{site} {n}" for site, n in report["gc_sites"]),
    ]
    durations: dict[str, list[float]] = {}
    for name, s0, s1 in report["sections"]:
        durations.setdefault(name, []).append((s1 - s0) * 1e3)
    for name, xs in sorted(durations.items()):
        xs.sort()
        lines.append(f"section {name}: {len(xs)} runs, median {xs[len(xs) // 2]:.2f} ms, max {xs[-1]:.2f} ms")
    scope = "in the measured windows" if windows is not None else "over the whole run"
    lines.append(f"stalls over {STALL_S * 1e3:g} ms {scope}: {len(stalls)}")
    by_cause: dict[str, list[dict[str, Any]]] = {}
    for s in stalls:
        by_cause.setdefault(s["cause"], []).append(s)
    for cause, group in sorted(by_cause.items(), key=lambda kv: -sum(s["wall_ms"] for s in kv[1])):
        walls = sorted(s["wall_ms"] for s in group)
        lines.append(
            f"  {cause}: {len(group)} stalls, {sum(walls):.0f} ms in all"
            f" ({sum(s['run_ms'] for s in group):.0f} running, {sum(s['wait_ms'] for s in group):.0f}"
            f" waiting for a CPU), median {walls[len(walls) // 2]:.1f} ms, max {walls[-1]:.1f} ms"
        )
        if cause.startswith("garbage"):
            freed = sorted(s["gc_freed"] for s in group)
            lines.append(
                f"      objects freed by those collections: median {freed[len(freed) // 2]}, max {freed[-1]}"
            )
        top = Counter(tuple(s["stack"][:4]) for s in group if s["stack"]).most_common(2)
        for stack, n in top:
            frames = " <- ".join(f.rsplit("/", 1)[-1] for f in stack)
            lines.append(f"      {n}x {frames}")
    lines.extend(_near_sections(report, stalls))
    return "\n".join(lines)


def _near_sections(report: dict[str, Any], stalls: list[dict[str, Any]], after_s: float = 0.05) -> list[str]:
    """For each periodic section: how many stalls began within ``after_s`` of one of its runs
    beginning, against how many would by chance (its runs' share of the time covered)."""
    lines = []
    starts: dict[str, list[float]] = {}
    for name, s0, _ in report["sections"]:
        starts.setdefault(name, []).append(s0)
    for name, xs in sorted(starts.items()):
        if len(xs) < 10 or not stalls:
            continue
        xs.sort()
        near = [s for s in stalls if any(0 <= s["start"] - x < after_s for x in xs)]
        span = xs[-1] - xs[0]
        chance = min(1.0, len(xs) * after_s / span) if span > 0 else 1.0
        big = [s for s in stalls if s["wall_ms"] >= 5]
        big_near = [s for s in near if s["wall_ms"] >= 5]
        lines.append(
            f"stalls beginning within {after_s * 1e3:g} ms after a run of {name} began: {len(near)} of"
            f" {len(stalls)} ({len(big_near)} of the {len(big)} over 5 ms); {chance:.0%} expected by chance"
        )
    return lines


def census(limit: int = 15) -> list[tuple[str, int]]:
    """The cyclic garbage kept so far (``gc.DEBUG_SAVEALL``), counted by type."""
    gc.collect()
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    return counts.most_common(limit)


def install(
    recorder: Recorder | None,
    no_gc: bool,
    no_sampler: bool,
    keep_garbage: bool = False,
    gc_threshold: int | None = None,
) -> None:
    """Wrap the proxy's start-up (and, with a recorder, its sampling and logging)."""
    from exporter.proxy import Proxy
    from foundation.server import DrainingServer

    original_startup = DrainingServer.startup

    async def startup(self: DrainingServer, sockets: list[Any] | None = None) -> None:
        await original_startup(self, sockets)  # the proxy's lifespan (gc.freeze) ran in it
        if no_gc:
            gc.disable()
        if gc_threshold is not None:
            gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
        if keep_garbage:
            gc.set_debug(gc.DEBUG_SAVEALL)
        if recorder is not None:
            recorder.start(asyncio.get_running_loop())

    DrainingServer.startup = startup  # type: ignore[method-assign]
    if no_sampler:

        async def idle(self: Proxy) -> None:
            return None

        Proxy._sample_forever = idle  # type: ignore[method-assign]
    if recorder is None:
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.callbacks.append(recorder.on_gc)
    Proxy._sample = recorder.timed("sample", Proxy._sample)  # type: ignore[method-assign]
    Proxy._fetch_upstream_metrics = recorder.timed_async(  # type: ignore[method-assign]
        "upstream /metrics fetch (wall)", Proxy._fetch_upstream_metrics
    )
    logging.Handler.handle = recorder.timed("logging", logging.Handler.handle)  # type: ignore[method-assign]


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """A launcher's own options, and those of ``retrywatch proxy`` (after ``--``)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def run_proxy(proxy_args: list[str]) -> None:
    """``retrywatch proxy`` in this process, its probes installed already."""
    from retrywatch.cli import main as retrywatch

    retrywatch(args=["proxy", *proxy_args], prog_name="retrywatch")


def parse_launcher(
    parser: argparse.ArgumentParser, summarize: Callable[[Any], str]
) -> tuple[argparse.Namespace, list[str]] | None:
    """A launcher's own options (``--report`` and ``--summarize`` added to ``parser``'s) and those
    of ``retrywatch proxy``; None once ``--summarize`` printed a report's summary."""
    parser.add_argument("--report", help="where to write the JSON report at exit")
    parser.add_argument("--summarize", metavar="REPORT", help="print the summary of a report and exit")
    own, proxy_args = split_argv(sys.argv[1:])
    args = parser.parse_args(own)
    if args.summarize:
        with open(args.summarize) as f:
            print(summarize(json.load(f)))
        return None
    return args, proxy_args


def report_at_exit(path: str | None, make: Callable[[], Any]) -> None:
    """Write ``make()`` as JSON to ``path`` when the proxy exits (nothing when no path)."""
    if path is None:
        return
    path = os.path.abspath(path)

    def write() -> None:
        with open(path, "w") as f:
            json.dump(make(), f)

    atexit.register(write)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="install the stall probe")
    parser.add_argument("--no-gc", action="store_true", help="disable the garbage collector after start-up")
    parser.add_argument(
        "--no-sampler", action="store_true", help="no per-second sampling or /metrics refresh"
    )
    parser.add_argument("--gc-threshold", type=int, help="the youngest generation's collection threshold")
    parser.add_argument("--census", action="store_true", help="keep the cyclic garbage and count it by type")
    parsed = parse_launcher(parser, summarize)
    if parsed is None:
        return
    args, proxy_args = parsed
    recorder = Recorder() if args.probe else None
    install(recorder, args.no_gc, args.no_sampler, args.census, args.gc_threshold)
    started = time.perf_counter()

    def report() -> dict[str, Any]:
        out = recorder.report() if recorder is not None else {}
        if args.census:
            out["garbage_census"] = census()
            out["census_seconds"] = time.perf_counter() - started
        return out

    if recorder is not None or args.census:
        report_at_exit(args.report, report)
    run_proxy(proxy_args)


if __name__ == "__main__":
    main()
