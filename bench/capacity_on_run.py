"""Ĉ learned before saturation, on one kept run: what the engine did, and what the fit made of it.

Reads a run directory's ``metrics.jsonl`` (the scraped vLLM series; a run of ``reproduce run`` or
of the real-vLLM pulse test kept with ``--basetemp``) and prints

- per stretch of ``--step`` seconds, what the engine did: calls finished per second, uncached
  prompt tokens per second, prompt tokens per call, prefix-cache hits, decoded tokens per second
  and per call, the mean inter-token latency, the mean running and waiting counts, KV-cache use,
  and the prefill seconds per uncached prompt token (``vllm:request_prefill_time_seconds``);
- ``detector.capacity``'s prediction over ``--from``–``--to`` (the whole stretch, and each
  ``--window`` ending every ``--every`` seconds in it) for each sub-window length of ``--parts``:
  value over ``--true``, the range, and the fitted step cost; then, over those windows, the
  median, the least and greatest, and how many are within ±15 %;
- beside it, a variant tried and not adopted (docs/results.md, "Why the prediction misses on the
  CPU engine"): ``c`` measured, not fitted, as vLLM's prefill time over the uncached prompt
  tokens (those admitted: prefix-cache queries − hits; or those of the calls the histogram timed:
  the prompt-token histogram's sum less the window's hit share), then ``a, β ≥ 0`` fitted on
  ``busy − c·prompt``, and the same ``1/Ĉ = U·c + O·(a/B + β)``.

    .venv/bin/python bench/capacity_on_run.py RUN_DIR --true 3.1333 --from 80 --to 166.7 \\
        --window 30 --parts 1.5 3 5 10 15
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from bench_learned_capacity import TOLERANCE, summed_samples

from detector.capacity import (
    PART_S,
    PREDICTOR_SERIES,
    CapacityPrediction,
    WindowTotals,
    fit_step_cost,
    predict_capacity,
    split_windows,
    window_totals,
)
from foundation import metricnames as mn

Samples = list[tuple[float, dict[str, float]]]
_PREFILL = f"{mn.VLLM_PREFILL_TIME}_sum"
_EXTRA = (mn.VLLM_NUM_WAITING, "vllm:request_success_total", _PREFILL)


def _engine(samples: Samples, step: float) -> None:
    print(" from    to done/s uncached/s P/call  hit%  dec/s  O/call ITL ms  run   wait    kv  prefill s/tok")
    end, a = samples[-1][0], samples[0][0]
    while a < end - 1e-9:
        b = min(a + step, end)
        part = [s for s in samples if a - 1e-9 <= s[0] <= b + 1e-9]
        if len(part) < 2:
            break
        first, last = part[0][1], part[-1][1]

        def inc(name: str, first: dict[str, float] = first, last: dict[str, float] = last) -> float:
            return last.get(name, 0.0) - first.get(name, 0.0)

        def mean(name: str, part: Samples = part) -> float:
            return sum(v.get(name, math.nan) for _, v in part[1:]) / (len(part) - 1)

        d = part[-1][0] - part[0][0]
        q, h = inc(mn.VLLM_PREFIX_CACHE_QUERIES), inc(mn.VLLM_PREFIX_CACHE_HITS)
        pc, ps = inc(f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_count"), inc(f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum")
        gen = mn.VLLM_REQUEST_GENERATION_TOKENS
        oc, os_ = inc(f"{gen}_count"), inc(f"{gen}_sum")
        ic, isum = inc(f"{mn.VLLM_INTER_TOKEN_LATENCY}_count"), inc(f"{mn.VLLM_INTER_TOKEN_LATENCY}_sum")
        nan = math.nan
        print(
            f"{a:5.0f} {b:5.0f} {inc('vllm:request_success_total') / d:6.2f} {(q - h) / d:10.0f}"
            f" {ps / pc if pc else nan:6.0f} {100 * h / q if q else nan:5.1f} {ic / d:6.1f}"
            f" {os_ / oc if oc else nan:6.1f} {1000 * isum / ic if ic else nan:6.0f}"
            f" {mean(mn.VLLM_NUM_RUNNING):5.1f} {mean(mn.VLLM_NUM_WAITING):6.1f}"
            f" {mean(mn.VLLM_KV_CACHE_USAGE):5.3f}"
            f" {inc(_PREFILL) / (q - h) if q > h else nan:10.3g}"
        )
        a = b


def _increase(samples: Samples, name: str) -> float:
    """A counter's increase over ``samples`` (the value after a fall counts, as ``rate()``)."""
    total, prev = 0.0, None
    for _, values in samples:
        v = values.get(name)
        if v is None:
            continue
        if prev is not None:
            total += v - prev if v >= prev else v
        prev = v
    return total


