"""Pure figure builders: what each panel shows, its units, its colours and its bad-input errors."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard import figures
from dashboard.figures import (
    PALETTE,
    Shade,
    attempts_figure,
    cohort_shares,
    creation_rate_vs_recovery_figure,
    delivery_by_cohort_figure,
    downsample,
    episodes_timeline_figure,
    fates_figure,
    prompt_tokens_figure,
    queue_figure,
    run_shades,
)
from detector.thresholds import ALERTS_BY_NAME
from foundation.groundtruth import Collapse
from foundation.rundir import RunDirError


def make_run(
    condition: str, run: int, *, recovered: bool, created: float, attempts: float, model: str = "m1"
) -> dict:
    return {
        "block": "diagnostic",
        "condition": condition,
        "model": model,
        "run": run,
        "recovered": recovered,
        "recovery_time_s": 60.0 * run if recovered else None,
        "delivery": {
            "pulse": {"within_deadline": 0.4, "by_horizon": 0.9},
            "hold": {"within_deadline": 0.8 if recovered else 0.1, "by_horizon": 1.0 if recovered else 0.3},
            "primary": {
                "within_deadline": 0.9 if recovered else 0.05,
                "by_horizon": 1.0 if recovered else 0.2,
            },
        },
        "rates_x_capacity": {"attempts": attempts, "executions_created": created},
        "series": f"runs/diagnostic__{condition}__{model}__r{run}/metrics.jsonl",
        "pulse": {"start_s": 120.0, "end_s": 227.0},
    }


RUNS = [
    make_run("retries-off", 1, recovered=True, created=0.62, attempts=0.62),
    make_run("retries-off", 2, recovered=True, created=0.60, attempts=0.60),
    make_run("retries-on", 1, recovered=False, created=2.3, attempts=2.4),
    make_run("retries-on", 2, recovered=False, created=2.1, attempts=2.2),
]


def test_delivery_by_cohort_stacks_within_late_undelivered_per_condition() -> None:
    fig = delivery_by_cohort_figure(RUNS)
    assert fig.layout.barmode == "stack"
    names = {(t.name, t.xaxis) for t in fig.data}
    assert ("within the deadline", "x") in names and ("undelivered", "x3") in names
    # hold cohort (second panel): retries-on is 10% within, 20% late, 70% undelivered
    hold = {t.name: dict(zip(t.y, t.x, strict=True)) for t in fig.data if t.xaxis == "x2"}
    assert hold["within the deadline"]["retries-on"] == pytest.approx(10.0)
    assert hold["late"]["retries-on"] == pytest.approx(20.0)
    assert hold["undelivered"]["retries-on"] == pytest.approx(70.0)
    assert hold["within the deadline"]["retries-off"] == pytest.approx(80.0)
    for axis in ("xaxis", "xaxis2", "xaxis3"):
        assert "%" in fig.layout[axis].title.text


def test_delivery_labels_name_the_model_when_models_vary() -> None:
    runs = [*RUNS, make_run("retries-on", 1, recovered=False, created=2.0, attempts=2.0, model="m2")]
    fig = delivery_by_cohort_figure(runs)
    assert "m2 · retries-on" in set(fig.data[0].y)


def test_delivery_rejects_impossible_shares() -> None:
    bad = make_run("x", 1, recovered=True, created=0.5, attempts=0.5)
    bad["delivery"]["pulse"] = {"within_deadline": 0.9, "by_horizon": 0.5}
    with pytest.raises(RunDirError, match="within_deadline <= by_horizon"):
        delivery_by_cohort_figure([bad])
    missing = make_run("x", 1, recovered=True, created=0.5, attempts=0.5)
    del missing["delivery"]
    with pytest.raises(RunDirError, match="delivery"):
        delivery_by_cohort_figure([missing])


def test_cohort_shares_reads_counts_when_calls_given() -> None:
    run = {"delivery": {"pulse": {"within_deadline": 30, "by_horizon": 90, "calls": 100}}}
    assert cohort_shares(run, "pulse") == pytest.approx((0.3, 0.6, 0.1))


def test_creation_rate_vs_recovery_separates_recovered_runs() -> None:
    fig = creation_rate_vs_recovery_figure(RUNS)
    by_panel = {(t.name, t.xaxis): list(t.x) for t in fig.data}
    assert sorted(by_panel[("recovered", "x2")]) == [0.60, 0.62]
    assert sorted(by_panel[("not recovered", "x2")]) == [2.1, 2.3]
    assert sorted(by_panel[("not recovered", "x")]) == [2.2, 2.4]
    # a dashed line at 1 Ĉ on both panels
    lines = [s for s in fig.layout.shapes if s.x0 == 1.0 and s.x1 == 1.0]
    assert len(lines) == 2
    assert all("Ĉ" in fig.layout[a].title.text for a in ("xaxis", "xaxis2"))


def test_creation_rate_needs_executions_created() -> None:
    run = make_run("x", 1, recovered=True, created=0.5, attempts=0.5)
    del run["rates_x_capacity"]["executions_created"]
    with pytest.raises(RunDirError, match="executions_created"):
        creation_rate_vs_recovery_figure([run])


def test_empty_runs_give_an_annotated_figure() -> None:
    assert delivery_by_cohort_figure([]).layout.annotations[0].text == "no runs"
    assert creation_rate_vs_recovery_figure([]).layout.annotations[0].text == "no runs"


def series(values: list[float], t0: float = 1_700_000_000.0) -> np.ndarray:
    return np.column_stack([t0 + 5.0 * np.arange(len(values)), values])


SIGNALS = {
    "attempt_rate_first": series([1.0, 1.0, 1.0]),
    "attempt_rate_retry": series([0.0, 2.0, 3.0]),
    "attempt_rate": series([1.0, 3.0, 4.0]),
    "execution_creation_rate": series([1.0, 3.0, 4.0]),
    "capacity": series([2.8, 2.8, 2.8]),
    "deadline": series([120.0, 120.0, 120.0]),
    "vllm_waiting": series([0.0, 100.0, 300.0]),
    "proxy_queued": series([0.0, 0.0, 5.0]),
    "completion_rate_completed": series([1.0, 0.5, 0.0]),
    "completion_rate_orphaned": series([0.0, 2.0, 2.8]),
    "completion_rate_refused": series([0.0, 0.1, 0.1]),
    "completion_rate_failed": series([0.0, 0.1, 0.2]),
    "prompt_tokens_counted_rate": series([12000.0, 5000.0, 1000.0]),
    "prompt_tokens_admitted_rate": series([12000.0, 20000.0, 30000.0]),
    "delivery_burn_rate_short": series([0.0, 10.0, 45.0]),
    "delivery_burn_rate_long": series([0.0, 2.0, 12.0]),
}


@pytest.mark.parametrize("builder", figures.LIVE_PANELS)
def test_live_panels_have_units_date_axis_and_palette_colours(builder) -> None:
    fig = builder(
        SIGNALS, [Shade(1_700_000_002.0, None, "VLLMMetastableRetryLoop", "critical")], now=1_700_000_010.0
    )
    assert fig.layout.xaxis.type == "date"
    assert fig.layout.yaxis.title.text  # a unit on the y axis
    assert fig.layout.xaxis.title.text == "time (UTC)"
    colours = {t.line.color for t in fig.data if t.line.color} | {
        t.marker.color for t in fig.data if t.marker.color
    }
    allowed = {*PALETTE, figures.GREY}
    assert colours <= allowed
    # the open episode is shaded up to `now`, in milliseconds on the date axis
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert rects[0].x0 == pytest.approx(1_700_000_002_000.0) and rects[0].x1 == pytest.approx(
        1_700_000_010_000.0
    )
    assert rects[0].fillcolor == figures.VERMILLION


def test_queue_panel_draws_executions_created_times_deadline() -> None:
    fig = queue_figure(SIGNALS)
    line = next(t for t in fig.data if t.name == "created × deadline")
    assert list(line.y) == [120.0, 360.0, 480.0]
    waiting = next(t for t in fig.data if t.name == "vLLM waiting")
    assert waiting.stackgroup == "q"


def test_fates_panel_stacks_execution_fates_only_and_draws_attempts_apart() -> None:
    fig = fates_figure(SIGNALS)
    by_name = {t.name: t for t in fig.data}
    stacked = {t.name for t in fig.data if t.stackgroup == "f"}
    # each execution has one fate: those add up; attempts attached or shed create none
    assert stacked == {"delivered", "orphaned", "cancelled", "dropped / refused / failed"}
    for name in ("attempts attached", "attempts shed"):
        assert by_name[name].stackgroup is None and by_name[name].line.dash == "dash"
    assert list(by_name["orphaned"].y) == [0.0, 2.0, 2.8]
    assert list(by_name["dropped / refused / failed"].y) == pytest.approx([0.0, 0.2, 0.3])
    assert len(by_name["attempts shed"].y) == 0  # no data: an empty trace, not an invented zero


def test_delivery_panel_draws_both_burn_rates_against_the_symptom_alerts_threshold() -> None:
    fig = figures.delivery_figure(SIGNALS)
    by_name = {t.name: list(t.y) for t in fig.data}
    assert by_name == {"burn rate, 60 s": [0.0, 10.0, 45.0], "burn rate, 300 s": [0.0, 2.0, 12.0]}
    (line,) = [s for s in fig.layout.shapes if s.type == "line"]
    assert line.y0 == line.y1 == ALERTS_BY_NAME["VLLMCallsNotDeliveredInTime"].condition.terms[0].threshold  # type: ignore[union-attr]
    assert figures.delivery_figure({}).layout.annotations[0].text.startswith("no data: burn rate")


def test_panel_without_data_says_so_and_names_what_is_missing() -> None:
    fig = attempts_figure({})
    note = fig.layout.annotations[0].text
    assert note.startswith("no data: first attempts, retries, executions created")
    # a source that stopped answering leaves nulls: still no data
    nulls = {"attempt_rate_first": [[1.0, float("nan")], [2.0, float("nan")]]}
    assert attempts_figure(nulls).layout.annotations[0].text.startswith("no data:")
    # values outside the shown range are no data in it either
    old = {"attempt_rate_first": [[1.0, 3.0]]}
    assert attempts_figure(old, x_range=(100.0, 200.0)).layout.annotations
    assert not attempts_figure(old, x_range=(0.0, 200.0)).layout.annotations
    for builder in (fates_figure, queue_figure, prompt_tokens_figure):
        assert builder({}).layout.annotations[0].text.startswith("no data: ")


def test_time_panels_share_margins_and_keep_legends_above_the_plot() -> None:
    # equal side margins and no legend beside the plot: stacked panels' x-axes line up
    for builder in (attempts_figure, fates_figure, queue_figure, prompt_tokens_figure):
        layout = builder(SIGNALS).layout
        assert (layout.margin.l, layout.margin.r) == (figures.TIME_MARGIN["l"], figures.TIME_MARGIN["r"])
        assert layout.legend.orientation == "h" and layout.legend.yanchor == "bottom"
        assert layout.yaxis.automargin is False


def test_downsample_bounds_points_and_keeps_the_mean() -> None:
    pts = series(list(np.arange(4320, dtype=float)))
    out = downsample(pts, 1000)
    assert out.shape == (1000, 2)
    assert out[:, 1].mean() == pytest.approx(pts[:, 1].mean(), rel=0.01)
    assert out[-1, 0] == pts[-1, 0]
    with pytest.raises(ValueError, match="pairs"):
        downsample(np.arange(6.0))


def test_seconds_axis_for_runs_and_run_shades() -> None:
    shades = run_shades(
        [{"alertname": "VLLMMetastableRetryLoop", "fired_at_s": 250.0, "resolved_at_s": None}]
    )
    assert shades[0].severity == "critical"
    fig = attempts_figure(
        {"attempt_rate_first": [[0.0, 1.0], [5.0, 2.0]]}, shades, now=900.0, x_kind="seconds"
    )
    assert fig.layout.xaxis.title.text == "time since run start (s)"
    assert fig.layout.shapes[0].x1 == 900.0


def test_episodes_timeline_one_row_per_alert_and_engine() -> None:
    eps = [
        {
            "alertname": "A",
            "severity": "critical",
            "labels": {"engine": "0", "instance": "e1"},
            "started_at": 100.0,
            "resolved_at": 400.0,
        },
        {
            "alertname": "A",
            "severity": "critical",
            "labels": {"engine": "0", "instance": "e2"},
            "started_at": 200.0,
            "resolved_at": None,
        },
        {
            "alertname": "B",
            "severity": "warning",
            "labels": {"engine": "0", "instance": "e1"},
            "started_at": 150.0,
            "resolved_at": 160.0,
        },
    ]
    fig = episodes_timeline_figure(eps, now=1000.0)
    rows = {y for t in fig.data for y in t.y}
    assert rows == {"A · e1", "A · e2", "B · e1"}  # by instance: every vLLM's engine label is "0"
    critical = next(t for t in fig.data if t.name == "critical")
    assert list(critical.x) == [300_000.0, 800_000.0]  # the open one runs to `now`
    empty = episodes_timeline_figure([], now=0.0)
    # an empty state, not date axes around January 2000
    assert empty.layout.annotations[0].text == "no alert episodes in this time range"
    assert empty.layout.xaxis.visible is False and not empty.data


def test_x_range_pins_every_panel_to_the_chosen_window() -> None:
    for builder in (attempts_figure, fates_figure, queue_figure, prompt_tokens_figure):
        fig = builder(SIGNALS, x_range=(1_700_000_000.0, 1_700_003_600.0))
        assert list(fig.layout.xaxis.range) == [1_700_000_000_000.0, 1_700_003_600_000.0]


def test_overlapping_alerts_shade_as_one_span_per_severity() -> None:
    shades = [
        Shade(100.0, 300.0, "A", "warning"),
        Shade(200.0, 400.0, "B", "warning"),
        Shade(250.0, None, "C", "critical"),
        Shade(900.0, 950.0, "D", "warning"),
    ]
    fig = attempts_figure({}, shades, now=1000.0, x_kind="seconds")
    rects = [(s.x0, s.x1, s.fillcolor) for s in fig.layout.shapes if s.type == "rect"]
    assert rects == [
        (100.0, 400.0, figures.ORANGE),
        (900.0, 950.0, figures.ORANGE),
        (250.0, 1000.0, figures.VERMILLION),  # drawn last: over the warnings
    ]


def test_cohorts_without_calls_are_left_out_and_variants_kept_apart() -> None:
    empty = make_run("sweep", 1, recovered=True, created=0.5, attempts=0.5)
    empty["variant"] = "pulse 1.5"
    empty["delivery"]["pulse"] = {"offered": 0, "within_deadline": None, "by_horizon": None}
    other = make_run("sweep", 2, recovered=False, created=2.0, attempts=2.0)
    other["variant"] = "pulse 2.7"
    fig = delivery_by_cohort_figure([empty, other])
    pulse = {t.name: list(t.y) for t in fig.data if t.xaxis == "x"}
    assert pulse["within the deadline"] == ["sweep (pulse 2.7)"]  # the empty cohort is left out
    hold = {t.name: list(t.y) for t in fig.data if t.xaxis == "x2"}
    assert hold["within the deadline"] == ["sweep (pulse 1.5)", "sweep (pulse 2.7)"]
    assert cohort_shares(empty, "pulse") is None


HOSTILE = '<a href="https://evil.example/">click</a><b>B</b>&amp;'


def test_label_values_are_shown_as_text_never_as_plotly_markup() -> None:
    # Plotly renders <a>, <b>, <br> and entities in tick labels and hover text: a model name or
    # instance (any label value the source passes on) must show as written, never as a link.
    episode = {
        "alertname": "VLLMRetrywatchNoData",
        "severity": "warning",
        "labels": {"engine": "0", "model": HOSTILE, "instance": "http://10.0.0.1:8100/metrics"},
        "started_at": 100.0,
        "resolved_at": None,
    }
    fig = episodes_timeline_figure([episode], now=1000.0)
    (row,) = {y for t in fig.data for y in t.y}
    assert "<" not in row and ">" not in row
    assert row == (
        'VLLMRetrywatchNoData · 10.0.0.1:8100 (&lt;a href="https://evil.example/"&gt;click&lt;/a&gt;'
        "&lt;b&gt;B&lt;/b&gt;&amp;amp;)"
    )
    assert list(fig.layout.yaxis.categoryarray) == [row]
    # the experiments' rows and hover text, from a hand-edited summary, are text too
    runs = [
        {**make_run("retries-on", 1, recovered=False, created=2.3, attempts=2.4), "condition": HOSTILE},
        {**make_run("retries-off", 1, recovered=True, created=0.6, attempts=0.6), "run": "<b>1</b>"},
    ]
    for fig in (delivery_by_cohort_figure(runs), creation_rate_vs_recovery_figure(runs)):
        texts = [str(v) for t in fig.data for v in [*t.y, *(t.customdata or ())]]
        assert texts and not any("<" in v for v in texts), texts


def test_admitted_prompt_tokens_show_where_counted_ones_lie_on_them() -> None:
    """Healthy, the two rates are equal: "admitted" (drawn first) hid under "counted". Now it is a
    wide band under a thin dashed "counted" line, so both are seen."""
    same = series([12000.0, 12000.0, 12000.0])
    fig = prompt_tokens_figure({"prompt_tokens_admitted_rate": same, "prompt_tokens_counted_rate": same})
    admitted, counted = fig.data
    assert (admitted.name, counted.name) == ("admitted", "counted")  # the wide one underneath
    assert admitted.line.width >= 2 * counted.line.width
    assert counted.line.dash == "dash" and admitted.line.dash in (None, "solid")


# --- a replayed trace's run ------------------------------------------------------------------

TRACE_ENTRY = {
    "slug": "composition__no-control-t-load3__m__r0",
    "pulse": None,
    "burst": {"start_s": 28.1, "end_s": 88.1},
    "collapses": [
        {
            "burst": {"start_s": 28.1, "end_s": 88.1},
            "start_s": 60.0,
            "end_s": 420.0,
            "metastable": True,
            "ended": True,
            "metastable_at_s": 205.0,
            "metastable_for_s": 50.0,
        },
        {"start_s": 500.0, "end_s": 600.0, "metastable": False, "ended": False, "metastable_at_s": None},
    ],
}


def named(fig: object, name: str) -> list[object]:
    return [s for s in fig.layout.shapes if s.name == name]  # type: ignore[attr-defined]


def test_arrivals_panel_draws_calls_arriving_and_delivered_in_time_against_capacity() -> None:
    arriving, in_time = figures.STEP_SIGNALS
    signals = {
        arriving: [[0.0, 10.0], [5.0, 80.0], [10.0, 10.0]],
        in_time: [[0.0, 10.0], [5.0, 20.0], [10.0, 0.0]],
        "capacity": [[0.0, 21.6], [10.0, 21.6]],
    }
    fig = figures.arrivals_figure(signals, x_kind="seconds")
    lines = {t.name: list(t.y) for t in fig.data}
    assert lines["calls arriving (first attempts)"] == [10.0, 80.0, 10.0]  # the burst, unsmoothed
    assert lines["delivered within the deadline"] == [10.0, 20.0, 0.0]
    assert lines["capacity Ĉ"] == [21.6, 21.6]
    assert not fig.layout.annotations
    empty = figures.arrivals_figure({}, x_kind="seconds")
    assert "no data: calls arriving, delivered within the deadline" in empty.layout.annotations[0].text


def test_trace_runs_are_told_from_pulse_runs() -> None:
    assert figures.is_trace_run(TRACE_ENTRY)
    assert not figures.is_trace_run(RUNS[0])  # a pulse
    assert not figures.is_trace_run({"pulse": None})  # neither: nothing to mark


def test_collapses_are_bands_behind_the_panel_with_the_metastable_stretch_and_the_burst_apart() -> None:
    collapses = figures.run_collapses(TRACE_ENTRY)
    assert collapses[0] == Collapse(60.0, 420.0, True, True, 205.0, 50.0, (28.1, 88.1))
    assert collapses[1].burst is None and collapses[1].metastable is False and not collapses[1].ended
    fig = figures.collapse_marks(attempts_figure({}, x_kind="seconds"), collapses)
    assert [(s.x0, s.x1, s.layer) for s in named(fig, "collapse")] == [
        (60.0, 420.0, "below"),
        (500.0, 600.0, "below"),
    ]
    assert [(s.x0, s.x1) for s in named(fig, "metastable")] == [(205.0, 420.0)]  # the second never looped
    (burst,) = named(fig, "burst")
    assert (burst.x0, burst.x1) == (28.1, 88.1) and burst.y1 <= 0.1  # a bar along the foot
    colours = {s.name: s.fillcolor for s in fig.layout.shapes}
    assert len(set(colours.values())) == 3 and not set(colours.values()) & set(
        figures.SEVERITY_COLOURS.values()
    )
    assert {"collapse", "metastable (retry loop)", "burst behind a collapse"} <= {t.name for t in fig.data}
    bare = figures.collapse_marks(attempts_figure({}, x_kind="seconds"), collapses, legend=False)
    assert "collapse" not in {t.name for t in bare.data}


def test_alerts_over_a_trace_run_are_a_row_of_their_own_along_the_top() -> None:
    shades = run_shades(
        [
            {"alertname": "VLLMBacklogBeyondDeadline", "fired_at_s": 70.0, "resolved_at_s": 310.0},
            {"alertname": "VLLMMetastableRetryLoop", "fired_at_s": 215.0, "resolved_at_s": None},
        ]
    )
    fig = figures.alert_row(attempts_figure({}, x_kind="seconds"), shades, 605.0)
    rows = [(s.name, s.x0, s.x1) for s in fig.layout.shapes]
    assert rows == [("warning alert", 70.0, 310.0), ("critical alert", 215.0, 605.0)]  # critical on top
    assert all(s.y0 >= 0.9 and s.y1 == 1.0 for s in fig.layout.shapes)  # not the full-height shading
    assert {"warning alert", "critical alert"} <= {t.name for t in fig.data}


def test_collapses_in_words() -> None:
    text = figures.collapses_text(figures.run_collapses(TRACE_ENTRY))
    assert text.startswith("2 collapses (1 metastable): 60–420 s after the burst at 28–88 s")
    assert "metastable from 205 s, held 50 s" in text and "500 s to the end" in text
    assert figures.collapses_text([]) == "no collapse"


@pytest.mark.parametrize(
    ("collapses", "message"),
    [
        ("soon", "'collapses' must be a list"),
        ([5], r"collapses\[0\] must be an object"),
        ([{"end_s": 3.0}], r"collapses\[0\].start_s must be a number"),
        ([{"start_s": 1.0, "end_s": "nan"}], r"collapses\[0\].end_s must be a finite number"),
        ([{"start_s": 1.0, "end_s": 3.0, "burst": [1, 2]}], r"collapses\[0\].burst must be an object"),
    ],
)
def test_a_hand_edited_collapse_names_what_is_wrong(collapses: object, message: str) -> None:
    with pytest.raises(RunDirError, match=message):
        figures.run_collapses({**TRACE_ENTRY, "collapses": collapses})
    with pytest.raises(RunDirError, match="no 'collapses'"):
        figures.run_collapses({"pulse": None, "burst": {}})
