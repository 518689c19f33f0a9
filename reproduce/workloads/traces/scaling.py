"""Pure functions over a record stream: the mean rate, rescaling it, and taking a window.

NOTE: the mean rate of a trace is (calls - 1) / (last arrival - first arrival), the inverse of
its mean inter-arrival time. ``rescale_to_rate`` multiplies every arrival by one factor, so the
burst shape (every ratio of inter-arrival times, the busiest minute against the median one) is
kept exactly, and the rescaled mean rate is the target exactly. ``--load X`` is
``rescale_to_rate(records, X * capacity, source_rate)``; the source rate comes from a first
streaming pass (``mean_rate``) or is given. A window is taken before rescaling: its mean rate is
the one that becomes X × Ĉ.

Windows are in seconds from the trace's first request (every layout has relative arrivals;
only Azure's carry dates), written ``START:END`` with either side optional; the records of
``[START, END)`` are kept with their arrivals counted from START, and reading stops at the first
record at or after END, so a window at the start of a week-long trace reads only that window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from reproduce.workloads.traces.records import TraceError, TraceRecord

__all__ = ["mean_rate", "parse_window", "rate_factor", "rescale_arrivals", "rescale_to_rate", "window"]


def mean_rate(records: Iterable[TraceRecord]) -> float:
    """Calls per second of a trace: (calls - 1) / span. Streams; needs two distinct times."""
    n = 0
    first = last = 0.0
    for record in records:
        if n == 0:
            first = record.arrival_s
        last = record.arrival_s
        n += 1
    if n < 2 or last <= first:
        raise TraceError(f"a mean rate needs at least two calls at different times; the trace has {n}")
    return (n - 1) / (last - first)


def _time_factor(factor: float) -> float:
    if not (math.isfinite(factor) and factor > 0):
        raise TraceError(f"the time factor must be a positive number, got {factor!r}")
    return factor


def rescale_arrivals(records: Iterable[TraceRecord], factor: float) -> Iterator[TraceRecord]:
    """Every arrival times ``factor`` (> 0): < 1 compresses the trace (more load), > 1 stretches it."""
    _time_factor(factor)
    for record in records:
        yield record.arriving_at(record.arrival_s * factor)


def rate_factor(target_rate: float, source_rate: float) -> float:
    """The factor of every arrival that gives a trace of mean rate ``source_rate`` the mean
    rate ``target_rate`` (calls/s), checked as ``rescale_arrivals`` checks it."""
    for name, value in (("target rate", target_rate), ("source rate", source_rate)):
        if not (math.isfinite(value) and value > 0):
            raise TraceError(f"the {name} must be a positive number of calls per second, got {value!r}")
    return _time_factor(source_rate / target_rate)


def rescale_to_rate(
    records: Iterable[TraceRecord], target_rate: float, source_rate: float
) -> Iterator[TraceRecord]:
    """The trace with mean rate ``target_rate`` calls/s, its burst shape kept.

    ``source_rate`` is the trace's own mean rate (``mean_rate`` of a first pass)."""
    return rescale_arrivals(records, rate_factor(target_rate, source_rate))


def parse_window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds from the trace's start (``:600``, ``3600:``, ``60:120``)."""
    start_text, sep, end_text = text.partition(":")
    if not sep:
        raise TraceError(f"a window is START:END in seconds from the trace's start, got {text!r}")
    try:
        start = float(start_text) if start_text.strip() else 0.0
        end = float(end_text) if end_text.strip() else math.inf
    except ValueError:
        raise TraceError(f"a window is START:END in seconds from the trace's start, got {text!r}") from None
    if not (math.isfinite(start) and start >= 0 and end > start) or math.isnan(end):
        raise TraceError(f"a window needs 0 <= START < END, got {text!r}")
    return start, end


def window(records: Iterable[TraceRecord], start_s: float, end_s: float = math.inf) -> Iterator[TraceRecord]:
    """The records arriving in ``[start_s, end_s)``, arrivals counted from ``start_s``.

    Stops reading at the first record at or after ``end_s`` (records are in time order)."""
    if not (start_s >= 0 and end_s > start_s):
        raise TraceError(f"a window needs 0 <= start < end, got {start_s!r}:{end_s!r}")
    for record in records:
        if record.arrival_s >= end_s:
            return
        if record.arrival_s >= start_s:
            # from the start, every arrival stays as it is (t - 0.0 is t): no copy
            yield record if start_s == 0.0 else record.arriving_at(record.arrival_s - start_s)
