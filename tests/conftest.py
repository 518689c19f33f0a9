"""Checks every test of the suite shares: a test whose markers stand for system tools
(``promtool``, ``browser``, ``postgres``, ``balancer``, ``ray``) is skipped before it starts when one is
missing, with one line naming the tool and its ``apt-get install``; under ``CI=true`` it fails
instead (``tests/systemtools.py`` owns the tools and that rule)."""

from __future__ import annotations

import pytest

from tests.systemtools import require_marked


def pytest_runtest_setup(item: pytest.Item) -> None:
    require_marked([mark.name for mark in item.iter_markers()])
