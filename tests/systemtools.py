"""The system tools the tests run (Debian's Prometheus, Alertmanager, Chromium, PostgreSQL, nginx,
HAProxy and tc; kubectl from the machine image; uv from PyPI, as the README's quick start installs
it; Ray, the project's ``ray`` extra, in the project's venv): where each is found, which package
brings it,
and what a missing one does to a test that needs it.

On a developer's machine a missing tool skips the test with one line naming the tool and the
``apt-get install`` that brings it, so a plain ``python -m pytest`` ends green with what is
installed. Under ``CI=true`` (CI sets it; ``bash .ci/run`` installs every tool first) a missing
tool fails the test: CI never goes green by skipping. Tests name a tool by calling
:func:`require`, or carry a marker that :data:`MARKER_TOOLS` maps to tools (the root
``conftest.py`` checks those before the test runs).
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Tool:
    """A program a test runs, the Debian package that brings it, and where else to look for it
    than PATH (nginx and tc live in /usr/sbin, often outside a user's PATH; PostgreSQL's server
    programs in its versioned directory)."""

    name: str
    package: str
    dirs: tuple[str, ...] = ()
    # False only for a tool no package registry reachable here brings: CI cannot install it,
    # so even under CI=true a missing one skips (saying so).
    ci_installs: bool = True
    # The command that installs it, where that is not Debian's apt-get.
    installer: str | None = None
    # A console script of this Python's own environment, looked for beside its interpreter only
    # (one elsewhere on PATH would run another Python, without this project).
    beside_python: bool = False

    @property
    def install(self) -> str:
        if not self.ci_installs:
            return f"{self.package}; bash .ci/run cannot install it"
        command = self.installer or f"apt-get install -y --no-install-recommends {self.package}"
        return f"{command} (or: bash .ci/run)"


_SBIN = ("/usr/sbin", "/sbin")
_POSTGRES = tuple(sorted((str(p) for p in Path("/usr/lib/postgresql").glob("*/bin")), reverse=True))

TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool("promtool", "prometheus"),
        Tool("prometheus", "prometheus"),
        Tool("amtool", "prometheus-alertmanager"),
        Tool("prometheus-alertmanager", "prometheus-alertmanager"),
        Tool("chromium", "chromium chromium-driver"),
        Tool("initdb", "postgresql", _POSTGRES),
        Tool("postgres", "postgresql", _POSTGRES),
        Tool("nginx", "nginx", _SBIN),
        Tool("haproxy", "haproxy", _SBIN),
        Tool("tc", "iproute2", _SBIN),
        Tool("kubectl", "kubectl, from the Kubernetes project's packages (not Debian's)", ci_installs=False),
        Tool("uv", "uv", installer="python3 -m pip install uv"),
        Tool(
            "ray",
            "ray (PyPI)",
            installer="uv pip install --python .venv/bin/python -e '.[ray]'",
            beside_python=True,
        ),
    )
}

# The markers of pyproject.toml that stand for tools: a test carrying one needs them all.
MARKER_TOOLS: dict[str, tuple[str, ...]] = {
    "promtool": ("promtool", "prometheus"),
    "browser": ("chromium",),
    "postgres": ("initdb", "postgres"),
    "balancer": ("nginx", "haproxy"),
    "ray": ("ray",),
}


def in_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def locate(name: str) -> str | None:
    """The path of tool ``name`` on this machine, or None. Chromium may be named by
    ``RETRYWATCH_CHROMIUM``."""
    tool = TOOLS[name]
    if tool.beside_python:
        script = Path(sys.executable).parent / name
        return str(script) if script.is_file() else None
    if name == "chromium" and (override := os.environ.get("RETRYWATCH_CHROMIUM")):
        return override if Path(override).is_file() else None
    found = shutil.which(name)
    if found is not None:
        return found
    return next((str(Path(d) / name) for d in tool.dirs if (Path(d) / name).is_file()), None)


def missing_line(name: str) -> str:
    """The one line a missing tool gets: the tool and what installs it."""
    return f"{name} not found: {TOOLS[name].install}"


def require(name: str) -> str:
    """The path of tool ``name``; without it, skip the test (fail it under CI=true)."""
    path = locate(name)
    if path is not None:
        return path
    if in_ci() and TOOLS[name].ci_installs:
        pytest.fail(f"{missing_line(name)} [CI=true: a missing tool fails]", pytrace=False)
    pytest.skip(missing_line(name))


def require_marked(markers: list[str]) -> None:
    """Require every tool that the given marker names stand for."""
    for marker in markers:
        for name in MARKER_TOOLS.get(marker, ()):
            require(name)
