"""What the dashboard was started with (``DashboardConfig``) and the context its pages read
through (``Context``): the detector client, the signal source, the runs directory and a bounded
memo. Pages (``dashboard/pages/``) take it as an argument; the app (``dashboard/app.py``) builds
it once and hands it to each page."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from dashboard.data import DetectorClient, DetectorError, SignalSource
from dashboard.runs import RunsDir, load_runs

T = TypeVar("T")
MEMO_ENTRIES = 32  # remembered signal fetches: a few engines x ranges x open tabs


@dataclass(frozen=True)
class DashboardConfig:
    """What ``retrywatch dashboard`` was started with."""

    detector_url: str
    prometheus_url: str | None = None
    runs_dir: Path | None = None
    plan_dir: Path | None = None  # ``retrywatch reproduce plan-daily --out``: the Headroom page's
    refresh_s: float = 5.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.refresh_s < 1.0:
            raise ValueError(f"refresh interval must be at least 1 s, got {self.refresh_s}")


class Context:
    """The data the pages read: the detector client, the signal source and the runs dir."""

    def __init__(self, config: DashboardConfig, *, signals: SignalSource | None = None) -> None:
        self.config = config
        self.detector = DetectorClient(config.detector_url, timeout_s=config.timeout_s)
        if signals is None and config.prometheus_url:
            from dashboard.prometheus import PrometheusSignals  # lazy: only with --prometheus

            signals = PrometheusSignals(config.prometheus_url, timeout_s=config.timeout_s)
        self.signals: SignalSource = signals if signals is not None else self.detector
        self._runs: RunsDir | None = None
        self._runs_lock = threading.Lock()
        self._memo: OrderedDict[Hashable, Any] = OrderedDict()
        self._memo_lock = threading.Lock()

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, remembered under ``key`` (bounded, least recently used dropped).

        Only for results that ``key`` fully determines (e.g. the detector's history up to one
        scrape), so a remembered result is never stale.
        """
        with self._memo_lock:
            if key in self._memo:
                self._memo.move_to_end(key)
                return cast(T, self._memo[key])
        value = compute()
        with self._memo_lock:
            self._memo[key] = value
            while len(self._memo) > MEMO_ENTRIES:
                self._memo.popitem(last=False)
        return value

    def runs(self) -> RunsDir | None:
        """The reproduce output given with ``--runs`` (read once; RunDirError if broken)."""
        if self.config.runs_dir is None:
            return None
        with self._runs_lock:
            if self._runs is None:
                self._runs = load_runs(self.config.runs_dir)
            return self._runs

    def now(self) -> float:
        """The reference "now" of the views: the detector's last evaluation (so a replay shows its
        latest window, and while the source is down an alert firing now is drawn up to now, past
        the last scrape), else its last scrape, else the wall clock."""
        try:
            _, evaluated_at = self.detector.alerts_at()
        except DetectorError:
            evaluated_at = None  # e.g. an alert no page can show: the last scrape will do
        if evaluated_at is not None:
            return evaluated_at
        try:
            health = self.detector.health()
        except DetectorError:
            return time.time()
        return health.last_scrape_at if health.last_scrape_at is not None else time.time()
