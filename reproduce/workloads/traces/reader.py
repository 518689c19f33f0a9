"""Streaming a trace file into ``TraceRecord``s: opening, layout detection, time order.

``read_trace`` is a generator: it reads one row at a time (a week-long trace is never loaded
whole), from a path (plain, or gzip-compressed: detected from its first bytes) or from any
iterable of text lines (a pipe, a socket's lines, an endless generator).

The layout comes from the header (CSV) or the first record (JSON lines); ``format`` names it
when the header does not tell, e.g. a CSV file without a header, whose columns are then taken
in the layout's documented order.

NOTE: time order. Arrivals count from the trace's first (earliest) request, so the reader needs
rows in time order. Equal timestamps are fine. A row earlier than the one before it is refused
with its line and column, unless ``reorder_window_s`` > 0: then a row may be up to that many
seconds earlier than the latest row read before it, and rows are sorted within that bounded
window (a heap holding the rows of one window: memory stays bounded by the window, not the
file); a row further behind is refused.
Logs written at completion rather than arrival are out of order by about one latency: pass a
window of that size, or sort the file first.

NOTE: bounded memory, whatever the input. A line longer than ``max_line_chars`` (1,000,000 by
default: a Mooncake line with a long prompt's block ids is a few KB) is refused with its line
number, so an endless line (``/dev/zero``, a gzip of NULs) costs one line's worth; a reorder
window holds at most ``MAX_REORDER_ROWS`` rows.

NOTE: directories. A directory is read as one trace: its files (``*.jsonl``, ``*.csv``, either
``.gz`` too; hidden ones skipped) in name order, the proxy's recording (``retrywatch proxy
--record DIR``: files named by their UTC start time) among them. A recording's lines are written
when attempts end, so its rows are sorted within ``RECORDING_REORDER_S`` at least; a row further
behind (an attempt longer than that) is skipped and noted, as is a torn last line (a proxy killed
mid-write), never an error. What was skipped is told in ``notes`` (a list the caller passes).

NOTE: pipes. A path is opened once and read once: its first bytes (gzip or not) are read from
the same stream that is then parsed, so a FIFO or ``<(cat FILE)`` loses nothing. A FIFO whose
writer does not open it within ``writer_wait_s`` seconds is an error, not a hang.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import heapq
import io
import json
import os
import select
import stat
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import IO, TYPE_CHECKING

from reproduce.workloads.traces.layouts import (
    FORMATS,
    CsvParser,
    RecordingParser,
    Row,
    csv_layout,
    default_columns,
    detect_csv,
    detect_json,
    json_parser,
    names_columns_of,
)
from reproduce.workloads.traces.records import TraceError, TraceRecord, row_error

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MAX_LINE_CHARS",
    "MAX_REORDER_ROWS",
    "RECORDING_REORDER_S",
    "WRITER_WAIT_S",
    "TraceSource",
    "is_regular_file",
    "read_trace",
]

#: Block size assumed for the retrywatch layout's ``prefix_blocks`` (Mooncake's convention).
DEFAULT_BLOCK_TOKENS = 512
#: The longest line read (characters, its line ending not counted); a longer one is an error.
MAX_LINE_CHARS = 1_000_000
#: The most rows a reorder window may hold at once (memory: about 200 bytes each).
MAX_REORDER_ROWS = 1_000_000
#: How long a FIFO given as the trace is waited on for its writer, seconds.
WRITER_WAIT_S = 30.0
#: The least reorder window of a recording, seconds: its lines come at attempts' ends, so an
#: attempt's row is behind those of later arrivals by up to its duration.
RECORDING_REORDER_S = 600.0
#: The file names a directory given as the trace is read from.
_TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".csv", ".csv.gz")

TraceSource = str | os.PathLike[str] | Iterable[str]


def read_trace(
    source: TraceSource,
    format: str | None = None,
    *,
    reorder_window_s: float = 0.0,
    keep_failed: bool = False,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    max_line_chars: int = MAX_LINE_CHARS,
    writer_wait_s: float = WRITER_WAIT_S,
    notes: list[str] | None = None,
) -> Iterator[TraceRecord]:
    """Stream the requests of a trace, in time order, arrivals counted from the first one.

    ``format``: one of ``FORMATS``; autodetected from the header when None. ``keep_failed``
    keeps BurstGPT's failed rows (0 response tokens). ``block_tokens``: tokens per prefix block
    of the retrywatch layout. ``max_line_chars``: the longest line read. ``writer_wait_s``: how
    long a FIFO is waited on for a writer. ``notes``, if given, gets one line for each thing
    skipped on purpose (a recording's retries, a torn last line). A directory is read as one
    trace (its files in name order). Raises ``TraceError`` (one line: line and column) on a bad
    row.
    """
    if format is not None and format not in FORMATS:
        raise TraceError(f"unknown trace format {format!r}; known: {', '.join(FORMATS)}")
    if not reorder_window_s >= 0.0:
        raise TraceError(f"reorder_window_s must be >= 0 seconds, got {reorder_window_s!r}")
    if block_tokens < 1:
        raise TraceError(f"block_tokens must be >= 1, got {block_tokens!r}")
    if max_line_chars < 1:
        raise TraceError(f"max_line_chars must be >= 1, got {max_line_chars!r}")
    told = notes if notes is not None else []
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            return _read_directory(
                path, format, reorder_window_s, keep_failed, block_tokens, max_line_chars, told
            )
        return _read_path(
            path, format, reorder_window_s, keep_failed, block_tokens, max_line_chars, writer_wait_s, told
        )
    lines = _bounded(iter(source), "<stream>", max_line_chars)
    return _read_lines(lines, format, reorder_window_s, keep_failed, block_tokens, max_line_chars, told)


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (one that can be read twice), not a pipe or a device."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _read_lines(
    lines: Iterator[str],
    fmt: str | None,
    window: float,
    keep_failed: bool,
    block_tokens: int,
    max_line_chars: int,
    notes: list[str],
) -> Iterator[TraceRecord]:
    rows, time_column, layout = _rows(
        lines, "<stream>", fmt, keep_failed, block_tokens, notes, max_line_chars
    )
    yield from _in_order(rows, "<stream>", time_column, window, layout, notes)


def _read_directory(
    path: Path,
    fmt: str | None,
    window: float,
    keep_failed: bool,
    block_tokens: int,
    max_line_chars: int,
    notes: list[str],
) -> Iterator[TraceRecord]:
    """Every trace file of a directory, in name order, as one trace."""
    try:
        files = sorted(
            p
            for p in path.iterdir()
            if not p.name.startswith(".") and p.name.endswith(_TRACE_SUFFIXES) and is_regular_file(p)
        )
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not files:
        raise TraceError(f"{path}: a directory without trace files ({', '.join(_TRACE_SUFFIXES)})")
    layouts: list[str] = []

    def rows() -> Iterator[tuple[Row, int]]:
        for file in files:
            try:
                fh = _open(file, 0.0)
            except OSError as exc:
                raise TraceError(f"{file}: cannot read: {exc.strerror or exc}") from None
            with fh:
                lines = _lines(fh, str(file), max_line_chars)
                head = next(lines, "")
                if not head.endswith("\n"):  # empty, or one torn line: a file just begun
                    if head.strip():
                        notes.append(f"{file}: line 1: a torn last line (a proxy stopped mid-write) skipped")
                    continue
                found, _, layout = _rows(
                    chain([head], lines), str(file), fmt, keep_failed, block_tokens, notes, max_line_chars
                )
                layouts.append(layout)
                yield from found

    found = rows()
    first = next(found, None)
    if first is None:
        raise TraceError(f"{path}: no rows in its {len(files)} trace file(s)")
    yield from _in_order(chain([first], found), str(path), "arrival_s", window, layouts[0], notes)


def _in_order(
    rows: Iterator[tuple[Row, int]], source: str, column: str, window: float, layout: str, notes: list[str]
) -> Iterator[TraceRecord]:
    """``_ordered``; a recording's rows within ``RECORDING_REORDER_S`` at least, a row further
    behind skipped and noted."""
    if layout != "recording":
        yield from _ordered(rows, source, column, window)
        return
    window = max(window, RECORDING_REORDER_S)
    late = [0]
    yield from _ordered(rows, source, column, window, late)
    if late[0]:
        notes.append(
            f"{source}: {late[0]} row(s) more than {window:g} s behind a later arrival skipped "
            "(attempts longer than the reorder window)"
        )


def _read_path(
    path: Path,
    fmt: str | None,
    window: float,
    keep_failed: bool,
    block_tokens: int,
    max_line_chars: int,
    writer_wait_s: float,
    notes: list[str],
) -> Iterator[TraceRecord]:
    try:
        fh = _open(path, writer_wait_s)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        lines = _lines(fh, str(path), max_line_chars)
        rows, time_column, layout = _rows(
            lines, str(path), fmt, keep_failed, block_tokens, notes, max_line_chars
        )
        yield from _in_order(rows, str(path), time_column, window, layout, notes)


class _Prefixed(io.RawIOBase):
    """A binary stream with the bytes already read from it put back in front (a pipe cannot seek)."""

    def __init__(self, head: bytes, rest: io.FileIO) -> None:
        super().__init__()
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int | None:
        if not self._head:
            return self._rest.readinto(buffer)
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._head))
        view[:n] = self._head[:n]
        self._head = self._head[n:]
        return n

    def close(self) -> None:
        self._rest.close()
        super().close()


def _open_fifo(path: Path, writer_wait_s: float) -> io.FileIO:
    """A FIFO opened for reading once a writer has written to it (not blocking forever on none)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if not poller.poll(max(0.0, writer_wait_s) * 1000.0):
            raise TraceError(
                f"{path}: a pipe nothing was written to within {writer_wait_s:g} s; start its writer first"
            )
        os.set_blocking(fd, True)
        return io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open(path: Path, writer_wait_s: float) -> IO[str]:
    """The file as text, decompressed if its first bytes say gzip; read once, from the start."""
    fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    raw = _open_fifo(path, writer_wait_s) if fifo else io.FileIO(path, "rb")
    try:
        head = b""
        while len(head) < 2:
            chunk = raw.read(2 - len(head))
            if not chunk:
                break
            head += chunk
    except BaseException:
        raw.close()
        raise
    binary = io.BufferedReader(_Prefixed(head, raw), buffer_size=1 << 16)
    if head == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=binary, mode="rb"), encoding="utf-8-sig", newline="")
    return io.TextIOWrapper(binary, encoding="utf-8-sig", newline="")


