"""Ĉ learned before saturation: ``detector.capacity``'s prediction against the calibrated Ĉ.

For each engine preset (the study's prompts at 0.6 Ĉ) and each trace mix (replayed at 0.5 Ĉ of
its own mix), one simulated run per seed with retries off; the predictor reads the first
``--minutes`` of vLLM's series the simulator wrote (one sample per 5 simulated s, vLLM's
counting rules) and prints the prediction, its range, the calibrated Ĉ, the error, and the
simulated time from which every prediction (on the series so far) stays within ±15 %.

    .venv/bin/python bench/bench_learned_capacity.py --seeds 2 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from detector.capacity import COUNTERS, GAUGES, predict_capacity, split_windows, window_totals
from foundation.timeseries import read_series

PRESETS = ("qwen2.5-7b-h100", "qwen3-14b-h100", "llama3.1-8b-h100")
#: (trace, --window): the whole of each, and the Azure code trace's second quarter hour alone
#: (a trace replay draws nothing from the seed: each runs once).
TRACES = (
    ("azure_code_2023_30min.csv.gz", None),
    ("azure_code_2023_30min.csv.gz", "900:1800"),
    ("azure_conv_2023_5min.csv", None),
    ("mooncake_conversation_4min.jsonl", None),
)
TRACE_DIR = Path(__file__).resolve().parents[1] / "reproduce" / "workloads" / "traces" / "data"
# The study's base load for ten minutes, then a short tail the harness needs (a pulse phase).
LOW_LOAD = '{"phases": [[600, 0.6], [30, 0.6], [30, 0.6]], "phase_names": ["base", "pulse", "hold"]}'
TOLERANCE = 0.15


def _run(out: Path, model: str, seed: int, trace: str | None, window: str | None) -> tuple[float, Path]:
    cmd = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--backend", "sim", "--model", model,
        "--block", "diagnostic", "--condition", "retries-off-cancel-off", "--runs", "1",
        "--seed", str(seed), "--out", str(out), "--no-progress",
    ]  # fmt: skip
    if trace is None:
        cmd += ["--backend-option", f"workload={LOW_LOAD}"]
    else:
        cmd += ["--trace", str(TRACE_DIR / trace), "--load", "0.5"]
        if window is not None:
            cmd += ["--window", window]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    run = json.loads((out / "summary.json").read_text())["runs"][0]
    return float(run["capacity"]), out / "runs" / run["slug"] / "metrics.jsonl"


def summed_samples(path: Path, wanted: set[str]) -> list[tuple[float, dict[str, float]]]:
    """Each snapshot of a run's series: its time and the ``wanted`` series, summed over labels."""
    out = []
    for snap in read_series(path):
        values: dict[str, float] = {}
        for name, _, value in snap.samples:
            if name in wanted:
                values[name] = values.get(name, 0.0) + value
        out.append((snap.t, values))
    return out


def _predict(
    samples: list[tuple[float, dict[str, float]]], until: float
) -> tuple[float, float, float] | None:
    upto = [s for s in samples if s[0] <= until]
    whole = window_totals(upto)
    if whole is None:
        return None
    p = predict_capacity(whole, split_windows(upto))
    return None if p is None else (p.capacity, p.low, p.high)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--minutes", type=float, default=10.0)
    args = ap.parse_args()
    horizon = args.minutes * 60.0
    head = ("mix", "seed", "Ĉ pred", "range", "Ĉ true", "error", "known at")
    print(
        f"{head[0]:34s} {head[1]:>4s} {head[2]:>8s} {head[3]:>13s} {head[4]:>8s} {head[5]:>7s} {head[6]:>9s}"
    )
    cases = [(m, None, None, seed) for m in PRESETS for seed in args.seeds]
    cases += [("qwen2.5-7b-h100", t, w, args.seeds[0]) for t, w in TRACES]
    for model, trace, window, seed in cases:
        with tempfile.TemporaryDirectory() as tmp:
            true, path = _run(Path(tmp) / "out", model, seed, trace, window)
            samples = summed_samples(path, set(COUNTERS) | set(GAUGES))
        preds = [(t, _predict(samples, t)) for t in range(60, int(horizon) + 1, 30)]
        known = next(
            (
                t
                for i, (t, _) in enumerate(preds)
                if all(p is not None and abs(p[0] / true - 1) <= TOLERANCE for _, p in preds[i:])
            ),
            None,
        )
        name = model if trace is None else f"{trace.split('_20')[0].split('_4min')[0]} {window or 'all'}"
        tag = str(seed) if trace is None else "-"
        final = preds[-1][1]
        if final is None:
            print(f"{name:34s} {tag:>4s} {'none':>8s} {'':13s} {true:8.2f}")
            continue
        est, lo, hi = final
        print(
            f"{name:34s} {tag:>4s} {est:8.2f} {lo:6.2f}-{hi:<6.2f} {true:8.2f} "
            f"{(est / true - 1) * 100:+6.1f}% {'never' if known is None else f'{known} s':>9s}"
        )


if __name__ == "__main__":
    main()
