"""The generated rules file and promtool tests match the detector's one definition of every alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from detector.thresholds import ALERTS, PROMETHEUS_ALERTS, PrometheusAlert, alert_expr
from rules import generate, learned, unittests
from rules.backfill import parse_duration

REPO = Path(__file__).resolve().parents[2]


def _groups() -> list[dict]:
    return yaml.safe_load(generate.RULES_PATH.read_text(encoding="utf-8"))["groups"]


def _rules() -> list[dict]:
    return [rule for group in _groups() for rule in group["rules"]]


def test_a_group_per_tier_with_its_own_alerts_and_records() -> None:
    groups = {g["name"]: g["rules"] for g in _groups()}
    assert list(groups) == list(generate.GROUP_NAMES.values())
    for tier, name in generate.GROUP_NAMES.items():
        alerts = [r["alert"] for r in groups[name] if "alert" in r]
        assert alerts[: len([a for a in ALERTS if a.tier == tier])] == [
            a.name for a in ALERTS if a.tier == tier
        ]
    # vLLM's group reads vLLM's series and the two stated numbers, nothing else of the proxy's
    vllm_exprs = " ".join(r["expr"] for r in groups[generate.GROUP_NAMES["vllm"]])
    assert set(re.findall(r"(?<![:\w])retrywatch_[a-z_]+", vllm_exprs)) == {
        "retrywatch_capacity_calls_per_second",
        "retrywatch_client_deadline_seconds",
    }
    proxy_records = {r["record"] for r in groups[generate.GROUP_NAMES["proxy"]] if "record" in r}
    assert not any(record in vllm_exprs for record in proxy_records)
    assert generate.group_job(generate.GROUP_NAMES["vllm"]) == "vllm"


def test_every_signal_is_recorded_with_its_own_promql_and_only_rules_only_records_are_added() -> None:
    """One fact: the rules record each signal exactly as ``detector.signals`` declares it (nothing
    rewrites a spec after the fact); ``rules.learned`` adds records, never replaces one."""
    from detector.signals import HELPER_RECORDS, RULES_ONLY_RECORDS, SIGNALS

    recorded = {r["record"]: r["expr"] for r in _rules() if "record" in r}
    for spec in SIGNALS:
        assert recorded[spec.record] == spec.promql, spec.name
    declared = {s.record for s in SIGNALS} | {n for helpers in HELPER_RECORDS.values() for n, _ in helpers}
    added = {name for name, _ in learned.helper_records()} | {learned.source_record()[0]}
    assert set(recorded) == declared | added and not declared & added
    assert set(RULES_ONLY_RECORDS) <= added


def test_committed_files_are_what_the_definitions_generate() -> None:
    stale = generate.stale_files()
    assert stale == [], f"out of date, run `python -m rules.generate`: {[str(p) for p in stale]}"


def test_check_reports_a_drifted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drifted = tmp_path / "retrywatch.rules.yml"
    drifted.write_text(generate.render().replace("for: 2m", "for: 3m"), encoding="utf-8")
    monkeypatch.setattr(generate, "RULES_PATH", drifted)
    assert drifted in generate.stale_files()
    with pytest.raises(SystemExit) as exc:
        generate.run(["--check"])
    assert exc.value.code == 1


def test_the_file_parses_to_the_rule_documents() -> None:
    assert yaml.safe_load(generate.RULES_PATH.read_text(encoding="utf-8")) == generate.rule_documents()


# In the file's order: the vLLM tier's alerts, then the rules' own on its deadline
# (``rules.learned``), then the proxy tier's and those on Prometheus' own scrapes.
ALL_ALERT_NAMES = [
    *(a.name for a in ALERTS if a.tier == "vllm"),
    *(a.name for a in learned.EXTRA_ALERTS),
    *(a.name for a in ALERTS if a.tier == "proxy"),
    *(a.name for a in PROMETHEUS_ALERTS),
]


def test_every_alert_once_with_the_detector_thresholds() -> None:
    by_name = {r["alert"]: r for r in _rules() if "alert" in r}
    assert list(by_name) == ALL_ALERT_NAMES
    extras: list[learned.ExtraAlert | PrometheusAlert] = [*learned.EXTRA_ALERTS, *PROMETHEUS_ALERTS]
    for extra in extras:
        rule = by_name[extra.name]
        assert (rule["expr"], parse_duration(rule["for"])) == (extra.expr, extra.for_s)
        assert rule["labels"] == {"severity": extra.severity}
    for alert in ALERTS:
        rule = by_name[alert.name]
        assert rule["expr"] == alert_expr(alert)
        assert parse_duration(rule["for"]) == alert.for_s
        assert parse_duration(rule.get("keep_firing_for", "0s")) == alert.keep_firing_for_s
        assert rule["labels"] == {"severity": alert.severity}


def test_alert_naming_and_annotations_follow_the_mixin_conventions() -> None:
    runbook = (REPO / "detector" / "runbook.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^## (\S+)\s*$", runbook, flags=re.M))
    for rule in (r for r in _rules() if "alert" in r):
        name = rule["alert"]
        assert re.fullmatch(r"VLLM[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        ann = rule["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url"}
        assert "{{" not in ann["summary"] and ann["summary"].endswith(".")
        if name not in {a.name for a in PROMETHEUS_ALERTS}:  # those have no instance to name
            assert "{{ $labels.instance }}" in ann["description"]
        # Absolute: the detector's runbook page at its default address, the section by its name.
        assert ann["runbook_url"] == f"http://127.0.0.1:8200/runbook#{name}"
        assert name in headings, f"detector/runbook.md has no section for {name}"


def test_recording_rules_are_named_level_metric_operations() -> None:
    records = [r["record"] for r in _rules() if "record" in r]
    assert len(records) == len(set(records))
    for name in records:
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_each_group_recording_rules_before_the_alerts() -> None:
    for group in _groups():
        rules = group["rules"]
        kinds = ["record" if "record" in r else "alert" for r in rules]
        assert kinds == sorted(kinds, key=lambda k: k != "record")
        defined: set[str] = set()
        for rule in rules:  # a group is evaluated in order: read only what it already recorded
            used = set(re.findall(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b", rule["expr"]))
            assert used <= defined, (
                f"{rule.get('record', rule.get('alert'))} reads {used - defined} before it is defined"
            )
            if "record" in rule:
                defined.add(rule["record"])


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (10, "10s"), (60, "1m"), (90, "1m30s"), (3600, "1h"), (0.5, "500ms")]
)
def test_duration_round_trips(seconds: float, text: str) -> None:
    assert generate.duration(seconds) == text
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        parse_duration("5 minutes")


def _expand(notation: str) -> list[float]:
    """promtool's expanding notation, read independently of the writer."""
    out: list[float] = []
    for token in notation.split():
        m = re.fullmatch(r"(-?[\d.]+)([+-])([\d.]+)x(\d+)", token)
        if m is None:
            out.append(float(token))
            continue
        start, sign, step, n = float(m[1]), m[2], float(m[3]), int(m[4])
        out.extend(start + (step if sign == "+" else -step) * i for i in range(n + 1))
    return out


