"""The runbook's PromQL on vLLM's series against the release facts (``foundation/vllmreleases.py``):
every vLLM name it reads is one some release serves; beside a name an older release serves under
another, that name too; and each query reaches vLLM's series on every release family that serves
what it reads, under whatever name (its alternatives followed as the rules' are,
``detector.needs``). The runbook is written by hand: this keeps its examples to the one fact."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detector.needs import Selector, expression_needs
from foundation import metricnames as mn
from foundation.vllmreleases import (
    FAMILIES,
    SAMPLE_ALIASES,
    WAITING_DEFERRED,
    WAITING_FOR_CAPACITY,
    ReleaseFamily,
)

RUNBOOK = Path(__file__).resolve().parents[2] / "detector" / "runbook.md"
_VLLM = re.compile(r"vllm:[a-z0-9_:]+")
_SERVED = frozenset(n for f in FAMILIES for s in f.served() for n in s.sample_names())


def _blocks() -> list[str]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return [b for b in re.findall(r"^```promql\n(.*?)^```", text, re.M | re.S) if _VLLM.search(b)]


def _queries(block: str) -> list[str]:
    """A block's expressions: each starts at a line's first column and goes on over indented lines;
    a blank or comment line ends it (as ``tests/deploy/test_operator_docs.py`` reads them)."""
    out: list[list[str]] = []
    current: list[str] | None = None
    for line in block.splitlines():
        code = line.split("  #", 1)[0].rstrip()  # a trailing comment
        if not code.strip() or code.lstrip().startswith("#"):
            current = None
        elif current is None or not code[0].isspace():
            current = [code]
            out.append(current)
        else:
            current.append(code)
    return ["\n".join(q) for q in out if _VLLM.search("\n".join(q))]


def _quantity(sample: str) -> str:
    """The canonical series a served sample name stands for; the waiting queue's split for the
    queue (its capacity part is read where the whole is not)."""
    canonical = SAMPLE_ALIASES.get(sample, sample)
    base = re.sub(r"_(bucket|count|sum)$", "", canonical)
    if base == mn.VLLM_NUM_WAITING_BY_REASON:
        return mn.VLLM_NUM_WAITING
    return base if base in FAMILIES[-1].series else canonical


def _served_by(family: ReleaseFamily) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for s in family.served():
        for name in s.sample_names():
            out[name] = [{}]
    if family.series[mn.VLLM_NUM_WAITING_BY_REASON] is not None:
        out[mn.VLLM_NUM_WAITING_BY_REASON] = [{"reason": WAITING_FOR_CAPACITY}, {"reason": WAITING_DEFERRED}]
    return out


def test_the_runbook_reads_vllm_series_at_all() -> None:
    assert len(_blocks()) >= 4


@pytest.mark.parametrize("block", _blocks(), ids=lambda b: b.splitlines()[0][:50])
def test_every_vllm_name_is_served_and_its_older_names_stand_beside_it(block: str) -> None:
    names = set(_VLLM.findall(block))
    assert names <= _SERVED, f"names no vLLM release serves: {sorted(names - _SERVED)}"
    for name in names:
        canonical = SAMPLE_ALIASES.get(name, name)
        older = {alias for alias, of in SAMPLE_ALIASES.items() if of == canonical}
        assert older <= names, f"{canonical} without the names older releases serve it under: {older - names}"
    for query in _queries(block):
        if re.search(r"sum by \(instance\) \(vllm:num_requests_waiting\{", query):
            assert f'reason="{WAITING_FOR_CAPACITY}"' in query, (
                f"the whole queue, deferred requests in it: {query}"
            )


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_query_reaches_the_series_a_family_serves(family: ReleaseFamily) -> None:
    served = _served_by(family)
    for block in _blocks():
        for query in _queries(block):
            text = re.sub(r'instance="\$i",?', "", query)
            quantities = {_quantity(n) for n in _VLLM.findall(text)}
            expected = all(family.series[q] is not None for q in quantities)
            reached = any(
                all(
                    not sel.name.startswith("vllm:")
                    or any(sel.matches(sel.name, lb) for lb in served.get(sel.name, ()))
                    for sel in map(Selector.parse, alternative)
                )
                for alternative in expression_needs(text)
            )
            assert reached == expected, (family.name, query)
