"""The generated Grafana dashboard: committed as generated, built from the live page and the signal
catalogue, and every panel's query run by a real Prometheus over a simulated run's series and
recording rules (``rules.backfill``)."""

from __future__ import annotations

import json
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
    write_blocks,
)
from rules.generate import RULES_PATH
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
    (row,) = [p for p in doc["panels"] if p["type"] == "row"]
    assert row["repeat"] == "instance"
    # The live page's four panels, titled as in Dash, and its tiles.
    titles = [p["title"] for p in doc["panels"] if p["type"] == "timeseries"]
    dash_titles = [
        build({}, x_kind="seconds").layout.title.text  # type: ignore[operator]
        for build in figures.LIVE_PANELS
    ]
    assert titles == dash_titles
    assert [p["title"] for p in doc["panels"] if p["type"] == "stat"] == [t.label for t in TILE_SPECS]
    # Every signal the live page draws is queried, through its recording rule, per instance.
    queries = [expr for _, expr in grafana.panel_queries(doc)]
    for signal in figures.LIVE_SIGNALS:
        if signal == "attempt_rate":
            continue  # fetched by the live page, drawn as first attempts + retries
        assert any(SIGNALS_BY_NAME[signal].record in q for q in queries), signal
    assert all('instance=~"$instance"' in q for q in queries)
    # Annotations: firing alerts per severity, every alert of the catalogue.
    notes = [a for a in doc["annotations"]["list"] if "expr" in a]
    assert {a["name"] for a in notes} == {f"{rule.severity} alerts" for rule in ALERTS}
    assert all(rule.name in notes[0]["expr"] for rule in ALERTS)


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
    (group,) = rules["groups"]
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
        for title, expr in grafana.panel_queries(doc):
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
