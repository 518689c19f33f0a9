"""The rules-only part of the vLLM tier's Ĉ and deadline, where nobody states them: the records
the tier's signals read by name (``detector.signals``: ``vllm_capacity``, ``vllm_deadline``, the
in-time rates), the record of Ĉ's source, and two alerts on the deadline (``rules.generate``
renders them into the tier's group).

Ĉ (``vllm_capacity``): stated (a ``retrywatch_capacity_calls_per_second`` series), else the saturated estimate
(vLLM's finish rate averaged over an hour of a queue that never emptied), else predicted below
saturation from vLLM's own counters, the model of ``detector.capacity`` (read its docstring):
``busy = a·steps + c·prompt + β·decoded`` fitted by least squares over 5-s sub-windows of the
last five minutes, then ``1/Ĉ = U·c + O·(a/B + β)``. One recording rule per step:

- per evaluation, the sub-window ending now (``*:rate5s``): the share of evaluations with a
  running batch, steps, uncached prompt tokens and decoded tokens per second, present only where
  the sub-window decoded anything (the detector's rows, each divided by its length: the same fit).
  Increases are ``x - x offset 5s`` of the counters summed per instance, over the seconds
  between those two scrapes (``timestamp()``): exact at any scrape interval, a longer one than
  5 s making each scrape interval one sub-window, as in the detector (``increase()`` would
  extrapolate); a counter reset drops that one row or zeroes its prompt tokens (the detector
  counts the value after it).
- their sums of products over the window's 5-s subquery steps (the normal equations).
- the non-negative least squares: each of the 7 subsets of (steps, prompt, decoded) solved by
  Cramer's rule (a subset whose Gram determinant is below 1e-12 of its diagonal's product is
  singular, as the detector's pivot test), kept where all its coefficients are >= 0, the kept one
  with the least residual winning (``bottomk``): the detector's enumeration, exactly.
- the prediction from the window's per-call mix and the saturated batch.

Ranges and subqueries are one second short of their length (``[4s]``, ``[299s:5s]``): they then
hold the evaluations after a (sub-)window's start, as the detector's samples after its first, in
Prometheus 2's closed ranges and 3's left-open ones alike.

NOTE (versus ``detector.capacity``): the point estimate only (no range from the two halves), and
the sub-windows lie on the rule group's 5-s evaluation grid rather than start at the window's
first scrape. At a 5-s scrape interval the two cut the same sub-windows and give the same number
to rounding (1e-13 measured); at 10- and 15-s scrapes, within 1e-4 (``tests/rules/test_learned.py``
measures both). An evaluation interval other than 5 s changes which evaluations the busy share
counts.
Only vLLM 0.10.2 on exports ``vllm:inter_token_latency_seconds``: without it, no prediction.

The deadline: stated (a ``retrywatch_client_deadline_seconds`` series: ``rules.stated`` records
one, a proxy scraped under the same instance exports the one it was given or learned), else
missing: no default (``vllm_deadline``). The e2e bucket that counts finishes in time is chosen
per instance from the deadline in force (``detector.signals.deadline_bucket``: vLLM's bound at or
below it), recorded as a series labelled with its ``le`` whose value is the seconds from that
bound up to the deadline; the in-time rates keep only that bucket (``and on (instance, le)``, in
``detector.signals``). A deadline between
two bounds is not rounded silently: ``VLLMDeadlineBetweenBuckets`` (info) says which finishes
count as late; a missing deadline, or one below vLLM's first bound, fires ``VLLMDeadlineMissing``
(warning) beside the tier's NoData.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from detector.capacity import DEFAULT_MAX_NUM_SEQS, PART_S, PREDICT_WINDOW_S
from detector.signals import (
    CAPACITY_PREDICTED_RECORD,
    DEADLINE_BUCKET_RECORD,
    PROMETHEUS_JOBS,
    RECORD_NAMES,
    VLLM_CAPACITY_SOURCES,
    vllm_join,
    vllm_record,
)
from detector.thresholds import ENGINE_MODEL_TEMPLATE
from foundation import metricnames as mn
from foundation.vllmbuckets import REQUEST_LATENCY_BUCKETS, le_label

__all__ = [
    "CAPACITY_PREDICTED",
    "CAPACITY_RECORD",
    "CAPACITY_SOURCE",
    "DEADLINE_BETWEEN_BUCKETS",
    "DEADLINE_BUCKET",
    "DEADLINE_MISSING",
    "DEADLINE_RECORD",
    "EXTRA_ALERTS",
    "EXTRA_COMMENTS",
    "ExtraAlert",
    "helper_records",
    "source_record",
]


def _dur(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 60}m" if whole % 60 == 0 else f"{whole}s"


_PART = _dur(PART_S)
_WINDOW = _dur(PREDICT_WINDOW_S)
# Means over the evaluations after a (sub-)window's start, as the detector's samples after its
# first, and the sub-windows ending after the window's start: ranges one second short, the same
# in Prometheus 2's closed ranges and subqueries and 3's left-open ones.
_PART_MEAN = _dur(PART_S - 1)
_WINDOW_MEAN = _dur(PREDICT_WINDOW_S - 1)
_SUB = f"[{_WINDOW_MEAN}:{_PART}]"
_VLLM_UP = f'up{{job="{PROMETHEUS_JOBS["vllm"]}"}}'

CAPACITY_RECORD = RECORD_NAMES["vllm_capacity"]
CAPACITY_PREDICTED = CAPACITY_PREDICTED_RECORD
CAPACITY_SOURCE = vllm_record("capacity_source:info")
DEADLINE_RECORD = RECORD_NAMES["vllm_deadline"]
DEADLINE_BUCKET = DEADLINE_BUCKET_RECORD

# per-evaluation records of the fit
_RUNNING = vllm_record("capacity_fit_running:sum")
_KV = vllm_record("capacity_fit_kv_usage:sum")
_BUSY_NOW = vllm_record("capacity_fit_running:bool")
_BUSY_SHARE = vllm_record(f"capacity_fit_busy:share{_PART}")
_SPACING = vllm_record(f"capacity_fit_span:seconds{_PART}")
_X = (
    vllm_record(f"capacity_fit_steps:rate{_PART}"),
    vllm_record(f"capacity_fit_prompt:rate{_PART}"),
    vllm_record(f"capacity_fit_decoded:rate{_PART}"),
)
_Y = vllm_record(f"capacity_fit_busy:rate{_PART}")
_TERMS = ("step", "prompt", "decode")
_COEF = vllm_record("capacity_fit_candidate:seconds")
_RESID = vllm_record("capacity_fit_candidate_residual:sum")
_COST = vllm_record(f"capacity_fit_step_cost:seconds{_WINDOW}")


def _s(i: int, j: int) -> str:
    """The record of the sum over the window of column i times column j (3: the busy share)."""
    i, j = min(i, j), max(i, j)
    names = ("steps", "prompt", "decoded", "busy")
    return vllm_record(f"capacity_fit_{names[i]}_{names[j]}:sum{_WINDOW}")


def _sum(metric: str) -> str:
    return f"sum by (instance) ({metric})"


def _delta(metric: str) -> str:
    """The increase of ``metric`` (summed per instance) over the sub-window ending now."""
    return f"({_sum(metric)} - {_sum(f'{metric} offset {_PART}')})"


def _span(metric: str) -> str:
    """The seconds between the two scrapes of ``metric`` that :func:`_delta` subtracts: the
    sub-window's length at a scrape interval up to its own, one scrape interval at a longer one."""
    last, before = (f"max by (instance) (timestamp({m}))" for m in (metric, f"{metric} offset {_PART}"))
    return f"({last} - {before})"


