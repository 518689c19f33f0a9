"""The Dockerfile cannot be built here (no container engine): what it copies and how it runs are
checked against the project's packages and the manifests that run its image."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from typing import Any

from tests.deploy.conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _packages() -> set[str]:
    """The top-level packages setuptools installs (pyproject's packages.find)."""
    patterns = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    return {
        p.name
        for p in REPO.iterdir()
        if (p / "__init__.py").exists() and any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)
    }


def _instructions(name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.+)$", DOCKERFILE, flags=re.MULTILINE)


def test_the_image_gets_every_installed_package_and_nothing_else() -> None:
    copied = {line.split()[0] for line in _instructions("COPY") if not line.startswith("--from")}
    assert copied == _packages() | {"pyproject.toml"}, "COPY every package pyproject installs"
    ignore = [s for s in (REPO / ".dockerignore").read_text().splitlines() if s and not s.startswith("#")]
    assert ignore[0] == "*"  # the context holds only what is let back in: never .venv or .vllm-venv
    allowed = {s[1:].rstrip("/") for s in ignore if s.startswith("!")}
    assert allowed == _packages() | {"pyproject.toml", "README.md"}


def test_the_image_runs_retrywatch_as_the_manifests_non_root_user(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert json.loads(_instructions("ENTRYPOINT")[-1]) == ["retrywatch"]
    assert "retrywatch" in PYPROJECT["project"]["scripts"]
    (user,) = _instructions("USER")
    uid, _, gid = user.partition(":")
    assert int(uid) > 0 and int(gid) > 0  # numeric, so that runAsNonRoot can check it
    for obj in rendered["ingress-nginx"]:
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        if any(c["image"].startswith("retrywatch:") for c in pod["containers"]):
            assert pod["securityContext"]["runAsUser"] == int(uid), obj["metadata"]["name"]
    # Both stages on one base: the environment copied from the build stage runs its python.
    froms = _instructions("FROM")
    assert [f.split()[0] for f in froms] == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    (base,) = _instructions("ARG")
    python = re.search(r"python:(\d+\.\d+)", base)
    assert python is not None
    required = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python[1].split("."))) >= tuple(map(int, required.split(".")))
