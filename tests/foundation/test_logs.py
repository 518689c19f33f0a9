"""``foundation.logs``: the formats of every command's log (the commands themselves are exercised
as real processes in each package's test_cli.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import pytest

from foundation.logs import announce, setup_logging


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[[], str]]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield lambda: capsys.readouterr().err
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_is_one_object_per_line_with_its_traceback_and_credentials_masked(
    stderr: Callable[[], str],
) -> None:
    setup_logging("info", "json", ["http://ops:S3CRET@db.example/x"])
    log = logging.getLogger("retrywatch.test")
    announce("retrywatch test on http://127.0.0.1:1")
    log.debug("not shown")
    try:
        raise RuntimeError("broke at http://ops:S3CRET@db.example/x")
    except RuntimeError:
        log.exception("failed\non two lines")
    text = stderr()
    lines = [json.loads(line) for line in text.splitlines()]
    assert [(d["level"], d["logger"]) for d in lines] == [
        ("info", "retrywatch.start"),
        ("error", "retrywatch.test"),
    ]
    assert all(set(d) == {"time", "level", "logger", "message"} for d in lines)
    assert lines[1]["message"].startswith("failed\non two lines\nTraceback")
    assert "ops:***@db.example" in lines[1]["message"] and "S3CRET" not in text


def test_text_shows_the_start_line_bare_at_any_level(stderr: Callable[[], str]) -> None:
    setup_logging("error", "text")
    announce("retrywatch test on http://127.0.0.1:1")
    logging.getLogger("retrywatch.test").warning("below the level")
    logging.getLogger("retrywatch.test").error("shown")
    first, second = stderr().splitlines()
    assert first == "retrywatch test on http://127.0.0.1:1"
    assert second.endswith(" ERROR retrywatch.test: shown")
