"""``reproduce whatif`` through its command on the simulator: the composition block's ordering
on the pulse, a headroom search that resumes from the points already in DIR, and usage errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from foundation.rundir import read_summary
from reproduce.cli import reproduce
from reproduce.whatif import CRITERIA, POLICIES, POLICY_SOURCES, Point, WhatIfError, parse_policies

from .test_runner import SMALL

# The small engine of the runner's tests, ten times faster than the study: a what-if of four
# policies runs in a few seconds. Seed 21 tunes nothing.
OPTIONS = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
BASE = ["whatif", "--time-scale", "10", "--seed", "21", "--no-progress", "--jobs", "2", *OPTIONS]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(reproduce, [*BASE, *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def composition(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whatif")
    result = invoke("--policies", "none,budget,coalescing,lookup-first", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_the_pulse_reproduces_the_composition_blocks_ordering(composition: Path) -> None:
    body = json.loads((composition / "whatif.json").read_text())
    at = {p: body["policies"][p]["at_load"] for p in body["policies"]}
    pulse = {p: at[p]["pulse"] for p in at}
    # coalescing and lookup-first deliver (nearly) every pulse call, and never loop
    for p in ("coalescing", "lookup-first"):
        assert pulse[p]["failed"] <= 0.02 * pulse[p]["calls"], pulse[p]
        assert at[p]["recovered"] == 1 and at[p]["loops"] == 0
        assert at[p]["executions_per_call"] < 1.1
    # the budget restores service and leaves pulse calls undelivered
    assert at["budget"]["recovered"] == 1
    assert pulse["budget"]["failed"] > 0.3 * pulse["budget"]["calls"]
    assert at["budget"]["executions_per_call"] < 1.1
    # no control does not recover: the loop forms and holds, executions far above calls
    assert at["none"]["recovered"] == 0 and at["none"]["loops"] == 1
    assert at["none"]["executions_per_call"] > 2.0
    assert "VLLMMetastableRetryLoop" in at["none"]["alerts"]
    assert "VLLMMetastableRetryLoop" not in at["coalescing"].get("alerts", {})
    for p in at:  # every call is counted once
        assert at[p]["within_deadline"] + at[p]["late"] + at[p]["failed"] == at[p]["calls"] > 0
    report = (composition / "report.md").read_text()
    assert "| lookup-first |" in report and "<section>" in (composition / "report.html").read_text()


def test_headroom_brackets_the_loop_and_resumes_from_the_points_in_dir(composition: Path) -> None:
    before = {r["slug"] for r in read_summary(composition / "points")["runs"]}
    result = invoke(
        "--policies", "none", "--headroom", "--headroom-range", "1:2.7", "--precision", "0.5",
        "--out", str(composition),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    head = json.loads((composition / "whatif.json").read_text())["policies"]["none"]["headroom"]
    tried = {t["load"]: t["safe"] for t in head["tried"]}
    # the pulse's own load (2.7, already run: reused) loops; the search brackets the headroom
    assert tried[2.7] is False and head["kind"] == "bracketed"
    assert head["precision_reached"] <= 0.5 and tried[head["headroom_load"]] is True
    assert all(safe == (load <= head["headroom_load"]) for load, safe in tried.items())
    after = [r["slug"] for r in read_summary(composition / "points")["runs"]]
    assert before <= set(after) and len(after) == len(set(after))
    assert len(after) - len(before) == len(tried) - 1  # 2.7 was not run again


def test_a_dir_of_other_settings_is_refused_and_bad_policies_named(composition: Path) -> None:
    result = CliRunner().invoke(
        reproduce, [*BASE[:-1], "--policies", "none", "--out", str(composition)], catch_exceptions=False
    )  # one backend option fewer: another engine
    assert result.exit_code == 2 and "differ in backend_options" in result.output
    with pytest.raises(WhatIfError, match="unknown policy 'nope'"):
        parse_policies("none,nope")
    assert parse_policies("none, budget,none") == ["none", "budget"]
    assert set(POLICIES) == set(POLICY_SOURCES)


def _point(collapses: int, loops: int) -> Point:
    return Point("none", 2.0, runs=1, calls=10, within_deadline=5, late=0, failed=5, executions=1.0,
                 collapses=collapses, loops=loops, loop_at_s=[None], loop_for_s=[0.0])  # fmt: skip


def test_the_headroom_criterion_says_what_makes_a_load_unsafe() -> None:
    """A sustained overload above Ĉ collapses without a loop: safe by the default criterion (no
    metastable collapse), unsafe by "collapse"; a loop is unsafe by both."""
    overload, loop, served = _point(collapses=1, loops=0), _point(collapses=1, loops=1), _point(0, 0)
    assert [overload.safe_under(c) for c in CRITERIA] == [True, False]
    assert [loop.safe_under(c) for c in CRITERIA] == [False, False]
    assert [served.safe_under(c) for c in CRITERIA] == [True, True]
    result = CliRunner().invoke(reproduce, ["whatif", "--headroom", "--unsafe-on", "sometimes"])
    assert result.exit_code == 2 and "--unsafe-on" in result.output
