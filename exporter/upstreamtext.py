"""What the proxy reads of the upstream's ``/metrics`` text, in slices that never hold the event
loop long: the check that it is a Prometheus exposition (``is_exposition``), the sums of the few
``vllm:`` families the window needs (``scan_vllm``), and the upstream's own ``retrywatch_``
families, left out of the passthrough (``digest``).

NOTE: a vLLM serving many LoRA adapters or models exports 100k series and more (15 MB, under the
16 MiB a fetch may take), fetched every second. Read on the event loop in one piece, the scan cost
about 16 us a wanted line (prometheus_client's parser, line by line) and the check about 14 ns a
byte: seconds of stalls a second, every stream waiting behind them. Here the work is C-speed where
it can be (``str.find`` for the wanted names, one regular expression a wanted line, one a slice for
the check), and cut into slices of ``SLICE_CHARS`` whole lines: each is a step of a generator, and
``run_sliced`` lets the event loop run between steps (``bench/bench_big_metrics.py`` measures the
time to first token beside such an upstream). A thread would not help: the regular expressions
hold the GIL for a whole call.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Generator
from dataclasses import dataclass
from typing import TypeVar

from foundation import metricnames as mn

#: The upstream's families the window samples (summed over their label sets).
WINDOW_VLLM_FAMILIES = (mn.VLLM_NUM_WAITING, mn.VLLM_PROMPT_TOKENS, mn.VLLM_PREFIX_CACHE_QUERIES)
#: Characters a step reads (cut at the next line end): about a millisecond of work at most.
SLICE_CHARS = 64 * 1024
#: The prefix of the proxy's own families: the upstream's are not passed through (``digest``).
OWN_PREFIX = "retrywatch_"

T = TypeVar("T")

# The Prometheus text format, line by line (a subset of what Prometheus and prometheus_client's
# parser, the detector's, both read): a sample, a comment (a TYPE one with a known type), or blank.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"(?:[^"\\\n]|\\.)*+"'
_LABELS = r"\{[ \t]*(?:" + _LABEL + r"[ \t]*(?:,[ \t]*" + _LABEL + r"[ \t]*)*+,?[ \t]*)?\}"
_VALUE = r"[-+]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|(?i:infinity|inf|nan))"
_TIMESTAMP = r"(?:[ \t]+-?[0-9]+)?"
_SAMPLE = _NAME + "(?:" + _LABELS + r")?[ \t]+" + _VALUE + _TIMESTAMP
_TYPES = "counter|gauge|histogram|summary|untyped|unknown|info|stateset|gaugehistogram"
_COMMENT = r"#(?:[ \t]+TYPE[ \t]+" + _NAME + r"[ \t]+(?:" + _TYPES + r")|(?![ \t]+TYPE[ \t])[^\n]*)"
# Possessive wherever a line could be split two ways: no backtracking, linear in the text's size
# (a hostile upstream's 16 MiB of blanks must not hold the event loop).
_LINE = r"[ \t]*+(?:" + _SAMPLE + "|" + _COMMENT + r")?+[ \t]*+\r?"
_EXPOSITION = re.compile(r"(?:" + _LINE + r"\n)*+" + _LINE)
# The labels of a sample the scan reads, loosely: quoted values (which may hold a brace) are skipped
# whole, the names and commas between them not checked (the check of the whole text does that,
# ``is_exposition``); unrolled, so that a value is read at C speed (about 1 us a line, against 1.7).
_LOOSE_LABELS = r'\{[^"}\n]*+(?:"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"[^"}\n]*+)*+\}'
_WANTED_TAIL = "(?:" + _LOOSE_LABELS + r")?[ \t]+(" + _VALUE + ")" + _TIMESTAMP + r"[ \t]*\r?$"
# What may precede an own family's name on a comment line about it.
_OWN_COMMENT = re.compile(r"#[ \t]+(?:HELP|TYPE)[ \t]+")


@dataclass(frozen=True)
class Digest:
    """What one pass over an upstream text found: whether it is an exposition, and the text to
    pass through (the upstream's ``retrywatch_`` families left out; the text itself if it has
    none)."""

    usable: bool
    passthrough: str
    own_lines_dropped: int


def _slices(text: str) -> Generator[tuple[int, int], None, None]:
    """(start, end) of consecutive pieces of ``text`` of about ``SLICE_CHARS``, cut after a line
    end (a line longer than that is one piece)."""
    size = len(text)
    start = 0
    while start < size:
        cut = text.find("\n", min(start + SLICE_CHARS, size) - 1)
        end = size if cut < 0 else cut + 1
        yield start, end
        start = end


def is_exposition(text: str) -> bool:
    """Whether every line of ``text`` is one of the Prometheus text format's.

    NOTE: the upstream's /metrics text is appended to the proxy's own. One line that is not the
    format's (a gateway's sign-in page answered 200, JSON, a value that is no number) made a
    scrape of the proxy fail whole, and Prometheus and the detector lost every ``retrywatch_``
    series with it. One regular expression over the text, linear in its size: about 0.6 ms for
    vLLM's few hundred lines, against several for prometheus_client's parser."""
    return _EXPOSITION.fullmatch(text) is not None


@functools.cache
def _wanted_lines(name: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The value of each sample line of family ``name`` after a line end (its literal prefix
    lets the regular expression engine skip to it), and of one at the start of a text."""
    tail = re.escape(name) + _WANTED_TAIL
    return re.compile("(?m)\n" + tail), re.compile("(?m)" + tail)


