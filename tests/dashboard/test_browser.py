"""Every page in a real headless Chromium against the app served by a real HTTP server: graphs
drawn, no console errors, selections update the graphs, the banner follows the alert state.
Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dashboard.context import DashboardConfig
from tests.dashboard.staticapi import StaticDetectorAPI

from .conftest import DRAW_TIMEOUT_MS, ENGINE_B, TRACE_SLUGS, Page, ServedApp, loop_alert, whatif_dir

pytestmark = pytest.mark.browser


CREATED_MAX = """() => {
    const gd = document.querySelector('#graph-attempts .js-plotly-plot');
    const tr = gd && gd._fullData && gd._fullData.find(t => t.name === 'executions created');
    return tr ? Math.max(...Array.from(tr.y).filter(v => v !== null)) : -1;
}"""


PANEL_BOXES = """() => [...document.querySelectorAll('#graph-grid .js-plotly-plot')].map(gd => {
    const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
        return {x: r.x, y: r.y, w: r.width, h: r.height}; };
    return {id: gd.parentElement.id, plot: box(gd.querySelector('.nsewdrag')),
            title: box(gd.querySelector('.gtitle')),
            modebar: box(gd.querySelector('.modebar-container .modebar'))};
})"""


def _overlap(a: dict[str, float], b: dict[str, float]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def assert_panels_line_up(tab: Page) -> None:
    """The live panels' plot areas are equally wide and those in one column start at one x
    (their x-axes line up); no title runs under its panel's toolbar."""
    boxes = tab.page.evaluate(PANEL_BOXES)
    assert len(boxes) == 5
    widths = {round(b["plot"]["w"]) for b in boxes}
    assert max(widths) - min(widths) <= 1, boxes
    columns: dict[int, list[float]] = {}
    for b in boxes:
        columns.setdefault(round(b["plot"]["x"] / 100), []).append(b["plot"]["x"])
    for xs in columns.values():
        assert max(xs) - min(xs) <= 1, boxes
    for b in boxes:
        assert b["title"] is not None and b["modebar"] is not None, b
        assert not _overlap(b["title"], b["modebar"]), b


def test_live_page_engine_selection_and_banner(browser: Any, api: StaticDetectorAPI) -> None:
    """A fleet of two engines whose vLLM engine label is "0" on both: selecting the second engine
    shows its own series, tiles, chips and episodes; the banner names engines by instance."""
    with ServedApp(DashboardConfig(detector_url=api.url, refresh_s=1.0)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + "/?range=900")  # 15 min: 181 points a signal
        tab.wait_graphs(4)
        banner = tab.page.locator("#alert-banner")
        banner.wait_for(state="visible", timeout=DRAW_TIMEOUT_MS)
        assert "VLLMMetastableRetryLoop" in banner.inner_text()
        assert "on 10.0.0.1:8100 (qwen)" in banner.inner_text()  # host:port, not the /metrics URL
        assert tab.page.locator("#live-engine").inner_text().strip() == "10.0.0.1:8100"  # the first
        assert tab.trace_max("graph-attempts", "executions created") > 2.8
        tiles = tab.page.locator("#tiles")
        assert "VLLMMetastableRetryLoop" in tiles.inner_text()
        assert "VLLMPromptTokensUncounted" not in tiles.inner_text()
        chips = tab.page.locator("#engine-states").inner_text()
        assert (
            "10.0.0.1:8100 (qwen): VLLMMetastableRetryLoop" in chips
            and "10.0.0.2:8100 (llama): VLLMPromptTokensUncounted" in chips
        )
        assert_panels_line_up(tab)
        tab.screenshot("live-engine-a.png")

        tab.select("live-engine", "10.0.0.2:8100")
        tab.page.wait_for_function(
            f"() => ({CREATED_MAX})() >= 0 && ({CREATED_MAX})() < 2.8", timeout=DRAW_TIMEOUT_MS
        )
        # its own alert on its tiles, its own open episode shaded (not engine A's two)
        tab.page.wait_for_function(
            "() => document.querySelector('#tiles').innerText.includes('VLLMPromptTokensUncounted')",
            timeout=DRAW_TIMEOUT_MS,
        )
        assert "VLLMMetastableRetryLoop" not in tiles.inner_text()
        shapes = tab.page.evaluate(
            "() => document.querySelector('#graph-attempts .js-plotly-plot').layout.shapes"
            ".filter(s => s.type === 'rect').length"
        )
        assert shapes == 1
        # the alerts resolve: the banner goes at the next refresh; one fires again: it comes back
        api.set_alerts([])
        banner.wait_for(state="hidden", timeout=DRAW_TIMEOUT_MS)
        api.set_alerts([loop_alert(ENGINE_B)])
        banner.wait_for(state="visible", timeout=DRAW_TIMEOUT_MS)
        assert "on 10.0.0.2:8100 (llama)" in banner.inner_text()
        tab.page.wait_for_function(
            "() => document.querySelector('#tiles').innerText.includes('VLLMMetastableRetryLoop')",
            timeout=DRAW_TIMEOUT_MS,
        )
        tab.screenshot("live-engine-b.png")
        assert tab.errors == []
        tab.close()