def _lines(fh: IO[str], source: str, max_chars: int) -> Iterator[str]:
    """The lines of ``fh``, none longer than ``max_chars`` (read at most that far: bounded)."""
    line_number = 0
    try:
        while line := fh.readline(max_chars + 2):  # room for the line ending
            line_number += 1
            if len(line) > max_chars and len(line.rstrip("\r\n")) > max_chars:
                raise row_error(source, line_number, None, _too_long(max_chars))
            yield line
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, OSError) as exc:
        raise TraceError(f"{source}: cannot read past the last good row: {exc}") from None


def _bounded(lines: Iterator[str], source: str, max_chars: int) -> Iterator[str]:
    for line_number, line in enumerate(lines, start=1):
        if len(line) > max_chars and len(line.rstrip("\r\n")) > max_chars:
            raise row_error(source, line_number, None, _too_long(max_chars))
        yield line


def _too_long(max_chars: int) -> str:
    return f"a line longer than {max_chars:,} characters: not a row of a trace"


def _rows(
    lines: Iterator[str],
    source: str,
    fmt: str | None,
    keep_failed: bool,
    block_tokens: int,
    notes: list[str],
    max_chars: int = MAX_LINE_CHARS,
) -> tuple[Iterator[tuple[Row, int]], str, str]:
    """The parsed rows (with their line numbers), the layout's time column and the layout; a CSV
    row over ``max_chars`` characters, whatever lines it spans, is an error (``_RowSpan``)."""
    first = ""
    skipped = 0
    for first in lines:
        if first.strip():
            break
        skipped += 1
    else:
        raise TraceError(f"{source}: empty: no header and no rows")
    first = first.removeprefix(codecs.BOM_UTF8.decode())
    if first.lstrip().startswith("{"):
        return _json_rows(chain([first], lines), source, fmt, skipped, block_tokens, notes)
    header = next(csv.reader([first]))
    detected = detect_csv(header)
    if fmt is None and detected is None:
        raise TraceError(
            f"{source}: line {skipped + 1}: the header {first.strip()[:80]!r} is no known layout; "
            f"pass the format ({', '.join(FORMATS)}) or use the retrywatch layout's columns"
        )
    layout = fmt if fmt is not None else detected
    assert layout is not None
    if layout in ("mooncake", "recording"):
        raise row_error(source, skipped + 1, None, f"a {layout} trace is JSON lines, this line is not")
    has_header = detected == layout or names_columns_of(layout, header)
    offset = skipped + 1 if has_header else skipped
    span = _RowSpan(lines if has_header else chain([first], lines), source, max_chars, offset)
    reader = csv.reader(span)
    columns = header if has_header else default_columns(layout, len(header))
    parser, time_column = csv_layout(
        layout, columns, source, keep_failed=keep_failed, block_tokens=block_tokens
    )
    return _csv_rows(reader, parser, offset, source, span), time_column, layout


