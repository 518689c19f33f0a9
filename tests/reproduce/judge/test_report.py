"""The report: Markdown tables and an HTML page with plotly figures from summary.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from foundation.rundir import RunDirError
from reproduce.conditions import expand
from reproduce.judge.report import render_markdown, write_report
from reproduce.judge.summary import write_summary
from reproduce.judge.validate import validate_dir
from reproduce.registry import get_backend
from reproduce.runner import run_many
from reproduce.workloads.plan import RunClock
from tests.dashboard.conftest import Page, browser  # noqa: F401 (the fixture)
from tests.reproduce.test_runner import SMALL


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("report")
    runs = [
        *expand(
            "diagnostic",
            models="qwen2.5-7b-h100",
            runs=1,
            conditions=["retries-off-cancel-off", "retries-on-cancel-off"],
        ),
        *expand("tracing", runs=1, conditions=["steps-2k-cancel-on"]),
        *expand("trigger-sweep", models="qwen2.5-7b-h100", runs=1)[:2],
    ]
    run_many(get_backend("sim", **SMALL), runs, folder, jobs=2, clock=RunClock(10.0), progress=False)
    return folder


def test_markdown_tables_per_block_and_trace_breakdown(out: Path) -> None:
    md_path, html_path = write_report(out)
    md = md_path.read_text()
    for heading in ("## diagnostic", "## tracing", "## trigger-sweep", "## Trace breakdown"):
        assert heading in md
    rows = [line for line in md.splitlines() if line.startswith("| retries-")]
    assert any(line.startswith("| retries-off-cancel-off | qwen2.5-7b-h100 | 1/1 |") for line in rows)
    assert any(line.startswith("| retries-on-cancel-off | qwen2.5-7b-h100 | 0/1 | – |") for line in rows)
    assert "retries-on-cancel-off (pulse-1.5)" in md  # sweep cells stay apart
    html = html_path.read_text()
    assert html.count('class="plotly-graph-div"') == 4
    assert "Delivery by cohort" in html and "Recovery time" in html and "Computed prompt tokens" in html
    # the tables are HTML tables, not Markdown in a <pre>, and the missing validation is said so
    assert html.count("<table>") == 4 and "<pre>" not in html and "| --- |" not in html
    assert "<th>condition</th>" in html and "No validation yet" in html


def test_the_page_shows_the_validation_with_a_timeline_per_block_and_needs_no_network(out: Path) -> None:
    validate_dir(out)
    try:
        _, html_path = write_report(out)
        html = html_path.read_text()
    finally:
        for name in ("validation.json", "validation.md"):
            (out / name).unlink()
    assert "id='validation'" in html and "No validation yet" not in html
    # validation.md's tables, rendered
    assert "<h3>Cause alerts</h3>" in html and "<th>recall over metastable collapses</th>" in html
    assert "<td>VLLMMetastableRetryLoop</td>" in html and "<strong>recall</strong>" in html
    assert html.count("<table>") >= 4 + 4  # the report's 4; cause, data, by block, runs
    # 4 figures of the runs, then a timeline per block (diagnostic, tracing, trigger-sweep)
    assert html.count('class="plotly-graph-div"') == 4 + 3
    assert "diagnostic: collapses (shaded)" in html and "collapse, metastable" in html
    # plotly.js is in the page once, and nothing is fetched from elsewhere
    assert html.count("plotly.js v") == 1
    assert "<script src=" not in html and 'src="http' not in html


def test_markdown_from_hand_built_entries() -> None:
    entry = {
        "block": "b",
        "condition": "c",
        "model": "m",
        "recovered": True,
        "recovery_time_s": 120.0,
        "delivery": {k: {"within_deadline": 0.5, "by_horizon": 0.75} for k in ("pulse", "hold", "primary")},
        "rates_x_capacity": {"attempts": 1.5, "executions_created": 0.9},
        "waiting_over_littles_law": None,
        "prompt_token_gap_hold": 0.25,
    }
    md = render_markdown([entry, {**entry, "recovered": False, "recovery_time_s": None}])
    assert "| c | m | 1/2 | 120 | 50.0 / 25.0 / 25.0 |" in md
    assert "| 1.50 | 0.90 | – | – | – | 25.0% |" in md
    # runs of other clients than the study's are their own rows, named by their clients
    sdk = {**entry, "settings": {"client": "openai-sdk"}}
    md = render_markdown([entry, sdk, {**entry, "settings": {"client": "study"}}])
    assert "| c | m | 2/2 |" in md and "| c [openai-sdk clients] | m | 1/1 |" in md


def test_missing_summary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        write_report(tmp_path)


def test_report_survives_an_empty_cohort(tmp_path: Path) -> None:
    entry = {
        "block": "b",
        "condition": "c",
        "model": "m",
        "run": 0,
        "slug": "b__c__m__r0",
        "recovered": False,
        "recovery_time_s": None,
        "pulse": {"start_s": 12.0, "end_s": 22.7},
        "hold_end_s": 94.7,
        "delivery": {
            "pulse": {"offered": 0, "within_deadline": None, "by_horizon": None},
            "hold": {"offered": 3, "within_deadline": 1 / 3, "by_horizon": 2 / 3},
            "primary": {"offered": 2, "within_deadline": 0.5, "by_horizon": 0.5},
        },
        "rates_x_capacity": {"attempts": 2.0, "executions_created": 1.5},
    }
    write_summary(tmp_path, [entry])
    md_path, html_path = write_report(tmp_path)
    assert "| c | m | 0/1 | – | – | 33.3 / 33.3 / 33.3 |" in md_path.read_text()
    assert html_path.read_text().count('class="plotly-graph-div"') == 3


@pytest.mark.browser
def test_the_page_draws_offline_in_a_real_browser(out: Path, browser: Any) -> None:  # noqa: F811
    """report.html in a headless Chromium that may fetch nothing but the file itself: every
    figure is drawn (the runs' four, a validation timeline per block), without a console error."""
    validate_dir(out)
    try:
        _, html_path = write_report(out)
    finally:
        for name in ("validation.json", "validation.md"):
            (out / name).unlink()
    tab = Page(browser)
    fetched: list[str] = []

    def only_the_file(route: Any) -> None:
        url = route.request.url
        if url.startswith("file:"):
            route.continue_()
        else:
            fetched.append(url)
            route.abort()

    tab.page.route("**/*", only_the_file)
    try:
        tab.page.goto(html_path.as_uri())
        tab.wait_graphs(4 + 3)
        names = tab.page.evaluate(
            "() => [...document.querySelectorAll('.js-plotly-plot')].map(g => g._fullData.map(t => t.name))"
        )
        assert any(
            "collapse, metastable" in traces and "VLLMMetastableRetryLoop" in traces for traces in names
        )
        assert tab.page.locator("#validation").is_visible()
        assert tab.page.locator("table").count() >= 8
        assert fetched == [] and tab.errors == []
    finally:
        tab.close()