def test_history_page_filters(browser: Any, api: StaticDetectorAPI) -> None:
    with ServedApp(DashboardConfig(detector_url=api.url)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + "/history")
        tab.wait_graphs(1)
        tab.page.locator("#history-range").get_by_text("all", exact=True).click()  # the whole history
        rows = tab.page.locator("#episodes-table .episode-row")
        tab.page.wait_for_function("() => document.querySelectorAll('.episode-row').length === 4")
        tab.select("history-engine", "10.0.0.1:8100 (qwen)")  # listed by instance, not by engine "0"
        tab.page.wait_for_function("() => document.querySelectorAll('.episode-row').length === 2")
        assert ENGINE_B not in tab.page.locator("#episodes-table").inner_text()
        tab.select("history-engine", "10.0.0.2:8100 (llama)")
        tab.select("history-alert", "VLLMOrphanedExecutions")
        tab.page.wait_for_function("() => document.querySelectorAll('.episode-row').length === 1")
        assert "10.0.0.2:8100 (llama)" in rows.first.inner_text()
        tab.screenshot("history.png")
        assert tab.errors == []
        tab.close()


def test_experiments_page_run_selection(browser: Any, api: StaticDetectorAPI, runs_dir: Path) -> None:
    with ServedApp(DashboardConfig(detector_url=api.url, runs_dir=runs_dir)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + "/experiments")
        tab.wait_graphs(6)
        summary = tab.page.locator("#experiments-run-summary")
        # the run panels arrive with the summary line (one callback): wait for it
        tab.page.wait_for_function(
            "() => document.querySelector('#experiments-run-summary').innerText.includes('retries-off')",
            timeout=DRAW_TIMEOUT_MS,
        )
        assert "recovered" in summary.inner_text()
        assert tab.trace_max("graph-run-attempts", "retries") <= 0.0
        tab.select("experiments-run", "diagnostic · retries-on · qwen2.5-7b · run 1 (not recovered)")
        tab.page.wait_for_function(
            "() => document.querySelector('#experiments-run-summary').innerText.includes('RetryLoop')",
            timeout=DRAW_TIMEOUT_MS,
        )
        tab.wait_graphs(6)
        assert tab.trace_max("graph-run-attempts", "retries") > 4.0
        assert not tab.page.locator("#graph-run-arrivals").is_visible()  # a trace run's panel only
        tab.screenshot("experiments.png")
        assert tab.errors == []
        tab.close()


# The shapes a run panel draws by name, and how many of them Plotly put on the page (its shape
# layers hold one path per shape drawn).
SHAPES = """([id, name]) => {
    const gd = document.querySelector('#' + id + ' .js-plotly-plot');
    const drawn = gd.querySelectorAll('.shapelayer path').length;
    return {named: gd._fullLayout.shapes.filter(s => s.name === name).map(s => [s.x0, s.x1]), drawn};
}"""


