"""The proxy's recording of its traffic (``retrywatch proxy --record DIR``): one JSON line per
attempt, in rotated files a trace reader takes as a trace (``reproduce.workloads.traces``, layout
``recording``).

Two parts:

* :class:`AttemptRecorder`, on the event loop: at an attempt's arrival (``Proxy.attempt``) it
  keeps what is known then (arrival, the prompt's length, hashes of the call key and of the
  caller's credentials, the attempt's number within its call and its fate: created, queued,
  attached, shed); at the attempt's end (delivered, left, refused, failed) it hands one tuple to
  the writer. The output length (and the exact prompt length) come from the engine's ``usage``,
  read from the last bytes of a completed answer (:meth:`AttemptRecorder.watch`); where the
  engine sent none (a stream without ``stream_options.include_usage``, an answer not completed)
  the field is empty (null) and the prompt length is the proxy's estimate.
* :class:`RecordWriter`, a thread: a bounded queue of records (full: the record is dropped and
  counted, the proxy never waits), JSON lines written to ``attempts-<UTC time>-<n>.jsonl`` files
  in batches every ``FLUSH_S``, flushed (a ``kill -9`` loses at most about the last second), a new
  file every ``ROTATE_S`` or ``rotate_bytes``, and the oldest files deleted past
  ``--record-max-bytes`` (all files together) or ``--record-max-age``.

No text is ever written: no prompt, completion or credential, only counts, times and hashes
(``exporter.callkey`` keys are hashes already; they are hashed again, shortened).

NOTE: a record is written when its attempt ends, so lines are in order of end, not arrival (the
reader sorts them within a window), and an attempt still in flight at a ``kill -9`` is not in the
recording: it never ended.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import orjson
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from exporter.policy import Attached, AttemptKind, Created, Decision, Shed
from exporter.relay import Relay, Subscription

__all__ = [
    "FILE_PREFIX",
    "FLUSH_S",
    "ROTATE_S",
    "AttemptRecorder",
    "RecordWriter",
    "recording_files",
]

log = logging.getLogger("retrywatch.recorder")

FILE_PREFIX = "attempts-"
FILE_SUFFIX = ".jsonl"
#: The writer writes what is queued and flushes it this often (a kill -9 loses at most this).
FLUSH_S = 0.2
#: A new file at least this often (and the age bound checked).
ROTATE_S = 3600.0
#: The largest file before a new one; smaller when --record-max-bytes is small (an eighth of it).
ROTATE_BYTES = 64 * 1024 * 1024
#: Records waiting for the writer at most; past it they are dropped and counted.
QUEUE_RECORDS = 65_536
#: Records formatted and written at a time by the writer (the event loop runs between slices).
SLICE_RECORDS = 256
#: Bytes of an answer's end kept to find the engine's ``usage`` in (the last event or the JSON).
USAGE_TAIL_BYTES = 4096
#: Calls whose attempt count is remembered (the number of a retry); the oldest forgotten.
MAX_CALLS = 100_000
_HASH_BYTES = 8  # 16 hex digits: unique enough to tell calls apart within a recording

_USAGE = re.compile(rb'"usage"\s*:\s*\{([^{}]*)\}')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def _short_hash(text: str | None) -> str | None:
    if text is None:
        return None
    return hashlib.blake2b(text.encode(), digest_size=_HASH_BYTES).hexdigest()


def usage_of(tail: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) of the last ``"usage"`` object in an answer's last
    bytes, or None if they hold none."""
    matches = list(_USAGE.finditer(tail))
    if not matches:
        return None
    found = matches[-1]
    prompt, completion = _PROMPT.search(found.group(1)), _COMPLETION.search(found.group(1))
    if prompt is None or completion is None:
        return None
    return int(prompt.group(1)), int(completion.group(1))


def recording_files(directory: Path) -> list[Path]:
    """The recording's files in ``directory``, oldest first (their names sort by time)."""
    return sorted(
        p for p in directory.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}") if p.is_file() and not p.is_symlink()
    )


# A record as the event loop hands it to the writer (formatted there, off the loop):
# (arrival_s, end_s, prompt_tokens, output_tokens, usage, max_tokens, call, client, attempt,
#  fate, shed_reason, ended, stream)
Record = tuple[
    float, float, int, int | None, bool, int | None, str | None, str | None, int, str, str | None, str, bool
]
_KEYS = (
    "arrival_s",
    "end_s",
    "prompt_tokens",
    "output_tokens",
    "usage",
    "max_tokens",
    "call",
    "client",
    "attempt",
    "fate",
    "shed_reason",
    "ended",
    "stream",
)


