"""Trace records as planned calls: lengths, ids, the derived shared prefix, and segments that
keep exactly the prefix-block sharing of the trace in the engine model's prefix cache."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from reproduce.engine.kvcache import BlockPool, prompt_layout
from reproduce.workloads.calls import PlannedCall
from reproduce.workloads.traces import (
    TraceError,
    TraceRecord,
    mean_rate,
    rate_factor,
    read_trace,
    rescale_arrivals,
    to_planned_calls,
    to_trace_calls,
    trace_segments,
)

DATA = Path(__file__).resolve().parents[3] / "reproduce" / "workloads" / "traces" / "data"
MOONCAKE = DATA / "mooncake_conversation_4min.jsonl"
EXAMPLE = DATA / "retrywatch_example.csv"
ENGINE_BLOCK = 16


def cached_hits(cached: Sequence[tuple[int, int]], asked: Sequence[tuple[int, int]]) -> int:
    """Tokens of ``asked`` the engine model's prefix cache hits after computing ``cached``."""
    pool = BlockPool(100_000)
    for segment_id, owned in prompt_layout(cached, ENGINE_BLOCK):
        assert pool.allocate(owned)
        pool.commit(segment_id, 0, owned)
    _, total, _ = pool.lookup(prompt_layout(asked, ENGINE_BLOCK), 100_000)
    return total * ENGINE_BLOCK


def test_planned_calls_of_a_plain_trace() -> None:
    records = [TraceRecord(0.0, 100, 5), TraceRecord(1.5, 0, 0, call_id="mine"), TraceRecord(2.0, 40_000, 9)]
    calls = list(to_planned_calls(records, call_id_prefix="az", max_context=32_768))
    assert calls == [
        PlannedCall("az-000000", 0.0, 100, 0, 5, "trace"),
        PlannedCall("mine", 1.5, 1, 0, 1, "trace"),
        PlannedCall("az-000002", 2.0, 32_767, 0, 1, "trace"),
    ]
    with pytest.raises(TraceError, match="max_context"):
        list(to_planned_calls(records, max_context=1))


def test_segments_of_a_record_without_blocks_are_unique_to_the_call() -> None:
    record = TraceRecord(0.0, 1000, 5)
    assert [n for _, n in trace_segments(record, "a")] == [1000]
    assert trace_segments(record, "a") == trace_segments(record, "a")  # a retry hits its own blocks
    assert trace_segments(record, "a") != trace_segments(record, "b")


def test_the_planned_segments_are_trace_segments_of_each_call_with_or_without_blocks() -> None:
    plain = [
        TraceRecord(0.0, 1000, 5),
        TraceRecord(0.5, 0, 3, prefix_blocks=(7, 8)),  # blocks of no size: none
        TraceRecord(0.7, 900, 3, block_tokens=512),  # a size, no blocks: none
    ]
    records = [*plain, *read_trace(EXAMPLE), *itertools.islice(read_trace(MOONCAKE), 40)]
    calls = list(to_trace_calls(records, max_context=4_000))
    assert {c.blocks > 0 for c in calls} == {False, True}
    for record, call in zip(records, calls, strict=True):
        segments = trace_segments(record, call.planned.call_id, call.planned.prompt_len)
        assert call.segments == segments
        assert sum(n for _, n in segments) == call.planned.prompt_len


def test_time_factor_rescales_as_rescale_arrivals_does() -> None:
    records = list(read_trace(MOONCAKE))
    factor = rate_factor(7.3, mean_rate(records))
    assert list(to_trace_calls(records, time_factor=factor)) == list(
        to_trace_calls(rescale_arrivals(records, factor))
    )


def test_mooncake_calls_share_exactly_their_common_leading_blocks() -> None:
    # Mooncake's README example: two requests sharing their first 12 hash ids.
    a = TraceRecord(27.482, 6955, 52, prefix_blocks=(*range(46, 58), 2353, 2354), block_tokens=512)
    b = TraceRecord(30.535, 6472, 26, prefix_blocks=(*range(46, 58), 2366), block_tokens=512)
    calls = list(to_trace_calls([a, b]))
    seg_a, seg_b = calls[0].segments, calls[1].segments
    assert [n for _, n in seg_a] == [512] * 13 + [6955 - 13 * 512]
    assert sum(n for _, n in seg_b) == 6472
    assert seg_a[:12] == seg_b[:12] and seg_a[12] != seg_b[12]
    assert cached_hits(seg_a, seg_b) == 12 * 512
    assert calls[0].planned.shared_prefix_len == 0
    assert calls[1].planned.shared_prefix_len == 12 * 512