def test_experiments_page_shows_a_trace_runs_arrivals_and_collapses(
    browser: Any, api: StaticDetectorAPI, trace_runs_dir: Path
) -> None:
    """A replayed trace (the real reproduce run): its arrivals panel drawn with the burst above
    Ĉ, its collapse shaded on every run panel; the run at 1 Ĉ: no collapse shaded."""
    with ServedApp(DashboardConfig(detector_url=api.url, runs_dir=trace_runs_dir)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + f"/experiments?run={TRACE_SLUGS[3]}")
        tab.page.wait_for_function(
            "() => document.querySelector('#experiments-run-summary')?.innerText.includes('collapse')",
            timeout=DRAW_TIMEOUT_MS,
        )
        tab.wait_graphs(8)
        summary = tab.page.locator("#experiments-run-summary").inner_text()
        assert "at 3x Ĉ: 1 collapse (1 metastable)" in summary
        assert tab.page.locator("#graph-run-arrivals").is_visible()
        assert tab.trace_max("graph-run-arrivals", "calls arriving (first attempts)") > 40.0  # 3 Ĉ is ~65/s
        assert tab.trace_max("graph-run-arrivals", "delivered within the deadline") > 0.0
        for graph in ("graph-run-arrivals", "graph-run-attempts", "graph-run-delivery"):
            shapes = tab.page.evaluate(SHAPES, [graph, "collapse"])
            assert len(shapes["named"]) == 1 and shapes["drawn"] >= 4, (
                graph,
                shapes,
            )  # + loop, burst, alerts
        # laid out in its cell once shown (not at Plotly's default width, spilling out of it)
        widths = tab.page.evaluate(
            "() => ['graph-run-arrivals', 'graph-run-attempts'].map(id => "
            "document.querySelector('#' + id + ' .nsewdrag').getBoundingClientRect().width)"
        )
        assert abs(widths[0] - widths[1]) <= 1, widths
        tab.screenshot("experiments-trace.png")
        tab.select(
            "experiments-run",
            "composition · no-control (azure_code_2023_30min-load1) · qwen2.5-7b-h100 · run 0 (recovered)",
        )
        tab.page.wait_for_function(
            "() => document.querySelector('#experiments-run-summary')?.innerText.includes('no collapse')",
            timeout=DRAW_TIMEOUT_MS,
        )
        tab.wait_graphs(8)
        assert tab.page.evaluate(SHAPES, ["graph-run-arrivals", "collapse"]) == {"named": [], "drawn": 0}
        assert tab.trace_max("graph-run-arrivals", "calls arriving (first attempts)") > 0.0
        assert tab.errors == []
        tab.close()


def test_experiments_page_shows_a_whatif_side_by_side(
    browser: Any, api: StaticDetectorAPI, runs_dir: Path
) -> None:
    """A what-if's DIR (whatif.json beside its points): the policies' table and its figures
    drawn in the browser (delivery per policy, headroom per policy with the load tried, the
    curve against load), its
    points' runs below as any run."""
    root = whatif_dir(runs_dir)
    with ServedApp(DashboardConfig(detector_url=api.url, runs_dir=root)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + "/experiments")
        tab.page.wait_for_selector("#whatif-table", timeout=DRAW_TIMEOUT_MS)
        table = tab.page.locator("#whatif-table").inner_text()
        for text in ("none", "coalescing", "1.325x Ĉ (within 0.0687)", "≥ 6x Ĉ (bound)"):
            assert text in table, text
        tab.page.wait_for_function(
            "() => ['graph-whatif-delivery', 'graph-whatif-headroom', 'graph-whatif-curve'].every(id => "
            "document.querySelector('#' + id + ' .js-plotly-plot')?._fullData !== undefined)",
            timeout=DRAW_TIMEOUT_MS,
        )
        bars = tab.page.evaluate(
            "() => document.querySelector('#graph-whatif-headroom .js-plotly-plot')._fullData[0].x"
        )
        assert list(bars) == [1.325, 6.0]
        assert "2 runs from points" in tab.page.locator("body").inner_text()
        tab.screenshot("experiments-whatif.png")
        assert tab.errors == []
        tab.close()


def test_headroom_page(browser: Any, api: StaticDetectorAPI, plan_dir: Path) -> None:
    """The Headroom page of two real plan-daily runs: reached from the nav, its answer, the days'
    headroom with the observed peak marked, and the newest run's curves drawn."""
    with ServedApp(DashboardConfig(detector_url=api.url, plan_dir=plan_dir)) as served:
        tab = Page(browser)
        tab.page.goto(served.url + "/history")
        tab.page.click("#nav-headroom")
        tab.wait_graphs(2)
        assert tab.page.url.endswith("/headroom")
        assert "than the policy in force (none)" in tab.page.locator("#headroom-answer").inner_text() or (
            "The policy in force, none" in tab.page.locator("#headroom-answer").inner_text()
        )
        assert tab.trace_max("graph-headroom-history", "observed peak") > 0
        assert tab.trace_max("graph-headroom-curves", "within the deadline") == 100.0
        tab.screenshot("headroom.png")
        assert tab.errors == []
        tab.close()
