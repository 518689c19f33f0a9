"""Page callbacks called directly (no browser) against a real HTTP server in the detector's
API shapes and a reproduce output written in the real formats."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from dashboard import figures
from dashboard.app import create_app
from dashboard.context import Context, DashboardConfig
from dashboard.data import DetectorClient
from dashboard.figures import MAX_POINTS
from dashboard.pages import experiments, history, live
from dashboard.runs import run_key
from foundation.processes import free_port
from tests.dashboard.staticapi import StaticDetectorAPI, synthetic_history

from .conftest import ENGINE_A, ENGINE_B, NOW, TRACE_SLUGS, episode, loop_alert, whatif_dir


def context(api: StaticDetectorAPI, runs_dir: Path | None = None) -> Context:
    app = create_app(DashboardConfig(detector_url=api.url, runs_dir=runs_dir))
    ctx = app.server.config["RETRYWATCH_CONTEXT"]
    assert isinstance(ctx, Context)
    return ctx


def rects(fig: object) -> list[object]:
    return [s for s in fig.layout.shapes if s.type == "rect"]  # type: ignore[attr-defined]


def test_live_update_for_a_collapsed_engine(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    banner, banner_style, chips, tiles, *figs, status = live.update(ctx, ENGINE_A, 3600)
    assert banner_style["display"] == "block"
    text = str(banner)
    assert "VLLMMetastableRetryLoop" in text and "CRITICAL" in text
    # the engine is named by its instance and model, never by vLLM's engine label ("0" everywhere)
    # as host:port, not its raw /metrics URL
    assert " on 10.0.0.1:8100 (qwen) since" in text and " on 0 " not in text and "/metrics" not in text
    assert "VLLMPromptTokensUncounted (warning, 10.0.0.2:8100 (llama))" in text
    assert "10.0.0.1:8100 (qwen): VLLMMetastableRetryLoop (critical)" in str(chips)
    assert "10.0.0.2:8100 (llama): VLLMPromptTokensUncounted (warning)" in str(chips)
    assert len(figs) == len(figures.LIVE_PANELS) == 5
    attempts = figs[0]
    created = next(t for t in attempts.data if t.name == "executions created")
    assert len(created.x) == MAX_POINTS  # 1 h at 5 s is 721 points: averaged down to MAX_POINTS
    # its open critical episode and resolved warning are shaded on every panel, not engine B's
    for fig in figs:
        assert len(rects(fig)) == 2
    assert "data up to" in status
    tile_text = str(tiles)
    assert "executions created / Ĉ" in tile_text
    assert "VLLMMetastableRetryLoop" in tile_text and "VLLMPromptTokensUncounted" not in tile_text


def test_live_update_switches_engine_and_range(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    _, _, _, _, *figs0, _ = live.update(ctx, ENGINE_A, 900)
    _, _, _, tiles1, *figs1, _ = live.update(ctx, ENGINE_B, 900)
    y0 = max(next(t for t in figs0[0].data if t.name == "executions created").y)
    y1 = max(next(t for t in figs1[0].data if t.name == "executions created").y)
    assert y0 > 2.8 > y1  # engine A creates above Ĉ, engine B below: each its own series
    assert len(next(t for t in figs1[0].data if t.name == "executions created").x) == 181
    # engine B: only its own open gap episode in the last 15 min, only its own alert on the tiles
    assert [r.x0 for r in rects(figs1[0])] == [pytest.approx((NOW - 600) * 1000.0)]
    assert "VLLMPromptTokensUncounted" in str(tiles1) and "VLLMMetastableRetryLoop" not in str(tiles1)


def test_banner_follows_the_alert_state(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    api.set_alerts([])
    _, banner_style, *_ = live.update(ctx, ENGINE_B, 900)
    assert banner_style == {"display": "none"}
    api.set_alerts([loop_alert(ENGINE_B)])
    banner, banner_style, *_ = live.update(ctx, ENGINE_A, 900)
    assert banner_style["display"] == "block" and "on 10.0.0.2:8100 (llama)" in str(banner)  # any engine


def test_source_down_is_no_data_never_healthy(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    api.set_alerts([])
    api.set_source_up(False)
    banner, banner_style, *_ = live.update(ctx, ENGINE_B, 900)
    assert banner_style["display"] == "block" and "NO DATA" in str(banner)


def test_unreachable_detector_shows_no_data() -> None:
    port = free_port()
    app = create_app(DashboardConfig(detector_url=f"http://127.0.0.1:{port}", timeout_s=0.5))
    ctx = app.server.config["RETRYWATCH_CONTEXT"]
    banner, _, _, _, *figs, status = live.update(ctx, None, 3600)
    assert "NO DATA" in str(banner) and "unreachable" in str(banner)
    assert status == "detector unreachable"
    assert figs[0].layout.annotations[0].text.startswith("no data: first attempts")
    assert live.engine_options(ctx, "e") == ([], "e")


def test_engine_options_keep_a_known_selection(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    assert live.engine_options(ctx, ENGINE_B) == (
        [{"label": "10.0.0.1:8100", "value": ENGINE_A}, {"label": "10.0.0.2:8100", "value": ENGINE_B}],
        ENGINE_B,
    )
    assert live.engine_options(ctx, "gone")[1] == ENGINE_A
    assert live.engine_options(ctx, "0")[1] == ENGINE_A  # vLLM's engine label selects nothing


def test_history_filters_by_alert_engine_and_time(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    fig, table, count, alert_opts, engine_opts = history.update(ctx, history.ALL, history.ALL, 0)
    assert count == "4 episodes"
    assert {o["value"] for o in alert_opts} >= {"VLLMMetastableRetryLoop", "VLLMOrphanedExecutions"}
    # engines listed by instance (with their model), not by vLLM's engine label "0"
    assert engine_opts == [
        {"label": "all engines", "value": history.ALL},
        {"label": "10.0.0.1:8100 (qwen)", "value": ENGINE_A},
        {"label": "10.0.0.2:8100 (llama)", "value": ENGINE_B},
    ]
    assert "10.0.0.2:8100 (llama)" in str(table)
    _, _, count, _, _ = history.update(ctx, history.ALL, history.ALL, 3600)
    assert count == "3 episodes"  # engine B's orphaned-executions episode ended 8 h ago
    fig, table, count, _, _ = history.update(ctx, "VLLMMetastableRetryLoop", ENGINE_A, 0)
    assert count == "1 episodes"
    assert "firing" in str(table)
    assert {y for t in fig.data for y in t.y} == {"VLLMMetastableRetryLoop · 10.0.0.1:8100 (qwen)"}
    _, table, count, _, _ = history.update(ctx, history.ALL, ENGINE_B, 0)
    assert count == "2 episodes" and ENGINE_A not in str(table)
    fig, _, count, _, _ = history.update(ctx, history.ALL, ENGINE_A, 0)
    assert count == "2 episodes"
    assert {y for t in fig.data for y in t.y} == {
        "VLLMBacklogBeyondDeadline · 10.0.0.1:8100 (qwen)",
        "VLLMMetastableRetryLoop · 10.0.0.1:8100 (qwen)",
    }
    _, _, count, _, _ = history.update(ctx, history.ALL, "0", 0)
    assert count == "0 episodes"  # "0" is every vLLM's engine label, not an engine


def test_a_pulse_runs_recorded_collapses_are_shaded_as_a_traces_are(
    api: StaticDetectorAPI, runs_dir: Path
) -> None:
    summary = json.loads((runs_dir / "summary.json").read_text())
    collapse = {"start_s": 125.0, "end_s": 947.0, "ended": False, "metastable_at_s": 300.0}
    summary["runs"][1]["collapses"] = [collapse]  # the ground-truth record every run now writes
    (runs_dir / "summary.json").write_text(json.dumps(summary))
    view = experiments.run_view(context(api, runs_dir), "diagnostic__retries-on__qwen2.5-7b__r1")
    for fig in view.panels:
        assert [(s.x0, s.x1) for s in fig.layout.shapes if s.name == "collapse"] == [(125.0, 947.0)]
        assert [(s.x0, s.x1) for s in fig.layout.shapes if s.name == "metastable"] == [(300.0, 947.0)]
    assert "not recovered" in view.summary and "1 collapse (0 metastable)" in view.summary


def test_experiments_layout_and_run_callback(api: StaticDetectorAPI, runs_dir: Path) -> None:
    ctx = context(api, runs_dir)
    page = experiments.layout(ctx)
    text = str(page)
    assert "graph-delivery" in text and "graph-creation" in text
    view = experiments.run_view(ctx, "diagnostic__retries-on__qwen2.5-7b__r1")
    figs, summary = view.panels, view.summary
    assert "not recovered" in summary and "VLLMMetastableRetryLoop at 260 s" in summary
    assert view.arrivals is None  # a pulse run: as it always was, the pulse marked, no arrivals panel
    for fig in figs:
        assert fig.layout.xaxis.title.text == "time since run start (s)"
        rects = [s for s in fig.layout.shapes if s.type == "rect"]
        assert [r.x0 for r in rects] == [180.0, 260.0] and rects[0].x1 == 600.0
        pulse = [s.x0 for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1]  # not a threshold line
        assert pulse == [120.0, 227.0]
    assert "detector (validation.json)" in summary
    summary = experiments.run_view(ctx, "diagnostic__retries-off__qwen2.5-7b__r1").summary
    assert "recovered 120 s after the pulse" in summary and "no alerts" in summary
    summary = experiments.run_view(ctx, "nope").summary
    assert "no run 'nope'" in summary


def test_experiments_without_runs_dir_says_how(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    assert "--runs DIR" in str(experiments.layout(ctx))


def test_refresh_interval_is_bounded() -> None:
    with pytest.raises(ValueError, match="at least 1 s"):
        DashboardConfig(detector_url="http://x", refresh_s=0.1)


def test_reference_now_is_the_last_scrape(api: StaticDetectorAPI) -> None:
    assert context(api).now() == NOW


def test_experiments_replays_runs_missing_from_validation(api: StaticDetectorAPI, runs_dir: Path) -> None:
    (runs_dir / "validation.json").unlink()
    ctx = context(api, runs_dir)
    view = experiments.run_view(ctx, "diagnostic__retries-on__qwen2.5-7b__r1")
    figs, summary = view.panels, view.summary
    assert "detector (the detector's replay)" in summary
    assert "VLLMMetastableRetryLoop" in summary  # the real detector fires on the collapsed run
    rects = [s for s in figs[0].layout.shapes if s.type == "rect"]
    assert rects and any(r.fillcolor == figures.VERMILLION for r in rects)


def test_tabs_on_one_engine_share_a_fetch_per_scrape(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    live.live_view(ctx, ENGINE_A, 900)
    fetched = api.requests["/signals"]
    again = live.live_view(ctx, ENGINE_A, 900)
    assert api.requests["/signals"] == fetched  # same scrape: remembered
    assert again.signals["execution_creation_rate"].shape[0] == 181
    live.live_view(ctx, ENGINE_B, 900)
    assert api.requests["/signals"] > fetched  # another engine: fetched


def test_a_resolving_alert_is_shown_as_resolving_with_its_runbook(api: StaticDetectorAPI) -> None:
    ctx = context(api)
    resolving = {
        **loop_alert(ENGINE_B),
        "state": "resolving",
        "resolving_since": NOW - 60,
        "resolves_at": NOW + 60,
        "runbook_url": "https://runbooks.example/retrywatch#vllmmetastableretryloop",
    }
    api.set_alerts([resolving])
    banner, banner_style, chips, *_ = live.update(ctx, ENGINE_B, 900)
    text = str(banner)
    assert "RESOLVING critical VLLMMetastableRetryLoop" in text and "unless it returns" in text
    assert "CRITICAL" not in text  # not shouted as firing
    assert "resolving" in str(chips)
    assert "dashed" in banner_style["border"]  # every alert shown is resolving: outlined, not filled
    link = next(c for c in banner[0].children if getattr(c, "className", "") == "banner-runbook")
    assert link.href == resolving["runbook_url"]
    # a firing alert outranks a resolving one of the same severity, and fills the banner
    api.set_alerts([resolving, {**loop_alert(ENGINE_A), "runbook_url": "/runbook#vllmmetastableretryloop"}])
    banner, banner_style, *_ = live.update(ctx, ENGINE_A, 900)
    assert "CRITICAL VLLMMetastableRetryLoop" in str(banner) and "border" not in banner_style
    assert "(critical, resolving, 10.0.0.2:8100 (llama))" in str(banner)
    link = next(c for c in banner[0].children if getattr(c, "className", "") == "banner-runbook")
    assert link.href == f"{api.url}/runbook#vllmmetastableretryloop"  # relative: on the detector
    # no runbook_url, or one that is not a web link: no link
    for url in (None, "javascript:alert(1)"):
        api.set_alerts([{**loop_alert(ENGINE_A), "runbook_url": url}])
        banner, *_ = live.update(ctx, ENGINE_A, 900)
        assert "banner-runbook" not in str(banner)


def test_the_live_page_opens_on_the_smallest_range_that_shows_the_data_whole(
    api: StaticDetectorAPI,
) -> None:
    assert live.range_for_span(None) == 300  # no data yet: the shortest range
    assert live.range_for_span(40.0) == 300  # a demo's first minute: 5 min, never a sliver of 1 h
    assert live.range_for_span(301.0) == 900
    assert live.range_for_span(3600.0) == 3600
    assert live.range_for_span(10 * 86400.0) == 21600
    ctx = context(api)
    assert live.fitting_range(ctx, ENGINE_A) == 3600  # the static API holds 1 h of history
    assert _find(live.layout(ctx, {"engine": ENGINE_A}), "live-range").value == 3600
    asked = live.layout(ctx, {"engine": ENGINE_A, "range": "900"})
    assert _find(asked, "live-range").value == 900  # a range asked for in the link is kept
    for odd in ("²", "٩٠٠", "901", "-900", "0900", "9" * 5000):  # not one of the ranges: the fitting one
        assert _find(live.layout(ctx, {"engine": ENGINE_A, "range": odd}), "live-range").value == 3600


def _find(component: Any, ident: str) -> Any:
    if getattr(component, "id", None) == ident:
        return component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str):
            found = _find(child, ident)
            if found is not None:
                return found
    return None


# a value the page never offers, as a stale page or a hand-made request may send it
ODD_VALUES = ("abc", -5, 1e308, [1], {"a": 1}, 10**30, True, "x" * 100_000, "\x00", 900)
# an output of each callback -> its inputs, with the values the page sends first
CALLBACKS = {
    "live-status.children": {
        "live-refresh.n_intervals": 1,
        "live-engine.value": None,
        "live-range.value": None,
    },
    "history-count.children": {
        "history-alert.value": None,
        "history-engine.value": None,
        "history-range.value": 0,
    },
    "experiments-run-summary.children": {"experiments-run.value": None},
}


def _prop(key: str, value: object = None) -> dict[str, object]:
    ident, prop = key.rsplit(".", 1)
    return {"id": ident, "property": prop, "value": value}


def test_a_callback_sent_a_value_the_page_never_offers_answers_as_if_nothing_were_selected(
    api: StaticDetectorAPI, runs_dir: Path
) -> None:
    client = create_app(DashboardConfig(detector_url=api.url, runs_dir=runs_dir)).server.test_client()
    callback_map = client.get("/_dash-dependencies").get_json()
    for output, inputs in CALLBACKS.items():
        (spec,) = [c for c in callback_map if output in c["output"]]
        outputs = [_prop(o) for o in spec["output"].strip(".").split("...")]
        for changed in inputs:
            for odd in ODD_VALUES:
                sent = [_prop(k, odd if k == changed else v) for k, v in inputs.items()]
                body = {"output": spec["output"], "outputs": outputs, "inputs": sent}
                got = client.post("/_dash-update-component", json={**body, "changedPropIds": [changed]})
                assert got.status_code == 200, (changed, repr(odd)[:40], got.status_code)


def test_a_detector_answering_what_no_page_can_show_is_no_data_not_a_500() -> None:
    """A time no clock can format (a detector bug, a proxy in between) used to be a 500."""
    answers = {
        "/healthz": {"status": "ok", "source": {"up": True, "last_scrape_at": NOW}},
        "/alerts": {"alerts": [{**loop_alert(), "started_at": 1e300}]},
        "/episodes": {"episodes": []},
        "/signals": {"signals": [], "engines": [], "series": []},
    }
    app = create_app(DashboardConfig(detector_url="http://detector"))
    ctx = app.server.config["RETRYWATCH_CONTEXT"]
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=answers[r.url.path]))
    ctx.detector = ctx.signals = DetectorClient("http://detector", transport=transport)
    body = {
        "output": "page.children",
        "outputs": _prop("page.children"),
        "inputs": [_prop("url.pathname", "/")],
        "state": [_prop("url.search", "")],
        "changedPropIds": ["url.pathname"],
    }
    got = app.server.test_client().post("/_dash-update-component", json=body)
    assert got.status_code == 200
    assert "NO DATA" in got.get_data(as_text=True) and "not a Unix time" in got.get_data(as_text=True)


@pytest.mark.parametrize(
    ("run_index", "change"),
    [
        (1, {"validation_alert": {"alertname": "VLLMMetastableRetryLoop"}}),  # no fired_at_s
        (0, {"recovery_time_s": "soon"}),
        (0, {"pulse": "start"}),
        (0, {"series": "runs/diagnostic__retries-off__qwen2.5-7b__r1/metrics.d"}),  # a directory
    ],
)
def test_a_hand_edited_run_is_shown_with_what_is_wrong_not_a_500(
    api: StaticDetectorAPI, runs_dir: Path, run_index: int, change: dict[str, Any]
) -> None:
    summary = json.loads((runs_dir / "summary.json").read_text())
    run = summary["runs"][run_index]
    if "validation_alert" in change:
        validation = json.loads((runs_dir / "validation.json").read_text())
        validation["runs"][0]["alerts"] = [change["validation_alert"]]
        (runs_dir / "validation.json").write_text(json.dumps(validation))
    else:
        run.update(change)
        (runs_dir / "runs/diagnostic__retries-off__qwen2.5-7b__r1/metrics.d").mkdir()
        (runs_dir / "summary.json").write_text(json.dumps(summary))
    view = experiments.run_view(context(api, runs_dir), run_key(run))
    figs, text = view.panels, view.summary
    assert len(figs) == len(figures.LIVE_PANELS) == 5
    assert any(
        word in text for word in ("unreadable", "not a regular file (a directory)", "no alerts (KeyError")
    )


@pytest.mark.parametrize("change", [{"delivery": {"pulse": 5}}, {"rates_x_capacity": 5}])
def test_a_hand_edited_summary_is_a_note_not_a_500(
    api: StaticDetectorAPI, runs_dir: Path, change: dict[str, Any]
) -> None:
    summary = json.loads((runs_dir / "summary.json").read_text())
    summary["runs"][0].update(change)
    (runs_dir / "summary.json").write_text(json.dumps(summary))
    assert "Cannot open" in str(experiments.layout(context(api, runs_dir)))


def test_an_outage_is_drawn_up_to_the_detectors_last_evaluation_not_its_last_scrape(
    api: StaticDetectorAPI,
) -> None:
    """While its source is down the detector goes on evaluating past its last scrape: an alert
    that fires now is drawn up to its last evaluation (it used to be a 1-s sliver at the last
    scrape), and the tiles say "no data" rather than the last minute before the outage as healthy."""
    outage = 600.0
    api.outage(outage)
    nodata = {
        **episode("VLLMRetrywatchNoData", ENGINE_B, NOW + 15.0, None, ident=9),
        "summary": "The detector has no data for this engine.",
    }
    api.set_episodes([nodata])
    api.set_alerts([{**nodata, "state": "firing", "value": 1.0}])
    ctx = context(api)
    assert ctx.now() == NOW + outage
    fig, *_ = history.update(ctx, None, None, 3600)
    (bar,) = fig.data
    assert list(bar.base) == [(NOW + 15.0) * 1000.0]
    assert list(bar.x) == [pytest.approx((outage - 15.0) * 1000.0)]
    for _ in range(2):  # the first refresh and the next (remembered) one alike
        view = live.live_view(ctx, ENGINE_B, 900)
        assert view.now == NOW + outage
        assert [(t.key, t.status, t.text) for t in view.tiles() if t.status != "nodata"] == []
        assert all(r.x1 == (NOW + outage) * 1000.0 for fig in view.figures() for r in rects(fig))


def test_an_engine_that_left_is_never_shown_ok(api: StaticDetectorAPI) -> None:
    """The detector keeps an engine's history after it leaves (a replica scaled down: the source
    stops naming it, its alerts resolve): its chip says it has no recent data, never "ok"."""
    api.set_signals(ENGINE_B, synthetic_history(end=NOW - 600.0, duration_s=3000, seed=2), model="llama")
    api.set_alerts([loop_alert()])
    ctx = context(api)
    _, _, chips, *_ = live.update(ctx, ENGINE_A, 900)
    text = str(chips)
    assert "10.0.0.2:8100: ok" not in text
    assert "10.0.0.2:8100: no data in the last minute" in text
    assert "VLLMMetastableRetryLoop (critical)" in text  # the engine still reporting as before


def test_the_history_table_links_each_episodes_runbook_section(api: StaticDetectorAPI) -> None:
    """The detector's /episodes carry each alert's runbook_url; the table showed none of them."""
    ctx = context(api)
    api.set_episodes(
        [
            {**episode("VLLMMetastableRetryLoop", ENGINE_A, NOW - 1100, None, ident=1),
             "runbook_url": "/runbook#VLLMMetastableRetryLoop"},
            {**episode("VLLMOrphanedExecutions", ENGINE_B, NOW - 900, NOW - 800, ident=2),
             "runbook_url": "https://wiki.example/retrywatch#VLLMOrphanedExecutions"},
            {**episode("VLLMPromptTokensUncounted", ENGINE_B, NOW - 700, None, ident=3),
             "runbook_url": "javascript:alert(1)"},
        ]
    )  # fmt: skip
    _, table, _, _, _ = history.update(ctx, history.ALL, history.ALL, 0)
    links = {
        row.children[0].children: cell.children.href
        for row in table.children[1].children
        for cell in row.children
        if getattr(cell.children, "className", "") == "episode-runbook"
    }
    assert links == {
        "VLLMMetastableRetryLoop": f"{api.url}/runbook#VLLMMetastableRetryLoop",  # on the detector
        "VLLMOrphanedExecutions": "https://wiki.example/retrywatch#VLLMOrphanedExecutions",
    }  # a link that is not a web link is never shown


def test_experiments_shows_a_whatif_side_by_side_with_headroom(
    api: StaticDetectorAPI, runs_dir: Path
) -> None:
    root = whatif_dir(runs_dir)
    page = str(experiments.layout(context(api, root)))
    for graph in ("graph-whatif-delivery", "graph-whatif-headroom", "graph-whatif-curve"):
        assert graph in page, graph
    assert "whatif-table" in page
    # the policies side by side: fates, executions per call, loops and alerts, the headroom, and
    # beside it where the loop formed and where the engine was simply overloaded
    for text in (
        "21.9", "78.1", "3.34", "1/1 runs, from 28 s, held up to 41.5 s", "VLLMMetastableRetryLoop (30 s)",
        "none (0/1)", "1.325x Ĉ (within 0.0687)", "≥ 6x Ĉ (bound)", "0/1", "1/1",
        "loop onset", "at 2.7x Ĉ (not at 1.4x)", "at 1.4x Ĉ (not at 1.325x)",
    ):  # fmt: skip
        assert text in page, text
    # its points' runs are listed below, as any reproduce output's
    assert "2 runs from points" in page
    summary = experiments.run_view(context(api, root), "diagnostic__retries-on__qwen2.5-7b__r1").summary
    assert "not recovered" in summary
    headroom = figures.whatif_headroom_figure(json.loads((root / "whatif.json").read_text()))
    assert list(headroom.data[0].x) == [1.325, 6.0] and list(headroom.data[2].x) == [2.7]


def test_whatif_figures_name_the_criterion_in_force_and_draw_the_curve(runs_dir: Path) -> None:
    """The headroom figure's title and legend name the criterion whatif.json was searched by (a
    what-if written before it named one: the metastable collapse it was); the curve draws each
    policy's fates against load, the objective as a line, and the headroom, the loop's onset
    and the overload where they were found."""
    body = json.loads((whatif_dir(runs_dir) / "whatif.json").read_text())
    headroom = figures.whatif_headroom_figure(body)
    assert "safe by 'objective' (meets the delivery objective)" in headroom.layout.title.text
    assert [t.name for t in headroom.data[1:]] == [
        "tried: meets the delivery objective",
        "tried: misses the delivery objective",
    ]
    old = {k: v for k, v in body.items() if k not in ("criterion", "objective")}
    assert "metastable" in figures.whatif_headroom_figure(old).layout.title.text
    assert figures.whatif_headroom_figure(old).data[2].name == "tried: a metastable collapse"
    curve = figures.whatif_curve_figure(body)
    assert "'objective'" in curve.layout.title.text
    # only "none" has a curve: within / late / failed against load
    assert [t.name for t in curve.data] == ["within the deadline", "late", "failed"]
    assert list(curve.data[0].x) == [0.5, 1.325, 1.4, 2.7]
    assert [round(y, 1) for y in curve.data[2].y] == [0.0, 0.0, 0.0, 78.1]
    lines = {(s.type, s.x0 if s.type == "line" and s.x0 == s.x1 else s.y0) for s in curve.layout.shapes}
    assert {("line", 98.0), ("line", 1.325), ("line", 2.7), ("line", 1.4)} <= lines
    notes = {a.text for a in curve.layout.annotations}
    assert {"objective 98%", "headroom 1.325x", "loop onset 2.7x", "overload 1.4x"} <= notes
    assert (
        "no curve"
        in figures.whatif_curve_figure(old | {"policies": {"x": {"at_load": {}}}}).layout.annotations[0].text
    )


def test_experiments_names_a_broken_whatif(api: StaticDetectorAPI, runs_dir: Path) -> None:
    root = whatif_dir(runs_dir)
    (root / "whatif.json").write_text(json.dumps({"policies": {"none": {"does": "x"}}}))
    assert "policy 'none' needs an 'at_load' object" in str(experiments.layout(context(api, root)))


# --- a replayed trace's run (the real `reproduce run --trace` and `reproduce validate`) --------


def _full_height(fig: object) -> list[object]:
    return [s for s in rects(fig) if (s.y0, s.y1) == (0, 1)]  # type: ignore[attr-defined]


def test_a_trace_run_shows_its_arrivals_its_collapses_and_the_alerts_over_them(
    api: StaticDetectorAPI, trace_runs_dir: Path
) -> None:
    ctx = context(api, trace_runs_dir)
    page = str(experiments.layout(ctx))
    assert experiments.ARRIVALS_GRAPH_ID in page
    assert (
        "no-control (azure_code_2023_30min-load3)" in page
        and "no-control (azure_code_2023_30min-load1)" in page
    )
    run = ctx.runs().run(TRACE_SLUGS[3])  # type: ignore[union-attr]
    (collapse,) = run["collapses"]
    view = experiments.run_view(ctx, TRACE_SLUGS[3])
    assert view.arrivals is not None and len(view.panels) == len(experiments.RUN_GRAPH_IDS)
    lines = {t.name: t for t in view.arrivals.data}
    arriving = np.array(lines["calls arriving (first attempts)"].y, dtype=float)
    in_time = np.array(lines["delivered within the deadline"].y, dtype=float)
    t = np.array(lines["calls arriving (first attempts)"].x, dtype=float)
    assert np.nanmax(arriving) > 2 * run["capacity"]  # the trace's burst, at 3 Ĉ
    looping = (t > collapse["metastable_at_s"]) & (t < collapse["end_s"])
    assert np.nanmax(in_time[looping]) < 0.2 * run["capacity"]  # while the loop holds, next to none in time
    alerts = {a["alertname"]: a for a in ctx.runs().alerts[TRACE_SLUGS[3]]}  # type: ignore[union-attr]
    assert "VLLMMetastableRetryLoop" in alerts
    for fig in (view.arrivals, *view.panels):
        (band,) = [s for s in rects(fig) if s.name == "collapse"]  # type: ignore[attr-defined]
        assert (band.x0, band.x1) == (collapse["start_s"], collapse["end_s"])
        (loop,) = [s for s in rects(fig) if s.name == "metastable"]  # type: ignore[attr-defined]
        assert (loop.x0, loop.x1) == (collapse["metastable_at_s"], collapse["end_s"])
        (burst,) = [s for s in rects(fig) if s.name == "burst"]  # type: ignore[attr-defined]
        assert (burst.x0, burst.x1) == (collapse["burst"]["start_s"], collapse["burst"]["end_s"])
        row = [s for s in rects(fig) if str(s.name).endswith(" alert")]  # type: ignore[attr-defined]
        assert row and all(s.y0 >= 0.9 for s in row)  # their own row, not full-height shading
        assert min(s.x0 for s in row) == min(a["fired_at_s"] for a in alerts.values())
        assert {s.name for s in _full_height(fig)} == {"collapse", "metastable"}
        assert not [s for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1]  # no pulse marks
    summary = view.summary
    assert "trace azure_code_2023_30min at 3x Ĉ: 1 collapse (1 metastable)" in summary
    assert f"{collapse['start_s']:.0f}–{collapse['end_s']:.0f} s" in summary
    assert f"metastable from {collapse['metastable_at_s']:.0f} s" in summary
    assert "after the pulse" not in summary and "VLLMMetastableRetryLoop at" in summary

    calm = experiments.run_view(ctx, TRACE_SLUGS[1])
    assert calm.arrivals is not None and "trace azure_code_2023_30min at 1x Ĉ: no collapse" in calm.summary
    assert "no alerts" in calm.summary  # its own validation entry, not the 3-Ĉ run's
    assert not [s for f in (calm.arrivals, *calm.panels) for s in rects(f)]


def _post_run(app: Any, run_id: str) -> Any:
    client = app.server.test_client()
    (spec,) = [
        c for c in client.get("/_dash-dependencies").get_json() if "experiments-run-summary" in c["output"]
    ]
    outputs = [_prop(o) for o in spec["output"].strip(".").split("...")]
    body = {"output": spec["output"], "outputs": outputs, "inputs": [_prop("experiments-run.value", run_id)]}
    got = client.post("/_dash-update-component", json={**body, "changedPropIds": ["experiments-run.value"]})
    assert got.status_code == 200
    return got.get_json()["response"]


def test_the_arrivals_panel_shows_for_a_trace_run_and_stays_hidden_for_a_pulse_run(
    api: StaticDetectorAPI, runs_dir: Path, trace_runs_dir: Path
) -> None:
    trace = _post_run(
        create_app(DashboardConfig(detector_url=api.url, runs_dir=trace_runs_dir)), TRACE_SLUGS[3]
    )
    assert trace[experiments.ARRIVALS_GRAPH_ID]["style"] == experiments.SHOWN
    pulse = create_app(DashboardConfig(detector_url=api.url, runs_dir=runs_dir))
    got = _post_run(pulse, "diagnostic__retries-on__qwen2.5-7b__r1")
    assert got[experiments.ARRIVALS_GRAPH_ID]["style"] == experiments.HIDDEN


@pytest.mark.parametrize(
    "change",
    [
        {"collapses": "soon"},
        {"collapses": [{"end_s": 3.0}]},
        {"collapses": [{"start_s": 60.0, "end_s": 420.0, "burst": "early"}]},
        {"collapses": None},
        {"workload": "azure"},
        {"workload": None, "settings": "azure"},  # an entry from before ``workload``
    ],
)
def test_a_hand_edited_trace_run_is_a_note_not_a_500(
    api: StaticDetectorAPI, trace_runs_dir: Path, tmp_path: Path, change: dict[str, Any]
) -> None:
    root = tmp_path / "edited"
    shutil.copytree(trace_runs_dir, root)
    summary = json.loads((root / "summary.json").read_text())
    (run,) = [r for r in summary["runs"] if r["slug"] == TRACE_SLUGS[3]]
    run.update(change)
    (root / "summary.json").write_text(json.dumps(summary))
    app = create_app(DashboardConfig(detector_url=api.url, runs_dir=root))
    view = experiments.run_view(app.server.config["RETRYWATCH_CONTEXT"], TRACE_SLUGS[3])
    assert "summary entry unreadable" in view.summary and "VLLMMetastableRetryLoop at" in view.summary
    assert view.arrivals is not None and len(view.panels) == 5  # the series still drawn
    assert "summary entry unreadable" in _post_run(app, TRACE_SLUGS[3])["experiments-run-summary"]["children"]
