"""Fixtures for the rules tests: Prometheus' own tools, which `.ci/run` installs from Debian's
``prometheus`` package. Missing tools fail the tests that need them (never a silent skip);
deselect those with ``-m 'not promtool'``."""

from __future__ import annotations

import shutil

import pytest


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} not found: install Debian's prometheus package "
            "(apt-get install -y --no-install-recommends prometheus) or deselect with -m 'not promtool'"
        )
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _tool("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return _tool("prometheus")