class _RowSpan:
    """The lines a CSV reader takes, bounded per row: a quoted field may hold line breaks, so a
    row can span lines, and one that never closes its quote would grow without end. A row over
    ``max_chars`` characters, whatever its lines, is an error naming the line it began on."""

    def __init__(self, lines: Iterator[str], source: str, max_chars: int, offset: int) -> None:
        self._lines = lines
        self._offset = offset  # the lines before the first one taken
        self._source = source
        self._max_chars = max_chars
        self.line = 0  # lines taken so far
        self._row_line = 1  # the line the row being read began on
        self._row_chars = 0

    def __iter__(self) -> _RowSpan:
        return self

    def __next__(self) -> str:
        line = next(self._lines)
        self.line += 1
        self._row_chars += len(line.rstrip("\r\n"))
        if self._row_chars > self._max_chars:
            raise row_error(self._source, self._offset + self._row_line, None, _too_long_row(self._max_chars))
        return line

    def row_done(self) -> None:
        self._row_line, self._row_chars = self.line + 1, 0


def _too_long_row(max_chars: int) -> str:
    return f"a row longer than {max_chars:,} characters (a quoted field left open?): not a row of a trace"


def _csv_rows(
    reader: Iterator[list[str]], parser: CsvParser, offset: int, source: str, span: _RowSpan
) -> Iterator[tuple[Row, int]]:
    while True:
        span.row_done()
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # a field over the csv module's size limit, a stray quote
            raise row_error(source, offset + reader.line_num, None, f"not CSV: {exc}") from None  # type: ignore[attr-defined]
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        line = offset + reader.line_num  # type: ignore[attr-defined]
        row = parser(fields, line)
        if row is not None:
            yield row, line


