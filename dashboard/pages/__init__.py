"""The dashboard's pages. Each module defines ``PAGE``: its path, name, layout function (of the
context and the URL's query, e.g. ``/?engine=e1&range=21600``) and callback registration; the app
routes to them in this order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dash

    from dashboard.app import Context


@dataclass(frozen=True)
class Page:
    key: str
    path: str
    name: str
    layout: Callable[[Context, dict[str, str]], Any]  # (context, URL query) -> layout
    register: Callable[[dash.Dash, Context], None]


def _pages() -> tuple[Page, ...]:
    from dashboard.pages import experiments, history, live

    return (live.PAGE, history.PAGE, experiments.PAGE)


PAGES: tuple[Page, ...] = _pages()
