"""The facts of a trace, and the ``python -m reproduce.workloads.traces.stats`` command that prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from reproduce.workloads.traces import TraceError, TraceRecord, trace_stats
from reproduce.workloads.traces.facts import format_stats, percentile

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "reproduce" / "workloads" / "traces" / "data"


def test_facts_of_a_small_trace() -> None:
    # minute 0: 3 calls, minute 1: none, minute 2: 1 call
    records = [
        TraceRecord(0.0, 10, 1, session="a"),
        TraceRecord(1.0, 20, 2, session="a"),
        TraceRecord(59.0, 30, 3, prefix_blocks=(1,), block_tokens=512),
        TraceRecord(150.0, 40, 400, session="b"),
    ]
    stats = trace_stats(records)
    assert stats.calls == 4
    assert stats.duration_s == 150.0
    assert stats.mean_rate == pytest.approx(3 / 150.0)
    assert stats.busiest_minute_calls == 3
    assert stats.median_minute_calls == 1.0  # minutes hold 3, 0, 1: the empty one counts
    assert stats.prompt_p == {50: 20, 90: 40, 99: 40}
    assert stats.output_max == 400
    assert stats.with_prefix_blocks == 1
    assert stats.sessions == 2
    with pytest.raises(TraceError, match="no calls"):
        trace_stats([])


def test_the_median_minute_of_a_long_span_costs_only_its_calls() -> None:
    # four calls, the last 54 years after the others: 28 million minutes, three of them busy
    records = [TraceRecord(0.0, 1, 1), TraceRecord(1.0, 1, 1), TraceRecord(2.0, 1, 1)]
    records.append(TraceRecord(1.7e9, 3, 4))
    tracemalloc.start()
    try:
        stats = trace_stats(records)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # bytes: no list of the span's minutes
    assert (stats.busiest_minute_calls, stats.median_minute_calls) == (3, 0.0)
    # an even number of minutes, the median between an empty and a busy one
    even = trace_stats([TraceRecord(0.0, 1, 1), TraceRecord(0.5, 1, 1), TraceRecord(200.0, 1, 1)])
    assert (even.busiest_minute_calls, even.median_minute_calls) == (2, 0.5)  # minutes 2, 0, 0, 1


def test_nearest_rank_percentile() -> None:
    values = list(range(1, 101))
    assert [percentile(values, p) for p in (1, 50, 90, 99, 100)] == [1, 50, 90, 99, 100]
    assert percentile([7], 50) == 7


def run_stats(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "reproduce.workloads.traces.stats", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
    )


def test_the_command_prints_the_facts_of_the_azure_code_slice() -> None:
    done = run_stats(str(DATA / "azure_code_2023_30min.csv.gz"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = dict(line.split(None, 1) for line in done.stdout.replace(" minute", "_minute").splitlines())
    assert lines["calls"] == "5740"
    assert lines["busiest_minute"].startswith("632 calls")
    done = run_stats("--json", str(DATA / "mooncake_conversation_4min.jsonl"))
    facts = json.loads(done.stdout)
    assert facts["calls"] == 731 and facts["with_prefix_blocks"] == 731
    done = run_stats("--json", "--window", "60:120", str(DATA / "mooncake_conversation_4min.jsonl"))
    assert json.loads(done.stdout)["calls"] == 177  # the second minute of the slice
    done = run_stats("--window", "120", str(DATA / "mooncake_conversation_4min.jsonl"))
    assert done.returncode == 1 and "a window is START:END" in done.stderr


def test_the_command_reports_a_bad_row_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n1,x,1\n")
    done = run_stats(str(bad))
    assert done.returncode == 1
    assert done.stderr.strip() == f"Error: {bad}: line 3, column 'prompt_tokens': not a number: 'x'"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "huge.csv",
            "arrival_s,prompt_tokens,output_tokens\n0,1,1\n1,1e300,1\n",
            "line 3, column 'prompt_tokens': more tokens than any model's context "
            "(at most 1,000,000,000): '1e300'",
        ),
        (
            "deep.jsonl",
            '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n'
            + '{"arrival_s": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
            "line 2: not JSON that can be read (nested too deeply)",
        ),
    ],
)  # fmt: skip
def test_the_command_reports_what_it_cannot_count_in_one_line(
    tmp_path: Path, name: str, text: str, expected: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    done = run_stats(str(path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"Error: {path}: {expected}"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_the_command_reads_a_pipe_whole(tmp_path: Path) -> None:
    """``stats --format azure <(cat FILE)``: the layout named, the pipe read once from its first byte."""
    fifo = tmp_path / "trace.pipe"
    os.mkfifo(fifo)
    data = (DATA / "azure_conv_2023_5min.csv").read_bytes()

    def write() -> None:
        with fifo.open("wb") as fh:
            fh.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    done = run_stats("--json", "--format", "azure", str(fifo))
    writer.join(10)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["calls"] == 1_445


def test_a_stream_past_the_kept_calls_is_sampled_and_its_minutes_cost_their_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reproduce.workloads.traces import facts

    monkeypatch.setattr(facts, "MAX_KEPT", 100)
    # 1,000 calls, one every 10 minutes for a while, then a burst: far more calls than kept.
    records = [TraceRecord(600.0 * i, 1 + i % 7, 2) for i in range(900)]
    records += [TraceRecord(600.0 * 900 + 0.01 * i, 500, 3) for i in range(100)]
    stats = trace_stats(iter(records))
    assert stats.calls == 1000 and stats.lengths_from == 100
    assert stats.prompt_max == 500 and stats.output_max == 3  # exact, whatever the sample
    assert stats.busiest_minute_calls == 100 and stats.median_minute_calls == 0.0
    assert "percentiles of a sample of 100" in format_stats(stats)
    with pytest.raises(TraceError, match="not in arrival order"):
        trace_stats([TraceRecord(120.0, 1, 1), TraceRecord(0.0, 1, 1)])
