"""Reading traces: every layout from the shipped slices, autodetection, bad rows, streaming."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reproduce.workloads.traces import FORMATS, TraceError, TraceRecord, read_trace
from reproduce.workloads.traces.reader import MAX_LINE_CHARS

DATA = Path(__file__).resolve().parents[3] / "reproduce" / "workloads" / "traces" / "data"
AZURE_CODE = DATA / "azure_code_2023_30min.csv.gz"
AZURE_CONV = DATA / "azure_conv_2023_5min.csv"
MOONCAKE = DATA / "mooncake_conversation_4min.jsonl"
EXAMPLE_CSV = DATA / "retrywatch_example.csv"
EXAMPLE_JSONL = DATA / "retrywatch_example.jsonl"

# The first rows of Azure's 2024 code trace as its own analysis notebook shows them
# (AzurePublicDataset, CC-BY 4.0): UTC offsets and 6 fractional digits.
AZURE_2024 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2024-05-10 00:00:00.009930+00:00,2162,5\n"
    "2024-05-10 00:00:00.017335+00:00,2399,6\n"
    "2024-05-10 00:00:00.022314+00:00,76,15\n"
    "2024-05-10 00:00:00.037845+00:00,2376,1\n"
    "2024-05-10 00:00:00.083890+00:00,7670,8\n"
    "2024-05-10 00:00:01+00:00,10,1\n"
)
BURSTGPT_OLD = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,ChatGPT,1087,230,1317,Conversation log\n"
    "60,GPT-4,300,0,300,API log\n"
    "118,GPT-4,417,276,693,Conversation log\n"
)
BURSTGPT_NEW = (
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "19440110.0,1722ac82,43,GPT-4,906,446,1352,Conversation log\n"
    "19440161.0,d5983bf9,2,ChatGPT,36,29,65,Conversation log\n"
    "19440170.5,,3,ChatGPT,50,0,50,API log\n"
    "19440192.0,1722ac82,8,GPT-4,1779,123,1902,Conversation log\n"
)


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_azure_2023_code_gzip_every_request_from_the_first() -> None:
    records = list(read_trace(AZURE_CODE))
    assert len(records) == 5740
    assert records[0].arrival_s == 0.0
    assert (records[0].prompt_tokens, records[0].output_tokens) == (4808, 10)
    # 2023-11-16 18:17:03.9799600 -> 18:17:04.0319600: the 7-digit fractions are kept
    assert records[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    # last row 2023-11-16 18:46:52.3906350
    assert records[-1].arrival_s == pytest.approx(1788.410675, abs=1e-5)
    assert (records[-1].prompt_tokens, records[-1].output_tokens) == (941, 264)
    assert records[-1].line == 5741
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(records))
    assert all(r.call_id is None and r.prefix_blocks == () for r in records)


def test_azure_2023_conversation_slice() -> None:
    records = list(read_trace(AZURE_CONV))
    assert len(records) == 1445
    assert (records[0].prompt_tokens, records[0].output_tokens) == (374, 44)
    assert records[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert records[-1].arrival_s < 300.0


def test_azure_2024_offsets_and_missing_fractions(tmp_path: Path) -> None:
    records = list(read_trace(write(tmp_path, AZURE_2024)))
    assert [r.prompt_tokens for r in records] == [2162, 2399, 76, 2376, 7670, 10]
    assert records[1].arrival_s == pytest.approx(0.007405, abs=1e-6)
    assert records[-1].arrival_s == pytest.approx(0.99007, abs=1e-6)


@pytest.mark.parametrize("offset", ["+99:99", "+24:00", "-05:60", "+0a:00", "+ 1:00"])
def test_an_azure_offset_out_of_range_is_refused(tmp_path: Path, offset: str) -> None:
    text = f"TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.5{offset},1,1\n"
    assert message_of(tmp_path, text).startswith("line 2, column 'TIMESTAMP': not a timestamp")
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.5-23:59,1,1\n"
    assert [r.prompt_tokens for r in read_trace(write(tmp_path, text))] == [1]


def test_azure_offsets_are_applied(tmp_path: Path) -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 02:00:00+02:00,1,1\n2024-05-10T00:00:30Z,2,2\n"
    )
    records = list(read_trace(write(tmp_path, text)))
    assert [r.arrival_s for r in records] == [0.0, 30.0]


def test_burstgpt_old_layout_drops_failures_by_default(tmp_path: Path) -> None:
    path = write(tmp_path, BURSTGPT_OLD)
    records = list(read_trace(path))
    assert [r.arrival_s for r in records] == [0.0, 40.0, 113.0]
    assert (records[0].prompt_tokens, records[0].output_tokens) == (472, 18)
    assert [r.line for r in records] == [2, 3, 5]
    kept = list(read_trace(path, keep_failed=True))
    assert [(r.arrival_s, r.output_tokens) for r in kept][2] == (55.0, 0)


def test_burstgpt_new_layout_has_sessions(tmp_path: Path) -> None:
    records = list(read_trace(write(tmp_path, BURSTGPT_NEW), keep_failed=True))
    assert [r.session for r in records] == ["1722ac82", "d5983bf9", None, "1722ac82"]
    assert records[1].arrival_s == pytest.approx(51.0)
    assert len(list(read_trace(write(tmp_path, BURSTGPT_NEW)))) == 3


def test_mooncake_slice_keeps_its_prefix_blocks() -> None:
    records = list(read_trace(MOONCAKE))
    assert len(records) == 731
    first = records[0]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 6758, 500)
    assert first.prefix_blocks == tuple(range(14))
    assert first.block_tokens == 512
    assert records[1].prefix_blocks[0] == 0  # every conversation shares block 0
    assert all(len(r.prefix_blocks) == -(-r.prompt_tokens // 512) for r in records)
    assert records[-1].arrival_s < 240.0


@pytest.mark.parametrize("path", [EXAMPLE_CSV, EXAMPLE_JSONL], ids=["csv", "jsonl"])
def test_retrywatch_layout_csv_and_jsonl_agree(path: Path) -> None:
    records = list(read_trace(path))
    assert len(records) == 120
    first = records[0]
    assert first.call_id == "c0000"
    assert first.session == "s01"
    assert first.tenant == "batch"
    assert first.prefix_blocks == (1000, 1001, 100000)
    assert first.block_tokens == 512


def test_csv_and_jsonl_examples_are_the_same_calls() -> None:
    strip = [
        (r.arrival_s, r.prompt_tokens, r.output_tokens, r.call_id, r.prefix_blocks)
        for r in read_trace(EXAMPLE_CSV)
    ]
    other = [
        (r.arrival_s, r.prompt_tokens, r.output_tokens, r.call_id, r.prefix_blocks)
        for r in read_trace(EXAMPLE_JSONL)
    ]
    assert strip == other


def test_retrywatch_optional_columns_any_order(tmp_path: Path) -> None:
    text = "tenant,output_tokens,arrival_s,prompt_tokens\nacme,5,10.5,100\n,6,11,200\n"
    records = list(read_trace(write(tmp_path, text)))
    assert records == [
        TraceRecord(0.0, 100, 5, tenant="acme", line=2),
        TraceRecord(0.5, 200, 6, line=3),
    ]


@pytest.mark.parametrize(
    ("path", "fmt"),
    [(AZURE_CODE, "azure"), (AZURE_CONV, "azure"), (MOONCAKE, "mooncake"), (EXAMPLE_CSV, "retrywatch")],
)
def test_autodetected_layout_equals_the_named_one(path: Path, fmt: str) -> None:
    assert list(itertools.islice(read_trace(path), 50)) == list(itertools.islice(read_trace(path, fmt), 50))


def test_format_names_a_headerless_file(tmp_path: Path) -> None:
    path = write(tmp_path, "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04.0319600,3180,8\n")
    with pytest.raises(TraceError, match=r"line 1: the header .* is no known layout; pass the format"):
        list(read_trace(path))
    records = list(read_trace(path, "azure"))
    assert [(r.line, r.prompt_tokens) for r in records] == [(1, 4808), (2, 3180)]
    assert list(read_trace(write(tmp_path, "0,100,5\n2.5,200,6\n"), "retrywatch"))[1].arrival_s == 2.5


def test_unknown_format_and_bad_options() -> None:
    with pytest.raises(TraceError, match="unknown trace format 'sharegpt'"):
        read_trace(AZURE_CONV, "sharegpt")
    with pytest.raises(TraceError, match="reorder_window_s must be >= 0"):
        read_trace(AZURE_CONV, reorder_window_s=-1)
    assert FORMATS == ("azure", "burstgpt", "mooncake", "recording", "retrywatch")


def message_of(tmp_path: Path, text: str, name: str = "trace.csv", **kwargs: object) -> str:
    path = write(tmp_path, text, name)
    with pytest.raises(TraceError) as info:
        list(read_trace(path, **kwargs))  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    return message.removeprefix(f"{path}: ")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a missing column
        ("arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,20\n", "line 3, column 'output_tokens': missing"),
        # not a number
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,lots,2\n",
            "line 3, column 'prompt_tokens': not a number: 'lots'",
        ),
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,2.5,2\n",
            "line 3, column 'prompt_tokens': not a whole number",
        ),
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,1\nnan,1,2\n",
            "line 3, column 'arrival_s': not a finite time",
        ),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,1,1\n2023-11-16 25:00:00,1,1\n",
            "line 3, column 'TIMESTAMP': not a timestamp",
        ),
        # negative
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,1\n1,10,-3\n",
            "line 3, column 'output_tokens': negative: '-3'",
        ),
        (
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "-5,ChatGPT,1,1,2,API log\n",
            "line 2, column 'Timestamp': negative",
        ),
        # unsorted
        (
            "arrival_s,prompt_tokens,output_tokens\n0,10,1\n\n5,10,1\n4.5,10,1\n",
            "line 5, column 'arrival_s': 0.5 s earlier than line 4: the trace must be in time order",
        ),
        (
            "arrival_s,prompt_tokens,output_tokens,prefix_blocks\n0,10,1,1 x\n",
            "line 2, column 'prefix_blocks'",
        ),
    ],
)
def test_a_bad_csv_row_names_its_line_and_column(tmp_path: Path, text: str, expected: str) -> None:
    assert message_of(tmp_path, text).startswith(expected)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            [
                '{"timestamp": 0, "input_length": 1, "output_length": 1}',
                '{"timestamp": 5, "input_length": 1}',
            ],
            "line 2, column 'output_length': missing",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 1, "output_length": 1}',
                '{"timestamp": 5, "input_length": "9", "output_length": 1}',
            ],
            "line 2, column 'input_length': not a number",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 1, "output_length": 1}',
                '{"timestamp": 5, "input_length": -9, "output_length": 1}',
            ],
            "line 2, column 'input_length': negative",
        ),
        (
            [
                '{"timestamp": 9, "input_length": 1, "output_length": 1}',
                '{"timestamp": 5, "input_length": 9, "output_length": 1}',
            ],
            "line 2, column 'timestamp': 0.004 s earlier than line 1",
        ),
        (
            ['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, "a"]}'],
            "line 1, column 'hash_ids': not a list of integers",
        ),
        (['{"timestamp": 0, "input_length": 1, "output_length": 1}', '{"timestamp": 1,'], "line 2: not JSON"),
        (
            ['{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": true}'],
            "line 1, column 'output_tokens': not a number",
        ),
        (
            ['{"arrival_s": 0, "prompt_tokens": 1' + "0" * 400 + ', "output_tokens": 1}'],
            "line 1, column 'prompt_tokens': too large",
        ),
        (
            ['{"timestamp": 1' + "0" * 400 + ', "input_length": 1, "output_length": 1}'],
            "line 1, column 'timestamp': too large",
        ),
        (
            ['{"timestamp": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 1}'],
            "line 1: not JSON that can be read (Exceeds the limit",
        ),
    ],
)
def test_a_bad_json_line_names_its_line_and_key(tmp_path: Path, lines: list[str], expected: str) -> None:
    assert message_of(tmp_path, "\n".join(lines) + "\n", "trace.jsonl").startswith(expected)


def test_a_header_missing_a_column_names_it(tmp_path: Path) -> None:
    text = "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.97,1\n"
    assert message_of(tmp_path, text, format="azure").startswith(
        "line 1, column 'GeneratedTokens': missing from the header 'TIMESTAMP,ContextTokens'"
    )
    assert message_of(tmp_path, text).startswith(
        "line 1: the header 'TIMESTAMP,ContextTokens' is no known layout"
    )


def test_unsorted_rows_within_the_reorder_window_are_sorted(tmp_path: Path) -> None:
    text = "arrival_s,prompt_tokens,output_tokens\n10,1,1\n12,2,1\n11,3,1\n9.5,4,1\n14,5,1\n13.5,6,1\n"
    path = write(tmp_path, text)
    records = list(read_trace(path, reorder_window_s=2.5))
    assert [r.prompt_tokens for r in records] == [4, 1, 3, 2, 6, 5]
    assert [r.arrival_s for r in records] == [0.0, 0.5, 1.5, 2.5, 4.0, 4.5]
    assert [r.line for r in records] == [5, 2, 4, 3, 7, 6]
    late = "arrival_s,prompt_tokens,output_tokens\n10,1,1\n12,2,1\n15,3,1\n12.5,4,1\n"
    assert message_of(tmp_path, late, reorder_window_s=2.0).startswith(
        "line 5, column 'arrival_s': 2.5 s earlier than line 4"
    )
    assert len(list(read_trace(write(tmp_path, late), reorder_window_s=2.5))) == 4


def test_a_line_that_is_not_csv_names_its_line(tmp_path: Path) -> None:
    huge = "1 " * 70_000
    text = f"arrival_s,prompt_tokens,output_tokens,prefix_blocks\n0,1,1,1\n1,1,1,{huge}\n"
    assert message_of(tmp_path, text).startswith("line 3: not CSV: field larger than field limit")


def test_empty_and_unreadable_files(tmp_path: Path) -> None:
    assert message_of(tmp_path, "\n\n").startswith("empty")
    with pytest.raises(TraceError, match="cannot read"):
        list(read_trace(tmp_path / "absent.csv"))
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(gzip.compress(b"arrival_s,prompt_tokens,output_tokens\n0,1,1\n" * 50)[:-30])
    with pytest.raises(TraceError, match="cannot read past the last good row"):
        list(read_trace(broken))


def endless_azure_lines(counter: list[int]) -> Iterator[str]:
    counter[0] += 1
    yield "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    for i in itertools.count():
        counter[0] += 1
        yield f"2024-05-10 00:{i // 600 % 60:02d}:{i // 10 % 60:02d}.{i % 10}00000+00:00,{i % 900 + 1},7\n"


def test_streaming_reads_no_further_than_it_must() -> None:
    counter = [0]
    stream = read_trace(endless_azure_lines(counter))
    assert counter[0] == 0  # nothing is read before the first record is asked for
    first = next(stream)
    assert (first.arrival_s, first.prompt_tokens) == (0.0, 1)
    assert counter[0] <= 3
    rest = list(itertools.islice(stream, 999))
    assert rest[-1].arrival_s == pytest.approx(99.9)
    assert counter[0] <= 1002
    # a reorder window reads ahead by one window only
    counter = [0]
    windowed = read_trace(endless_azure_lines(counter), reorder_window_s=5.0)
    assert next(windowed).arrival_s == 0.0
    assert counter[0] <= 60


def test_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    path = tmp_path / "trace.data"
    path.write_bytes(gzip.compress(MOONCAKE.read_bytes()))
    assert list(read_trace(path)) == list(read_trace(MOONCAKE))
    json_lines = [json.loads(line) for line in MOONCAKE.read_text().splitlines()[:3]]
    assert [r.prompt_tokens for r in read_trace(json.dumps(o) for o in json_lines)] == [6758, 7322, 7236]


HEADER = "arrival_s,prompt_tokens,output_tokens\n"


def test_a_line_over_the_cap_is_refused_naming_it(tmp_path: Path) -> None:
    long_line = "0," + "1" * (MAX_LINE_CHARS - 4) + "0,1\n"  # one character over
    assert len(long_line.rstrip()) == MAX_LINE_CHARS + 1
    text = HEADER + "0,1,1\n" + long_line
    expected = f"line 3: a line longer than {MAX_LINE_CHARS:,} characters"
    assert message_of(tmp_path, text).startswith(expected)
    assert message_of(tmp_path, text.replace("\n", "\r\n")).startswith(expected)
    gz = tmp_path / "long.csv.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    with pytest.raises(TraceError, match=f"{gz}: {expected}"):
        list(read_trace(gz))
    with pytest.raises(TraceError, match=f"<stream>: {expected}"):
        list(read_trace(iter(text.splitlines(keepends=True))))
    # a line of exactly the cap is read (its fields each under the csv module's own limit)
    fits = HEADER + "0,1,1" + "," * (MAX_LINE_CHARS - 5) + "\n"
    assert [r.prompt_tokens for r in read_trace(write(tmp_path, fits))] == [1]


def test_an_endless_line_costs_one_lines_worth(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    with pytest.raises(TraceError, match=r"^/dev/zero: line 1: a line longer than 1,000 characters"):
        list(read_trace("/dev/zero", max_line_chars=1000))
    nuls = tmp_path / "nuls.gz"
    nuls.write_bytes(gzip.compress(bytes(5_000_000)))  # 5 MB of NULs in a few KB
    with pytest.raises(TraceError, match="line 1: a line longer than 1,000 characters"):
        list(read_trace(nuls, max_line_chars=1000))


def test_a_json_line_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    deep = '{"arrival_s": ' + "[" * 100_000 + "]" * 100_000 + "}"
    first = '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}'
    for lines, line in (([deep], 1), ([first, deep], 2)):
        message = message_of(tmp_path, "\n".join(lines) + "\n", "deep.jsonl")
        assert message == f"line {line}: not JSON that can be read (nested too deeply)"


@pytest.mark.parametrize(
    ("text", "name", "column"),
    [
        (HEADER + "0,1e300,1\n", "trace.csv", "prompt_tokens"),
        (HEADER + "0,1,1000000001\n", "trace.csv", "output_tokens"),
        ('{"arrival_s": 0, "prompt_tokens": 1e300, "output_tokens": 1}\n', "trace.jsonl", "prompt_tokens"),
    ],
)
def test_a_token_count_beyond_any_context_is_refused(
    tmp_path: Path, text: str, name: str, column: str
) -> None:
    assert message_of(tmp_path, text, name).startswith(
        f"line 2, column '{column}': more tokens than any model's context"
        if name.endswith(".csv")
        else f"line 1, column '{column}': more tokens than any model's context"
    )


def feed(fifo: Path, data: bytes, delay_s: float = 0.0) -> threading.Thread:
    """A writer thread: opens the FIFO (after ``delay_s``), writes ``data`` in small pieces, closes."""

    def write() -> None:
        time.sleep(delay_s)
        with fifo.open("wb") as fh:
            for i in range(0, len(data), 1000):
                fh.write(data[i : i + 1000])
                fh.flush()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("compress", [False, True])
def test_a_fifo_is_read_once_and_whole(tmp_path: Path, compress: bool) -> None:
    data = AZURE_CONV.read_bytes()
    fifo = tmp_path / "trace.pipe"
    os.mkfifo(fifo)
    writer = feed(fifo, gzip.compress(data) if compress else data, delay_s=0.2)
    records = list(read_trace(fifo, "azure"))
    writer.join(10)
    assert records == list(read_trace(AZURE_CONV))  # the first 8 KiB too
    assert len(records) == 1_445


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_without_a_writer_is_an_error_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.pipe"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(TraceError, match=f"^{fifo}: a pipe nothing was written to within 0.2 s"):
        list(read_trace(fifo, writer_wait_s=0.2))
    assert time.monotonic() - start < 5


def test_a_quote_left_open_costs_one_rows_worth_whatever_its_lines(tmp_path: Path) -> None:
    # Every line is short, but the quote never closes: the csv module would gather one row forever.
    endless = HEADER + '0,1,"' + "x\n" * 5_000
    with pytest.raises(TraceError, match=r"line 2: a row longer than 1,000 characters"):
        list(read_trace(write(tmp_path, endless), max_line_chars=1000))
    # A quoted field over a few lines, within the bound, is still one row.
    quoted = HEADER + '0,1,1\n1,2,"3\n"\n'
    assert [r.prompt_tokens for r in read_trace(write(tmp_path, quoted))] == [1, 2]
