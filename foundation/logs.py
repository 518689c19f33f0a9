"""Logging and the start of every ``retrywatch`` command: declared once, used by each CLI.

* ``log_options``: the ``--log-level`` (critical, error, warning, info, debug; default warning) and
  ``--log-format`` (text, or json: one object per line with time, level, logger, message) options,
  set also by ``RETRYWATCH_LOG_LEVEL`` and ``RETRYWATCH_LOG_FORMAT``.
* ``setup_logging``: one handler on the root logger, on stderr, that masks the credentials of the
  URLs it is given (``foundation.redact``); uvicorn's and the libraries' loggers propagate to it
  (pass ``log_config=None`` to uvicorn).
* ``announce``: the command's one start line (what it serves and where its state lives), shown
  whatever the level, as a bare line in text and as an object in JSON.
* ``check_port``: a port already in use is a usage error (exit 2) that names the option to change,
  raised before anything is announced, created or fetched.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from foundation.knobs import env_var
from foundation.processes import port_taken
from foundation.redact import RedactFilter

__all__ = [
    "DEFAULT_LEVEL",
    "FORMATS",
    "LEVELS",
    "JsonFormatter",
    "PortTaken",
    "TextFormatter",
    "announce",
    "check_port",
    "log_options",
    "setup_logging",
]

LEVELS = ("critical", "error", "warning", "info", "debug")
DEFAULT_LEVEL = "warning"
FORMATS = ("text", "json")
#: The logger of the start line: it has a level of its own, so the line shows at any --log-level.
START_LOGGER = "retrywatch.start"

FC = TypeVar("FC", bound=Callable[..., Any])


def log_options(command: FC) -> FC:
    """Add ``--log-level`` and ``--log-format`` (parameters ``log_level``, ``log_format``)."""
    command = click.option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="text",
        show_default=True,
        envvar=env_var("log-format"),
        show_envvar=True,
        help="text, or json: one object per line (time, level, logger, message) for log pipelines.",
    )(command)
    return click.option(
        "--log-level",
        type=click.Choice(LEVELS, case_sensitive=False),
        default=DEFAULT_LEVEL,
        show_default=True,
        envvar=env_var("log-level"),
        show_envvar=True,
        help="Least severe level logged (state changes of what the command depends on are warnings).",
    )(command)


def _time(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message``; the start line bare."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == START_LOGGER:
            return record.getMessage()
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``
    (with the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        doc = {"time": _time(record), "level": record.levelname.lower(), "logger": record.name}
        doc["message"] = message
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(level: str, log_format: str = "text", secrets: Iterable[str | None] = ()) -> None:
    """Log at ``level`` and above to stderr in ``log_format``, masking the credentials of the URLs
    ``secrets`` in every record (and Python's warnings through the same handler)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RedactFilter(secrets))
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger(START_LOGGER).setLevel(logging.INFO)
    logging.captureWarnings(True)


def announce(message: str) -> None:
    """The command's start line, once (through the handler of :func:`setup_logging`)."""
    logging.getLogger(START_LOGGER).info(message)


class PortTaken(click.ClickException):
    """A port the command cannot listen on: one line, exit 2 (a usage error)."""

    exit_code = 2


def check_port(host: str, port: int, option: str = "--port", what: str = "") -> None:
    """Exit 2 with one line naming ``option`` when ``host:port`` cannot be listened on now
    (``what``: whose port, for a command that opens several)."""
    if port == 0:
        return  # the OS picks a free one
    reason = port_taken(host, port)
    if reason is not None:
        whose = f" for {what}" if what else ""
        raise PortTaken(f"cannot listen on {host}:{port}{whose} ({reason}): pick another with {option}")