def _json_rows(
    lines: Iterator[str], source: str, fmt: str | None, skipped: int, block_tokens: int, notes: list[str]
) -> tuple[Iterator[tuple[Row, int]], str, str]:
    first = next(lines)
    obj = _json_object(first, source, skipped + 1)
    layout = fmt if fmt is not None else detect_json(obj)
    if layout is None:
        raise TraceError(
            f"{source}: line {skipped + 1}: a JSON record of no known layout (keys "
            f"{', '.join(sorted(obj))[:80]}); pass the format ({', '.join(FORMATS)})"
        )
    parser, time_key = json_parser(layout, source, block_tokens=block_tokens)

    recording = parser if isinstance(parser, RecordingParser) else None

    def rows() -> Iterator[tuple[Row, int]]:
        row = parser(obj, skipped + 1)
        if row is not None:
            yield row, skipped + 1
        for n, text in enumerate(lines, start=skipped + 2):
            if not text.strip():
                continue
            try:
                record = _json_object(text, source, n)
            except TraceError:
                # NOTE: a recording's last line without its line end was cut by a proxy killed
                # mid-write: what came before it is whole.
                if recording is None or text.endswith("\n"):
                    raise
                notes.append(f"{source}: line {n}: a torn last line (a proxy stopped mid-write) skipped")
                continue
            row = parser(record, n)
            if row is not None:
                yield row, n
            if recording is not None and recording.ready:
                yield from recording.ready
                recording.ready.clear()
        if recording is not None:
            recording.flush()
            yield from recording.ready
            recording.ready.clear()
        if recording is not None and (recording.retries or recording.unknown_output):
            notes.append(
                f"{source}: {recording.retries} retries (attempt > 0) skipped: the replay's client "
                f"model makes its own; {recording.unknown_output} call(s) of no known output length "
                "skipped"
            )

    return rows(), time_key, layout


