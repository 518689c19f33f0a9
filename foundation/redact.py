"""Credentials out of URLs before a URL is printed, logged or stored: the one masking helper.

:func:`redact_url` masks, in any URL (HTTP or a SQLAlchemy database URL):

- the password of the userinfo (``postgresql://rw:***@db/x``); for http(s) a userinfo without a
  password is a token (``https://KEY@host``) and is masked whole; a database user name stays;
- the value of every query parameter whose name says it is a secret (password, token, key,
  secret, signature, auth, credential: ``?token=***``);
- the path after the marker segment of the well-known webhook shapes, where the path itself is
  the secret: ``/hooks/`` (Mattermost, Rocket.Chat, Zapier), ``/webhooks/`` (Discord),
  ``/webhookb2/`` (Microsoft Teams), and ``/services/`` on ``hooks.slack.com``.

Anything that is not a parsable http(s) URL is read as SQLAlchemy's ``make_url`` reads a
database URL (the password runs from ``user:`` to the first ``@``), so it never raises.
:func:`redact_text` scrubs the secrets of known URLs out of any text (a third-party error
message, a log line); :class:`RedactFilter` applies it to everything a logging handler writes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import SplitResult, unquote, unquote_plus, urlsplit, urlunsplit

MASK = "***"
_SECRET_KEY = re.compile(r"pass|pwd|secret|token|key|sig|auth|credential", re.IGNORECASE)
_WEBHOOK_MARKERS = frozenset({"hooks", "webhooks", "webhookb2"})
_SLACK_HOSTS = ("hooks.slack.com",)
# A secret shorter than this is replaced only where it sits as a password (``:s@``), not
# everywhere in a text: a two-letter password would otherwise mask every word that holds it.
_MIN_FREE_SECRET = 4
# The userinfo of a database URL as SQLAlchemy reads it (``make_url``: the password runs to the
# first ``@``, ``/`` and ``?`` included), with or without a scheme (``rw:pw@host/db``).
_DB_USERINFO = re.compile(r"^((?:[A-Za-z][\w+.\-]*://)?)([^:/@]*):(?!//)([^@]*)@")


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def _query_secret(piece: str) -> str | None:
    """The value of one ``key=value`` query piece when its key names a secret, else None."""
    key, eq, value = piece.partition("=")
    return value if eq and value and _SECRET_KEY.search(unquote_plus(key)) else None


def _mask_query(query: str) -> str:
    pieces = query.split("&") if query else []
    return "&".join(p if _query_secret(p) is None else p.partition("=")[0] + "=" + MASK for p in pieces)


def _webhook_cut(parts: SplitResult) -> int | None:
    """Index of the first secret path segment of a well-known webhook URL, else None."""
    segments = parts.path.split("/")
    host = (parts.hostname or "").lower()
    for i, segment in enumerate(segments[:-1]):
        name = segment.lower()
        if name in _WEBHOOK_MARKERS or (name == "services" and host in _SLACK_HOSTS):
            return i + 1
    return None


def _http_parts(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        parts.hostname  # noqa: B018  (raises on a malformed IPv6 host)
    except ValueError:
        return None
    return parts


def redact_url(url: str) -> str:
    """``url`` with its credentials masked (see the module docstring); never raises."""
    parts = _http_parts(url) if _is_http(url) else None
    if parts is None:  # a database URL (or an unparsable one): SQLAlchemy's reading
        masked = _DB_USERINFO.sub(rf"\1\2:{MASK}@", url, count=1)
        head, q, query = masked.partition("?")
        return head + q + _mask_query(query)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostport}" if colon else f"{MASK}@{hostport}"
    path = parts.path
    cut = _webhook_cut(parts)
    if cut is not None:
        path = "/".join([*path.split("/")[:cut], MASK])
    return urlunsplit((parts.scheme, netloc, path, _mask_query(parts.query), parts.fragment))


def url_secrets(url: str) -> list[str]:
    """The secret strings ``url`` holds, as written and percent-decoded, longest first."""
    found: set[str] = set()
    parts = _http_parts(url) if _is_http(url) else None
    if parts is None:
        match = _DB_USERINFO.match(url)
        if match:
            found.add(match.group(3))
        query = _DB_USERINFO.sub("", url, count=1).partition("?")[2]
    else:
        if "@" in parts.netloc:
            userinfo = parts.netloc.rpartition("@")[0]
            user, colon, password = userinfo.partition(":")
            found.add(password if colon else user)
        cut = _webhook_cut(parts)
        if cut is not None:
            found.update(parts.path.split("/")[cut:])
        query = parts.query
    found.update(v for v in map(_query_secret, query.split("&")) if v is not None)
    found |= {unquote(s) for s in found} | {unquote_plus(s) for s in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def _replacements(urls: Iterable[str | None]) -> list[tuple[str, str]]:
    """(text, its replacement) pairs that mask ``urls`` and their secrets, in the order to apply."""
    known = sorted({u for u in urls if u}, key=len, reverse=True)
    pairs = [(url, redact_url(url)) for url in known]
    for url in known:
        for secret in url_secrets(url):
            if len(secret) >= _MIN_FREE_SECRET:
                pairs.append((secret, MASK))
            else:
                pairs.append((f":{secret}@", f":{MASK}@"))
    return pairs


def _apply(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def redact_text(text: str, urls: Iterable[str | None]) -> str:
    """``text`` with each of ``urls`` (as given) replaced by its masked form and each of their
    secrets masked wherever it appears (a short one only where it sits as ``:secret@``)."""
    return _apply(text, _replacements(urls))


class RedactFilter(logging.Filter):
    """A handler filter that masks the secrets of ``urls`` in every record it passes on, its
    message, arguments and traceback included. On the root logger's handler it covers every
    logger that propagates (httpx logs each request's full URL at INFO)."""

    def __init__(self, urls: Iterable[str | None]) -> None:
        super().__init__()
        self._pairs = _replacements(urls)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._pairs:
            return True
        record.msg = _apply(record.getMessage(), self._pairs)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _apply(record.exc_text, self._pairs)
        if record.stack_info:
            record.stack_info = _apply(record.stack_info, self._pairs)
        return True
