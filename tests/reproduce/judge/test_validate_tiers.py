"""``retrywatch reproduce validate``: each tier's pages (its critical alerts) scored side by side,
and held to the reference tier's, over every run and per block."""

from __future__ import annotations

import dataclasses

from detector.thresholds import ALERTS, CALLS_NOT_DELIVERED_IN_TIME, RETRY_LOOP, TIERS, AlertRule
from reproduce.judge.groundtruth import Collapse
from reproduce.judge.validate import Firing, RunResult, build_report, render_markdown, tier_pages
from tests.reproduce.judge.test_validate import _info

FULL = RETRY_LOOP.name
# A page of the other tier, as the vLLM-only tier declares its own: same kind, same severity.
OWN = dataclasses.replace(RETRY_LOOP, name="VLLMLoopFromEngineSeries", tier=TIERS[0])
OWN_WARNING = dataclasses.replace(OWN, name="VLLMEngineQueueEarly", severity="warning")
OWN_SYMPTOM = dataclasses.replace(CALLS_NOT_DELIVERED_IN_TIME, name="VLLMEngineLate", tier=TIERS[0])
RULES: tuple[AlertRule, ...] = (*ALERTS, OWN, OWN_WARNING, OWN_SYMPTOM)
NAMES = [FULL, OWN.name, OWN_WARNING.name, CALLS_NOT_DELIVERED_IN_TIME.name, OWN_SYMPTOM.name]
SLUG = "paper__no-control__qwen2.5-7b-h100__r{}"


def _collapse(start: float, end: float, *, ended: bool) -> Collapse:
    return Collapse(start_s=start, end_s=end, ended=ended, metastable=True, metastable_at_s=start + 60.0)


def _block(result: RunResult, block: str) -> RunResult:
    return dataclasses.replace(result, info=dataclasses.replace(result.info, block=block))


def _results() -> list[RunResult]:
    # the pulse runs 120–227 s; runs 1-3 never recover (a metastable collapse from 200 s on)
    to_end = [_collapse(200.0, 947.0, ended=False)]
    return [
        # both tiers fire: the engine's series 20 s after the full alert; two of its pages overlap
        RunResult(
            _info(1, recovered=False),
            [
                Firing(FULL, 287.0, None),
                Firing(OWN.name, 307.0, 500.0),
                Firing(OWN.name, 450.0, None),
                Firing(OWN_SYMPTOM.name, 420.0, None),
            ],
            to_end,
        ),
        # the full alert alone: the engine's series miss it
        RunResult(_info(2, recovered=False), [Firing(FULL, 300.0, None)], to_end),
        # the engine's series alone (a late warning does not count as a page)
        RunResult(
            _info(3, recovered=False),
            [Firing(OWN.name, 280.0, None), Firing(OWN_WARNING.name, 200.0, None)],
            to_end,
        ),
        # recovered at 407 s; the engine's page fires inside its collapse (no false positive, but a
        # firing in a run that recovers), and again after the recovery (a false positive)
        RunResult(
            _info(4, recovered=True, recovery_time_s=180.0),
            [Firing(OWN.name, 250.0, 300.0), Firing(OWN.name, 900.0, 950.0)],
            [_collapse(200.0, 380.0, ended=True)],
        ),
        _block(RunResult(_info(5, recovered=False), [Firing(FULL, 290.0, None)], to_end), "engine-cap"),
    ]


def test_each_tier_has_its_critical_alerts_of_each_kind_as_pages() -> None:
    pages = tier_pages(RULES, NAMES)
    assert list(pages) == list(TIERS)
    assert pages[TIERS[0]] == {"cause": [OWN.name], "symptom": [OWN_SYMPTOM.name]}
    assert pages[TIERS[-1]] == {"cause": [FULL], "symptom": [CALLS_NOT_DELIVERED_IN_TIME.name]}
    # an alert not validated is no page
    assert tier_pages(RULES, [FULL])[TIERS[0]] == {"cause": [], "symptom": []}