def _increase(metric: str) -> str:
    return f"sum by (instance) (increase({metric}[{_WINDOW}]))"


def _det(m: Sequence[Sequence[str]]) -> str:
    """The determinant of a 1x1, 2x2 or 3x3 matrix of PromQL terms (Laplace expansion)."""
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return f"({m[0][0]} * {m[1][1]} - {m[0][1]} * {m[1][0]})"
    minors = []
    for k in range(3):
        sub = [[row[j] for j in range(3) if j != k] for row in m[1:]]
        sign = "+" if k % 2 == 0 else "-"
        minors.append(f"{sign} {m[0][k]} * {_det(sub)}")
    return "(" + " ".join(minors).removeprefix("+ ") + ")"


def _candidates() -> str:
    """Each subset's least-squares coefficients (Cramer's rule), labelled ``subset`` and ``term``;
    0 for the terms a subset leaves out; absent where its Gram matrix is singular."""
    parts = []
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            gram = [[_s(i, j) for j in cols] for i in cols]
            det = _det(gram)
            diag = " * ".join(_s(i, i) for i in cols)
            guard = f"({det} > 1e-12 * {diag})"
            subset = ",".join(_TERMS[c] for c in cols)
            for t in range(3):
                if t in cols:
                    k = cols.index(t)
                    swapped = [
                        [_s(i, 3) if j == k else gram[r][j] for j in range(size)] for r, i in enumerate(cols)
                    ]
                    value = f"{_det(swapped)} / {guard}"
                else:
                    value = f"{guard} * 0"
                labelled = f'label_replace({value}, "subset", "{subset}", "", "")'
                parts.append(f'label_replace({labelled}, "term", "{_TERMS[t]}", "", "")')
    return "\n or ".join(parts)