def _json_object(text: str, source: str, line: int) -> dict[str, object]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise row_error(source, line, None, f"not JSON ({exc.msg} at character {exc.pos})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise row_error(source, line, None, f"not JSON that can be read ({exc})") from None
    except RecursionError:
        raise row_error(source, line, None, "not JSON that can be read (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise row_error(source, line, None, "not a JSON object")
    return obj


def _record(row: Row, base: float, line: int) -> TraceRecord:
    # (positional: a frozen record's keyword arguments cost a tenth of a row's reading)
    return TraceRecord(
        row.time_s - base,  # arrival_s
        row.prompt_tokens,
        row.output_tokens,
        row.call_id,
        row.session,
        row.tenant,
        row.prefix_blocks,
        row.block_tokens,
        line,
    )


def _unsorted(
    source: str, line: int, column: str, earlier_than: int, by_s: float, window: float
) -> TraceError:
    return row_error(
        source,
        line,
        column,
        f"{by_s:.6g} s earlier than line {earlier_than}: the trace must be in time order "
        f"(or out of order by at most reorder_window_s={window:g} s); sort it first or widen the window",
    )


def _ordered(
    rows: Iterator[tuple[Row, int]], source: str, column: str, window: float, late: list[int] | None = None
) -> Iterator[TraceRecord]:
    """The rows in time order (sorted within ``window``); a row further behind is an error, or,
    with ``late`` (a one-item count), skipped and counted."""
    base: float | None = None
    last_t = float("-inf")
    last_line = 0
    if window == 0.0:
        for row, line in rows:
            if row.time_s < last_t:
                raise _unsorted(source, line, column, last_line, last_t - row.time_s, window)
            if base is None:
                base = row.time_s
            last_t, last_line = row.time_s, line
            yield _record(row, base, line)
        return
    heap: list[tuple[float, int, Row]] = []
    for row, line in rows:
        if row.time_s < last_t - window:
            if late:
                late[0] += 1
                continue
            raise _unsorted(source, line, column, last_line, last_t - row.time_s, window)
        heapq.heappush(heap, (row.time_s, line, row))
        if len(heap) > MAX_REORDER_ROWS:
            raise row_error(
                source,
                line,
                column,
                f"more than {MAX_REORDER_ROWS:,} rows within reorder_window_s={window:g} s; "
                "narrow the window",
            )
        if row.time_s > last_t:
            last_t, last_line = row.time_s, line
        while heap[0][0] < last_t - window:
            t, held_line, held = heapq.heappop(heap)
            if base is None:
                base = t
            yield _record(held, base, held_line)
    while heap:
        t, held_line, held = heapq.heappop(heap)
        if base is None:
            base = t
        yield _record(held, base, held_line)
