"""``DIR/summary.json``: one entry per run, the same shape whichever backend produced it.

A backend hands over the call records and the metrics series of a run; this module writes the
series to ``DIR/runs/<slug>/metrics.jsonl`` (and the call records to ``attempts.jsonl``),
computes the outcomes (``reproduce.judge.outcomes``) on the run's plan
(``reproduce.workloads.plan``) and shapes the run's entry as the contract in
docs/architecture.md asks. Every run's ground truth over time (``reproduce.judge.groundtruth``:
its judged span and windows, its collapses) is computed here, once, and written into its entry,
where validation, the what-if and the dashboard read it. A run
without a pulse (a replayed trace, a stepped load) is judged by it alone: its collapses, each
with the burst that started it, and ``recovered`` when none runs to its end.
``write_summary`` writes the file atomically; ``foundation.rundir`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from foundation.groundtruth import GroundTruth, JudgedSpan
from foundation.timeseries import Snapshot, write_series
from reproduce.conditions import RunSpec
from reproduce.judge.groundtruth import calls_of_records, ground_truth
from reproduce.judge.outcomes import cohort_delivery, compute_outcomes, counts, rates_x_capacity
from reproduce.workloads.client import CallRecord
from reproduce.workloads.plan import RECOVERY_WINDOWS, RunPlan

__all__ = ["judged_span", "run_dir", "run_entry", "write_run_files", "write_summary"]


def run_dir(out: Path, run: RunSpec) -> Path:
    return out / "runs" / run.slug


def write_run_files(
    out: Path, run: RunSpec, snapshots: Sequence[Snapshot], calls: Sequence[CallRecord]
) -> str:
    """Write the run's series and call records; return the series path relative to ``out``."""
    folder = run_dir(out, run)
    folder.mkdir(parents=True, exist_ok=True)
    write_series(folder / "metrics.jsonl", snapshots)
    with (folder / "attempts.jsonl").open("w", encoding="utf-8") as fh:
        for call in calls:
            fh.write(json.dumps(call.to_dict(), separators=(",", ":")))
            fh.write("\n")
    return (folder / "metrics.jsonl").relative_to(out).as_posix()


def run_entry(
    *,
    run: RunSpec,
    backend: str,
    capacity: float,
    plan: RunPlan,
    calls: Sequence[CallRecord],
    snapshots: Sequence[Snapshot],
    series: str,
    duration_s: float,
    trace: Mapping[str, float | None] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary entry of one run (``capacity`` in calls per run-second), judged on the
    timeline of the run's own ``plan``: its pulse, cohorts and windows are the phases it ran;
    without a pulse, on its ground truth over time (:func:`trace_outcomes`). Every entry holds
    the run's ground-truth record (``collapses`` and ``judged``: ``reproduce.judge.groundtruth``)."""
    snapshots = sorted(snapshots, key=lambda s: s.t)
    truth = ground_truth(calls_of_records(calls), snapshots, judged_span(plan, capacity, duration_s))
    if plan.pulse is None:
        outcomes = trace_outcomes(calls, snapshots, plan, capacity, duration_s, truth)
    else:
        timeline = plan.timeline()
        outcomes = {
            "pulse_multiple": plan.pulse.multiple,
            "pulse": {"start_s": timeline.pulse_start, "end_s": timeline.pulse_end},
            "hold_end_s": timeline.hold_end,
            **compute_outcomes(calls, snapshots, timeline, capacity),
        }
    entry: dict[str, Any] = {
        **_identity(run, backend, capacity, plan, series, duration_s),
        **outcomes,
        **truth.entry_fields(),
    }
    if trace is not None:
        entry["trace"] = dict(trace)
    if extra:
        entry.update(extra)
    safe: dict[str, Any] = _json_safe(entry)
    return safe


def judged_span(plan: RunPlan, capacity: float, duration_s: float) -> JudgedSpan:
    """The span a run's ground truth judges, from its plan: a pulse run from its start to the end
    of its hold, windows aligned to the pulse's end; a run without a pulse over its whole length,
    windows aligned to its start. The window and deadline are the plan's (run seconds)."""
    pulse = plan.pulse
    timeline = None if pulse is None else plan.timeline()
    return JudgedSpan(
        start_s=0.0,
        end_s=duration_s if timeline is None else timeline.hold_end,
        align_s=0.0 if timeline is None else timeline.pulse_end,
        window_s=plan.window_s,
        deadline_s=plan.deadline_s,
        capacity=capacity,
        max_growth_per_s=plan.max_growth_per_s,
        pulse_start_s=None if timeline is None else timeline.pulse_start,
        pulse_end_s=None if timeline is None else timeline.pulse_end,
    )


def _identity(
    run: RunSpec, backend: str, capacity: float, plan: RunPlan, series: str, duration_s: float
) -> dict[str, Any]:
    return {
        "block": run.block,
        "condition": run.condition.slug,
        "variant": run.condition.variant,
        "model": run.model,
        "run": run.run,
        "seed": run.seed,
        "slug": run.slug,
        "backend": backend,
        "capacity": capacity,
        "settings": run.condition.describe(),
        "workload": {"kind": run.condition.workload.kind, "label": run.condition.workload.label()},
        **plan.clock.record(),
        "deadline_s": plan.deadline_s,
        "duration_s": duration_s,
        "plan": plan.describe(),
        "series": series,
    }


def trace_outcomes(
    calls: Sequence[CallRecord],
    snapshots: Sequence[Snapshot],
    plan: RunPlan,
    capacity: float,
    duration_s: float,
    truth: GroundTruth,
) -> dict[str, Any]:
    """A run without a pulse, judged over its whole length (docs/protocol.md §9) by its ground
    truth ``truth``: ``recovered`` unless a collapse runs to the run's end; the ``burst``
    validation aligns the run on (the truth's overload: the first collapse's burst, or the run's
    busiest stretch without one) and ``recovery_time_s`` from that burst's end to the end of the
    last collapse plus the two good windows that ended it. Delivery, rates and counts are over
    the whole run."""
    collapses = truth.collapses
    recovered = all(c.ended for c in collapses)
    assert truth.overload is not None  # a span without a pulse always names one
    burst = truth.overload
    recovery_time = None
    if recovered:
        last_end = collapses[-1].end_s + RECOVERY_WINDOWS * truth.span.window_s if collapses else burst[1]
        recovery_time = max(last_end - burst[1], 0.0)
    return {
        "pulse": None,
        "pulse_multiple": None,
        "hold_end_s": None,
        "burst": {"start_s": burst[0], "end_s": burst[1]},
        "recovered": recovered,
        "recovery_time_s": recovery_time,
        "delivery": cohort_delivery(calls, {"trace": (0.0, math.inf)}, plan.deadline_s, plan.horizon_s),
        "rates_x_capacity": rates_x_capacity(snapshots, 0.0, duration_s, capacity),
        **counts(calls, snapshots),
    }


def _json_safe(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_summary(
    out: Path, runs: Sequence[Mapping[str, Any]], meta: Mapping[str, Any] | None = None
) -> Path:
    """Write ``out/summary.json`` atomically: ``{"runs": [...], "meta": {...}}``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    body = {"runs": list(runs), "meta": dict(meta or {})}
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".summary.", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(_json_safe(body), fh, indent=1)
    os.replace(tmp, path)
    return path