def test_the_tiers_are_scored_side_by_side_and_held_to_the_reference() -> None:
    report = build_report(_results(), NAMES, rules=RULES)
    tiers = report["tiers"]
    assert tiers["reference"] == TIERS[-1]
    own, full = tiers["tiers"][TIERS[0]], tiers["tiers"][TIERS[-1]]
    assert full["against_reference"] is None
    assert full["cause"]["recall"] == 0.75  # runs 1, 2, 5 of 4
    assert full["cause"]["missed_runs"] == [SLUG.format(3)]
    assert full["cause"]["fired_in_recovered_runs"] == []
    cause = own["cause"]
    assert cause["alerts"] == [OWN.name]
    assert cause["recall"] == 0.5  # runs 1 and 3
    assert cause["recall_metastable"] == 0.6  # runs 1, 3, 4 of the five metastable collapses
    assert cause["missed_runs"] == [SLUG.format(2), "engine-cap__no-control__qwen2.5-7b-h100__r5"]
    assert cause["fired_in_recovered_runs"] == [SLUG.format(4)]
    assert (cause["false_positive_runs"], cause["false_positive_firings"]) == (1, 1)  # the 900-s one
    assert cause["lead_time_s"] == {"median": 66.5, "max": 80.0}  # 307 and 280 s, after 227 s
    ref = own["against_reference"]
    assert ref["silent_where_reference_fired"] == [
        SLUG.format(2),
        "engine-cap__no-control__qwen2.5-7b-h100__r5",
    ]
    assert ref["fired_where_reference_silent"] == [SLUG.format(3), SLUG.format(4)]
    assert ref["after_reference_s"] == {"median": 20.0, "max": 20.0}
    assert own["symptom"]["alerts"] == [OWN_SYMPTOM.name]
    assert own["symptom"]["recall"] == 0.2  # one collapse of five
    # per block: the same figures over the block's runs
    cap = report["by_block"]["engine-cap"]["tiers"]["tiers"]
    assert cap[TIERS[0]]["cause"]["recall"] == 0.0
    assert cap[TIERS[-1]]["cause"]["recall"] == 1.0
    assert report["alerts"][OWN.name]["tier"] == TIERS[0]


def test_overlapping_pages_of_a_tier_count_as_one_firing() -> None:
    run = RunResult(
        _info(6, recovered=True, recovery_time_s=100.0),
        [Firing(OWN.name, 30.0, 60.0), Firing(OWN.name, 50.0, 90.0), Firing(OWN.name, 90.0, 95.0)],
        [],
    )
    cause = build_report([run], NAMES, rules=RULES)["tiers"]["tiers"][TIERS[0]]["cause"]
    assert (cause["false_positive_runs"], cause["false_positive_firings"]) == (1, 1)


def test_a_tier_without_pages_says_so() -> None:
    report = build_report(_results(), [FULL], rules=RULES)
    own = report["tiers"]["tiers"][TIERS[0]]
    assert own == {"cause": None, "symptom": None, "against_reference": None}
    text = render_markdown(report)
    assert f"| all runs | {TIERS[0]} | no critical cause alert |" in text


def test_the_markdown_shows_the_tiers_side_by_side_and_names_the_runs_they_part_on() -> None:
    text = render_markdown(build_report(_results(), NAMES, rules=RULES))
    section = text.split("## By tier", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in section.splitlines() if line.startswith("| all runs") or line.startswith("| paper")
    ]
    assert [row.split(" | ")[1] for row in rows] == [*TIERS, *TIERS]
    assert f"| all runs | {TIERS[0]} | 0.5 of 4 | 0.6 of 5 | 1 | 1 of 1 | 66.5 / 80 |" in section
    assert f"| engine-cap | {TIERS[0]} | 0 of 1 |" in section
    assert f"- {TIERS[0]}, silent where {TIERS[-1]} fired: {SLUG.format(2)}" in section
    assert f"- {TIERS[0]}, fired in a run that recovered: {SLUG.format(4)}" in section
    assert f"- {TIERS[0]}, cause: {OWN.name}" in section
    assert "**missed runs**" in section  # the legend
    assert f"| condition | runs not recovered | runs recovered | {' | '.join(TIERS)} |" in section
    # by condition: the full alert fired 60, 73 and 63 s after the pulse's end
    assert "| no-control | 4 | 1 | 0.5 · 1 · 66.5 / 80 | 0.75 · 0 · 63 / 73 |" in section
