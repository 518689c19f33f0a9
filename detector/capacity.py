"""Ĉ predicted below saturation from what a serving vLLM exports anyway.

The detector otherwise knows Ĉ (calls/s the engine completes when saturated, docs/protocol.md §5)
only when stated, or after vLLM has stayed saturated for minutes. This module predicts it from
vLLM's own counters at any load, with the engine model's step cost: a step costs a fixed part
``a``, ``c`` per uncached prompt token it computes and ``β`` per sequence it decodes.

Fit (time conservation): over each sub-window (:data:`PART_S`) the engine's busy time is the sum
of its steps, ``busy = a·steps + c·prompt + β·decoded``, where ``busy`` is the sub-window's length
times the share of its scrapes with a running batch, ``prompt`` the uncached prompt tokens admitted
(prefix-cache queries − hits), ``decoded`` the inter-token latency's count, and ``steps = busy /
mean inter-token latency`` (each step gives every decoding sequence one token; the batch is taken
as steady within a sub-window). ``a, c, β ≥ 0`` by least squares over the sub-windows: the load's
own ups and downs from one sub-window to the next are what tell the three apart.

Prediction: at saturation every step carries the batch ``B`` the KV cache holds when full (the
running count over ``vllm:kv_cache_usage_perc``, at most ``max_num_seqs``), so a call of the
window's mix costs

    1 / Ĉ = U·c + O·(a / B + β)

with ``U``, ``O`` the mean uncached prompt tokens and output tokens per finished call (the prompt-
and generation-token histograms' sums over their counts). The range is the least and greatest of
the same prediction fitted on each half of the sub-windows and on all of them: the fit's noise,
not the model's error (docs/results.md, "Ĉ learned before saturation", measures that: within
±11 % of the calibrated Ĉ on every preset and trace mix tried, from 5 or 10 minutes below
saturation). It needs vLLM 0.10.2 or later (``vllm:inter_token_latency_seconds``; older releases
name it otherwise, ``foundation.vllmreleases``): without it there is no prediction. Not
modelled: a token budget that binds before the KV cache or ``max_num_seqs`` does, and preemption.

The sub-windows are short (:data:`PART_S`) because a low, intermittent batch needs them: vLLM on
CPU at 0.5-0.6 Ĉ runs one to three sequences with idle gaps, and over 15-s sub-windows the mix
barely moves from one to the next, so the fit traded the prompt cost for the per-step one and
read 0.9-2.4x; over 5-s ones, 0.94-1.28x (docs/results.md, "At K = 1"). ``c`` measured instead
(vLLM's prefill time over the uncached prompt tokens) suits that engine too, but breaks the
simulator's trace mixes (-34 % to -42 %, or no fit): a request's prefill time spans whole steps,
shared with decodes and other prefills, so it bounds ``c`` from above only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from foundation import metricnames as mn

__all__ = [
    "CAPACITY_SOURCES",
    "COUNTERS",
    "DEFAULT_MAX_NUM_SEQS",
    "GAUGES",
    "MIN_FIT_WINDOWS",
    "PART_S",
    "PREDICTOR_SERIES",
    "PREDICT_WINDOW_S",
    "CapacityPrediction",
    "StepCost",
    "WindowTotals",
    "fit_step_cost",
    "predict_capacity",
    "predict_over",
    "split_windows",
    "window_totals",
]

#: vLLM's ``--max-num-seqs`` as the study ran it (vLLM does not export it).
DEFAULT_MAX_NUM_SEQS = 256
#: Where the Ĉ in force comes from, in order of precedence.
CAPACITY_SOURCES = ("stated", "saturated", "predicted")
#: The fit's sub-windows (seconds): one scrape of the detector's and the shipped Prometheus'
#: 5-s cadence (a longer scrape interval makes each interval one; docs/results.md, "Ĉ learned
#: before saturation", measures 15-s sub-windows against these on a real engine).
PART_S = 5.0
#: Sub-windows the fit needs at least: a minute's worth.
MIN_FIT_WINDOWS = 12
#: The window the detector predicts over (seconds): five minutes of any load.
PREDICT_WINDOW_S = 300.0

_ITL_SUM = f"{mn.VLLM_INTER_TOKEN_LATENCY}_sum"
_ITL_COUNT = f"{mn.VLLM_INTER_TOKEN_LATENCY}_count"
_PROMPT_SUM = f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum"
_PROMPT_COUNT = f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_count"
_OUTPUT_SUM = f"{mn.VLLM_REQUEST_GENERATION_TOKENS}_sum"
_OUTPUT_COUNT = f"{mn.VLLM_REQUEST_GENERATION_TOKENS}_count"

#: The counters (cumulative) and gauges the prediction reads, by their exported names.
COUNTERS = (
    _ITL_SUM,
    _ITL_COUNT,
    _PROMPT_SUM,
    _PROMPT_COUNT,
    _OUTPUT_SUM,
    _OUTPUT_COUNT,
    mn.VLLM_PREFIX_CACHE_QUERIES,
    mn.VLLM_PREFIX_CACHE_HITS,
)
GAUGES = (mn.VLLM_NUM_RUNNING, mn.VLLM_KV_CACHE_USAGE)
PREDICTOR_SERIES: tuple[str, ...] = COUNTERS + GAUGES


@dataclass(frozen=True, slots=True)
class WindowTotals:
    """One (sub-)window: each counter's increase over it, each gauge's mean over its samples."""

    seconds: float
    increase: Mapping[str, float]
    mean: Mapping[str, float]
    busy: float = 1.0  # the share of its scrapes with a running batch

    def per_call(self, total: str, count: str) -> float | None:
        n = self.increase.get(count, 0.0)
        return self.increase[total] / n if n > 0 and total in self.increase else None


def window_totals(samples: Sequence[tuple[float, Mapping[str, float]]]) -> WindowTotals | None:
    """A window from ``(t, {series: value})`` samples in time order (counters cumulative, summed
    over their label sets); None with fewer than two samples. A counter that falls (a restart)
    counts its value after the fall as its increase, as ``rate()`` does."""
    if len(samples) < 2:
        return None
    increase: dict[str, float] = {}
    for name in COUNTERS:
        total, prev = 0.0, None
        for _, values in samples:
            v = values.get(name)
            if v is None or not math.isfinite(v):
                continue
            if prev is not None:
                total += v - prev if v >= prev else v
            prev = v
        if prev is not None:
            increase[name] = total
    mean: dict[str, float] = {}
    for name in GAUGES:
        vals = [values[name] for _, values in samples[1:] if math.isfinite(values.get(name, math.nan))]
        if vals:
            mean[name] = sum(vals) / len(vals)
    running = [values.get(mn.VLLM_NUM_RUNNING, math.nan) for _, values in samples[1:]]
    known = [r for r in running if math.isfinite(r)]
    busy = sum(1 for r in known if r > 0) / len(known) if known else 1.0
    return WindowTotals(samples[-1][0] - samples[0][0], increase, mean, busy)


def split_windows(
    samples: Sequence[tuple[float, Mapping[str, float]]], part_s: float = PART_S
) -> list[WindowTotals]:
    """``samples`` cut into consecutive sub-windows of at least ``part_s`` seconds."""
    parts: list[WindowTotals] = []
    start = 0
    for i, (t, _) in enumerate(samples):
        if t - samples[start][0] >= part_s:
            part = window_totals(samples[start : i + 1])
            if part is not None:
                parts.append(part)
            start = i
    return parts


@dataclass(frozen=True, slots=True)
class StepCost:
    """The fitted step cost: seconds per step, per uncached prompt token, per decoded token."""

    step_s: float
    prompt_token_s: float
    decode_token_s: float


@dataclass(frozen=True, slots=True)
class CapacityPrediction:
    """Ĉ predicted for the window's mix (calls/s), its range, and the figures it came from."""

    capacity: float
    low: float
    high: float
    uncached_prompt_tokens: float
    output_tokens: float
    saturated_batch: float
    cost: StepCost


