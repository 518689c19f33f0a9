"""Fixtures for the rules tests: Prometheus' own tools, which `.ci/run` installs from Debian's
``prometheus`` package. A missing tool skips the tests that need it, naming the package, and
fails them under CI=true (``tests/systemtools.py``)."""

from __future__ import annotations

import pytest

from tests.systemtools import require


@pytest.fixture(scope="session")
def promtool() -> str:
    return require("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return require("prometheus")
