"""VLLMHeadroomLow's PrometheusRule (deploy/kubernetes/components/headroom): the daily what-if's
rule group wrapped, never edited apart from it; ``--check`` catches a drift; a kustomization that
adds the component gets it beside the base's, and the group as rendered passes the promtool unit
tests written for the rules file."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from reproduce.planner import daily
from rules import prometheusrule
from tests.deploy.conftest import KUSTOMIZE, find, kustomize
from tests.systemtools import require


def test_committed_headroom_prometheusrule_is_what_the_rule_group_gives() -> None:
    assert not prometheusrule.headroom_is_stale(), "out of date: run `python -m rules.prometheusrule`"
    committed = yaml.safe_load(prometheusrule.HEADROOM_OUTPUT_PATH.read_text(encoding="utf-8"))
    assert committed["spec"] == yaml.safe_load(daily.render_rules())
    assert committed["metadata"]["name"] == "retrywatch-headroom"
    assert committed["metadata"]["namespace"] == "retrywatch"
    assert prometheusrule.HEADROOM_RULES_PATH == daily.RULES_PATH


def test_check_reports_a_headroom_rule_change_not_carried_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = tmp_path / "headroom.rules.yml"
    changed.write_text(daily.render_rules().replace("for: 300s", "for: 600s"), encoding="utf-8")
    assert prometheusrule.headroom_is_stale(rules_path=changed)
    drifted = tmp_path / "prometheusrule.yaml"
    drifted.write_text(prometheusrule.render_headroom().replace("for: 300s", "for: 1s"), encoding="utf-8")
    monkeypatch.setattr(prometheusrule, "HEADROOM_OUTPUT_PATH", drifted)
    base = tmp_path / "base.yaml"  # the base's file, current: only the headroom one is stale
    base.write_text(prometheusrule.render(), encoding="utf-8")
    monkeypatch.setattr(prometheusrule, "OUTPUT_PATH", base)
    with pytest.raises(SystemExit) as exc:
        prometheusrule.run(["--check"])
    assert exc.value.code == 1
    with pytest.raises(SystemExit) as exc:
        prometheusrule.run([])  # rewrites both from their rules
    assert exc.value.code == 0
    assert not prometheusrule.headroom_is_stale(output_path=drifted)
    with pytest.raises(SystemExit) as exc:
        prometheusrule.run(["--check"])
    assert exc.value.code == 0


@pytest.mark.promtool
def test_the_component_adds_the_headroom_rule_that_passes_its_promtool_tests(tmp_path: Path) -> None:
    kubectl, promtool = require("kubectl"), require("promtool")
    user = tmp_path / "user"  # a kustomization of a user's own, outside the repository
    user.mkdir()
    rel = {name: os.path.relpath(KUSTOMIZE / name, user) for name in ("ingress-nginx", "components/headroom")}
    kustomization = {"resources": [rel["ingress-nginx"]], "components": [rel["components/headroom"]]}
    (user / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    objects = kustomize(kubectl, user)
    find(objects, "PrometheusRule", "retrywatch")  # the base's, still there
    rule = find(objects, "PrometheusRule", "retrywatch-headroom")
    assert rule["metadata"]["namespace"] == "retrywatch"
    # the group as the cluster gets it, under the rules file's name: its promtool tests pass on it
    work = tmp_path / "promtool"
    work.mkdir()
    (work / daily.RULES_PATH.name).write_text(yaml.safe_dump(rule["spec"], sort_keys=False), encoding="utf-8")
    shutil.copy(daily.RULES_DIR / "vllmheadroomlow.test.yml", work)
    proc = subprocess.run([promtool, "test", "rules", "vllmheadroomlow.test.yml"], capture_output=True,
                          text=True, timeout=120, cwd=work, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
