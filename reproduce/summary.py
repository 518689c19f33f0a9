"""``DIR/summary.json``: one entry per run, the same shape whichever backend produced it.

A backend hands over the call records and the metrics series of a run; this module writes the
series to ``DIR/runs/<slug>/metrics.jsonl`` (and the call records to ``attempts.jsonl``),
computes the outcomes (``reproduce.outcomes``) on the run's plan (``reproduce.plan``) and shapes
the run's entry as the contract in docs/architecture.md asks. ``write_summary`` writes the file
atomically; ``detector.rundir`` reads it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from foundation.timeseries import Snapshot, write_series
from reproduce.client import CallRecord
from reproduce.conditions import RunSpec
from reproduce.outcomes import compute_outcomes
from reproduce.plan import RunPlan

__all__ = ["run_dir", "run_entry", "write_run_files", "write_summary"]


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
    timeline of the run's own ``plan``: its pulse, cohorts and windows are the phases it ran."""
    timeline = plan.timeline()
    pulse = plan.pulse
    outcomes = compute_outcomes(calls, snapshots, timeline, capacity)
    entry: dict[str, Any] = {
        "block": run.block,
        "condition": run.condition.slug,
        "variant": run.condition.variant,
        "model": run.model,
        "run": run.run,
        "seed": run.seed,
        "slug": run.slug,
        "backend": backend,
        "capacity": capacity,
        "pulse_multiple": pulse.multiple if pulse is not None else run.condition.workload.pulse_multiple,
        "settings": run.condition.describe(),
        "time_scale": timeline.time_scale,
        "deadline_s": timeline.deadline_s,
        "duration_s": duration_s,
        "pulse": {"start_s": timeline.pulse_start, "end_s": timeline.pulse_end},
        "hold_end_s": timeline.hold_end,
        "plan": plan.describe(),
        "series": series,
        **outcomes,
    }
    if trace is not None:
        entry["trace"] = dict(trace)
    if extra:
        entry.update(extra)
    safe: dict[str, Any] = _json_safe(entry)
    return safe


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