def test_equal_block_ids_after_a_difference_are_not_shared() -> None:
    """Ids are chained: a block matches only with everything before it."""
    a = TraceRecord(0.0, 1024, 1, prefix_blocks=(1, 2), block_tokens=512)
    b = TraceRecord(1.0, 1024, 1, prefix_blocks=(3, 2), block_tokens=512)
    seg_a, seg_b = (c.segments for c in to_trace_calls([a, b]))
    assert seg_a[1] != seg_b[1]
    assert cached_hits(seg_a, seg_b) == 0


def test_prompt_beyond_its_blocks_and_blocks_beyond_the_prompt() -> None:
    longer = TraceRecord(0.0, 1500, 1, prefix_blocks=(7,), block_tokens=512)
    assert [n for _, n in trace_segments(longer, "x")] == [512, 988]
    shorter = TraceRecord(0.0, 600, 1, prefix_blocks=(7, 8, 9), block_tokens=512)
    assert [n for _, n in trace_segments(shorter, "x")] == [512, 88]
    # cut by max_context: segments follow the planned prompt
    (call,) = to_trace_calls([shorter], max_context=513)
    assert call.planned.prompt_len == 512
    assert [n for _, n in call.segments] == [512]


def test_the_mooncake_slice_shares_as_its_hash_ids_say() -> None:
    records = list(read_trace(MOONCAKE))
    calls = list(to_trace_calls(records))
    assert len(calls) == len(records) == 731
    for record, call in zip(records, calls, strict=True):
        assert sum(n for _, n in call.segments) == call.planned.prompt_len == record.prompt_tokens
        assert call.planned.arrival_s == record.arrival_s
        assert call.planned.response_len == record.output_tokens
    # the derived shared prefix is the longest run of leading blocks some earlier call had
    seen: set[tuple[int, ...]] = set()
    for record, call in zip(records, calls, strict=True):
        blocks = record.prefix_blocks
        k = max((i for i in range(len(blocks) + 1) if blocks[:i] in seen), default=0)
        assert call.planned.shared_prefix_len == min(k * 512, record.prompt_tokens)
        seen.update(blocks[:i] for i in range(1, len(blocks) + 1))
    assert sum(c.planned.shared_prefix_len > 0 for c in calls) > 700  # block 0 is everyone's
    # the engine model hits the same prefix between two calls that share blocks
    pairs = [
        (x, y)
        for (x, rx), (y, ry) in itertools.combinations(zip(calls, records, strict=True), 2)
        if rx.prefix_blocks[:3] == ry.prefix_blocks[:3]
    ][:20]
    assert pairs
    for x, y in pairs:
        common = 0
        for p, q in zip(x.segments, y.segments, strict=False):
            if p != q:
                break
            common += p[1]
        assert cached_hits(x.segments, y.segments) == common // ENGINE_BLOCK * ENGINE_BLOCK


def test_a_bounded_memory_of_blocks_only_shortens_shared_prefixes() -> None:
    records = list(read_trace(MOONCAKE))
    full = [c.shared_prefix_len for c in to_planned_calls(records)]
    small = [c.shared_prefix_len for c in to_planned_calls(records, max_tracked_blocks=50)]
    assert all(s <= f for s, f in zip(small, full, strict=True))
    assert sum(small) < sum(full)


def test_the_retrywatch_layout_keeps_call_ids() -> None:
    calls = list(to_planned_calls(read_trace(EXAMPLE)))
    assert [c.call_id for c in calls[:3]] == ["c0000", "c0001", "c0002"]
    assert len({c.call_id for c in calls}) == 120


def test_a_call_id_on_two_rows_is_refused_naming_both_lines() -> None:
    """Rows are calls: a repeated id would replay its later rows as attached retries of the first."""
    rows = "arrival_s,prompt_tokens,output_tokens,call_id\n0,1,1,a\n1,1,1,b\n2,1,1,\n3,1,1,a\n"
    calls = to_planned_calls(read_trace(iter(rows.splitlines(keepends=True))), source="mine.csv")
    with pytest.raises(TraceError) as info:
        list(calls)
    assert str(info.value) == (
        "mine.csv: line 5, column 'call_id': 'a' is also the call id of line 2; a trace has one row "
        "per call (the replay makes its own retries)"
    )
    # a generated id that a trace's own id already took
    taken = [TraceRecord(0.0, 1, 1, call_id="t-000001", line=2), TraceRecord(1.0, 1, 1, line=3)]
    with pytest.raises(
        TraceError, match="line 3, column 'call_id': 't-000001' is also the call id of line 2"
    ):
        list(to_planned_calls(taken))
