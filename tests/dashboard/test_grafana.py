"""The generated Grafana dashboard: committed as generated, built from the live page and the signal
catalogue, and every panel's query run by a real Prometheus over a simulated run's series and
recording rules (``rules.backfill``); its vLLM rows over vLLM's series alone, as a Prometheus
that scrapes only vLLM holds them (no Grafana server is installable here: the JSON's queries are
what is checked)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboard import figures, grafana
from dashboard.tiles import TILE_SPECS
from detector.signals import SIGNALS_BY_NAME
from detector.thresholds import ALERTS
from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from rules.backfill import (
    Prometheus,
    backfill_recording_rules,
    place_run,
    run_start,
    write_blocks,
)
from rules.generate import GROUP_NAMES, RULES_PATH
from tests.reproduce.sim.test_sim import DIAG
from tests.reproduce.sim.test_sim import run as simulated_run
from tests.rules.test_equivalence import fluid_run
from tests.systemtools import require

STEP_S = 5.0


def test_the_committed_dashboard_is_what_the_generator_gives() -> None:
    assert grafana.stale_files() == [], "out of date: run `python -m dashboard.grafana`"
    assert grafana.OUTPUT_PATH.read_text() == grafana.KUSTOMIZE_COPY.read_text()


def test_check_fails_on_a_hand_edited_file(tmp_path: Path) -> None:
    edited = tmp_path / "retrywatch.json"
    edited.write_text(grafana.render().replace("retrywatch fleet", "my fleet"), encoding="utf-8")
    assert grafana.stale_files([edited]) == [edited]
    edited.write_text(grafana.render(), encoding="utf-8")
    assert grafana.stale_files([edited]) == []


def test_variables_rows_panels_and_annotations() -> None:
    doc = json.loads(grafana.render())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert variables["instance"]["definition"] == 'label_values(up{job="retrywatch"}, instance)'
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    assert [p["repeat"] for p in doc["panels"] if p["type"] == "row"] == ["vllm_instance", "instance"]
    proxy = grafana.row_panels(doc, "instance")
    # The live page's four panels, titled as in Dash, and its tiles; each says it needs the proxy.
    titles = [p["title"] for p in proxy if p["type"] == "timeseries"]
    dash_titles = [
        build({}, x_kind="seconds").layout.title.text  # type: ignore[operator]
        for build in figures.LIVE_PANELS
    ]
    assert titles == dash_titles
    assert [p["title"] for p in proxy if p["type"] == "stat"] == [t.label for t in TILE_SPECS]
    assert {p["fieldConfig"]["defaults"]["noValue"] for p in proxy} == {grafana.NEEDS_PROXY}
    # Every signal the live page draws is queried, through its recording rule, per instance.
    queries = [expr for _, expr in grafana.panel_queries(doc, "instance")]
    for signal in figures.LIVE_SIGNALS:
        if signal == "attempt_rate":
            continue  # fetched by the live page, drawn as first attempts + retries
        assert any(SIGNALS_BY_NAME[signal].record in q for q in queries), signal
    assert all('instance=~"$instance"' in q for q in queries)
    # Annotations: firing alerts per tier and severity, every alert of the catalogue once, shown
    # for its tier's instances (vLLM's targets, or the proxies).
    notes = {a["name"]: a["expr"] for a in doc["annotations"]["list"] if "expr" in a}
    tier_var = {"vllm": 'instance=~"$vllm_instance"', "proxy": 'instance=~"$instance"'}
    for rule in ALERTS:
        (expr,) = [e for e in notes.values() if rule.name in _alertnames(e)]
        assert f'severity="{rule.severity}"' in expr and tier_var[rule.tier] in expr, rule.name


def _alertnames(expr: str) -> list[str]:
    """The alert names an annotation query's ``alertname=~"A|B"`` matcher lists."""
    found = re.search(r'alertname=~"([^"]+)"', expr)
    assert found is not None, expr
    return found[1].split("|")


def _scraped(instance: str, snaps: list[Snapshot]) -> list[Snapshot]:
    """A run's snapshots as Prometheus scraped them from one proxy: its instance, ``up``, and the
    counters a proxy exports from its start that the simulated run leaves out, at 0."""
    out = []
    for s in snaps:
        samples = [*s.samples, ("up", {}, 1.0)]
        present = {(n, tuple(sorted(lb.items()))) for n, lb, _ in samples}
        zero = [(mn.ATTEMPTS_SHED, {})] + [(mn.EXECUTIONS_FINISHED, {"fate": f}) for f in mn.FATES]
        samples += [(n, lb, 0.0) for n, lb in zero if (n, tuple(sorted(lb.items()))) not in present]
        out.append(Snapshot(s.t, [(n, {**lb, "instance": instance}, v) for n, lb, v in samples]))
    return out