def _residuals() -> str:
    """Each kept subset's residual sum of squares, ``Σy² − θ·Σxy`` (its least-squares solution's)."""
    fitted = " or ".join(
        f'{_COEF}{{term="{_TERMS[t]}"}} * on (instance) group_left {_s(t, 3)}' for t in range(3)
    )
    return (
        f"({_s(3, 3)} - on (instance) group_right sum by (instance, subset) ({fitted}))"
        f" unless on (instance, subset) ({_COEF} < 0)"
    )


def _prediction() -> str:
    a, c, beta = (f'{_COST}{{term="{t}"}}' for t in _TERMS)
    tokens = mn.VLLM_REQUEST_PROMPT_TOKENS
    prompt = f"{_increase(f'{tokens}_sum')} / ({_increase(f'{tokens}_count')} > 0)"
    queries = _increase(mn.VLLM_PREFIX_CACHE_QUERIES)
    hits = _increase(mn.VLLM_PREFIX_CACHE_HITS)
    hit_share = f"(clamp(({hits} / ({queries} > 0)), 0, 1) or {queries} * 0)"
    uncached = f"({prompt} * (1 - {hit_share}))"
    output = (
        f"({_increase(f'{mn.VLLM_REQUEST_GENERATION_TOKENS}_sum')}"
        f" / ({_increase(f'{mn.VLLM_REQUEST_GENERATION_TOKENS}_count')} > 0))"
    )
    running = f"(avg_over_time({_RUNNING}[{_WINDOW_MEAN}]) > 0)"
    kv = f"(avg_over_time({_KV}[{_WINDOW_MEAN}]) > 0)"
    batch = f"clamp_max(({running} / {kv} >= {running}) or {running}, {DEFAULT_MAX_NUM_SEQS})"
    per_call = (
        f"{uncached} * on (instance) {c}"
        f" + on (instance) {output} * on (instance) ({a} / on (instance) {batch} + on (instance) {beta})"
    )
    return f"1 / (sum by (instance) ({per_call}) > 0)"


def _bucket() -> str:
    """The e2e bucket at or below the deadline in force, labelled ``le``, valued deadline − bound."""
    deadline = f"max by (instance) ({mn.CLIENT_DEADLINE} > 0)"
    bounds = REQUEST_LATENCY_BUCKETS
    parts = []
    for i, b in enumerate(bounds):
        cond = f"{deadline} >= {b - 1e-9!r}"
        if i + 1 < len(bounds):
            cond += f" < {bounds[i + 1] - 1e-9!r}"
        parts.append(f'clamp_min(label_replace({cond}, "le", "{le_label(b)}", "", "") - {b!r}, 0)')
    return "\n or ".join(parts)


def helper_records() -> list[tuple[str, str]]:
    """The records the vLLM tier's Ĉ and deadline read, in evaluation order (before its signals)."""
    itl = mn.VLLM_INTER_TOKEN_LATENCY
    steps = f"({_BUSY_SHARE} > 0) * ({_delta(f'{itl}_count')} > 0) / ({_delta(f'{itl}_sum')} > 0)"
    uncached = f"clamp_min({_delta(mn.VLLM_PREFIX_CACHE_QUERIES)} - {_delta(mn.VLLM_PREFIX_CACHE_HITS)}, 0)"
    rows = [
        (_RUNNING, _sum(mn.VLLM_NUM_RUNNING)),
        (_KV, _sum(mn.VLLM_KV_CACHE_USAGE)),
        (_BUSY_NOW, f"{_RUNNING} > bool 0"),
        (_BUSY_SHARE, f"avg_over_time({_BUSY_NOW}[{_PART_MEAN}])"),
        (_SPACING, f"{_span(f'{itl}_count')} > 0"),
        (_X[0], steps),
        (_X[1], f"{uncached} / on (instance) {_SPACING} and on (instance) {_X[0]}"),
        (_X[2], f"{_delta(f'{itl}_count')} / on (instance) {_SPACING} and on (instance) {_X[0]}"),
        (_Y, f"{_BUSY_SHARE} and on (instance) {_X[0]}"),
    ]
    cols = (*_X, _Y)
    rows += [
        (_s(i, j), f"sum_over_time(({cols[i]} * {cols[j]}){_SUB})") for i in range(4) for j in range(i, 4)
    ]
    rows += [
        (_COEF, _candidates()),
        (_RESID, _residuals()),
        (
            _COST,
            f"sum by (instance, term) ({_COEF} and on (instance, subset)"
            f" bottomk by (instance) (1, {_RESID}))",
        ),
        (CAPACITY_PREDICTED, _prediction()),
        (DEADLINE_BUCKET, _bucket()),
    ]
    return rows


