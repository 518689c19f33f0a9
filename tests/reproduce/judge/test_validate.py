"""``retrywatch reproduce validate DIR``: scoring of the alerts, by kind, against run outcomes and
the ground truth over time."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from detector.thresholds import ALERTS_BY_NAME, AlertRule
from foundation import metricnames as mn
from foundation.rundir import RunDirError
from foundation.timeseries import Snapshot, write_series
from reproduce.judge.groundtruth import Collapse, Window
from reproduce.judge.validate import (
    BACKLOG,
    RETRY_LOOP,
    SILENCE,
    Firing,
    RunInfo,
    RunResult,
    build_report,
    check_targets,
    load_runs,
    loop_formed_at_s,
    render_markdown,
    validate,
    validate_dir,
)
from rules import unittests


def _info(
    run: int, *, recovered: bool, recovery_time_s: float | None = None, controlled: bool = False
) -> RunInfo:
    return RunInfo(
        block="paper",
        condition="no-control",
        model="qwen2.5-7b-h100",
        run=run,
        recovered=recovered,
        recovery_time_s=recovery_time_s,
        pulse_start_s=120.0,
        pulse_end_s=227.0,
        duration_s=1800.0,
        deadline_s=120.0,
        capacity=2.78,
        series=Path("unused"),
        shed_or_attached=controlled,
        hold_creation_x_capacity=0.85,
        hold_end_s=947.0,
    )


def _results() -> list[RunResult]:
    return [
        # collapsed: warned during the pulse, loop 60 s after its end
        RunResult(_info(1, recovered=False), [Firing(BACKLOG, 200.0, None), Firing(RETRY_LOOP, 287.0, None)]),
        # collapsed: loop 200 s after the pulse (late), no early warning
        RunResult(_info(2, recovered=False), [Firing(RETRY_LOOP, 427.0, None)]),
        # collapsed: never detected
        RunResult(_info(3, recovered=False), []),
        # recovered 180 s after the pulse (at 407 s): loop fired during the drain, resolved at 467
        RunResult(
            _info(4, recovered=True, recovery_time_s=180.0),
            [Firing(BACKLOG, 210.0, 300.0), Firing(RETRY_LOOP, 250.0, 467.0, value=1.3)],
        ),
        # recovered, but the loop alert fires before the pulse and after recovery: false positive
        RunResult(
            _info(5, recovered=True, recovery_time_s=120.0, controlled=True),
            [Firing(RETRY_LOOP, 60.0, 80.0), Firing(RETRY_LOOP, 900.0, 950.0)],
        ),
        # recovered quietly
        RunResult(_info(6, recovered=True, recovery_time_s=100.0), []),
    ]


def test_scores_recall_false_positives_lead_and_resolve_times() -> None:
    report = build_report(_results(), [RETRY_LOOP, BACKLOG])
    loop = report["alerts"][RETRY_LOOP]
    assert loop["recall"] == pytest.approx(2 / 3, abs=1e-4)
    assert (loop["runs_not_recovered"], loop["runs_recovered"]) == (3, 3)
    assert loop["false_positive_runs"] == 1
    assert loop["lead_time_s"] == {"median": 130.0, "max": 200.0}  # 60 and 200 s after the pulse
    assert loop["resolve_after_recovery_s"] == {"median": 60.0, "max": 60.0}  # 467 - 407
    backlog = report["alerts"][BACKLOG]
    assert backlog["recall"] == pytest.approx(1 / 3, abs=1e-4)
    assert backlog["lead_time_s"] == {"median": -27.0, "max": -27.0}  # before the pulse's end
    assert backlog["false_positive_runs"] == 0


def test_a_late_firing_is_put_beside_when_the_loop_formed(tmp_path: Path) -> None:
    # A 2 Ĉ pulse (ending at 227 s) whose backlog sits at the deadline's edge: creation falls to
    # 0.8 Ĉ after it, the loop forms only at 330 s (creation 1.4 Ĉ), and the alert fires at 355 s.
    capacity, created, snaps = 2.78, 0.0, []
    for t in range(0, 600):
        created += capacity * (2.0 if t < 227 else 0.8 if t < 330 else 1.4)
        snaps.append(Snapshot(float(t), [(mn.EXECUTIONS_CREATED, {}, created)]))
    series = tmp_path / "metrics.jsonl"
    write_series(series, snaps)
    info = dataclasses.replace(_info(7, recovered=False), series=series)
    # Over 10 s, creation reaches Ĉ once 4 of its seconds run at 1.4 Ĉ (3 fall short).
    assert loop_formed_at_s(info, 355.0) == 333.0
    assert loop_formed_at_s(info, 300.0) is None  # still below Ĉ: not formed yet
    steady = dataclasses.replace(info, pulse_end_s=340.0)
    assert loop_formed_at_s(steady, 400.0) is None  # at or above Ĉ from the pulse's end on
    report = build_report([RunResult(info, [Firing(RETRY_LOOP, 355.0, None)])], [RETRY_LOOP])
    (late,) = report["targets"][RETRY_LOOP]["late_runs"]
    assert (late["lead_time_s"], late["loop_formed_s"]) == (128.0, 106.0)
    assert "the loop formed at +106 s" in render_markdown(report)


def test_targets_name_the_runs_that_break_them() -> None:
    targets = build_report(_results(), [RETRY_LOOP, BACKLOG])["targets"]
    loop = targets[RETRY_LOOP]
    slug = "paper__no-control__qwen2.5-7b-h100__r{}"
    assert [r["run"] for r in loop["missed_runs"]] == [slug.format(3)]
    assert [(r["run"], r["lead_time_s"]) for r in loop["late_runs"]] == [(slug.format(2), 200.0)]
    assert [r["run"] for r in loop["fired_before_pulse"]] == [slug.format(5)]
    assert [r["run"] for r in loop["fired_after_recovery"]] == [slug.format(5)]
    assert [r["run"] for r in loop["fired_in_shed_or_attached_runs"]] == [slug.format(5)]
    between = loop["fired_between_pulse_and_recovery"]
    assert [(b["run"], b["fired_at_s"], b["recovery_at_s"]) for b in between] == [
        (slug.format(4), 250.0, 407.0)
    ]
    assert between[0]["why"] == (
        "executions created at 1.30 Ĉ when it fired; 0.85 Ĉ over the hold (347–947 s): below Ĉ, so the "
        "backlog drained; condition no-control: retries neither shed nor attached"
    )
    assert loop["met"] is False
    backlog = targets[BACKLOG]
    assert [r["run"] for r in backlog["missed_before_pulse_end"]] == [slug.format(2), slug.format(3)]
    assert backlog["fired_in_recovering_runs_count"] == 1
    assert backlog["met"] is False


def test_no_runs_of_a_kind_gives_nulls_not_errors() -> None:
    report = build_report([RunResult(_info(6, recovered=True, recovery_time_s=100.0), [])], [RETRY_LOOP])
    loop = report["alerts"][RETRY_LOOP]
    assert loop["recall"] is None
    assert loop["lead_time_s"] == {"median": None, "max": None}
    assert "| VLLMMetastableRetryLoop | n/a | 0 | 0 | 1 | n/a / n/a |" in render_markdown(report)


# --- end to end on a hand-made reproduce output, through the real detector replay ----------


def _write_dir(out: Path) -> None:
    collapsed = unittests.SCENARIOS[0].cases[0]  # retry-loop signature from 300 s to 600 s
    healthy = unittests.Case("healthy", {}, onset_s=300, clear_s=600, value_at_fire=0, value_at_last=0)
    runs = []
    for i, (case, recovered) in enumerate([(collapsed, False), (healthy, True)], start=1):
        slug = f"paper__no-control__qwen2.5-7b-h100__r{i}"
        write_series(_mkdir(out / "runs" / slug) / "metrics.jsonl", unittests.case_snapshots(case))
        runs.append(
            {
                "block": "paper",
                "condition": "no-control",
                "model": "qwen2.5-7b-h100",
                "run": i,
                "seed": 100 + i,
                "capacity": 2.0,
                "pulse_multiple": 2.7,
                "recovered": recovered,
                "recovery_time_s": 60.0 if recovered else None,
                "retries": {"total": 10, "refused": 0, "attached": 0},
                "series": f"runs/{slug}/metrics.jsonl",
                "pulse": {"start_s": 250.0, "end_s": 320.0},
                "deadline_s": 120.0,
                "duration_s": 1000.0,
                "time_scale": 1.0,
            }
        )
    (out / "summary.json").write_text(json.dumps({"runs": runs}), encoding="utf-8")


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_validate_dir_replays_every_run_and_writes_json_and_markdown(tmp_path: Path) -> None:
    _write_dir(tmp_path)
    report = validate_dir(tmp_path)
    saved = json.loads((tmp_path / "validation.json").read_text(encoding="utf-8"))
    assert saved == json.loads(json.dumps(report))
    assert set(saved["alerts"]) == set(ALERTS_BY_NAME)
    for name, figures in saved["alerts"].items():
        assert figures["kind"] == ALERTS_BY_NAME[name].kind
        assert set(figures) >= {
            "recall", "runs_not_recovered", "false_positive_runs", "runs_recovered",
            "lead_time_s", "resolve_after_recovery_s",
        }  # fmt: skip
    fire_at = 300.0 + ALERTS_BY_NAME[RETRY_LOOP].for_s  # the scenario's onset plus `for`
    loop = saved["alerts"][RETRY_LOOP]
    assert loop["recall"] == 1.0
    assert loop["lead_time_s"]["median"] == fire_at - 320.0
    assert loop["false_positive_runs"] == 0
    first, second = saved["runs"]
    assert {k: first[k] for k in ("block", "condition", "model", "run", "recovered")} == {
        "block": "paper", "condition": "no-control", "model": "qwen2.5-7b-h100", "run": 1, "recovered": False,
    }  # fmt: skip
    fired = {a["alertname"]: a for a in first["alerts"]}
    assert fired[RETRY_LOOP]["fired_at_s"] == fire_at
    assert set(fired[RETRY_LOOP]) == {"alertname", "fired_at_s", "resolved_at_s"}
    # The hand-made series carry the proxy tier's series alone: no proxy-tier alert fires in the
    # healthy run, and the vLLM tier says it lacks vLLM's own series.
    # the healthy run carries the proxy's series and vLLM's, passed through as a real proxy does:
    # no alert of either tier fires, NoData included
    assert second["alerts"] == []
    md = (tmp_path / "validation.md").read_text(encoding="utf-8")
    assert md.startswith("# Alert validation")
    assert f"| {RETRY_LOOP} | 1 | 1 | 0 | 1 |" in md


def test_cli_writes_the_files_and_reports_bad_input(tmp_path: Path) -> None:
    _write_dir(tmp_path)
    result = CliRunner().invoke(validate, [str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "validation.json").is_file() and (tmp_path / "validation.md").is_file()
    empty = _mkdir(tmp_path / "empty")
    result = CliRunner().invoke(validate, [str(empty)])
    assert result.exit_code != 0
    assert "summary.json: not found" in result.output


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda run: run.pop("pulse"), "missing field 'pulse'"),
        (lambda run: run.update(recovered="yes"), "'recovered' must be true or false"),
        (lambda run: run.update(series="runs/nope/metrics.jsonl"), "not found"),
        (lambda run: run.update(recovery_time_s=None, recovered=True), "needs 'recovery_time_s'"),
        (lambda run: run["pulse"].update(end_s="late"), "expected a finite number"),
        (lambda run: run.update(duration_s=10**400), "expected a finite number"),
        (lambda run: run.update(run="first"), "'run' must be a whole number"),
        (lambda run: run.update(run=1.5), "'run' must be a whole number"),
        (lambda run: run.update(time_scale=0), "'time_scale' must be a finite number > 0"),
        (lambda run: run.update(time_scale=-2.0), "'time_scale' must be a finite number > 0"),
        (lambda run: run.update(plan={"detector": {"windows": {}}}), "recorded detector settings"),
        (lambda run: run.update(time_scale=10.0), "before runs recorded their detector settings"),
    ],
)
def test_bad_summary_gets_a_clear_error(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    _write_dir(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    mutate(summary["runs"][0])
    (tmp_path / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    with pytest.raises(RunDirError, match=message):
        load_runs(tmp_path)


def test_block_filter(tmp_path: Path) -> None:
    _write_dir(tmp_path)
    with pytest.raises(RunDirError, match="no run of block 'engine-cap'"):
        validate_dir(tmp_path, block="engine-cap")
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    summary["runs"][1]["block"] = "diagnostic"
    (tmp_path / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    assert [r["run"] for r in validate_dir(tmp_path, block="diagnostic")["runs"]] == [2]
    assert len(validate_dir(tmp_path, block="paper")["runs"]) == 2  # paper is every block


def test_summary_capacity_stands_in_when_the_series_exports_none(tmp_path: Path) -> None:
    """Without Ĉ in the series, the summary's capacity is used: with Ĉ = 2 and executions at 3/s
    the retry-loop condition holds from the first evaluation, not from the series' own 300 s."""
    _write_dir(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))
    series = tmp_path / summary["runs"][0]["series"]
    snaps = [
        type(s)(s.t, [x for x in s.samples if x[0] != "retrywatch_capacity_calls_per_second"])
        for s in unittests.case_snapshots(unittests.SCENARIOS[0].cases[0])
    ]
    write_series(series, snaps)
    report = validate_dir(tmp_path)
    loop = [a for a in report["runs"][0]["alerts"] if a["alertname"] == RETRY_LOOP]
    assert loop and loop[0]["fired_at_s"] < 300.0