@pytest.mark.promtool
@pytest.mark.timeout(300)
def test_every_panel_query_returns_data_from_a_simulated_run_in_prometheus(tmp_path: Path) -> None:
    promtool, prometheus = require("promtool"), require("prometheus")
    doc: dict[str, Any] = json.loads(grafana.render())
    rules = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
    (group,) = [g for g in rules["groups"] if g["name"] == GROUP_NAMES["proxy"]]  # the proxy panels read it
    records = [r for r in group["rules"] if "record" in r]
    runs = {
        "replica-a": fluid_run(1, pulse=2.7, cancellation=False, duration_s=600.0),
        "replica-b": fluid_run(2, pulse=1.5, cancellation=True, duration_s=600.0),
    }
    duration = 600.0
    data = tmp_path / "data"
    data.mkdir()
    with Prometheus(data, binary=prometheus) as prom:
        rule_file, start = place_run(
            prom,
            rule_dir=tmp_path,
            group_name=group["name"],
            duration_s=duration,
            step_s=STEP_S,
            promtool=promtool,
        )
        prom.stop()
        scraped = [s for instance, snaps in runs.items() for s in _scraped(instance, snaps)]
        write_blocks(scraped, data, start_unix_s=start, extra_labels={"job": "retrywatch"}, promtool=promtool)
        prom.start()
        backfill_recording_rules(
            prom,
            records,
            rule_file=rule_file,
            group_name=group["name"],
            start_unix_s=start,
            end_unix_s=start + duration,
            step_s=STEP_S,
            promtool=promtool,
        )
        # The instance variable's query lists both replicas.
        ups = prom.query('up{job="retrywatch"}', start + duration)
        assert {r["metric"]["instance"] for r in ups} == set(runs)
        empty = []
        for title, expr in grafana.panel_queries(doc, "instance"):
            query = expr.replace("$instance", "replica-a")
            result = prom.query_range(query, start, start + duration, STEP_S)
            if not result:
                empty.append((title, query))
            assert {r["metric"].get("instance") for r in result} <= {"replica-a"}, (title, query)
        assert empty == []
        # The annotation queries parse (no alert is evaluated over backfilled history).
        for note in doc["annotations"]["list"]:
            if "expr" in note:
                prom.query(note["expr"].replace("$instance", ".+"), start + duration)


def test_the_vllm_rows_read_only_vllms_series_and_the_stated_numbers() -> None:
    plain = json.loads(grafana.render())
    stated = json.loads(grafana.render(grafana.Options(vllm_job="engines", deadline_s=30, capacity=2.5)))
    for doc in (plain, stated):
        vllm = grafana.row_panels(doc, "vllm_instance")
        assert vllm and all(p["type"] == "timeseries" for p in vllm)
        # Each query reads vLLM's series of the chosen job, or is a number the operator states.
        for _, expr in grafana.panel_queries(doc, "vllm_instance"):
            assert "retrywatch" not in expr and ('job="$vllm_job"' in expr or expr.startswith("vector($")), (
                expr
            )
        assert all(grafana.NEEDS_PROXY not in p["fieldConfig"]["defaults"]["noValue"] for p in vllm)
    variables = {v["name"]: v for v in stated["templating"]["list"]}
    assert variables["vllm_job"]["current"]["value"] == "engines"
    assert variables["deadline"]["current"]["value"] == "30"
    assert variables["capacity"]["current"]["value"] == "2.5"
    # Ĉ unstated: no capacity variable and no query reads one.
    assert "capacity" not in {v["name"] for v in plain["templating"]["list"]}
    assert not any("$capacity" in expr for _, expr in grafana.panel_queries(plain))
    assert any("$capacity" in expr for _, expr in grafana.panel_queries(stated))


@pytest.mark.parametrize(
    "options",
    [{"vllm_job": ""}, {"vllm_job": 'a"b'}, {"deadline_s": 0}, {"deadline_s": math.inf}, {"capacity": -1.0}],
)
def test_options_refuse_what_would_break_a_query(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        grafana.Options(**options)


def _interpolate(expr: str, variables: dict[str, str]) -> str:
    """What Grafana sends: each ``$name`` replaced by the variable's value (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    return expr


@pytest.mark.promtool
@pytest.mark.timeout(120)
def test_on_vllms_series_alone_the_vllm_panels_have_data_and_the_proxy_panels_say_they_need_it(
    tmp_path: Path,
) -> None:
    """A Prometheus holding only a simulated vLLM's series (as scraped from vLLM, job "vllm"):
    every vLLM panel's query is valid and returns data; every proxy panel's returns nothing and
    the panel says it needs the proxy."""
    promtool, prometheus = require("promtool"), require("prometheus")
    _, result = simulated_run(DIAG.condition("retries-on-cancel-on"))
    vllm_only = [
        Snapshot(s.t, [*((n, lb, v) for n, lb, v in s.samples if n.startswith("vllm:")), ("up", {}, 1.0)])
        for s in result.snapshots
    ]
    assert not any(n.startswith("retrywatch_") for s in vllm_only for n, _, _ in s.samples)
    duration = vllm_only[-1].t
    start = run_start(duration, STEP_S, 0.0)
    assert start is not None
    options = grafana.Options(capacity=9.77, deadline_s=12.0)
    doc: dict[str, Any] = json.loads(grafana.render(options))
    data = tmp_path / "data"
    labels = {"job": options.vllm_job, "instance": "vllm-0:8000"}
    write_blocks(vllm_only, data, start_unix_s=start, extra_labels=labels, promtool=promtool)
    with Prometheus(data, binary=prometheus) as prom:
        # The variables' queries find the job and the instance.
        series = prom.query(mn.VLLM_NUM_WAITING, start + duration / 2)
        assert {(r["metric"]["job"], r["metric"]["instance"]) for r in series} == {tuple(labels.values())}
        values = {v["name"]: v["current"].get("value", "") for v in doc["templating"]["list"]}
        values |= {"vllm_instance": labels["instance"], "instance": ".+"}
        empty = []
        for title, expr in grafana.panel_queries(doc, "vllm_instance"):
            if not prom.query_range(_interpolate(expr, values), start, start + duration, 1.0):
                empty.append((title, expr))
        assert empty == []
        for title, expr in grafana.panel_queries(doc, "instance"):
            assert prom.query_range(_interpolate(expr, values), start, start + duration, 1.0) == [], title
        assert {p["fieldConfig"]["defaults"]["noValue"] for p in grafana.row_panels(doc, "instance")} == {
            grafana.NEEDS_PROXY
        }
        # The annotation queries, as Grafana sends them, parse.
        for note in doc["annotations"]["list"]:
            if "expr" in note:
                prom.query(_interpolate(note["expr"], values), start + duration)