def format_record(record: Record) -> str:
    """One JSON line (with its newline)."""
    obj = dict(zip(_KEYS, record, strict=True))
    obj["arrival_s"] = round(record[0], 6)
    obj["end_s"] = round(record[1], 6)
    return orjson.dumps(obj).decode() + "\n"


class RecordWriter:
    """Writes records to rotated files in ``directory`` from a thread of its own (see the module's
    docstring). ``offer`` never blocks.

    NOTE: the thread wakes every ``flush_s`` and writes what is queued as a batch, in slices of
    ``SLICE_RECORDS`` (the interpreter's lock let go between them), then flushes. Woken per
    record (a ``queue.Queue``), it took the interpreter's lock from the event loop on every
    attempt: on two busy cores the proxy's added time to first token doubled."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        max_age_s: float,
        rotate_bytes: int | None = None,
        rotate_s: float = ROTATE_S,
        flush_s: float = FLUSH_S,
        queue_records: int = QUEUE_RECORDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.rotate_bytes = rotate_bytes or max(1, min(ROTATE_BYTES, max_bytes // 8))
        self.rotate_s = rotate_s
        self.flush_s = flush_s
        self.queue_records = queue_records
        self.clock = clock
        self.dropped = 0  # records not queued: the queue was full (counted on the event loop)
        self.failed = 0  # records not written: writing failed (counted in the writer thread)
        self.written = 0
        self._queue: deque[Record] = deque()  # appended by the loop, taken by the thread
        self._stop = threading.Event()
        self._file: TextIO | None = None
        self._size = 0
        self._opened_at = 0.0
        self._count = 0  # files begun
        directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="retrywatch-recorder", daemon=True)
        self._thread.start()

    def offer(self, record: Record) -> None:
        """Queue one record for writing; if the queue is full, drop and count it."""
        if len(self._queue) >= self.queue_records:
            self.dropped += 1
        else:
            self._queue.append(record)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, close the file and stop the thread (waiting at most ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout_s)

    # --- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        self._enforce_bounds(None)
        enforced_at = self.clock()
        while True:
            stopping = self._stop.wait(self.flush_s)
            try:
                now = self.clock()
                if now - enforced_at >= self.rotate_s:  # an idle proxy's old files go too
                    enforced_at = now
                    self._enforce_bounds(None if self._file is None else self._file.name)
                self._write_queued(now)
            except OSError as exc:
                log.warning("recording to %s failed (%s); a new file is tried", self.directory, exc)
                self._close_file()
            if stopping:
                break
        self._close_file()

    def _write_queued(self, now: float) -> None:
        if self._file is not None and (
            self._size >= self.rotate_bytes or now - self._opened_at >= self.rotate_s
        ):
            self._close_file()
        queue = self._queue
        while queue:
            for _ in range(min(len(queue), SLICE_RECORDS)):
                if self._file is None:
                    self._file, self._size, self._opened_at = self._open(now), 0, now
                    self._enforce_bounds(self._file.name)
                line = format_record(queue.popleft())
                try:
                    self._file.write(line)  # buffered: a system call per 64 KiB
                except OSError:
                    self.failed += 1
                    raise
                self._size += len(line)
                self.written += 1
                if self._size >= self.rotate_bytes:
                    self._close_file()
            time.sleep(0)  # let the event loop have the interpreter between slices
        if self._file is not None:
            self._file.flush()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _open(self, now: float) -> TextIO:
        stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        # NOTE: names sort by time, then by a count (files begun in the same microsecond);
        # exclusive creation: a file of the same name (two proxies, one directory) is never
        # appended to.
        while True:
            self._count += 1
            path = self.directory / f"{FILE_PREFIX}{stamp}-{self._count:06d}{FILE_SUFFIX}"
            try:
                return open(path, "x", encoding="utf-8", buffering=1 << 16)
            except FileExistsError:
                continue

    def _enforce_bounds(self, current: str | None) -> None:
        """Delete the oldest files past the size bound (all files, the current one counted) and
        those older than the age bound; never the current file."""
        now = self.clock()
        files: list[tuple[Path, int, float]] = []
        for path in recording_files(self.directory):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((path, st.st_size, st.st_mtime))
        total = sum(size for _, size, _ in files)
        for path, size, mtime in files:
            if str(path) == current:
                continue
            if total > self.max_bytes or now - mtime > self.max_age_s:
                try:
                    path.unlink()
                except OSError as exc:
                    log.warning("could not delete the old recording %s: %s", path, exc)
                    continue
                total -= size


@dataclass(slots=True)
class _Pending:
    """What is known of an attempt in flight, until its end."""

    arrival_s: float
    prompt_tokens: int
    max_tokens: int | None
    call: str | None
    client: str | None
    attempt: int
    fate: str
    stream: bool
    relay: Relay


class AttemptRecorder:
    """The proxy's side of the recording: what each attempt was, handed to the writer at its end."""

    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer
        self._pending: dict[int, _Pending] = {}  # by subscriber id
        self._attempts: OrderedDict[str, int] = OrderedDict()  # call hash -> last attempt number
        self._tails: weakref.WeakKeyDictionary[Relay, bytearray] = weakref.WeakKeyDictionary()
        self._usage: weakref.WeakKeyDictionary[Relay, tuple[int, int]] = weakref.WeakKeyDictionary()
        # wall-clock seconds = monotonic seconds + this (the proxy's clock is time.monotonic)
        self._offset = time.time() - time.monotonic()

    def arrived(
        self,
        started: float,
        prompt_tokens: int,
        body: dict[str, Any],
        key: str | None,
        caller: str | None,
        decision: Decision,
        relay: Relay | None,
        now: float,
    ) -> None:
        """An attempt was decided. A shed one ends here; another waits for its end."""
        call = _short_hash(key)
        number = self._number(call, decision.kind)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            max_tokens = None
        stream = bool(body.get("stream", False))
        client = _short_hash(caller)
        arrival = started + self._offset
        if isinstance(decision, Shed) or relay is None:
            reason = decision.reason.value if isinstance(decision, Shed) else None
            self.writer.offer(
                (arrival, now + self._offset, prompt_tokens, None, False, max_tokens, call, client,
                 number, "shed", reason, "shed", stream)
            )  # fmt: skip
            return
        fate = "attached" if isinstance(decision, Attached) else "created"
        if isinstance(decision, Created) and decision.queued:
            fate = "queued"
        self._pending[decision.subscriber_id] = _Pending(
            arrival, prompt_tokens, max_tokens, call, client, number, fate, stream, relay
        )

    def _number(self, call: str | None, kind: AttemptKind) -> int:
        """The attempt's number within its call: 0 for a first attempt, 1 and up for retries."""
        number = 0
        if kind is AttemptKind.RETRY:
            number = 1 if call is None else self._attempts.get(call, 0) + 1
        if call is not None:
            self._attempts[call] = number
            self._attempts.move_to_end(call)
            if len(self._attempts) > MAX_CALLS:
                self._attempts.popitem(last=False)
        return number

    def ended(self, subscription: Subscription, how: str, now: float) -> None:
        """An attempt ended: ``delivered``, ``left`` (its client went away), ``refused`` or
        ``failed``."""
        p = self._pending.pop(subscription.subscriber_id, None)
        if p is None:
            return
        usage = self._usage.get(p.relay)
        prompt, output = (p.prompt_tokens, None) if usage is None else usage
        self.writer.offer(
            (p.arrival_s, now + self._offset, prompt, output, usage is not None, p.max_tokens, p.call,
             p.client, p.attempt, p.fate, None, how, p.stream)
        )  # fmt: skip

    def watch(self, relay: Relay, sink: Callable[[bytes], None]) -> Callable[[bytes], None]:
        """``sink`` for an execution's answer, keeping its last bytes for :meth:`completed`."""
        tail = self._tails[relay] = bytearray()

        def watched(data: bytes) -> None:
            tail.extend(data)  # first: the sink may complete the execution (a stream's [DONE])
            if len(tail) > 2 * USAGE_TAIL_BYTES:
                del tail[:-USAGE_TAIL_BYTES]
            sink(data)

        return watched

    def completed(self, relay: Relay) -> None:
        """The execution's answer ended whole: its ``usage``, if the engine sent one, is its
        subscribers' counts."""
        tail = self._tails.pop(relay, None)
        if tail is not None:
            usage = usage_of(bytes(tail[-USAGE_TAIL_BYTES:]))
            if usage is not None:
                self._usage[relay] = usage

    def collector(self) -> Collector:
        """The recorder's counters for ``/metrics``."""
        return _RecorderCollector(self.writer)

    def close(self) -> None:
        self.writer.close()


class _RecorderCollector(Collector):
    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "retrywatch_recorder_records_dropped",
            "Attempt records the recorder (--record) dropped: its queue was full or writing failed.",
            value=self.writer.dropped + self.writer.failed,
        )
        yield CounterMetricFamily(
            "retrywatch_recorder_records_written",
            "Attempt records the recorder (--record) wrote.",
            value=self.writer.written,
        )


def open_recorder(directory: str, max_bytes: int, max_age_s: float) -> AttemptRecorder:
    """The recorder of ``--record DIR``; ``OSError`` if the directory cannot be made or written."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{directory}: not writable")
    return AttemptRecorder(RecordWriter(path, max_bytes=max_bytes, max_age_s=max_age_s))
