"""Rescaling a trace to a load (burst shape kept, mean rate hit) and taking a window."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from reproduce.workloads.traces import (
    TraceError,
    TraceRecord,
    mean_rate,
    parse_window,
    rate_factor,
    read_trace,
    rescale_arrivals,
    rescale_to_rate,
    trace_stats,
    window,
)

DATA = Path(__file__).resolve().parents[3] / "reproduce" / "workloads" / "traces" / "data"
AZURE_CODE = DATA / "azure_code_2023_30min.csv.gz"


def gaps(records: list[TraceRecord]) -> list[float]:
    return [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(records)]


@pytest.mark.parametrize("multiple", [0.6, 2.7])
def test_load_hits_the_mean_rate_and_keeps_the_burst_shape(multiple: float) -> None:
    capacity = 2.78
    source = mean_rate(read_trace(AZURE_CODE))  # the first streaming pass
    assert source == pytest.approx(5739 / 1788.410675, rel=1e-6)
    scaled = list(rescale_to_rate(read_trace(AZURE_CODE), multiple * capacity, source))
    original = list(read_trace(AZURE_CODE))
    assert mean_rate(scaled) == pytest.approx(multiple * capacity, rel=1e-9)
    # every inter-arrival gap shrinks or stretches by one factor: ratios of gaps are kept
    factor = source / (multiple * capacity)
    for before, after in zip(gaps(original), gaps(scaled), strict=True):
        assert after == pytest.approx(before * factor, rel=1e-9, abs=1e-9)
    # lengths and order are untouched
    assert [(r.prompt_tokens, r.output_tokens, r.line) for r in scaled] == [
        (r.prompt_tokens, r.output_tokens, r.line) for r in original
    ]


def test_burstiness_survives_rescaling() -> None:
    """The busiest stretch against the typical one is the same at any load (one time factor)."""
    source = mean_rate(read_trace(AZURE_CODE))
    before = trace_stats(read_trace(AZURE_CODE))
    after = trace_stats(rescale_arrivals(read_trace(AZURE_CODE), 60.0))  # half an hour becomes 30 hours
    assert after.calls == before.calls
    assert after.duration_s == pytest.approx(before.duration_s * 60.0)
    assert after.mean_rate == pytest.approx(source / 60.0)
    # each original second becomes one new minute: the busiest new minute holds the busiest second's calls
    per_second = [0] * (int(before.duration_s) + 1)
    for record in read_trace(AZURE_CODE):
        per_second[int(record.arrival_s)] += 1
    assert after.busiest_minute_calls == max(per_second)


def test_bad_rates_are_refused() -> None:
    with pytest.raises(TraceError, match="target rate must be a positive number"):
        list(rescale_to_rate(read_trace(AZURE_CODE), 0.0, 1.0))
    with pytest.raises(TraceError, match="source rate must be a positive number"):
        rate_factor(1.0, math.inf)
    with pytest.raises(TraceError, match="time factor must be a positive number"):
        rate_factor(1e-300, 1e300)  # (a factor past a float's range)
    with pytest.raises(TraceError, match="time factor must be a positive number"):
        list(rescale_arrivals(read_trace(AZURE_CODE), math.nan))
    with pytest.raises(TraceError, match="at least two calls"):
        mean_rate([TraceRecord(0.0, 1, 1)])


def test_window_keeps_start_to_end_counted_from_start() -> None:
    full = list(read_trace(AZURE_CODE))
    part = list(window(read_trace(AZURE_CODE), 600.0, 900.0))
    expected = [r for r in full if 600.0 <= r.arrival_s < 900.0]
    assert len(part) == len(expected) > 100
    assert [r.line for r in part] == [r.line for r in expected]
    assert [r.arrival_s for r in part] == pytest.approx([r.arrival_s - 600.0 for r in expected])
    assert part[0].arrival_s >= 0.0 and part[-1].arrival_s < 300.0


def test_window_stops_reading_at_its_end() -> None:
    read: list[int] = []

    def endless() -> Iterator[TraceRecord]:
        for i in itertools.count():
            read.append(i)
            yield TraceRecord(float(i), 1, 1)

    part = list(window(endless(), 10.0, 20.0))
    assert [r.arrival_s for r in part] == [float(i) for i in range(10)]
    assert len(read) == 21  # the records of [0, 20) and the first one at 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("60:120", (60.0, 120.0)),
        (":600", (0.0, 600.0)),
        ("3600:", (3600.0, math.inf)),
        ("0.5:1.5", (0.5, 1.5)),
    ],
)
def test_parse_window(text: str, expected: tuple[float, float]) -> None:
    assert parse_window(text) == expected


@pytest.mark.parametrize("text", ["60", "120:60", "a:b", "-5:10", "5:5", "nan:1"])
def test_parse_window_refuses(text: str) -> None:
    with pytest.raises(TraceError, match="window"):
        parse_window(text)


def test_window_then_load_rescales_the_window_rate() -> None:
    start, end = parse_window("600:1200")
    source = mean_rate(window(read_trace(AZURE_CODE), start, end))
    scaled = list(rescale_to_rate(window(read_trace(AZURE_CODE), start, end), 5.0, source))
    assert mean_rate(scaled) == pytest.approx(5.0, rel=1e-9)