def _scan_steps(text: str, names: tuple[str, ...]) -> Generator[None, None, dict[str, float]]:
    totals: dict[str, float] = {}
    for start, end in _slices(text):
        for name in names:
            after_line_end, first = _wanted_lines(name)
            # A line the format refuses is skipped, as a scrape of it would be.
            values = after_line_end.findall(text, max(start - 1, 0), end)
            if start == 0 and (head := first.match(text, 0, end)) is not None:
                values.append(head.group(1))
            if values:
                totals[name] = totals.get(name, 0.0) + sum(map(float, values))
        yield
    return totals


def scan_vllm(text: str, names: tuple[str, ...] = WINDOW_VLLM_FAMILIES) -> dict[str, float]:
    """Sum the samples of a few families (over all label sets) from an exposition text.

    NOTE: the proxy scans each fetched text once (``ProxyMetrics.upstream_fetched``), not on every
    sample and scrape, and in slices (``scan_vllm_sliced``). Only the lines that begin with a
    wanted name are read, found and taken apart by one regular expression a family and a slice
    (C speed, about a microsecond a wanted line; ``bench/bench_scan.py``)."""
    return run_to_end(_scan_steps(text, names))


async def scan_vllm_sliced(text: str, names: tuple[str, ...] = WINDOW_VLLM_FAMILIES) -> dict[str, float]:
    """``scan_vllm``, letting the event loop run between slices."""
    return await run_sliced(_scan_steps(text, names))


def _digest_steps(text: str) -> Generator[None, None, Digest]:
    usable = True
    dropped: list[tuple[int, int]] = []  # the own families' lines: (start, end after its line end)
    fullmatch, find = _EXPOSITION.fullmatch, text.find
    for start, end in _slices(text):
        if usable and fullmatch(text, start, end) is None:
            usable = False
        pos = find(OWN_PREFIX, start, end)
        while pos >= 0:
            line_start = text.rfind("\n", start, pos) + 1
            line_end = find("\n", pos, end)
            line_end = end if line_end < 0 else line_end + 1
            if line_start == pos or _OWN_COMMENT.fullmatch(text, line_start, pos) is not None:
                dropped.append((line_start, line_end))
            pos = find(OWN_PREFIX, line_end, end)
        yield
    if not dropped:
        return Digest(usable, text, 0)
    kept: list[str] = []
    at = 0
    for line_start, line_end in dropped:
        kept.append(text[at:line_start])
        at = line_end
    kept.append(text[at:])
    return Digest(usable, "".join(kept), len(dropped))


def digest(text: str) -> Digest:
    """Check ``text`` (``is_exposition``) and leave out the upstream's own ``retrywatch_``
    families (samples, HELP and TYPE lines), in one pass.

    NOTE: a proxy in front of another proxy (or an engine that exports our families) would
    otherwise serve two of each ``retrywatch_`` series with the same labels: Prometheus keeps one
    of them at random, and the detector reads the wrong proxy's counters."""
    return run_to_end(_digest_steps(text))


async def digest_sliced(text: str) -> Digest:
    """``digest``, letting the event loop run between slices."""
    return await run_sliced(_digest_steps(text))


def run_to_end(steps: Generator[None, None, T]) -> T:
    """Run every step of a sliced reading at once; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            result: T = end.value
            return result


async def run_sliced(steps: Generator[None, None, T]) -> T:
    """Run a sliced reading, one step per turn of the event loop; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            result: T = end.value
            return result
        await asyncio.sleep(0)
