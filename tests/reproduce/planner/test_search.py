"""The headroom search's rules on verdicts given by a threshold (pure: no load is run): a cold
search probes what the bisection always probed; a warm one, from any start, ends on the same
answer whenever more load never makes a policy safe, in two loads when the start was right; and
every load probed is a node of the search's grid."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from reproduce.planner.daily import HEADROOM_RANGE as DAILY_RANGE
from reproduce.planner.whatif import HEADROOM_RANGE, PRECISION, Grid, HeadroomSearch


def run(search: HeadroomSearch, threshold: float, precision: float) -> list[float]:
    """Drives ``search`` with loads up to ``threshold`` safe; the loads it probed, in order."""
    probed = []
    while (load := search.next_load(precision)) is not None:
        probed.append(load)
        search.add(load, load <= threshold)
        assert len(probed) < 100, probed
    return probed


def bisection(lo: float, hi: float, threshold: float, precision: float) -> list[float]:
    """The search as it was before it had a grid: the upper limit, the lower, then rounded
    midpoints until the bracket is no wider than the precision."""
    probed = [hi]
    if hi <= threshold:
        return probed
    probed.append(lo)
    if lo > threshold:
        return probed
    safe, unsafe = lo, hi
    while unsafe - safe > precision + 1e-9:
        mid = round((safe + unsafe) / 2, 4)
        probed.append(mid)
        safe, unsafe = (mid, unsafe) if mid <= threshold else (safe, mid)
    return probed


RANGES = [(*DAILY_RANGE, PRECISION), (*HEADROOM_RANGE, PRECISION), (1.0, 3.0, 0.2), (0.25, 4.0, 0.5)]


@pytest.mark.parametrize(("lo", "hi", "precision"), RANGES)
def test_a_cold_search_probes_what_the_bisection_always_did(lo: float, hi: float, precision: float) -> None:
    grid = Grid.of(lo, hi, precision)
    thresholds = [grid.load(k) for k in range(grid.top + 1)] + [lo / 2, hi * 2]
    for threshold in thresholds:
        cold = HeadroomSearch(grid)
        assert run(cold, threshold, precision) == bisection(lo, hi, threshold, precision), threshold
        assert cold.result(precision)["start"] == {"kind": "cold"}


@pytest.mark.parametrize(("lo", "hi", "precision"), RANGES)
def test_a_warm_search_gives_the_cold_answer_from_any_start(lo: float, hi: float, precision: float) -> None:
    grid = Grid.of(lo, hi, precision)
    nodes = [grid.load(k) for k in range(grid.top + 1)]
    assert nodes == sorted(nodes) and len(set(nodes)) == len(nodes)
    assert max(b - a for a, b in itertools.pairwise(nodes)) <= precision + 1e-4
    rng = random.Random(5)
    for t in [-1, *range(grid.top + 1)]:  # node t the last safe one (-1: none)
        threshold = nodes[t] if t >= 0 else lo / 2
        cold = HeadroomSearch(grid)
        cold_probes = run(cold, threshold, precision)
        answer = cold.result(precision)
        starts = {nodes[t] if t >= 0 else 0.0, lo, hi, 0.0, 10 * hi, rng.uniform(lo, hi), threshold + 0.01}
        for start in starts:
            warm = HeadroomSearch(grid, start=start)
            probes = run(warm, threshold, precision)
            got = warm.result(precision)
            assert set(probes) <= set(nodes), (start, probes)
            for key in ("headroom_load", "kind", "precision_reached"):
                assert got[key] == answer[key], (threshold, start, key)
            assert got["start"] == {"kind": "warm", "from": start, "load": nodes[grid.nearest(start)]}
            assert probes[0] == nodes[grid.nearest(start)]
        # started at yesterday's answer (unchanged): that load and the next node, or one at a limit;
        # a cold search runs both limits and the whole bisection
        if t >= 0:
            warm = HeadroomSearch(grid, start=nodes[t])
            assert len(run(warm, threshold, precision)) == (1 if t == grid.top else 2)
            assert len(cold_probes) == (1 if t == grid.top else 2 + grid.depth)


def test_a_warm_search_gallops_two_nodes_a_step_then_bisects() -> None:
    """A start ten nodes below the answer: 1, 2, 4, 8, 16 nodes up (the last unsafe), then the
    bisection of the eight nodes left: fewer loads than a cold search's nine."""
    grid = Grid.of(*DAILY_RANGE, PRECISION)
    assert grid.top == 128
    threshold = grid.load(50)
    probes = run(HeadroomSearch(grid, start=grid.load(40)), threshold, PRECISION)
    assert probes[:6] == [grid.load(k) for k in (40, 41, 42, 44, 48, 56)]
    assert len(probes) == 6 + 3 and math.isclose(max(p for p in probes if p <= threshold), threshold)
    assert len(run(HeadroomSearch(grid), threshold, PRECISION)) == 9


def test_loads_already_run_off_the_grid_still_narrow_the_bracket() -> None:
    grid = Grid.of(1.0, 3.0, 0.2)
    search = HeadroomSearch(grid)
    search.add(2.05, True)  # a what-if's own load, off the grid, safe
    search.add(2.1, False)  # and one just above it, unsafe: the bracket is narrower than the precision
    assert search.next_load(0.2) is None
    assert search.result(0.2)["headroom_load"] == 2.05 and search.result(0.2)["precision_reached"] == 0.05
