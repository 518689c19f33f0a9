"""Every relative link in the project's Markdown reaches a file, and every #anchor a heading.

Anchors follow GitHub's rule: the heading's text in lower case, punctuation other than ``-`` and
``_`` dropped, spaces turned into ``-``, and ``-1``, ``-2``... on repeats. Links inside code
blocks and inline code are not links and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(
    {
        p
        for p in [REPO / "README.md", *REPO.glob("*/*.md")]
        if not p.is_symlink() and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    }
)

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        text = re.sub(r"[`*]", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    problems: list[str] = []
    for link in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = (doc.parent / target).resolve() if target else doc
        if not dest.exists():
            problems.append(f"{link}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{link}: no heading with anchor #{anchor}")
    return problems


def test_the_docs_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "docs/fleet.md", "detector/runbook.md", "rules/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    problems = broken_links(doc)
    assert not problems, f"{doc.relative_to(REPO)}: {problems}"


def test_anchor_rule_matches_githubs() -> None:
    assert "the-default-policy-and-the-trade-offs-of-the-others" in anchors(REPO / "docs" / "proxy.md")
    assert "keys-first-attempts-retries-and-callers" in anchors(REPO / "docs" / "proxy.md")
    assert "the-controls-once" in anchors(REPO / "detector" / "runbook.md")
