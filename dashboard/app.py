"""The Dash app: the page shell and routing. Page modules (``dashboard/pages/``) own their
layouts and callbacks, and read through the context (``dashboard/context.py``) built here once;
this module only assembles them.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import dash
from dash import Input, Output, State, dcc, html

from dashboard import style
from dashboard.context import Context, DashboardConfig
from dashboard.data import SignalSource
from dashboard.pages import PAGES, Page


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
