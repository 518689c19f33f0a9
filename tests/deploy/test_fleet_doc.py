"""docs/fleet.md names real files, and every shipped deployment file is described there."""

from __future__ import annotations

import re

from tests.deploy.conftest import DEPLOY, REPO

DOC = (REPO / "docs" / "fleet.md").read_text(encoding="utf-8")


def test_every_path_the_page_names_exists() -> None:
    named = set(re.findall(r"\b((?:deploy|tests/deploy|rules|docs)/[\w./-]*\w)", DOC))
    assert named
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/fleet.md names paths that do not exist: {missing}"


def test_every_shipped_configuration_is_described() -> None:
    shipped = {
        p.parent.relative_to(REPO).as_posix()
        for p in DEPLOY.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    undescribed = sorted(d for d in shipped if d not in DOC and d != "deploy")
    assert not undescribed, f"docs/fleet.md does not mention {undescribed}"
