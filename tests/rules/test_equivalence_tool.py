"""``python -m rules.equivalence DIR``: pairing of episodes, and the command on a small output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from foundation.timeseries import write_series
from rules import unittests
from rules.equivalence import disagreements, main


def test_episodes_within_the_tolerance_agree() -> None:
    py = [("A", 100.0, 200.0), ("B", 50.0, None)]
    pr = [("B", 55.0, None), ("A", 95.0, 205.0)]
    assert disagreements(sorted(py), sorted(pr), tolerance_s=5.0) == []


@pytest.mark.parametrize(
    ("python", "prometheus", "what"),
    [
        ([("A", 100.0, 200.0)], [("A", 110.0, 200.0)], "A: python"),  # fired 10 s apart
        ([("A", 100.0, 200.0)], [("A", 100.0, None)], "A: python"),  # resolved in one only
        ([("A", 100.0, 200.0)], [], "A: python"),  # missing in one
        ([("A", 1.0, 2.0), ("A", 9.0, 10.0)], [("A", 1.0, 2.0)], "A: python"),  # an extra episode
    ],
)
def test_disagreements_are_named(python: list, prometheus: list, what: str) -> None:
    problems = disagreements(python, prometheus, tolerance_s=5.0)
    assert len(problems) == 1 and problems[0].startswith(what)


@pytest.mark.promtool
def test_the_command_compares_every_run_of_a_reproduce_output(tmp_path: Path, promtool: str) -> None:
    case = unittests.SCENARIOS[1].cases[0]
    slug = "diagnostic__retries-on-cancel-on__qwen2.5-7b-h100__r0"
    series = tmp_path / "runs" / slug / "metrics.jsonl"
    series.parent.mkdir(parents=True)
    write_series(series, unittests.case_snapshots(case, end_s=700))
    run = {"block": "diagnostic", "series": f"runs/{slug}/metrics.jsonl"}
    (tmp_path / "summary.json").write_text(json.dumps({"runs": [run]}), encoding="utf-8")
    result = CliRunner().invoke(main, [str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "1/1 runs agree within 5 s" in result.output
