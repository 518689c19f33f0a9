"""The trace layouts retrywatch reads, each from its header: columns, units, what is kept.

* ``azure``: the Azure LLM inference traces, 2023 and 2024 (``TIMESTAMP,ContextTokens,
  GeneratedTokens``; timestamps are date-times, see ``reproduce.workloads.traces.fields``).
* ``burstgpt``: BurstGPT (``Timestamp,Session ID,Elapsed time,Model,Request tokens,Response
  tokens,Total tokens,Log Type``, or the older files without ``Session ID`` and ``Elapsed
  time``). ``Timestamp`` is seconds. A row with 0 response tokens is a failed request in
  BurstGPT's own description; it is dropped unless ``keep_failed`` (then kept with 0 output
  tokens), so the default matches BurstGPT's ``without_fails`` files.
* ``mooncake``: Mooncake's JSON lines (``timestamp`` in ms, ``input_length``,
  ``output_length``, ``hash_ids``: ids of the prompt's 512-token prefix blocks).
* ``retrywatch``: our own, as CSV or JSON lines: ``arrival_s``, ``prompt_tokens``,
  ``output_tokens``, and optionally ``call_id``, ``session``, ``tenant``, ``prefix_blocks``
  (JSON: a list of integers; CSV: integers separated by spaces) of ``block_tokens`` tokens each.
* ``recording``: the proxy's recording (``retrywatch proxy --record DIR``, ``exporter.recorder``),
  JSON lines, one per attempt: ``arrival_s`` (Unix seconds), ``prompt_tokens``,
  ``output_tokens`` (null where the engine sent no usage), ``max_tokens``, ``attempt`` (0 for a
  call's first attempt), ``fate``, ``ended``, ``client`` (a hash of the caller's credentials).
  Calls are first attempts: a retry (``attempt`` > 0) is skipped, since the replay's client
  model makes its own retries (``RecordingParser`` counts them). A call's output length is its
  first attempt's, else that of a retry of it (the same ``call`` hash), else its
  ``max_tokens``; a call with none is skipped and counted.

A layout binds a header to a row parser that returns a ``Row`` (the time in seconds on the
trace's own clock, not yet counted from its first request), or ``None`` for a row it drops.
Columns are found by name, so extra columns and any column order are fine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from reproduce.workloads.traces.fields import (
    AzureClock,
    json_count,
    json_seconds,
    parse_count,
    parse_seconds,
)
from reproduce.workloads.traces.records import TraceError, row_error

__all__ = [
    "FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "RECORDING_KEYS",
    "CsvParser",
    "JsonParser",
    "RecordingParser",
    "Row",
    "csv_layout",
    "default_columns",
    "detect_csv",
    "detect_json",
    "json_parser",
    "names_columns_of",
]

FORMATS = ("azure", "burstgpt", "mooncake", "recording", "retrywatch")
#: Mooncake's prefix blocks are 512 tokens (its trace README).
MOONCAKE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
BURSTGPT_OLD = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
BURSTGPT_NEW = (
    "Timestamp",
    "Session ID",
    "Elapsed time",
    "Model",
    "Request tokens",
    "Response tokens",
    "Total tokens",
    "Log Type",
)
RETRYWATCH_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
RETRYWATCH_ALL = (*RETRYWATCH_COLUMNS, "call_id", "session", "tenant", "prefix_blocks")
#: How long (seconds of the recording's end times) a first attempt without a known output length
#: waits for a retry of its call that knows it, and how many wait at most.
RECORDING_JOIN_S = 300.0
RECORDING_MAX_WAITING = 100_000
#: The keys that tell a recording's line (``exporter.recorder``) from a retrywatch one.
RECORDING_KEYS = ("arrival_s", "attempt", "fate", "ended")


class Row(NamedTuple):
    """One parsed row, its time still on the trace's own clock (seconds)."""

    time_s: float
    prompt_tokens: int
    output_tokens: int
    call_id: str | None = None
    session: str | None = None
    tenant: str | None = None
    prefix_blocks: tuple[int, ...] = ()
    block_tokens: int = 0


CsvParser = Callable[[Sequence[str], int], "Row | None"]
JsonParser = Callable[[Mapping[str, object], int], "Row | None"]


def detect_csv(header: Sequence[str]) -> str | None:
    """The layout a CSV header belongs to, or None."""
    names = {h.strip() for h in header}
    if set(AZURE_COLUMNS) <= names:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= names:
        return "burstgpt"
    if set(RETRYWATCH_COLUMNS) <= names:
        return "retrywatch"
    return None


def detect_json(obj: Mapping[str, object]) -> str | None:
    """The layout a JSON-lines record belongs to, or None."""
    if "input_length" in obj and "timestamp" in obj:
        return "mooncake"
    if all(k in obj for k in RECORDING_KEYS):
        return "recording"
    if all(k in obj for k in RETRYWATCH_COLUMNS):
        return "retrywatch"
    return None