@pytest.mark.parametrize(
    "values",
    [[0.0], [1.0, 1.0, 1.0], [0, 5, 10, 15, 32.5, 50, 67.5, 72.5], [3, 1, 4, 1, 5, 9, 2, 6], [10, 8, 6, 6.5]],
)
def test_expanding_notation_round_trips(values: list[float]) -> None:
    assert _expand(unittests.encode([float(v) for v in values])) == pytest.approx(values)


def test_every_alert_has_a_promtool_scenario_on_the_evaluation_grid() -> None:
    assert sorted(s.alertname for s in unittests.ALL_SCENARIOS) == sorted(a.name for a in ALERTS)
    for scenarios in unittests.ALL_SCENARIOS:
        for case in scenarios.cases:
            assert case.onset_s % unittests.STEP_S == 0 and case.clear_s % unittests.STEP_S == 0
            assert unittests.CHANGE_S <= case.onset_s < case.clear_s <= unittests.END_S


def test_recorded_series_named_in_the_runbook_exist() -> None:
    runbook = (REPO / "detector" / "runbook.md").read_text(encoding="utf-8")
    named = set(re.findall(r"instance:retrywatch_[a-z0-9_]+:[a-z0-9_]+", runbook))
    records = {r["record"] for r in _rules() if "record" in r}
    assert named and named <= records, f"detector/runbook.md names unknown series: {named - records}"


def test_the_runbook_links_follow_the_one_option(tmp_path: Path) -> None:
    from click.testing import CliRunner

    wiki = "https://wiki.example/retrywatch#{alert}"
    documents = generate.rule_documents(wiki)
    links = {
        r["alert"]: r["annotations"]["runbook_url"]
        for g in documents["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert links == {name: f"https://wiki.example/retrywatch#{name}" for name in ALL_ALERT_NAMES}
    tests = "".join(unittests.unit_test_files(wiki).values())  # promtool expects the same links
    assert tests.count("runbook_url: https://wiki.example/retrywatch#") > len(ALERTS)
    stale = CliRunner().invoke(generate.main, ["--check", "--runbook-url", wiki])
    assert stale.exit_code == 1  # the committed files carry the default links
    bad = CliRunner().invoke(
        generate.main, ["--check"], env={"RETRYWATCH_RUNBOOK_URL": "docs/runbook.md#{alert}"}
    )
    assert bad.exit_code == 2 and "absolute" in bad.output