def test_reachable_as_retrywatch_reproduce_validate(tmp_path: Path) -> None:
    from retrywatch.cli import main

    _write_dir(tmp_path)
    result = CliRunner().invoke(main, ["reproduce", "validate", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| VLLMMetastableRetryLoop | 1 |" in result.output


def test_a_directory_without_summary_json_is_a_usage_mistake_and_nothing_is_written(tmp_path: Path) -> None:
    from retrywatch.cli import main

    empty = _mkdir(tmp_path / "empty")
    result = CliRunner().invoke(main, ["reproduce", "validate", str(empty)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert (
        len(errors) == 1 and "Invalid value for 'DIR'" in errors[0] and "summary.json: not found" in errors[0]
    )
    assert "Traceback" not in result.output and list(empty.iterdir()) == []


# --- scoring by kind against the ground truth over time -------------------------------------

SYMPTOM = "SyntheticCallsNotDeliveredInTime"
DATA = "SyntheticNoData"
KINDS = {RETRY_LOOP: "cause", BACKLOG: "cause", SYMPTOM: "symptom", DATA: "data"}


def _symptom_rule() -> AlertRule:
    """A symptom alert as another module may define one: scored by its kind alone."""
    return dataclasses.replace(ALERTS_BY_NAME[RETRY_LOOP], name=SYMPTOM, kind="symptom")


def test_a_symptom_alert_is_scored_against_every_collapse() -> None:
    rule = _symptom_rule()
    kinds = {**KINDS, rule.name: rule.kind}
    results = [
        # never recovers: fires 150 s into the collapse and stays firing to the end
        RunResult(
            _info(1, recovered=False),
            [Firing(SYMPTOM, 270.0, None)],
            [Collapse(120.0, 947.0, ended=False, metastable=True, metastable_at_s=300.0)],
        ),
        # recovers at 407 (collapse 125–287): fires at 250, gaps 300–310 (past the end: held),
        # resolves 40 s after the collapse ended; then a firing outside any collapse at 700
        RunResult(
            _info(2, recovered=True, recovery_time_s=180.0),
            [Firing(SYMPTOM, 250.0, 300.0), Firing(SYMPTOM, 310.0, 327.0), Firing(SYMPTOM, 700.0, 720.0)],
            [Collapse(125.0, 287.0, ended=True, metastable=False)],
        ),
        # a short collapse named one deadline late (inside its tail), with a gap inside it
        RunResult(
            _info(3, recovered=True, recovery_time_s=120.0),
            [Firing(SYMPTOM, 200.0, 210.0), Firing(SYMPTOM, 220.0, 260.0)],
            [Collapse(150.0, 227.0, ended=True, metastable=False)],
        ),
        # missed
        RunResult(_info(4, recovered=True, recovery_time_s=120.0), [], [Collapse(130.0, 227.0, ended=True)]),
        # no call records: not judged
        RunResult(_info(5, recovered=True, recovery_time_s=120.0), [Firing(SYMPTOM, 10.0, 20.0)], None),
    ]
    report = build_report(results, [SYMPTOM], kinds)
    s = report["alerts"][SYMPTOM]
    assert s["kind"] == "symptom"
    assert (s["collapses"], s["collapses_detected"], s["recall"]) == (4, 3, 0.75)
    assert s["held_to_collapse_end"] == 2  # run 3 has a gap inside its collapse
    assert (s["false_positive_runs"], s["false_positive_firings"]) == (1, 1)
    assert s["lead_time_s"] == {"median": 125.0, "max": 150.0}  # 150, 125, 50
    assert s["resolve_after_collapse_s"] == {"median": 36.5, "max": 40.0}  # 40 and 33
    assert s["still_firing_after_collapse"] == 0
    md = render_markdown(report)
    assert "## Symptom alerts" in md
    assert f"| {SYMPTOM} | 0.75 | 4 | 2 of 3 | 1 | 1 | 125 / 150 | 36.5 / 40 | 0 |" in md
    assert "**recall over collapses**" in md


def test_a_symptom_alert_reaches_validation_json_through_the_replay(tmp_path: Path) -> None:
    """``validate_dir`` scores whatever alerts it is given by their kind; a run without call
    records has no collapses (null), and the symptom alert is not scored on it."""
    _write_dir(tmp_path)
    report = validate_dir(
        tmp_path,
        replayer=lambda info: [Firing(SYMPTOM, 400.0, None)] if not info.recovered else [],
        alertnames=[SYMPTOM],
        kinds={SYMPTOM: "symptom"},
    )
    assert [r["collapses"] for r in report["runs"]] == [None, None]
    assert report["alerts"][SYMPTOM]["recall"] is None and report["alerts"][SYMPTOM]["collapses"] == 0


def test_a_cause_alert_firing_outside_the_collapses_is_a_false_positive() -> None:
    collapse = Collapse(125.0, 287.0, ended=True, metastable=True, metastable_at_s=240.0)
    results = [
        RunResult(
            _info(1, recovered=True, recovery_time_s=180.0),
            [
                Firing(BACKLOG, 200.0, 260.0),  # the overload's own stretch
                Firing(RETRY_LOOP, 250.0, 300.0),  # inside the collapse, 10 s after it turned metastable
                Firing(RETRY_LOOP, 300.0, 320.0),  # after the collapse, before the recovery (407)
            ],
            [collapse],
        ),
        # no collapse at all: the overload's stretch is the pulse
        RunResult(
            _info(2, recovered=True, recovery_time_s=120.0),
            [Firing(BACKLOG, 200.0, 230.0), Firing(RETRY_LOOP, 240.0, 260.0)],
            [],
        ),
    ]
    # a collapse that ran to the end of the hold had not ended: a firing after the hold is no false
    # positive (the hold's last calls still time out and retry)
    results.append(
        RunResult(
            _info(3, recovered=False),
            [Firing(BACKLOG, 200.0, 300.0), Firing(BACKLOG, 1000.0, 1070.0)],
            [Collapse(125.0, 947.0, ended=False, metastable=True, metastable_at_s=280.0)],
        )
    )
    report = build_report(results, [RETRY_LOOP, BACKLOG], KINDS)
    loop, backlog = report["alerts"][RETRY_LOOP], report["alerts"][BACKLOG]
    assert (loop["false_positive_runs"], loop["false_positive_firings"]) == (2, 2)
    assert backlog["false_positive_runs"] == 0
    assert (loop["recall_metastable"], loop["runs_metastable"]) == (0.5, 2)
    assert loop["lead_after_metastable_s"] == {"median": 10.0, "max": 10.0}
    # without a ground truth over time, the recovery verdict decides, as it always did
    old = [RunResult(r.info, r.firings, None) for r in results]
    assert build_report(old, [RETRY_LOOP], KINDS)["alerts"][RETRY_LOOP]["false_positive_runs"] == 0


def test_a_data_alert_is_reported_not_scored() -> None:
    results = [RunResult(_info(1, recovered=False), [Firing(DATA, 10.0, 20.0), Firing(DATA, 30.0, None)], [])]
    report = build_report(results, [DATA], KINDS)
    data = report["alerts"][DATA]
    assert (data["kind"], data["recall"], data["runs_fired"], data["firings"]) == ("data", None, 1, 2)
    md = render_markdown(report)
    assert "| SyntheticNoData | 1 | 2 | 1 |" in md and "not scored for recall" in md
    # an episode still firing is said so, not drawn as a dash
    assert "SyntheticNoData 30–still firing at the end" in md


def test_every_table_has_its_legend_and_no_bare_dash(tmp_path: Path) -> None:
    _write_dir(tmp_path)
    md = render_markdown(validate_dir(tmp_path))
    for heading in (
        "## Ground truth",
        "## Cause alerts",
        "## Symptom alerts",
        "## Data alerts",
        "## By block",
    ):
        assert heading in md
    assert "negative: it resolved before the run recovered" in md
    assert "–|" not in md.replace(" ", "") and "| – |" not in md


def _window(start: float, delivered: float, waiting: float) -> Window:
    return Window(start, start + 60.0, 100, delivered, waiting, 0.0, delivered >= 0.98, waiting <= 2.0)


def test_no_collapse_is_silent_names_the_runs_left_without_a_critical_alert() -> None:
    symptom = "VLLMCallsNotDeliveredInTime"
    assert ALERTS_BY_NAME[symptom].severity == "critical"
    lasting = [Collapse(300.0, 947.0, ended=False)]
    results = [
        # paged within the target and still firing at the hold's end: the loop, then the symptom
        RunResult(
            _info(1, recovered=False),
            [Firing(RETRY_LOOP, 420.0, 700.0), Firing(symptom, 500.0, None)],
            lasting,
        ),
        # a warning alone is silence: nothing critical fired
        RunResult(
            _info(2, recovered=False), [Firing(BACKLOG, 200.0, None)], lasting, [_window(827.0, 0.4, 80.0)]
        ),
        # the symptom resolved before the end, its last windows answered in time again
        RunResult(
            _info(3, recovered=False),
            [Firing(symptom, 520.0, 930.0)],
            lasting,
            [_window(767.0, 0.99, 54.0), _window(827.0, 1.0, 5.8), _window(887.0, 1.0, 0.2)],
        ),
        # paged, but 400 s after the collapse began: later than the target
        RunResult(_info(4, recovered=False), [Firing(symptom, 700.0, None)], lasting),
        # a collapse that ended is not this target's business
        RunResult(_info(5, recovered=True, recovery_time_s=200.0), [], [Collapse(300.0, 420.0, ended=True)]),
    ]
    silence = check_targets(results)[SILENCE]
    assert not silence["met"] and silence["runs_collapsed_to_the_end"] == 4
    silent = {r["run"]: r["why"] for r in silence["silent_at_the_end"]}
    assert set(silent) == {results[1].info.slug, results[2].info.slug}
    assert "only the queue part of the recovery rule" in silent[results[2].info.slug]
    assert "only the queue part" not in silent[results[1].info.slug]
    assert [r["run"] for r in silence["late_first_firing"]] == [results[3].info.slug]
    assert silence["first_critical_after_collapse_s"] == {"median": 220.0, "max": 400.0}  # 120, 220, 400
    text = render_markdown(build_report(results, [RETRY_LOOP, BACKLOG, symptom]))
    assert "No collapse is silent: NOT met" in text and results[2].info.slug in text