def names_columns_of(fmt: str, header: Sequence[str]) -> bool:
    """Whether a first CSV line names any column of layout ``fmt`` (a header, maybe incomplete)."""
    known = {
        "azure": AZURE_COLUMNS,
        "burstgpt": BURSTGPT_NEW,
        "retrywatch": RETRYWATCH_ALL,
    }.get(fmt, ())
    return any(h.strip() in known for h in header)


def default_columns(fmt: str, n_fields: int) -> tuple[str, ...]:
    """The column order assumed for a headerless CSV file of layout ``fmt``."""
    if fmt == "azure":
        return AZURE_COLUMNS
    if fmt == "burstgpt":
        return BURSTGPT_NEW if n_fields >= len(BURSTGPT_NEW) else BURSTGPT_OLD
    if fmt == "retrywatch":
        return RETRYWATCH_ALL
    raise TraceError(f"{fmt} is not a CSV layout; CSV layouts are azure, burstgpt, retrywatch")


def _index(columns: Sequence[str], wanted: Sequence[str], source: str, line: int) -> list[int]:
    stripped = [c.strip() for c in columns]
    out: list[int] = []
    for name in wanted:
        if name not in stripped:
            raise row_error(source, line, name, f"missing from the header {','.join(stripped)[:120]!r}")
        out.append(stripped.index(name))
    return out


def _optional(columns: Sequence[str], name: str) -> int | None:
    stripped = [c.strip() for c in columns]
    return stripped.index(name) if name in stripped else None


def _field(fields: Sequence[str], i: int, name: str, source: str, line: int) -> str:
    if i >= len(fields):
        raise row_error(source, line, name, f"missing (the row has {len(fields)} of the header's columns)")
    return fields[i]


def _text(fields: Sequence[str], i: int | None) -> str | None:
    if i is None or i >= len(fields):
        return None
    value = fields[i].strip()
    return value or None


def _blocks_csv(text: str | None, source: str, line: int) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split())
    except ValueError:
        raise row_error(
            source, line, "prefix_blocks", f"not integers separated by spaces: {text[:40]!r}"
        ) from None


def csv_layout(
    fmt: str, columns: Sequence[str], source: str, *, keep_failed: bool, block_tokens: int
) -> tuple[CsvParser, str]:
    """The row parser of a CSV layout for this header, and the name of its time column."""
    if fmt == "azure":
        t, p, o = _index(columns, AZURE_COLUMNS, source, 1)
        clock = AzureClock()

        def azure(fields: Sequence[str], line: int) -> Row | None:
            return Row(
                clock.seconds(_field(fields, t, "TIMESTAMP", source, line), source, line, "TIMESTAMP"),
                parse_count(_field(fields, p, "ContextTokens", source, line), source, line, "ContextTokens"),
                parse_count(
                    _field(fields, o, "GeneratedTokens", source, line), source, line, "GeneratedTokens"
                ),
            )

        return azure, "TIMESTAMP"
    if fmt == "burstgpt":
        t, p, o = _index(columns, BURSTGPT_COLUMNS, source, 1)
        s = _optional(columns, "Session ID")

        def burstgpt(fields: Sequence[str], line: int) -> Row | None:
            time_s = parse_seconds(_field(fields, t, "Timestamp", source, line), source, line, "Timestamp")
            prompt = parse_count(
                _field(fields, p, "Request tokens", source, line), source, line, "Request tokens"
            )
            output = parse_count(
                _field(fields, o, "Response tokens", source, line), source, line, "Response tokens"
            )
            if output == 0 and not keep_failed:
                return None  # a failed request (BurstGPT's docs): dropped, as in its without_fails files
            return Row(time_s, prompt, output, session=_text(fields, s))

        return burstgpt, "Timestamp"
    if fmt == "retrywatch":
        t, p, o = _index(columns, RETRYWATCH_COLUMNS, source, 1)
        c, s, n, b = (_optional(columns, name) for name in RETRYWATCH_ALL[3:])

        def retrywatch(fields: Sequence[str], line: int) -> Row | None:
            blocks = _blocks_csv(_text(fields, b), source, line)
            return Row(
                parse_seconds(_field(fields, t, "arrival_s", source, line), source, line, "arrival_s"),
                parse_count(_field(fields, p, "prompt_tokens", source, line), source, line, "prompt_tokens"),
                parse_count(_field(fields, o, "output_tokens", source, line), source, line, "output_tokens"),
                _text(fields, c),
                _text(fields, s),
                _text(fields, n),
                blocks,
                block_tokens if blocks else 0,
            )

        return retrywatch, "arrival_s"
    raise TraceError(f"{fmt} is not a CSV layout; CSV layouts are azure, burstgpt, retrywatch")


def _key(obj: Mapping[str, object], key: str, source: str, line: int) -> object:
    if key not in obj:
        raise row_error(source, line, key, "missing")
    return obj[key]


