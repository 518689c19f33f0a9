"""Sources of signals behind one interface: direct scrape, Prometheus HTTP API, replay.

A source returns :class:`foundation.timeseries.Snapshot` s whose samples carry an ``instance``
label; :class:`~detector.signals.SignalEngine` groups them per engine. A source that cannot
reach its target reports it in :attr:`FetchResult.down` (never an empty "healthy" answer).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from foundation.timeseries import Snapshot


@dataclass
class FetchResult:
    snapshots: list[Snapshot] = field(default_factory=list)
    down: list[str] = field(default_factory=list)  # instances that could not be read
    error: str | None = None
    # why each answer refused whole was (``foundation.timeseries.ExpositionRefused.reason``)
    refused: list[str] = field(default_factory=list)


class Source(Protocol):
    """What the detector reads signals from."""

    name: str

    def fetch(self, now: float) -> FetchResult:
        """New snapshots up to ``now`` (the source's clock)."""
        ...

    def close(self) -> None: ...


class AnswerTooLarge(ValueError):
    """An HTTP answer over its size bound (:func:`read_whole`)."""


class AnswerTooSlow(ValueError):
    """An HTTP answer not complete within its time bound (:func:`read_whole`)."""


def read_whole(chunks: Iterable[bytes], *, started: float, timeout_s: float, max_bytes: int) -> bytes:
    """An answer's body from ``chunks`` (each what has arrived), at most ``max_bytes`` and complete
    ``timeout_s`` after ``started`` (``time.monotonic()`` before the request).

    NOTE: an HTTP client's timeout (httpx's, requests') bounds each read, not the answer: a server
    that trickles its answer held the reader, an evaluation or a dashboard worker, for as long as
    it trickled. The scrape source, the Prometheus source and the dashboard read through this."""
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise AnswerTooLarge(f"the answer exceeds {max_bytes} bytes")
        if time.monotonic() - started > timeout_s:
            raise AnswerTooSlow(f"the answer was not complete after {timeout_s:g} s")
    return bytes(body)