_CAPACITY_SOURCE = " or on (instance) ".join(
    f'label_replace({expr} * 0 + 1, "source", "{name}", "", "")' for name, expr in VLLM_CAPACITY_SOURCES
)

#: Comments of the records this module adds (their help text).
EXTRA_COMMENTS: dict[str, str] = {
    CAPACITY_SOURCE: "1, labelled source=stated|saturated|predicted: where the Ĉ in force comes from.",
    CAPACITY_PREDICTED: (
        "Ĉ predicted from vLLM's own counters (detector/capacity.py's model, rules/learned.py): "
        "1 / (U·c + O·(a/B + β)) with the step cost fitted over the last 5 minutes."
    ),
    _COST: (
        f"The fitted step cost (non-negative least squares over {PART_S:g}-s sub-windows): term=step "
        "seconds per step (a), prompt per uncached prompt token (c), decode per decoded token (β)."
    ),
    _COEF: "Each subset's least-squares step cost (Cramer's rule), labelled subset and term.",
    _RESID: "Each subset's residual sum of squares, kept where its coefficients are all >= 0.",
    _X[0]: (
        f"Steps per second over the {PART_S:g}-s sub-window ending now (busy share × decodes / decode time)."
    ),
    DEADLINE_BUCKET: (
        "vLLM's e2e bucket at or below the deadline (label le), valued the seconds from it up to "
        "the deadline: above 0, finishes in between count as late (VLLMDeadlineBetweenBuckets)."
    ),
}


@dataclass(frozen=True)
class ExtraAlert:
    """An alert only the rules evaluate, on how they found the deadline."""

    name: str
    severity: str
    summary: str
    description: str
    expr: str
    for_s: float


DEADLINE_MISSING = "VLLMDeadlineMissing"
DEADLINE_BETWEEN_BUCKETS = "VLLMDeadlineBetweenBuckets"

EXTRA_ALERTS: tuple[ExtraAlert, ...] = (
    ExtraAlert(
        DEADLINE_MISSING,
        "warning",
        "The vLLM tier knows no usable clients' deadline: its deadline alerts cannot evaluate.",
        "Instance {{ $labels.instance }}" + ENGINE_MODEL_TEMPLATE + " has no clients' deadline: none is "
        f"stated (a series {mn.CLIENT_DEADLINE}, as `retrywatch mixin --deadline S` records) "
        "and no proxy scraped as this instance exports one, or it is below vLLM's first e2e bucket "
        f"({REQUEST_LATENCY_BUCKETS[0]:g} s). VLLMRetryLoopSuspected, VLLMRetryLoopAtQueueCap, "
        "VLLMQueueBeyondDeadline and VLLMRequestsNotAnsweredInTime cannot fire here.",
        vllm_join(
            f"max by (instance) ({_VLLM_UP}) > 0 unless on (instance) count by (instance) ({DEADLINE_BUCKET})"
        ),
        60.0,
    ),
    ExtraAlert(
        DEADLINE_BETWEEN_BUCKETS,
        "info",
        "The clients' deadline falls between vLLM's e2e latency buckets: finishes just under it "
        "count as late.",
        "Instance {{ $labels.instance }}" + ENGINE_MODEL_TEMPLATE + ": the clients' deadline is "
        '{{ $value | printf "%.3g" }} s above vLLM\'s e2e bucket le={{ $labels.le }}: finishes within '
        "{{ $labels.le }} s count as in time, later ones as late, so the late share and the error "
        "ratio err high (alerts a little early, never late). State a deadline on a bucket bound to "
        "avoid it.",
        vllm_join(f"{DEADLINE_BUCKET} > 1e-6"),
        0.0,
    ),
)


def source_record() -> tuple[str, str]:
    """The record saying where the Ĉ in force comes from (after the Ĉ record)."""
    return CAPACITY_SOURCE, vllm_join(_CAPACITY_SOURCE)
