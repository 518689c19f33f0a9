"""Parsing one field of a trace row: token counts, seconds, and the Azure traces' timestamps.

Every parser raises ``TraceError`` naming the source, the line and the column, so a bad field
is one line for the user, never a traceback. The Azure timestamp parser is hand-rolled for
speed (a week-long trace has tens of millions of rows): it reads
``2023-11-16 18:17:03.9799600`` (2023: naive, 7 fractional digits) and
``2024-05-10 00:00:00.009930+00:00`` (2024: UTC offset, 6 digits, sometimes none), also with a
``T`` separator or a ``Z``. Naive times are taken as UTC; only differences matter.
"""

from __future__ import annotations

import math
from datetime import date

from reproduce.workloads.traces.records import row_error

__all__ = [
    "MAX_TOKENS",
    "AzureClock",
    "json_count",
    "json_seconds",
    "number_of",
    "parse_count",
    "parse_seconds",
]

_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
#: The largest token count read: far beyond any model's context, still a machine integer.
MAX_TOKENS = 1_000_000_000


def parse_count(text: str, source: str, line: int, column: str) -> int:
    """A token count: a whole number from 0 to ``MAX_TOKENS`` (``12`` or ``12.0``)."""
    try:
        return _nonnegative(int(text), text, source, line, column)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise row_error(source, line, column, f"not a number: {text.strip()[:40]!r}") from None
    if not (math.isfinite(value) and value.is_integer()):
        raise row_error(source, line, column, f"not a whole number of tokens: {text.strip()[:40]!r}")
    return _nonnegative(int(value), text, source, line, column)


def _nonnegative(value: int, text: str, source: str, line: int, column: str) -> int:
    if value < 0:
        raise row_error(source, line, column, f"negative: {text.strip()[:40]!r}")
    if value > MAX_TOKENS:
        raise row_error(source, line, column, _too_many(text.strip()[:40]))
    return value


def _too_many(text: str) -> str:
    return f"more tokens than any model's context (at most {MAX_TOKENS:,}): {text!r}"


def parse_seconds(text: str, source: str, line: int, column: str, scale: float = 1.0) -> float:
    """A finite time >= 0, in the column's unit; ``scale`` converts it to seconds."""
    try:
        value = float(text)
    except ValueError:
        raise row_error(source, line, column, f"not a number: {text.strip()[:40]!r}") from None
    if not math.isfinite(value):
        raise row_error(source, line, column, f"not a finite time: {text.strip()[:40]!r}")
    if value < 0:
        raise row_error(source, line, column, f"negative: {text.strip()[:40]!r}")
    return value * scale


def number_of(value: object, source: str, line: int, key: str) -> float:
    """A JSON value that must be a number (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise row_error(source, line, key, f"not a number: {value!r:.40}")
    try:
        return float(value)
    except OverflowError:  # JSON's integers have no bound; a float's do
        raise row_error(source, line, key, f"too large: {value!r:.40}") from None


def json_count(value: object, source: str, line: int, key: str) -> int:
    """A JSON token count: a whole number from 0 to ``MAX_TOKENS``."""
    number = number_of(value, source, line, key)
    if not (math.isfinite(number) and number.is_integer()):
        raise row_error(source, line, key, f"not a whole number of tokens: {value!r:.40}")
    if number < 0:
        raise row_error(source, line, key, f"negative: {value!r:.40}")
    if number > MAX_TOKENS:
        raise row_error(source, line, key, _too_many(f"{value!r:.40}"))
    return int(number)


def json_seconds(value: object, source: str, line: int, key: str, scale: float = 1.0) -> float:
    """A JSON time: a finite number >= 0 in the key's unit, times ``scale`` seconds."""
    number = number_of(value, source, line, key)
    if not math.isfinite(number):
        raise row_error(source, line, key, f"not a finite time: {value!r:.40}")
    if number < 0:
        raise row_error(source, line, key, f"negative: {value!r:.40}")
    return number * scale


class AzureClock:
    """Seconds since 1970 (UTC) of the Azure traces' timestamps; caches each day's start."""

    __slots__ = ("_days",)

    def __init__(self) -> None:
        self._days: dict[str, int] = {}

    def seconds(self, text: str, source: str, line: int, column: str) -> float:
        try:
            return self._seconds(text)
        except (ValueError, IndexError):
            raise row_error(
                source,
                line,
                column,
                f"not a timestamp like 2023-11-16 18:17:03.9799600: {text.strip()[:40]!r}",
            ) from None

    def _seconds(self, text: str) -> float:
        text = text.strip()
        day = self._days.get(text[:10])
        if day is None:
            if len(self._days) > 10_000:  # bounded: a trace spans days, not decades
                self._days.clear()
            day = (date.fromisoformat(text[:10]).toordinal() - _EPOCH_ORDINAL) * 86_400
            self._days[text[:10]] = day
        if text[10] not in " T":
            raise ValueError(text)
        rest = text[11:]
        offset = 0
        if rest.endswith("Z"):
            rest = rest[:-1]
        elif len(rest) > 8 and rest[-6] in "+-" and rest[-3] == ":":
            off_hours, off_minutes = rest[-5:-3], rest[-2:]
            if not (off_hours.isdigit() and off_minutes.isdigit()):
                raise ValueError(text)
            if int(off_hours) > 23 or int(off_minutes) > 59:  # ISO 8601: -23:59 to +23:59
                raise ValueError(text)
            sign = 1 if rest[-6] == "+" else -1
            offset = sign * (int(off_hours) * 3600 + int(off_minutes) * 60)
            rest = rest[:-6]
        if rest[2] != ":" or rest[5] != ":" or not (rest[0:2] + rest[3:5] + rest[6:8]).isdigit():
            raise ValueError(text)
        hours, minutes, secs = int(rest[0:2]), int(rest[3:5]), float(rest[6:])
        if hours > 23 or minutes > 59 or not 0.0 <= secs < 61.0:
            raise ValueError(text)
        return day + hours * 3600 + minutes * 60 + secs - offset
