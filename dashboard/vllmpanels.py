"""The Grafana dashboard's vLLM-only panels: the loop's shape from vLLM's own series, before any proxy.

Each panel's queries read vLLM's raw series (``foundation.metricnames``) as a Prometheus that
scrapes only vLLM holds them, under the dashboard's ``vllm_job`` and ``vllm_instance`` variables:
no recording rule and no ``retrywatch_*`` series. Where the detector declares a signal over
vLLM's series (the queues, the admitted and counted prompt tokens, and their gap), the query is
that signal's: its raw series (``detector.signals.RAW``), its window (``detector.signals.WINDOWS``),
its help text and, for the gap, its ratio (``foundation.ratios.PROMPT_TOKEN_GAP``); the signal's
recording rule joins the same sum onto vLLM's engine labels.

Two numbers come from the operator as dashboard variables (``deadline``, and ``capacity`` when Ĉ
is stated): vLLM exports neither. What vLLM cannot show: a request its client abandoned is dropped
unrecorded (in no finish counter and no histogram), so the finish and latency panels show only
the requests that finished.
"""

from __future__ import annotations

from dataclasses import dataclass

from detector.signals import RAW, SIGNALS_BY_NAME, WINDOWS
from foundation import metricnames as mn
from foundation.ratios import PROMPT_TOKEN_GAP

JOB_VAR = "vllm_job"
INSTANCE_VAR = "vllm_instance"
DEADLINE_VAR = "deadline"
CAPACITY_VAR = "capacity"
#: The quantiles drawn from vLLM's latency histograms.
QUANTILES = (0.5, 0.99)


@dataclass(frozen=True)
class Query:
    """One line of a panel: its legend, its PromQL and how it is drawn."""

    legend: str
    expr: str
    colour: str | None = None
    dashed: bool = False  # a level the operator stated (the deadline, Ĉ)
    right_unit: str | None = None  # drawn on a right axis in this unit


@dataclass(frozen=True)
class Panel:
    """A vLLM-only panel: what it tells of the loop, and its queries."""

    title: str
    description: str
    unit: str
    axis_label: str
    queries: tuple[Query, ...]
    no_value: str = "no data: is vLLM scraped as the chosen job?"


def _range(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 60}m" if whole % 60 == 0 else f"{whole}s"


def selector() -> str:
    """The label matchers of every vLLM query: the chosen job and instance."""
    return f'{{job="${JOB_VAR}", instance=~"${INSTANCE_VAR}"}}'


def rate(metric: str, window_s: float, by: str = "instance") -> str:
    """The per-second rate of a vLLM counter, summed ``by`` the given labels."""
    return f"sum by ({by}) (rate({metric}{selector()}[{_range(window_s)}]))"


def gauge(metric: str) -> str:
    """A vLLM gauge, summed per instance (a data-parallel vLLM's engines added)."""
    return f"sum by (instance) ({metric}{selector()})"


def quantile(q: float, histogram: str, window_s: float) -> str:
    """The ``q`` quantile of a vLLM histogram over ``window_s``, per instance."""
    buckets = f"sum by (instance, le) (rate({histogram}_bucket{selector()}[{_range(window_s)}]))"
    return f"histogram_quantile({q!r}, {buckets})"


#: The detector's vLLM-tier signals the panels draw, over vLLM's raw series.
SIGNAL_EXPRS: dict[str, str] = {
    "vllm_waiting": gauge(RAW["waiting"][0]),
    "vllm_running": gauge(RAW["running"][0]),
    "prompt_tokens_counted_rate": rate(RAW["prompt_tokens"][0], WINDOWS.prompt_gap_s),
    "prompt_tokens_admitted_rate": rate(RAW["prefix_queries"][0], WINDOWS.prompt_gap_s),
}
PROMPT_TOKEN_GAP_EXPR = PROMPT_TOKEN_GAP.promql(SIGNAL_EXPRS)
DEADLINE_EXPR = f"vector(${DEADLINE_VAR})"
CAPACITY_EXPR = f"vector(${CAPACITY_VAR})"
# the waiting queue one deadline of work at Ĉ makes: beyond it every new request times out
DEADLINE_WORK_EXPR = f"vector(${CAPACITY_VAR} * ${DEADLINE_VAR})"


