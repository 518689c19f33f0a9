"""The PrometheusRule of deploy/kubernetes is the rules file, wrapped: never edited apart from it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rules import prometheusrule
from rules.generate import RULES_PATH
from tests.deploy.conftest import find


def test_committed_prometheusrule_is_what_the_rules_file_gives() -> None:
    assert not prometheusrule.is_stale(), "out of date: run `python -m rules.prometheusrule`"
    committed = yaml.safe_load(prometheusrule.OUTPUT_PATH.read_text(encoding="utf-8"))
    assert committed["spec"] == yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
    assert (committed["apiVersion"], committed["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")


def test_check_reports_a_rules_change_not_carried_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = tmp_path / "retrywatch.rules.yml"
    changed.write_text(RULES_PATH.read_text(encoding="utf-8").replace("for: 2m", "for: 3m"), encoding="utf-8")
    assert prometheusrule.is_stale(rules_path=changed)
    drifted = tmp_path / "prometheusrule.yaml"
    drifted.write_text(
        prometheusrule.render().replace("severity: critical", "severity: warning"), encoding="utf-8"
    )
    monkeypatch.setattr(prometheusrule, "OUTPUT_PATH", drifted)
    with pytest.raises(SystemExit) as exc:
        prometheusrule.run(["--check"])
    assert exc.value.code == 1
    with pytest.raises(SystemExit) as exc:
        prometheusrule.run([])  # rewrites the file from the rules
    assert exc.value.code == 0
    assert not prometheusrule.is_stale(output_path=drifted)


@pytest.mark.parametrize("text", ["", "groups: []", "- a list", "rules: {}"])
def test_a_file_without_rule_groups_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="groups"):
        prometheusrule.document(text)


@pytest.mark.promtool
def test_promtool_accepts_the_rendered_prometheusrules_groups(
    rendered: dict[str, list[dict[str, Any]]], promtool: str, tmp_path: Path
) -> None:
    """The groups as kustomize renders them (what the cluster gets), checked by Prometheus' own tool."""
    spec = find(rendered["ingress-nginx"], "PrometheusRule")["spec"]
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_rules = sum(len(group["rules"]) for group in spec["groups"])
    assert f"SUCCESS: {n_rules} rules found" in proc.stdout
