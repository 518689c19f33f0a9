"""validation.json and validation.md, byte for byte, for a fixed set of runs: pulse runs that
recover or not, with and without their ground truth, a replayed trace, every alert's firings. The
golden files were written by the validation before it was split by job; a change to what
validation says must change them on purpose (``python -m tests.reproduce.judge.test_validate_golden``
rewrites them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from foundation.groundtruth import Collapse, Window
from reproduce.judge import validate

GOLDEN = Path(__file__).parent.parent / "golden"


def results(ns: Any) -> list[Any]:
    """The runs, built from ``ns``'s ``RunInfo``, ``RunResult`` and ``Firing``
    (``reproduce.judge.validate``)."""

    def info(run: int, **kw: Any) -> Any:
        base: dict[str, Any] = {
            "block": "paper" if run < 5 else "engine-cap",
            "condition": "no-control" if run % 2 else "coalescing",
            "model": "qwen2.5-7b-h100",
            "run": run,
            "recovered": False,
            "recovery_time_s": None,
            "pulse_start_s": 120.0,
            "pulse_end_s": 227.0,
            "duration_s": 1500.0,
            "deadline_s": 120.0,
            "capacity": 2.78,
            "series": Path("unused"),
            "shed_or_attached": run % 2 == 0,
            "hold_creation_x_capacity": 0.85 + 0.1 * run,
            "hold_end_s": 947.0,
        }
        return ns.RunInfo(**{**base, **kw})

    def windows(*shares: float) -> list[Window]:
        return [
            Window(227 + 60 * i, 287 + 60 * i, 100, s, 1.0 + i, 0.001, s >= 0.98, i % 2 == 0)
            for i, s in enumerate(shares)
        ]

    loop, backlog, symptom, orphans = (
        "VLLMMetastableRetryLoop",
        "VLLMBacklogBeyondDeadline",
        "VLLMCallsNotDeliveredInTime",
        "VLLMOrphanedExecutions",
    )
    F = ns.Firing
    return [
        ns.RunResult(
            info(1),
            [F(backlog, 200.0, None), F(loop, 287.0, None), F(symptom, 250.0, None),
             F(orphans, 300.0, 700.0)],
            [Collapse(123.4, 947.0, False, True, 300.0, 647.0)],
            windows(0.2, 0.1, 0.99, 1.0),
        ),
        ns.RunResult(
            info(2, recovered=True, recovery_time_s=180.0),
            [F(backlog, 210.0, 300.0), F(loop, 250.0, 467.0, value=1.3), F(symptom, 260.0, 420.0)],
            [Collapse(125.0, 347.0, True, False, None, 0.0)],
            windows(0.5, 0.99, 1.0, 1.0),
        ),
        ns.RunResult(info(3), [F(loop, 427.0, None)], None, None),
        ns.RunResult(
            info(4, recovered=True, recovery_time_s=120.0),
            [F(loop, 60.0, 80.0), F(loop, 900.0, 950.0), F(symptom, 30.0, 50.0)],
            [],
            windows(1.0, 1.0),
        ),
        ns.RunResult(
            info(5, recovered=False),
            [F(symptom, 400.0, None), F(orphans, 500.0, None)],
            [Collapse(200.0, 947.0, False, None, None, None)],
            windows(0.99, 0.99, 0.99),
        ),
        ns.RunResult(
            info(6, recovered=True, recovery_time_s=200.0, trace=True, pulse_start_s=40.0, pulse_end_s=100.0,
                 hold_end_s=None, duration_s=700.0),
            [F(symptom, 150.0, 500.0), F(loop, 260.0, 400.0, value=1.1)],
            [Collapse(90.0, 240.0, True, True, 180.0, 30.0, (40.0, 100.0)),
             Collapse(500.0, 560.0, True, False, None, 0.0, (430.0, 490.0))],
            windows(0.5, 1.0),
        ),
    ]  # fmt: skip


def outputs(ns: Any) -> tuple[str, str]:
    report = ns.build_report(results(ns), [a.name for a in ns.ALERTS])
    return json.dumps(report, indent=2) + "\n", ns.render_markdown(report)


def test_validation_json_and_md_are_byte_identical_to_the_golden_files() -> None:
    text, md = outputs(validate)
    assert text == (GOLDEN / "validation.json").read_text(encoding="utf-8")
    assert md == (GOLDEN / "validation.md").read_text(encoding="utf-8")


if __name__ == "__main__":  # rewrite the golden files (on purpose)
    text, md = outputs(validate)
    (GOLDEN / "validation.json").write_text(text, encoding="utf-8")
    (GOLDEN / "validation.md").write_text(md, encoding="utf-8")
    sys.exit(0)
