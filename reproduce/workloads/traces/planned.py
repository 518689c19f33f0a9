"""Trace records as the run plan's calls: ``PlannedCall`` plus prompt segments that keep sharing.

``to_trace_calls`` turns each record into a ``TraceCall``: today's ``PlannedCall`` (call id,
arrival, prompt and response lengths, the shared prefix) and the prompt's ``segments``.

NOTE: segments. The engine model's prefix cache (``reproduce.engine.kvcache``) takes a prompt as
a chain of ``(segment_id, n_tokens)`` whose ids are unique for their content and everything
before them, like ``reproduce.workloads.calls.prompt_segments``. A record with prefix blocks (Mooncake's
``hash_ids``, 512 tokens each) becomes one segment per block, the id chained from the block's
id, its length and the previous segment's id, so two calls share exactly the leading blocks
whose ids match in order, as the trace says, and never more. The last block holds what is left
of the prompt (it may be partial); prompt tokens beyond the listed blocks form one segment
unique to the call, and blocks beyond the prompt are ignored. A record without blocks is one
segment unique to the call. Block sizes that are multiples of the engine's block size (512
and 16) keep block boundaries aligned.

``PlannedCall.shared_prefix_len`` can only say how long a shared prefix is, not with whom it is
shared: here it is the tokens of the call's leading blocks that an earlier call of the stream
also had (its reusable prefix when it arrives). ``workload.prompt_segments`` of such a call would
make every prefix of one length the same segment, so an integration that models the cache must
use ``TraceCall.segments``. The blocks already seen are kept in a bounded LRU set
(``max_tracked_blocks``); past it the oldest are forgotten, which can only shorten a derived
shared prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from reproduce.workloads.calls import PlannedCall
from reproduce.workloads.traces.records import TraceError, TraceRecord, row_error

__all__ = [
    "DEFAULT_MAX_TRACKED_BLOCKS",
    "TRACE_PHASE",
    "TraceCall",
    "to_planned_calls",
    "to_trace_calls",
    "trace_segments",
]

#: The phase name of every call replayed from a trace.
TRACE_PHASE = "trace"
#: Chained block ids remembered to derive ``shared_prefix_len`` (about 100 bytes each).
DEFAULT_MAX_TRACKED_BLOCKS = 1_000_000

Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class TraceCall:
    """A planned call of a trace and its prompt as chained segments ``(segment_id, n_tokens)``.

    The segments of a call without prefix blocks (one segment unique to the call) are made when
    asked for: a replay asks only for those of calls with blocks (``RunPlan.segments``), and
    hashing an id for each of the others was a tenth of a replay's planning."""

    planned: PlannedCall
    block_segments: Segments = ()  # its segments if it has prefix blocks, () if not
    blocks: int = 0  # how many of the segments are prefix blocks (shareable with other calls)

    @property
    def segments(self) -> Segments:
        if self.blocks:
            return self.block_segments
        return _unique_segment(self.planned.call_id, self.planned.prompt_len)


def _stable_id(*parts: object) -> int:
    """A 63-bit id stable across processes (``hash`` of a str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _has_blocks(record: TraceRecord) -> bool:
    return record.block_tokens > 0 and bool(record.prefix_blocks)


def _unique_segment(call_id: str, length: int) -> Segments:
    """The prompt of a call without prefix blocks: one segment unique to the call."""
    return ((_stable_id("trace-call", call_id, 0, 0), length),)


def trace_segments(record: TraceRecord, call_id: str, prompt_len: int | None = None) -> Segments:
    """The prompt of ``record`` (``prompt_len`` tokens, its own length by default) as segments."""
    length = record.prompt_tokens if prompt_len is None else prompt_len
    if not _has_blocks(record):
        return _unique_segment(call_id, length)
    segments: list[tuple[int, int]] = []
    previous = 0
    covered = 0
    size = record.block_tokens
    for block in record.prefix_blocks if size > 0 else ():
        if covered >= length:
            break
        n = min(size, length - covered)
        previous = _stable_id("trace-block", previous, block, n)
        segments.append((previous, n))
        covered += n
    if covered < length:
        segments.append((_stable_id("trace-call", call_id, previous, covered), length - covered))
    return tuple(segments)


def to_trace_calls(
    records: Iterable[TraceRecord],
    *,
    call_id_prefix: str = "t",
    max_context: int | None = None,
    max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS,
    source: str = "<trace>",
    time_factor: float = 1.0,
) -> Iterator[TraceCall]:
    """Each record as a ``TraceCall`` (streams), its arrival × ``time_factor`` (as
    ``rescale_arrivals``, without a copy of each record; the factor is the caller's to check).

    A record's own call id is kept; otherwise ``{call_id_prefix}-{index:06d}``. A call id is one
    call: a second row with the same id is a ``TraceError`` naming both lines (rows are calls,
    not attempts: the replay makes its own retries, and a repeated id would otherwise make later
    rows attach to the first one's execution); ``source`` names the trace in that message, and
    the ids are kept (memory grows with the calls that carry one, as the plan's calls do).
    Lengths of 0 become 1 (an engine needs a prompt token and asks for at least one output
    token). With
    ``max_context``, the prompt is cut to ``max_context - 1`` and the response to what is left,
    as ``reproduce.workloads.calls`` does.
    """
    if max_context is not None and max_context < 2:
        raise TraceError(f"max_context must leave room for a prompt and one output token, got {max_context}")
    seen: OrderedDict[int, None] = OrderedDict()
    lines: dict[str, int] = {}  # the trace's own call ids so far, and their rows' lines
    for index, record in enumerate(records):
        call_id = record.call_id or f"{call_id_prefix}-{index:06d}"
        first = lines.get(call_id)
        if first is not None:
            raise row_error(
                source,
                record.line,
                "call_id",
                f"{call_id!r} is also the call id of line {first}; a trace has one row per call "
                "(the replay makes its own retries)",
            )
        if record.call_id:
            lines[call_id] = record.line
        prompt = max(1, record.prompt_tokens)
        response = max(1, record.output_tokens)
        if max_context is not None:
            prompt = min(prompt, max_context - 1)
            response = min(response, max_context - prompt)
        segments: Segments = ()
        n_blocks = shared = 0
        if _has_blocks(record):
            segments = trace_segments(record, call_id, prompt)
            n_blocks = min(len(record.prefix_blocks), len(segments))
            reusable = True
            for segment_id, n_tokens in segments[:n_blocks]:
                hit = segment_id in seen
                if hit:
                    seen.move_to_end(segment_id)
                else:
                    seen[segment_id] = None
                    if len(seen) > max_tracked_blocks:
                        seen.popitem(last=False)
                reusable = reusable and hit
                if reusable:
                    shared += n_tokens
        planned = PlannedCall(
            call_id=call_id,
            arrival_s=record.arrival_s if time_factor == 1.0 else record.arrival_s * time_factor,
            prompt_len=prompt,
            shared_prefix_len=shared,
            response_len=response,
            phase=TRACE_PHASE,
        )
        yield TraceCall(planned, segments, n_blocks)


def to_planned_calls(
    records: Iterable[TraceRecord],
    *,
    call_id_prefix: str = "t",
    max_context: int | None = None,
    max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS,
    source: str = "<trace>",
) -> Iterator[PlannedCall]:
    """Each record as today's ``PlannedCall`` (see ``to_trace_calls``; segments dropped)."""
    for call in to_trace_calls(
        records,
        call_id_prefix=call_id_prefix,
        max_context=max_context,
        max_tracked_blocks=max_tracked_blocks,
        source=source,
    ):
        yield call.planned
