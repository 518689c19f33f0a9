"""The runbook and the links to it: one URL pattern, and the runbook as the detector's HTML page.

Every alert carries a ``runbook_url`` (the rules' annotation, the detector's ``/alerts`` and
``/episodes``, its webhook and Alertmanager notifications). Each is :func:`runbook_url` of one
pattern, set by ``--runbook-url`` or ``RETRYWATCH_RUNBOOK_URL`` (``python -m rules.generate``
and ``retrywatch detect`` take it, declared here once by :func:`runbook_option`): an absolute
http(s) URL with ``{alert}`` (the alert's name, e.g. ``VLLMMetastableRetryLoop``) or
``{anchor}`` (its name in lower case, as GitHub names a heading's anchor), e.g.
``https://wiki.example/retrywatch#{alert}``.

By default the link opens the runbook as the detector serves it (``GET /runbook``, one section
per alert with the alert's name as its anchor): :data:`DEFAULT_PATTERN` at the detector's default
address for the rules; the detector's own address for the detector. The runbook's text is
``detector/runbook.md``, shipped with the package.
"""

from __future__ import annotations

import functools
import html
import string
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click

from foundation.bounds import base_url

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PATTERN",
    "DEFAULT_PORT",
    "ENV_VAR",
    "RunbookPatternError",
    "check_pattern",
    "runbook_html",
    "runbook_markdown",
    "runbook_option",
    "runbook_url",
    "served_pattern",
]

#: The detector's default address (its --host and --port, the dashboard's --detector).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8200
PATH = "/runbook"
ENV_VAR = "RETRYWATCH_RUNBOOK_URL"
FIELDS = frozenset({"alert", "anchor"})


def served_pattern(host: str, port: int) -> str:
    """The pattern of the runbook served by a detector listening on ``host:port``."""
    if host in ("", "0.0.0.0", "::"):
        import socket

        host = socket.getfqdn()  # a wildcard bind: the machine's name, not an unroutable address
    return f"{base_url(host, port)}{PATH}#{{alert}}"


DEFAULT_PATTERN = served_pattern(DEFAULT_HOST, DEFAULT_PORT)

FC = TypeVar("FC", bound=Callable[..., Any])


class RunbookPatternError(ValueError):
    """A runbook URL pattern that would not give an absolute link per alert."""


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is an absolute http(s) URL with ``{alert}`` or ``{anchor}`` and no
    other field, and no blank, control character or literal brace; else
    :class:`RunbookPatternError` saying why."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(pattern) if name is not None}
    except ValueError as exc:
        raise RunbookPatternError(f"{pattern!r} is not a valid pattern: {exc}") from None
    if not fields & FIELDS or fields - FIELDS:
        raise RunbookPatternError(
            f"{pattern!r} must contain {{alert}} (the alert's name) or {{anchor}} (in lower case), "
            "and no other {field}"
        )
    url = runbook_url(pattern, "Alert")
    # Prometheus expands an alert's annotations as Go templates ("{{"), and a URL has no blanks,
    # control characters or braces (percent-encode them).
    if any(c.isspace() or not c.isprintable() or c in "{}" for c in url):
        raise RunbookPatternError(
            f"{pattern!r} must give a URL without spaces, control characters or braces (percent-encode them)"
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RunbookPatternError(
            f"{pattern!r} is not an absolute http(s) URL, e.g. https://wiki.example/retrywatch#{{alert}}"
        )
    return pattern


def runbook_url(pattern: str, alertname: str) -> str:
    """The link to ``alertname``'s section."""
    return pattern.format(alert=alertname, anchor=alertname.lower())


def runbook_option(default: str | None, help_default: str) -> Callable[[FC], FC]:
    """The ``--runbook-url`` option (parameter ``runbook_pattern``), also set by
    ``RETRYWATCH_RUNBOOK_URL``; checked by :func:`check_pattern`."""

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check_pattern(value)
        except RunbookPatternError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None

    return click.option(
        "--runbook-url",
        "runbook_pattern",
        default=default,
        envvar=ENV_VAR,
        show_envvar=True,
        callback=convert,
        help="Link to each alert's runbook: an http(s) URL with {alert} (or {anchor}, lower case), "
        f"e.g. https://wiki.example/retrywatch#{{alert}} [default: {help_default}].",
    )


def runbook_markdown() -> str:
    """The runbook's text, ``detector/runbook.md`` as shipped with the package."""
    return resources.files("detector").joinpath("runbook.md").read_text(encoding="utf-8")


@functools.cache
def runbook_html(alertnames: frozenset[str]) -> str:
    """``detector/runbook.md`` as one HTML page: each heading has an anchor (the section of an
    alert of ``alertnames`` its name, others GitHub's slug); links into the source tree become
    plain text."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(runbook_markdown())
    title = "retrywatch runbook"
    for i, token in enumerate(tokens):
        if token.type == "heading_open" and i + 1 < len(tokens):
            text = tokens[i + 1].content.strip()
            if token.tag == "h1":
                title = text
            token.attrSet("id", text if text in alertnames else _slug(text))
        for child in token.children or []:
            href = child.attrGet("href") if child.type == "link_open" else None
            if isinstance(href, str) and not urlsplit(href).scheme:
                child.attrs.pop("href", None)  # a file of the repository: nothing to open here
    body = md.renderer.render(tokens, md.options, {})
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n"
        f'<body><nav><a href="/">retrywatch detector</a></nav>\n{body}</body></html>\n'
    )


def _slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces as dashes, punctuation dropped."""
    kept = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem;"
    "line-height:1.5}code,pre{background:#f4f4f4;border-radius:3px}pre{padding:.6rem;overflow-x:auto}"
    "h2{border-bottom:1px solid #ddd;padding-top:.5rem}h2:target{background:#fff3c4}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .5rem}"
)
