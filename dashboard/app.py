"""The Dash app: configuration, the shared context the pages read through, the page shell and
routing. Page modules (``dashboard/pages/``) own their layouts and callbacks; this module only
assembles them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs

import dash
from dash import Input, Output, State, dcc, html

from dashboard import style
from dashboard.data import DetectorClient, DetectorError, SignalSource
from dashboard.pages import PAGES, Page
from dashboard.runs import RunsDir, load_runs

T = TypeVar("T")
MEMO_ENTRIES = 32  # remembered signal fetches: a few engines x ranges x open tabs


@dataclass(frozen=True)
class DashboardConfig:
    """What ``retrywatch dashboard`` was started with."""

    detector_url: str
    prometheus_url: str | None = None
    runs_dir: Path | None = None
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


def _nav() -> html.Div:
    links = [
        dcc.Link(page.name, href=page.path, style=style.NAV_LINK, id=f"nav-{page.key}") for page in PAGES
    ]
    return html.Div([html.Span("retrywatch", style=style.TITLE), *links], style=style.NAV)


def create_app(config: DashboardConfig, *, signals: SignalSource | None = None) -> dash.Dash:
    """Build the Dash app for ``config``; callbacks are bound to this app only."""
    ctx = Context(config, signals=signals)
    app = dash.Dash(
        __name__,
        title="retrywatch",
        suppress_callback_exceptions=True,
        update_title="",  # no "Updating..." title flicker on every refresh
    )
    app.layout = html.Div(
        [
            dcc.Location(id="url"),
            _nav(),
            html.Div(id="page"),
            # An empty, hidden graph starts loading plotly.js with the page, while the first
            # page's data is fetched (eager_loading would also pull every unused chunk).
            dcc.Graph(id="preload-plotly", style={"display": "none"}),
        ],
        style=style.PAGE,
    )
    by_path: dict[str, Page] = {page.path: page for page in PAGES}

    @app.callback(Output("page", "children"), Input("url", "pathname"), State("url", "search"))
    def route(pathname: str | None, search: str | None) -> object:
        page = by_path.get(pathname or "/")
        if page is None:
            return html.Div(f"No page at {pathname}.", style=style.NOTE)
        query = {k: v[-1] for k, v in parse_qs((search or "").lstrip("?")).items()}
        return page.layout(ctx, query)

    for page in PAGES:
        page.register(app, ctx)
    app.server.config["RETRYWATCH_CONTEXT"] = ctx
    return app