def _json_blocks(value: object, key: str, source: str, line: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise row_error(source, line, key, f"not a list of integers: {value!r:.40}")
    return tuple(value)


def _json_text(obj: Mapping[str, object], key: str, source: str, line: int) -> str | None:
    value = obj.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise row_error(source, line, key, f"not a string: {value!r:.40}")
    return str(value)


class RecordingParser:
    """The row parser of a proxy recording: a call per first attempt; retries and calls of no
    known output length are skipped and counted here (the reader's notes).

    NOTE: a first attempt that ended without the engine's usage (its client left, it was shed)
    waits for a retry of its call that has it: the call's output length is what its retry was
    given. It waits until ``JOIN_S`` seconds of the recording's end times have passed, or the end
    of its file (``flush``); then its ``max_tokens`` stands in, or it is skipped. The reader takes
    the rows made ready so (``ready``) after each line."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.retries = 0
        self.unknown_output = 0
        self.ready: list[tuple[Row, int]] = []
        self._waiting: dict[str, tuple[Row, int | None, int, float]] = {}  # by call hash
        self._latest_end = 0.0

    def __call__(self, obj: Mapping[str, object], line: int) -> Row | None:
        source = self.source
        end = obj.get("end_s")
        if isinstance(end, int | float) and not isinstance(end, bool) and end > self._latest_end:
            self._latest_end = float(end)
            self._expire(self._latest_end - RECORDING_JOIN_S)
        attempt = json_count(_key(obj, "attempt", source, line), source, line, "attempt")
        output = self._count(obj, "output_tokens", line)
        call = _json_text(obj, "call", source, line)
        if attempt > 0:
            self.retries += 1
            if call is not None and output is not None and (waiting := self._waiting.pop(call, None)):
                self.ready.append((waiting[0]._replace(output_tokens=output), waiting[2]))
            return None
        arrival = json_seconds(_key(obj, "arrival_s", source, line), source, line, "arrival_s")
        prompt = json_count(_key(obj, "prompt_tokens", source, line), source, line, "prompt_tokens")
        row = Row(arrival, prompt, output or 0, tenant=_json_text(obj, "client", source, line))
        if output is not None:
            return row
        max_tokens = self._count(obj, "max_tokens", line)
        if call is None:
            return self._fallback(row, max_tokens)
        if len(self._waiting) >= RECORDING_MAX_WAITING:
            self._expire(math.inf, 1)
        old = self._waiting.pop(call, None)  # the same call's first attempt again: that one is done
        if old is not None:
            self._settle(old)
        self._waiting[call] = (row, max_tokens, line, float(end) if isinstance(end, int | float) else 0.0)
        return None

    def _count(self, obj: Mapping[str, object], key: str, line: int) -> int | None:
        value = obj.get(key)
        return None if value is None else json_count(value, self.source, line, key)

    def _fallback(self, row: Row, max_tokens: int | None) -> Row | None:
        if max_tokens is None:
            self.unknown_output += 1
            return None
        return row._replace(output_tokens=max_tokens)

    def _settle(self, waiting: tuple[Row, int | None, int, float]) -> None:
        row = self._fallback(waiting[0], waiting[1])
        if row is not None:
            self.ready.append((row, waiting[2]))

    def _expire(self, before: float, at_most: float = math.inf) -> None:
        """Settle the waiting first attempts that ended before ``before`` (oldest first)."""
        for done, (call, waiting) in enumerate(list(self._waiting.items())):
            if waiting[3] >= before or done >= at_most:
                break
            del self._waiting[call]
            self._settle(waiting)

    def flush(self) -> None:
        """The end of the file: every first attempt still waiting is settled."""
        self._expire(math.inf)


def json_parser(fmt: str, source: str, *, block_tokens: int) -> tuple[JsonParser, str]:
    """The record parser of a JSON-lines layout, and the name of its time key."""
    if fmt == "recording":
        return RecordingParser(source), "arrival_s"
    if fmt == "mooncake":

        def mooncake(obj: Mapping[str, object], line: int) -> Row | None:
            blocks = _json_blocks(obj.get("hash_ids"), "hash_ids", source, line)
            return Row(
                json_seconds(_key(obj, "timestamp", source, line), source, line, "timestamp", 0.001),
                json_count(_key(obj, "input_length", source, line), source, line, "input_length"),
                json_count(_key(obj, "output_length", source, line), source, line, "output_length"),
                prefix_blocks=blocks,
                block_tokens=MOONCAKE_BLOCK_TOKENS if blocks else 0,
            )

        return mooncake, "timestamp"
    if fmt == "retrywatch":

        def retrywatch(obj: Mapping[str, object], line: int) -> Row | None:
            blocks = _json_blocks(obj.get("prefix_blocks"), "prefix_blocks", source, line)
            return Row(
                json_seconds(_key(obj, "arrival_s", source, line), source, line, "arrival_s"),
                json_count(_key(obj, "prompt_tokens", source, line), source, line, "prompt_tokens"),
                json_count(_key(obj, "output_tokens", source, line), source, line, "output_tokens"),
                _json_text(obj, "call_id", source, line),
                _json_text(obj, "session", source, line),
                _json_text(obj, "tenant", source, line),
                blocks,
                block_tokens if blocks else 0,
            )

        return retrywatch, "arrival_s"
    raise TraceError(
        f"{fmt} is not a JSON-lines layout; JSON-lines layouts are mooncake, recording, retrywatch"
    )
