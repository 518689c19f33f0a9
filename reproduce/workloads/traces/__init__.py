"""Request traces: reading operators' and public traces as a stream of calls to replay.

The public surface a run plan calls:

* ``read_trace(source, format=None, ...)``: stream a trace file (or lines) into
  ``TraceRecord``s, in time order, arrivals counted from the first request, every line and
  reorder window bounded, a pipe read once (``reproduce.workloads.traces.reader``; layouts in
  ``reproduce.workloads.traces.layouts``); ``is_regular_file``: whether a path can be read twice.
* ``mean_rate``, ``rescale_to_rate``, ``rate_factor``, ``rescale_arrivals``, ``window``, ``parse_window``:
  pure functions over the record stream (``reproduce.workloads.traces.scaling``).
* ``to_trace_calls`` / ``to_planned_calls``: records as ``PlannedCall``s, with prompt segments
  that keep prefix-block sharing (``reproduce.workloads.traces.planned``).
* ``trace_stats``: the facts of a trace (``reproduce.workloads.traces.facts``;
  ``python -m reproduce.workloads.traces.stats FILE`` prints them).

Every bad input is a ``TraceError`` (a ``ValueError``) with one line naming the line and column.
docs/traces.md describes the layouts and where to get each public trace.
"""

from reproduce.workloads.traces.facts import TraceStats, trace_stats
from reproduce.workloads.traces.layouts import FORMATS
from reproduce.workloads.traces.planned import TraceCall, to_planned_calls, to_trace_calls, trace_segments
from reproduce.workloads.traces.reader import is_regular_file, read_trace
from reproduce.workloads.traces.records import TraceError, TraceRecord
from reproduce.workloads.traces.scaling import (
    mean_rate,
    parse_window,
    rate_factor,
    rescale_arrivals,
    rescale_to_rate,
    window,
)

__all__ = [
    "FORMATS",
    "TraceCall",
    "TraceError",
    "TraceRecord",
    "TraceStats",
    "is_regular_file",
    "mean_rate",
    "parse_window",
    "rate_factor",
    "read_trace",
    "rescale_arrivals",
    "rescale_to_rate",
    "to_planned_calls",
    "to_trace_calls",
    "trace_segments",
    "trace_stats",
    "window",
]
