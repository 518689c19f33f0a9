"""Fixtures for the deployment tests: the rendered Kubernetes overlays and the real tools that check
them (kubectl, kubernetes-validate, promtool, nginx, HAProxy).

``.ci/run`` installs nginx, HAProxy and Prometheus from Debian and kubernetes-validate with the
project's test extra; a missing tool skips the tests that need it, naming its package, and fails
them under CI=true (``tests/systemtools.py``). kubectl comes with the machine image, not from a
package: without it the Kubernetes tests are skipped, saying so, in CI too.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.systemtools import require

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAYS = ("ingress-nginx", "gateway-api")


def tool(name: str) -> str:
    """A system tool's path; a missing one skips the test (fails it under CI=true)."""
    return require(name)


@pytest.fixture(scope="session")
def kubectl() -> str:
    return require("kubectl")


def kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``, parsed: every rendered object."""
    proc = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each overlay rendered, and ingress-nginx with the PostgreSQL component ("postgresql")."""
    out = {name: kustomize(kubectl, KUSTOMIZE / name) for name in OVERLAYS}
    # A kustomization of a user's own, outside the repository, adding the component.
    user = tmp_path_factory.mktemp("user-kustomization")
    overlay = os.path.relpath(KUSTOMIZE / "ingress-nginx", user)  # kustomize takes relative paths only
    component = os.path.relpath(KUSTOMIZE / "components" / "postgresql", user)
    kustomization = {"resources": [overlay], "components": [component]}
    (user / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    out["postgresql"] = kustomize(kubectl, user)
    return out


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    return containers[name]


def args_map(args: list[str]) -> dict[str, str]:
    """``--name=value`` and ``--name value`` arguments as {name: value}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            out[key] = value
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[arg] = args[i + 1]
            i += 1
        i += 1
    return out


def load_render() -> ModuleType:
    """deploy/render.py, a script outside the packages, as a module."""
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def render() -> ModuleType:
    return load_render()


@pytest.fixture(scope="session")
def promtool() -> str:
    return tool("promtool")


@pytest.fixture(scope="session")
def nginx() -> str:
    return tool("nginx")


@pytest.fixture(scope="session")
def haproxy() -> str:
    return tool("haproxy")