def _measured_prefill(
    samples: Samples, whole: WindowTotals, parts: list[WindowTotals], p: CapacityPrediction, finished: bool
) -> tuple[float, float] | None:
    """The variant's (Ĉ, c): c measured over the uncached prompt tokens admitted, or over those of
    the calls that finished (the ones the prefill histogram timed); None without prefills."""
    inc = whole.increase
    queries, hits = inc.get(mn.VLLM_PREFIX_CACHE_QUERIES, 0.0), inc.get(mn.VLLM_PREFIX_CACHE_HITS, 0.0)
    if finished:
        share = min(max(hits / queries, 0.0), 1.0) if queries > 0 else 0.0
        tokens = inc.get(f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum", 0.0) * (1.0 - share)
    else:
        tokens = queries - hits
    prefill = _increase(samples, _PREFILL)
    if tokens <= 0 or prefill <= 0:
        return None
    c = prefill / tokens
    cost = fit_step_cost(parts, prompt_token_s=c)  # a, β >= 0 on busy − c·prompt
    if cost is None:
        return None
    per_call = p.uncached_prompt_tokens * c + p.output_tokens * (
        cost.step_s / p.saturated_batch + cost.decode_token_s
    )
    return (1.0 / per_call, c) if per_call > 0 else None


def _fit(
    samples: Samples, lo: float, hi: float, window: float, parts: list[float], true: float, every: float
) -> None:
    moving = [(window, t) for t in _range(lo + window, hi, every)]
    same = abs(window - (hi - lo)) < 1e-6 and any(abs(t - hi) < 1e-6 for _, t in moving)
    stretch = [] if same else [(hi - lo, hi)]  # the whole stretch, unless a moving window is it
    for part_s in parts:
        ratios: list[float] = []
        for i, (width, t) in enumerate(stretch + moving):
            kept = [s for s in samples if max(lo, t - width) - 1e-9 <= s[0] <= t + 1e-9]
            whole, cut = window_totals(kept), split_windows(kept, part_s)
            p = None if whole is None else predict_capacity(whole, cut)
            head = f"sub-window {part_s:5.1f} s, window {width:5.1f} s ending {t:6.1f} s:"
            if whole is None or p is None:
                print(head, "no prediction")
                continue
            c = p.cost
            if i >= len(stretch):
                ratios.append(p.capacity / true)
            print(
                f"{head} {p.capacity / true:5.2f}x [{p.low / true:.2f}, {p.high / true:.2f}]"
                f"  a={c.step_s:.3g} c={c.prompt_token_s:.3g} beta={c.decode_token_s:.3g}"
                f"  U={p.uncached_prompt_tokens:.0f} O={p.output_tokens:.1f} B={p.saturated_batch:.0f}"
            )
            for label, finished in (("admitted", False), ("finished", True)):
                m = _measured_prefill(kept, whole, cut, p, finished)
                text = "none" if m is None else f"{m[0] / true:5.2f}x c={m[1]:.3g}"
                print(f"{'':10s}prefill measured over {label} tokens: {text}")
        if ratios:
            within = sum(abs(r - 1.0) <= TOLERANCE for r in ratios)
            print(
                f"sub-window {part_s:5.1f} s, the {len(ratios)} windows of {window:g} s: median"
                f" {statistics.median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f}x,"
                f" {within} of {len(ratios)} within ±{TOLERANCE:.0%}"
            )


def _range(start: float, stop: float, step: float) -> list[float]:
    out, t = [], start
    while t <= stop + 1e-9:
        out.append(t)
        t += step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a run directory holding metrics.jsonl")
    ap.add_argument("--true", type=float, required=True, help="the run's calibrated Ĉ (calls/s)")
    ap.add_argument("--from", dest="lo", type=float, default=0.0, help="stretch start (s)")
    ap.add_argument("--to", dest="hi", type=float, default=None, help="stretch end (s; default: the end)")
    ap.add_argument("--window", type=float, default=30.0, help="the detector's window (s)")
    ap.add_argument("--parts", type=float, nargs="+", default=[PART_S], help="sub-window lengths (s)")
    ap.add_argument("--every", type=float, default=None, help="seconds between windows' ends (half a window)")
    ap.add_argument("--step", type=float, default=10.0, help="the engine table's stretch (s)")
    args = ap.parse_args()
    every = args.window / 2 if args.every is None else args.every
    if min(args.true, args.window, args.step, every, *args.parts) <= 0:
        ap.error("--true, --window, --step, --every and --parts must be above 0")
    path = args.run / "metrics.jsonl"
    if not path.is_file():
        ap.error(f"{path}: no such file")
    samples = summed_samples(path, set(PREDICTOR_SERIES) | set(_EXTRA))
    if len(samples) < 2:
        ap.error(f"{path}: fewer than two snapshots")
    hi = samples[-1][0] if args.hi is None else args.hi
    _engine(samples, args.step)
    _fit(samples, args.lo, hi, args.window, args.parts, args.true, every)


if __name__ == "__main__":
    main()
