"""The fleet's Prometheus and Alertmanager configurations (deploy/prometheus, deploy/alertmanager),
checked by Prometheus' and Alertmanager's own tools against the rules they serve."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from detector.signals import PROMETHEUS_JOBS
from detector.thresholds import ALERTS as THRESHOLD_ALERTS
from foundation.processes import ManagedProcess, free_port
from rules.generate import RULES_PATH
from tests.deploy.conftest import DEPLOY, tool

PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = DEPLOY / "alertmanager" / "alertmanager.yml"
RULES = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
ALERTS = [r for r in RULES["groups"][0]["rules"] if "alert" in r]
#: Each tier's loop pages: the critical cause alerts, which the shipped Alertmanager's inhibition names.
LOOP_PAGES = {a.name for a in THRESHOLD_ALERTS if a.severity == "critical" and a.kind == "cause"}
NO_DATA = "VLLMRetrywatchNoData"


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
    # the proxies' job is the proxy tier's; the vLLM tier's job ("vllm") is scraped where vLLM is
    # monitored without a proxy
    jobs = set(re.findall(r'up\{job="([^"]+)"\}', RULES_PATH.read_text()))
    assert jobs == {job["job_name"], PROMETHEUS_JOBS["vllm"]} and job["job_name"] == PROMETHEUS_JOBS["proxy"]
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
    amtool = tool("amtool")
    proc = subprocess.run(
        [amtool, "check-config", str(ALERTMANAGER_YML)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(ALERTMANAGER_YML.read_text(encoding="utf-8"))
    assert "instance" in config["route"]["group_by"]
    # info (a note on the setup, e.g. a deadline between vLLM's buckets): Alertmanager's UI only
    receivers = {"critical": "pager", "warning": "chat", "info": "default"}
    assert {a["labels"]["severity"] for a in ALERTS} <= set(receivers)
    for alert in ALERTS:
        labels = {"alertname": alert["alert"], "instance": "retrywatch-engine-0", **alert["labels"]}
        assert _route(amtool, labels) == receivers[alert["labels"]["severity"]], alert["alert"]


@pytest.fixture
def shipped_alertmanager(tmp_path: Path) -> Iterator[str]:
    """A real Alertmanager running the shipped configuration (its webhooks never called: every
    alert below waits out its group_wait long after the test has read the inhibitions)."""
    binary = tool("prometheus-alertmanager")
    port = free_port()
    argv = [binary, f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
            f"--storage.path={tmp_path / 'am'}", f"--config.file={ALERTMANAGER_YML}"]  # fmt: skip
    with ManagedProcess(argv, log_path=tmp_path / "am.log", bound_s=120, name="Alertmanager") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/-/ready", timeout_s=30, poll_s=0.1)
        yield url


def test_the_shipped_inhibition_names_every_loop_page() -> None:
    """The Alertmanager's inhibition source is each tier's loop pages, no more and no fewer."""
    config = yaml.safe_load(ALERTMANAGER_YML.read_text(encoding="utf-8"))
    [rule] = config["inhibit_rules"]
    [matcher] = rule["source_matchers"]
    names = re.fullmatch(r'alertname=~"([A-Za-z|]+)"', matcher)
    assert names is not None, matcher
    assert set(names.group(1).split("|")) == LOOP_PAGES


def test_the_retry_loop_inhibits_its_replicas_warnings_but_not_its_missing_data(
    shipped_alertmanager: str,
) -> None:
    """While a replica is in the retry loop its other warnings are inhibited (one page), but not
    VLLMRetrywatchNoData: that one says the loop alert itself no longer rests on data (a proxy
    killed mid-loop keeps the loop alert firing for its keep_firing_for), and nothing of another
    replica is inhibited."""
    severity = {a["alert"]: a["labels"]["severity"] for a in ALERTS}
    firing = [("replica-1", name) for name in severity] + [
        ("replica-2", name) for name in severity if name not in LOOP_PAGES
    ]
    alerts = [
        {"labels": {"alertname": name, "instance": instance, "severity": severity[name]}}
        for instance, name in firing
    ]
    assert httpx.post(f"{shipped_alertmanager}/api/v2/alerts", json=alerts, timeout=10).status_code == 200
    deadline = time.monotonic() + 20
    while True:
        got = httpx.get(f"{shipped_alertmanager}/api/v2/alerts", timeout=10).json()
        inhibited = {
            (a["labels"]["instance"], a["labels"]["alertname"]) for a in got if a["status"]["inhibitedBy"]
        }
        if (len(got) == len(alerts) and inhibited) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    no_data = {NO_DATA, "VLLMTierNoData"}
    warnings = {name for name, sev in severity.items() if sev == "warning" and name not in no_data}
    expected = {("replica-1", name) for name in warnings}
    assert inhibited == expected
