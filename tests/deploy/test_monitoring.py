"""The fleet's Prometheus and Alertmanager configurations (deploy/prometheus, deploy/alertmanager),
checked by Prometheus' and Alertmanager's own tools against the rules they serve."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from rules.generate import RULES_PATH
from tests.deploy.conftest import DEPLOY, tool

PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
RULES = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
ALERTS = [r for r in RULES["groups"][0]["rules"] if "alert" in r]


@pytest.mark.promtool
def test_prometheus_scrapes_every_proxy_as_the_rules_job_and_loads_the_rules(promtool: str) -> None:
    proc = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in RULES['groups'])} rules found" in proc.stdout
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    assert [(PROMETHEUS_YML.parent / f).resolve() for f in config["rule_files"]] == [RULES_PATH]
    (job,) = config["scrape_configs"]
    assert {job["job_name"]} == set(re.findall(r'up\{job="([^"]+)"\}', RULES_PATH.read_text()))
    assert config["global"]["scrape_interval"] == RULES["groups"][0]["interval"]


def _route(amtool: str, labels: dict[str, str]) -> str:
    proc = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}"]
        + [f"{k}={v}" for k, v in labels.items()],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_alertmanager_groups_by_replica_and_routes_each_alert_by_severity() -> None:
    amtool = tool("amtool", "prometheus-alertmanager")
    proc = subprocess.run(
        [amtool, "check-config", str(ALERTMANAGER_YML)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(ALERTMANAGER_YML.read_text(encoding="utf-8"))
    assert "instance" in config["route"]["group_by"]
    receivers = {"critical": "pager", "warning": "chat"}
    assert {a["labels"]["severity"] for a in ALERTS} <= set(receivers)
    for alert in ALERTS:
        labels = {"alertname": alert["alert"], "instance": "retrywatch-engine-0", **alert["labels"]}
        assert _route(amtool, labels) == receivers[alert["labels"]["severity"]], alert["alert"]
