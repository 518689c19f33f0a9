"""The facts of a trace: calls, duration, mean rate, busiest minute against the median minute,
prompt and output length percentiles (``python -m reproduce.workloads.traces.stats FILE`` prints them).

Minutes are counted from the trace's first request; every minute of the span counts, the empty
ones too, so the median minute of a bursty trace can be far below its busiest. Only the minutes
that hold calls are kept (the empty ones are counted, not listed), so a span of decades costs
no more than its calls. Lengths are kept in compact integer arrays (8 bytes a call) for exact
percentiles (nearest rank).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reproduce.workloads.traces.records import TraceError, TraceRecord

__all__ = ["PERCENTILES", "TraceStats", "format_stats", "percentile", "trace_stats"]

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Facts of a trace (lengths in tokens; ``*_p`` maps a percentile to its value)."""

    calls: int
    duration_s: float
    mean_rate: float
    busiest_minute_calls: int
    median_minute_calls: float
    prompt_p: dict[int, int]
    prompt_max: int
    output_p: dict[int, int]
    output_max: int
    with_prefix_blocks: int
    sessions: int


def percentile(sorted_values: Sequence[int], p: float) -> int:
    """Nearest-rank percentile of sorted values (the smallest value with >= p % at or below)."""
    if not sorted_values:
        raise TraceError("a percentile of no values")
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def trace_stats(records: Iterable[TraceRecord]) -> TraceStats:
    """The facts of a record stream (one pass)."""
    prompts = array("q")
    outputs = array("q")
    minutes: dict[int, int] = {}
    sessions: set[str] = set()
    blocks = 0
    last = 0.0
    for record in records:
        prompts.append(record.prompt_tokens)
        outputs.append(record.output_tokens)
        minute = int(record.arrival_s // 60.0)
        minutes[minute] = minutes.get(minute, 0) + 1
        last = record.arrival_s
        blocks += bool(record.prefix_blocks)
        if record.session is not None and len(sessions) < 10_000_000:
            sessions.add(record.session)
    n = len(prompts)
    if n == 0:
        raise TraceError("the trace has no calls")
    busy = sorted(minutes.values())
    empty = int(last // 60.0) + 1 - len(busy)

    def count_at(rank: int) -> int:  # the minutes' counts in order: the empty ones, then ``busy``
        return 0 if rank < empty else busy[rank - empty]

    span = empty + len(busy)
    mid = span // 2
    median = float(count_at(mid)) if span % 2 else (count_at(mid - 1) + count_at(mid)) / 2.0
    sorted_prompts = sorted(prompts)
    sorted_outputs = sorted(outputs)
    return TraceStats(
        calls=n,
        duration_s=last,
        mean_rate=(n - 1) / last if n > 1 and last > 0 else 0.0,
        busiest_minute_calls=busy[-1],
        median_minute_calls=median,
        prompt_p={p: percentile(sorted_prompts, p) for p in PERCENTILES},
        prompt_max=sorted_prompts[-1],
        output_p={p: percentile(sorted_outputs, p) for p in PERCENTILES},
        output_max=sorted_outputs[-1],
        with_prefix_blocks=blocks,
        sessions=len(sessions),
    )


def format_stats(stats: TraceStats) -> str:
    """The facts as a few aligned lines."""

    def lengths(p: dict[int, int], top: int) -> str:
        return "  ".join(f"p{k} {v}" for k, v in p.items()) + f"  max {top}"

    ratio = (
        f"{stats.busiest_minute_calls / stats.median_minute_calls:.2f}x"
        if stats.median_minute_calls
        else "n/a (median minute empty)"
    )
    return "\n".join(
        [
            f"calls            {stats.calls}",
            f"duration         {stats.duration_s:.1f} s ({stats.duration_s / 60:.1f} min)",
            f"mean rate        {stats.mean_rate:.3f} calls/s",
            f"busiest minute   {stats.busiest_minute_calls} calls",
            f"median minute    {stats.median_minute_calls:g} calls (busiest/median {ratio})",
            f"prompt tokens    {lengths(stats.prompt_p, stats.prompt_max)}",
            f"output tokens    {lengths(stats.output_p, stats.output_max)}",
            f"prefix blocks    {stats.with_prefix_blocks} calls with them",
            f"sessions         {stats.sessions}",
        ]
    )
