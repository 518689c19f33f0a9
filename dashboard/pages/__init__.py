"""The dashboard's pages. Each module defines ``PAGE``: its path, name, layout function (of the
context and the URL's query, e.g. ``/?engine=e1&range=21600``) and callback registration; the app
routes to them in this order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin

from dash import html

from dashboard.context import Context
from detector.signals import MAX_INSTANCE_CHARS

if TYPE_CHECKING:
    import dash


@dataclass(frozen=True)
class Page:
    key: str
    path: str
    name: str
    layout: Callable[[Context, dict[str, str]], Any]  # (context, URL query) -> layout
    register: Callable[[dash.Dash, Context], None]


def text_choice(value: object) -> str | None:
    """A selection as a callback receives it: a string the page could have offered (an engine, an
    alert, a run), else None. A stale or forged request is answered like an empty selection."""
    return value if isinstance(value, str) and len(value) <= MAX_INSTANCE_CHARS else None


def range_choice(value: object, ranges: Sequence[tuple[str, int]]) -> int | None:
    """A time range as a callback (an int) or a link's ``?range=`` (its digits) gives it: one of
    ``ranges``' seconds, else None."""
    for _, seconds in ranges:
        if (type(value) is int and value == seconds) or value == str(seconds):
            return seconds
    return None


def runbook_link(runbook_url: str, detector_url: str, class_name: str) -> html.A | None:
    """A link to an alert's runbook section (a relative one resolved against the detector's URL),
    or None when the detector gave none."""
    if not runbook_url:
        return None
    href = urljoin(detector_url.rstrip("/") + "/", runbook_url)
    return html.A("runbook", href=href, target="_blank", rel="noopener", className=class_name)


def _pages() -> tuple[Page, ...]:
    from dashboard.pages import experiments, headroom, history, live

    return (live.PAGE, history.PAGE, experiments.PAGE, headroom.PAGE)


PAGES: tuple[Page, ...] = _pages()
