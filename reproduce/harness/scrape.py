"""Scrapes a proxy's (or an engine's) ``/metrics`` every few seconds into a metrics series.

Each scrape becomes one ``foundation.timeseries.Snapshot`` with ``t`` in seconds from the run's
start, written as one JSON line at once (a crash leaves every scrape taken so far) and kept in
memory for the run's outcomes. Of the histograms, the series format's are kept
(``foundation.vllmbuckets.SERIES_HISTOGRAMS``: vLLM's request latencies and sizes), the others
dropped, so a scrape of a real vLLM and the simulator's snapshots carry the same families. A failed
scrape is counted and skipped: a gap in the series, never a made-up value.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from foundation.timeseries import Snapshot, parse_exposition, write_snapshot
from foundation.vllmbuckets import SERIES_HISTOGRAMS

__all__ = ["MetricsScraper"]


class MetricsScraper:
    """``async with MetricsScraper(url, path, t0=...)``: scrape every ``interval_s`` until exit."""

    def __init__(
        self,
        metrics_url: str,
        path: Path,
        *,
        t0: float,
        interval_s: float = 2.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.metrics_url = metrics_url
        self.path = path
        self.t0 = t0
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.snapshots: list[Snapshot] = []
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def scrape_once(self) -> Snapshot | None:
        """One scrape now; appended to the series and returned, or None if it failed."""
        assert self._client is not None, "use MetricsScraper as an async context manager"
        t = self.clock() - self.t0
        try:
            response = await self._client.get(self.metrics_url)
            response.raise_for_status()
            samples = parse_exposition(response.text, keep_histograms=SERIES_HISTOGRAMS)
        except (httpx.HTTPError, ValueError):
            self.failures += 1
            return None
        snapshot = Snapshot(t=round(t, 3), samples=samples)
        self.snapshots.append(snapshot)
        with self.path.open("a", encoding="utf-8") as fh:
            write_snapshot(fh, snapshot)
        return snapshot

    async def _loop(self) -> None:
        next_at = self.clock()
        while True:
            await self.scrape_once()
            # A scrape slower than the interval (an overloaded proxy) delays the next one
            # rather than triggering a burst of catch-up scrapes.
            next_at = max(next_at + self.interval_s, self.clock())
            await asyncio.sleep(max(0.0, next_at - self.clock()))

    async def __aenter__(self) -> MetricsScraper:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("", encoding="utf-8")
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self.scrape_once()  # the run's end: outcomes read the last snapshot
        finally:
            assert self._client is not None
            await self._client.aclose()
            self._client = None
