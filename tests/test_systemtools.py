"""A missing system tool, as a newcomer's machine has it: ``python -m pytest`` skips each test that
needs it with one line naming the tool and the ``apt-get install`` that brings it, and under
``CI=true`` the same test fails. Real pytest runs, in a subprocess, of real tests of the suite:
one that needs promtool only through its marker, one that runs amtool itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BY_MARKER = "tests/rules/test_promtool.py::test_a_test_file_per_alert"
BY_CALL = "tests/test_fleetdemo.py::test_alertmanager_keeps_the_shipped_routes_without_webhooks"


def _pytest_without_tools(tmp_path: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    """The two tests, run with a PATH that holds Python and nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PATH": str(bin_dir)}
    if ci:
        env["CI"] = "true"
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", BY_MARKER, BY_CALL]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_missing_tool_skips_with_one_line_naming_it_and_its_install(tmp_path: Path) -> None:
    done = _pytest_without_tools(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, done.stdout[-3000:]
    assert any(
        "promtool not found: apt-get install -y --no-install-recommends prometheus " in line
        for line in skipped
    ), skipped
    assert any(
        "amtool not found: apt-get install -y --no-install-recommends prometheus-alertmanager " in line
        for line in skipped
    ), skipped
    assert "2 skipped" in done.stdout


def test_under_ci_a_missing_tool_fails_the_test(tmp_path: Path) -> None:
    done = _pytest_without_tools(tmp_path, ci=True)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped" not in done.stdout.splitlines()[-1]
    assert "promtool not found" in done.stdout and "amtool not found" in done.stdout
    assert "CI=true: a missing tool fails" in done.stdout


@pytest.mark.promtool
def test_a_marked_test_runs_where_its_tools_are_found() -> None:
    """Beside the two above: where promtool is installed (CI, ``bash .ci/run``), a test marked
    ``promtool`` runs and finds it."""
    from tests.systemtools import locate

    assert locate("promtool") is not None and locate("prometheus") is not None