def _signal(name: str, legend: str, colour: str) -> Query:
    return Query(legend, SIGNAL_EXPRS[name], colour)


def panels(*, capacity_stated: bool) -> tuple[Panel, ...]:
    """The vLLM-only panels; the Ĉ lines only where the operator stated Ĉ (``capacity_stated``)."""
    waiting, running = SIGNALS_BY_NAME["vllm_waiting"], SIGNALS_BY_NAME["vllm_running"]
    counted = SIGNALS_BY_NAME["prompt_tokens_counted_rate"]
    admitted = SIGNALS_BY_NAME["prompt_tokens_admitted_rate"]
    window = WINDOWS.rate_s
    deadline = Query("clients' deadline", DEADLINE_EXPR, "red", dashed=True)
    c_lines = capacity_stated
    return (
        Panel(
            "vLLM queues",
            f"{waiting.help} {running.help} In the loop the waiting queue sits near arrival rate × "
            "deadline"
            + (": beyond Ĉ × deadline every new request waits longer than its client." if c_lines else "."),
            "short",
            "requests",
            (
                _signal("vllm_waiting", "waiting", "orange"),
                _signal("vllm_running", "running", "green"),
                *((Query("Ĉ × deadline", DEADLINE_WORK_EXPR, "red", dashed=True),) if c_lines else ()),
            ),
        ),
        Panel(
            "vLLM finishes by reason",
            "Requests vLLM finished per second, by finished_reason "
            f"({mn.VLLM_REQUEST_SUCCESS}). A request its client abandoned is not counted: with "
            "cancellation on, the loop shows as an engine busy at capacity while almost nothing "
            "finishes; with it off, as finishes at capacity that arrive after the deadline.",
            "reqps",
            "requests/s",
            (
                Query(
                    "{{finished_reason}}", rate(mn.VLLM_REQUEST_SUCCESS, window, "instance, finished_reason")
                ),
                *((Query("Ĉ", CAPACITY_EXPR, "red", dashed=True),) if c_lines else ()),
            ),
        ),
        Panel(
            "Prompt tokens: admitted vs counted",
            f"{admitted.help} {counted.help} The gap (right axis): {PROMPT_TOKEN_GAP.help} "
            "vLLM counts a prompt at its first token, so prompts admitted and aborted before it "
            "(requests whose clients left) widen the gap.",
            "short",
            "tokens/s",
            (
                _signal("prompt_tokens_admitted_rate", "admitted", "blue"),
                _signal("prompt_tokens_counted_rate", "counted", "purple"),
                Query("gap", PROMPT_TOKEN_GAP_EXPR, "red", right_unit="percentunit"),
            ),
        ),
        Panel(
            "vLLM queue time and latency vs the deadline",
            "Quantiles of the time finished requests waited in vLLM's queue "
            f"({mn.VLLM_QUEUE_TIME}) and of their whole latency ({mn.VLLM_E2E_LATENCY}), against "
            "the clients' deadline: queue time near the deadline means requests wait out their "
            "clients. Only finished requests are observed.",
            "s",
            "seconds",
            (
                *(
                    Query(f"queue time p{round(q * 100)}", quantile(q, mn.VLLM_QUEUE_TIME, window))
                    for q in QUANTILES
                ),
                *(
                    Query(f"e2e latency p{round(q * 100)}", quantile(q, mn.VLLM_E2E_LATENCY, window))
                    for q in QUANTILES
                ),
                deadline,
            ),
        ),
        Panel(
            "vLLM admission rejections",
            f"Requests vLLM refused per second ({mn.VLLM_ADMISSION_REJECTIONS}, by reason): only "
            "with --max-num-queued-reqs (or tokens), answered 503 without Retry-After, which "
            "clients retry.",
            "reqps",
            "requests/s",
            (Query("{{reason}}", rate(mn.VLLM_ADMISSION_REJECTIONS, window, "instance, reason")),),
            no_value="no rejections counted (this vLLM does not export them)",
        ),
    )