def _row(w: WindowTotals) -> tuple[float, float, float, float] | None:
    """(steps, uncached prompt tokens, decoded tokens, busy seconds) of a sub-window; None
    without decodes."""
    inc = w.increase
    decoded = inc.get(_ITL_COUNT, 0.0)
    latency = inc.get(_ITL_SUM, 0.0)
    busy = w.seconds * w.busy
    if decoded <= 0 or latency <= 0 or busy <= 0:
        return None
    prompt = max(inc.get(mn.VLLM_PREFIX_CACHE_QUERIES, 0.0) - inc.get(mn.VLLM_PREFIX_CACHE_HITS, 0.0), 0.0)
    return busy * decoded / latency, prompt, decoded, busy


def _solve(rows: Sequence[tuple[float, float, float, float]]) -> StepCost | None:
    """Non-negative least squares of busy on (steps, prompt, decoded), by trying every subset
    of the three (the best fit whose coefficients are all >= 0); None when none fits."""
    best: tuple[float, tuple[float, float, float]] | None = None
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask >> j & 1]
        coef = _lstsq([[r[j] for j in cols] for r in rows], [r[3] for r in rows])
        if coef is None or min(coef) < 0:
            continue
        full = [0.0, 0.0, 0.0]
        for j, c in zip(cols, coef, strict=True):
            full[j] = c
        resid = sum((r[3] - sum(full[j] * r[j] for j in range(3))) ** 2 for r in rows)
        if best is None or resid < best[0] - 1e-15:
            best = (resid, (full[0], full[1], full[2]))
    return None if best is None else StepCost(*best[1])


