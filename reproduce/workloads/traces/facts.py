"""The facts of a trace: calls, duration, mean rate, busiest minute against the median minute,
prompt and output length percentiles (``python -m reproduce.workloads.traces.stats FILE`` prints them).

Minutes are counted from the trace's first request; every minute of the span counts, the empty
ones too, so the median minute of a bursty trace can be far below its busiest. Records come in
arrival order (as ``read_trace`` gives them), so a minute is counted once it ends and only how
many minutes held each count is kept: a span of decades, or a stream without end, costs no more
than the distinct counts. Lengths are kept in compact integer arrays (8 bytes a call) for exact
percentiles (nearest rank), up to ``MAX_KEPT`` calls; past that the percentiles come from a
seeded uniform sample of ``MAX_KEPT`` calls (reservoir sampling), and the facts say so.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reproduce.workloads.traces.records import TraceError, TraceRecord

__all__ = ["MAX_KEPT", "PERCENTILES", "TraceStats", "format_stats", "percentile", "trace_stats"]

PERCENTILES = (50, 90, 99)
#: The most calls whose lengths are kept for the percentiles (32 MB): past it, a uniform sample.
MAX_KEPT = 2_000_000


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
    #: How many calls the length percentiles come from (``calls``, or ``MAX_KEPT`` when sampled).
    lengths_from: int = 0


def percentile(sorted_values: Sequence[int], p: float) -> int:
    """Nearest-rank percentile of sorted values (the smallest value with >= p % at or below)."""
    if not sorted_values:
        raise TraceError("a percentile of no values")
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def trace_stats(records: Iterable[TraceRecord]) -> TraceStats:
    """The facts of a record stream in arrival order (one pass, bounded memory: module NOTE)."""
    prompts = array("q")
    outputs = array("q")
    sample = random.Random(0)
    minutes: Counter[int] = Counter()  # calls in a minute -> how many minutes held that many
    minute, in_minute = 0, 0
    sessions: set[str] = set()
    blocks = 0
    last = 0.0
    prompt_max = output_max = 0
    n = 0
    for record in records:
        n += 1
        if n <= MAX_KEPT:
            prompts.append(record.prompt_tokens)
            outputs.append(record.output_tokens)
        elif (slot := sample.randrange(n)) < MAX_KEPT:
            prompts[slot], outputs[slot] = record.prompt_tokens, record.output_tokens
        prompt_max = max(prompt_max, record.prompt_tokens)
        output_max = max(output_max, record.output_tokens)
        at = int(record.arrival_s // 60.0)
        if at < minute:
            raise TraceError(f"the records are not in arrival order (minute {at} after minute {minute})")
        if at > minute:
            if in_minute:
                minutes[in_minute] += 1
            minute, in_minute = at, 0
        in_minute += 1
        last = record.arrival_s
        blocks += bool(record.prefix_blocks)
        if record.session is not None and len(sessions) < 10_000_000:
            sessions.add(record.session)
    if n == 0:
        raise TraceError("the trace has no calls")
    minutes[in_minute] += 1
    busy = sum(minutes.values())
    empty = int(last // 60.0) + 1 - busy
    counts = sorted(minutes.items())  # ascending counts, each with its number of minutes

    def count_at(rank: int) -> int:  # the minutes' counts in order: the empty ones, then ``counts``
        if rank < empty:
            return 0
        rank -= empty
        for count, how_many in counts:
            if rank < how_many:
                return count
            rank -= how_many
        raise AssertionError("rank past the last minute")

    span = empty + busy
    mid = span // 2
    median = float(count_at(mid)) if span % 2 else (count_at(mid - 1) + count_at(mid)) / 2.0
    sorted_prompts = sorted(prompts)
    sorted_outputs = sorted(outputs)
    return TraceStats(
        calls=n,
        duration_s=last,
        mean_rate=(n - 1) / last if n > 1 and last > 0 else 0.0,
        busiest_minute_calls=counts[-1][0],
        median_minute_calls=median,
        prompt_p={p: percentile(sorted_prompts, p) for p in PERCENTILES},
        prompt_max=prompt_max,
        output_p={p: percentile(sorted_outputs, p) for p in PERCENTILES},
        output_max=output_max,
        with_prefix_blocks=blocks,
        sessions=len(sessions),
        lengths_from=len(prompts),
    )


def format_stats(stats: TraceStats) -> str:
    """The facts as a few aligned lines."""

    def lengths(p: dict[int, int], top: int) -> str:
        return "  ".join(f"p{k} {v}" for k, v in p.items()) + f"  max {top}"

    sampled = (
        f"  (percentiles of a sample of {stats.lengths_from})" if stats.lengths_from < stats.calls else ""
    )
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
            f"output tokens    {lengths(stats.output_p, stats.output_max)}{sampled}",
            f"prefix blocks    {stats.with_prefix_blocks} calls with them",
            f"sessions         {stats.sessions}",
        ]
    )
