"""``retrywatch mixin``: one command writes the rules, the PrometheusRule, the Grafana dashboard and
the runbook, each what its generator gives for the options; promtool accepts the rule files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner

from dashboard import grafana
from detector.runbook import runbook_markdown
from detector.thresholds import ALERTS
from retrywatch import mixin
from retrywatch.cli import main
from rules import generate, stated
from rules.backfill import Prometheus
from tests.systemtools import require

PATTERN = "https://wiki.example/retrywatch#{alert}"


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["mixin", *args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixin") / "bundle"
    code, output = _run(
        "--out",
        str(out),
        "--vllm-job",
        "engines",
        "--deadline",
        "30",
        "--capacity",
        "2.5",
        "--runbook-url",
        PATTERN,
    )
    assert code == 0, output
    assert output.count("wrote ") == len(mixin.BUNDLE_FILES)
    return out


def test_the_bundle_lays_out_the_mixins_files(bundle_dir: Path) -> None:
    files = sorted(str(p.relative_to(bundle_dir)) for p in bundle_dir.rglob("*") if p.is_file())
    assert files == sorted(mixin.BUNDLE_FILES)
    assert "dashboards_out/retrywatch.json" in files


def test_the_rules_are_the_generated_ones_for_the_options_and_runbook_links(bundle_dir: Path) -> None:
    rules = yaml.safe_load((bundle_dir / mixin.RULES_FILE).read_text(encoding="utf-8"))
    assert rules == yaml.safe_load(stated.render(PATTERN, vllm_job="engines", deadline_s=30.0, capacity=2.5))
    assert [g["name"] for g in rules["groups"]] == [g["name"] for g in generate.rule_documents()["groups"]]
    links = {
        r["alert"]: r["annotations"]["runbook_url"]
        for g in rules["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert {rule.name for rule in ALERTS} <= set(links)
    assert all(url == PATTERN.format(alert=name) for name, url in links.items())


def test_the_prometheusrule_holds_the_rule_files_groups(bundle_dir: Path) -> None:
    rule = yaml.safe_load((bundle_dir / mixin.PROMETHEUS_RULE_FILE).read_text(encoding="utf-8"))
    rules = yaml.safe_load((bundle_dir / mixin.RULES_FILE).read_text(encoding="utf-8"))
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"]


def test_the_dashboard_is_the_generated_one_for_the_options(bundle_dir: Path) -> None:
    text = (bundle_dir / mixin.DASHBOARD_FILE).read_text(encoding="utf-8")
    assert text == grafana.render(grafana.Options(vllm_job="engines", deadline_s=30.0, capacity=2.5))
    variables = {v["name"]: v["current"].get("value") for v in json.loads(text)["templating"]["list"]}
    assert (variables["vllm_job"], variables["deadline"], variables["capacity"]) == ("engines", "30", "2.5")


def test_the_runbook_is_the_detectors(bundle_dir: Path) -> None:
    runbook = (bundle_dir / mixin.RUNBOOK_FILE).read_text(encoding="utf-8")
    assert runbook == runbook_markdown()
    assert all(f"## {rule.name}" in runbook for rule in ALERTS)


@pytest.mark.promtool
def test_promtool_checks_the_bundles_rule_files(bundle_dir: Path, tmp_path: Path) -> None:
    promtool = require("promtool")
    rules = bundle_dir / mixin.RULES_FILE
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The PrometheusRule's spec is a rules file promtool accepts as it is.
    spec = yaml.safe_load((bundle_dir / mixin.PROMETHEUS_RULE_FILE).read_text(encoding="utf-8"))["spec"]
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec, allow_unicode=True), encoding="utf-8")
    checked = subprocess.run(
        [promtool, "check", "rules", str(spec_file)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_second_run_replaces_a_previous_bundle(bundle_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    assert _run("--out", str(out))[0] == 0
    (out / mixin.DASHBOARD_FILE).write_text("{}", encoding="utf-8")
    assert _run("--out", str(out))[0] == 0
    assert (out / mixin.DASHBOARD_FILE).read_text(encoding="utf-8") == grafana.render()


def test_a_directory_holding_other_files_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    code, output = _run("--out", str(tmp_path))
    assert code == 1 and "notes.txt" in output and "empty directory" in output
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "mine"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--deadline", "0"], "--deadline"),
        (["--deadline", "nan"], "--deadline"),
        (["--deadline", "0.1"], "below vLLM's first e2e latency bucket"),
        (["--capacity", "-2"], "--capacity"),
        (["--vllm-job", 'vllm"}'], "scrape job"),
        # each of them a traceback before: the rules' YAML broke on them
        (["--vllm-job", "vllm\tx"], "'--vllm-job': not a usable scrape job name: 'vllm\\tx'"),
        (["--vllm-job", "vllm\rx"], "'--vllm-job': not a usable scrape job name"),
        (["--vllm-job", "vllm\u2028x"], "'--vllm-job': not a usable scrape job name"),
        (["--vllm-job", "vllm\\x"], "'--vllm-job': not a usable scrape job name"),
        (["--runbook-url", "not a url"], "--runbook-url"),
        # promtool refused the rules: Prometheus expands an annotation as a Go template
        (["--runbook-url", "https://wiki.example/{{{{x}}}}#{alert}"], "without spaces, control characters"),
        (["--runbook-url", "https://wiki.example/\n#{alert}"], "without spaces, control characters"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(
    args: list[str], says: str, tmp_path: Path
) -> None:
    out = tmp_path / "bundle"
    code, output = _run("--out", str(out), *args)
    assert code == 2 and says in output, output
    assert "Traceback" not in output and len([line for line in output.splitlines() if "Error" in line]) == 1
    assert not out.exists()


JOB = "vllm #x: y ü"  # ": " and " #" ended a plain YAML scalar: the rules held a cut PromQL


@pytest.mark.promtool
def test_a_job_name_that_yaml_would_cut_is_written_whole_and_promtool_accepts_it(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    assert _run("--out", str(out), "--vllm-job", JOB, "--capacity", "2.5") == (0, _wrote(out))
    rules = yaml.safe_load((out / mixin.RULES_FILE).read_text(encoding="utf-8"))
    assert rules == yaml.safe_load(stated.render(vllm_job=JOB, capacity=2.5))
    stated_records = rules["groups"][0]["rules"][:2]
    assert all(r["expr"].startswith(f'max by (instance) (up{{job="{JOB}"}}) * 0 + ') for r in stated_records)
    missing = "instance:retrywatch_vllmtier_data_missing:bool"  # what VLLMTierNoData reads
    no_data = next(r for g in rules["groups"] for r in g["rules"] if r.get("record") == missing)
    assert f'up{{job="{JOB}"}}' in no_data["expr"] and 'job="vllm"' not in no_data["expr"]
    spec = yaml.safe_load((out / mixin.PROMETHEUS_RULE_FILE).read_text(encoding="utf-8"))["spec"]
    assert spec["groups"] == rules["groups"]
    checked = subprocess.run(
        [require("promtool"), "check", "rules", str(out / mixin.RULES_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _wrote(out: Path) -> str:
    return "".join(f"wrote {out / name}\n" for name in mixin.BUNDLE_FILES)


def test_an_out_under_a_file_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / "somefile").write_text("mine", encoding="utf-8")
    code, output = _run("--out", str(tmp_path / "somefile" / "sub"))
    assert (code, output) == (
        1,
        f"Error: cannot write the bundle into {tmp_path}/somefile/sub: {tmp_path}/somefile is a file, "
        "not a directory\n",
    )
    assert [p.name for p in tmp_path.iterdir()] == ["somefile"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_the_file_system_refuses_is_one_line() -> None:
    """procfs takes no new directory, whoever asks (root included)."""
    code, output = _run("--out", "/proc/retrywatch-bundle")
    assert code == 1 and output.startswith("Error: cannot write the bundle into /proc/retrywatch-bundle: ")
    assert output.count("\n") == 1 and "Traceback" not in output


@pytest.mark.parametrize("make", ["fifo", "link"])
def test_a_bundle_files_name_that_is_a_fifo_or_a_link_is_refused_untouched(tmp_path: Path, make: str) -> None:
    """A FIFO there would hold the write forever; a link would be written through."""
    out, outside = tmp_path / "bundle", tmp_path / "elsewhere.md"
    out.mkdir()
    outside.write_text("mine", encoding="utf-8")
    if make == "fifo":
        os.mkfifo(out / mixin.RUNBOOK_FILE)
    else:
        (out / mixin.RUNBOOK_FILE).symlink_to(outside)
    code, output = _run("--out", str(out))
    assert code == 1 and f"not the bundle's ({out / mixin.RUNBOOK_FILE})" in output, output
    assert [p.name for p in out.iterdir()] == [mixin.RUNBOOK_FILE]
    assert outside.read_text(encoding="utf-8") == "mine"


@pytest.mark.promtool
def test_the_vllm_tier_alone(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    assert _run("--out", str(out), "--tier", "vllm")[0] == 0
    rules = yaml.safe_load((out / mixin.RULES_FILE).read_text(encoding="utf-8"))
    assert [g["name"] for g in rules["groups"]] == [generate.GROUP_NAMES["vllm"]]
    rule = yaml.safe_load((out / mixin.PROMETHEUS_RULE_FILE).read_text(encoding="utf-8"))
    assert rule["spec"]["groups"] == rules["groups"]
    checked = subprocess.run(
        [require("promtool"), "check", "rules", str(out / mixin.RULES_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.promtool
def test_a_real_prometheus_loads_the_bundles_rules(bundle_dir: Path, tmp_path: Path) -> None:
    """As an operator loads it: the rules file in ``rule_files``; Prometheus lists every group."""
    with Prometheus(
        tmp_path / "data", rule_files=[bundle_dir / mixin.RULES_FILE], binary=require("prometheus")
    ) as prom:
        answer = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()
    loaded = {g["name"]: len(g["rules"]) for g in answer["data"]["groups"]}
    rules = yaml.safe_load((bundle_dir / mixin.RULES_FILE).read_text(encoding="utf-8"))
    assert loaded == {g["name"]: len(g["rules"]) for g in rules["groups"]}