def _lstsq(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Least squares by the normal equations (at most 3 columns), None when singular."""
    k = len(x[0])
    a = [
        [sum(r[i] * r[j] for r in x) for j in range(k)] + [sum(r[i] * v for r, v in zip(x, y, strict=True))]
        for i in range(k)
    ]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) <= 1e-12 * max(1.0, abs(a[col][col])):
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [u - f * v for u, v in zip(a[i], a[col], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


def fit_step_cost(parts: Sequence[WindowTotals], *, prompt_token_s: float | None = None) -> StepCost | None:
    """The step cost fitted over sub-windows (module docstring); None with fewer than
    :data:`MIN_FIT_WINDOWS` that decoded anything, or no non-negative fit. With
    ``prompt_token_s`` (``c`` known otherwise, e.g. measured), only ``a`` and ``β`` are fitted, on
    each sub-window's busy time less ``c`` times its prompt tokens."""
    rows = [r for r in (_row(p) for p in parts) if r is not None]
    if len(rows) < MIN_FIT_WINDOWS:
        return None
    if prompt_token_s is None:
        return _solve(rows)
    cost = _solve(
        [(steps, 0.0, decoded, busy - prompt_token_s * prompt) for steps, prompt, decoded, busy in rows]
    )
    return None if cost is None else StepCost(cost.step_s, prompt_token_s, cost.decode_token_s)


def predict_capacity(
    window: WindowTotals,
    parts: Sequence[WindowTotals],
    *,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> CapacityPrediction | None:
    """Ĉ for ``window``'s mix with the step cost fitted over ``parts`` (its sub-windows); None
    when the window lacks what the formula needs (no finished call, no decode, no KV-cache use,
    a series vLLM did not export, or too few sub-windows)."""
    inc = window.increase
    prompt = window.per_call(_PROMPT_SUM, _PROMPT_COUNT)
    output = window.per_call(_OUTPUT_SUM, _OUTPUT_COUNT)
    running = window.mean.get(mn.VLLM_NUM_RUNNING)
    kv = window.mean.get(mn.VLLM_KV_CACHE_USAGE)
    if prompt is None or output is None or not running or not kv or running <= 0 or kv <= 0:
        return None
    queries = inc.get(mn.VLLM_PREFIX_CACHE_QUERIES, 0.0)
    hit_share = inc.get(mn.VLLM_PREFIX_CACHE_HITS, 0.0) / queries if queries > 0 else 0.0
    uncached = prompt * (1.0 - min(max(hit_share, 0.0), 1.0))
    batch = min(float(max_num_seqs), max(running / kv, running))

    def capacity(cost: StepCost | None) -> float | None:
        if cost is None:
            return None
        per_call = uncached * cost.prompt_token_s + output * (cost.step_s / batch + cost.decode_token_s)
        return 1.0 / per_call if per_call > 0 else None

    cost = fit_step_cost(parts)
    estimate = capacity(cost)
    if cost is None or estimate is None:
        return None
    half = len(parts) // 2
    spread = [estimate] + [c for c in (capacity(fit_step_cost(h)) for h in (parts[:half], parts[half:])) if c]
    return CapacityPrediction(estimate, min(spread), max(spread), uncached, output, batch, cost)


def predict_over(
    times: Sequence[float],
    rows: Sequence[Sequence[float]],
    columns: Mapping[str, int],
    now: float,
    *,
    window_s: float = PREDICT_WINDOW_S,
    part_s: float = PART_S,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> CapacityPrediction | None:
    """The prediction over ``[now - window_s, now]`` of a history kept as rows (``columns``: each
    of :data:`PREDICTOR_SERIES`' column; NaN: not in that scrape), as the detector keeps one."""
    if not rows or not math.isfinite(rows[-1][columns[_ITL_COUNT]]):
        return None  # vLLM exports no inter-token latency (or the source drops histograms)
    samples: list[tuple[float, dict[str, float]]] = []
    for t, row in zip(times, rows, strict=True):
        if now - window_s - 1e-9 <= t <= now + 1e-9:
            samples.append((t, {name: row[j] for name, j in columns.items() if math.isfinite(row[j])}))
    whole = window_totals(samples)
    if whole is None:
        return None
    return predict_capacity(whole, split_windows(samples, part_s), max_num_seqs=max_num_seqs)
