"""Reproduce outputs for the Experiments page: ``DIR/summary.json``, ``DIR/validation.json``
and each run's metrics series (``foundation/timeseries.py``), turned into the same signal
names the detector serves so the live panels' figure builders draw a run too, plus the calls
arriving and delivered in time at the series' own step (a replayed trace's burst shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detector.replay import ReplaySettings, replay_reproduce_run
from detector.signals import DELIVERY_OBJECTIVE, WINDOWS, Windows
from foundation import metricnames as mn
from foundation.ratios import PROMPT_TOKEN_GAP, Ratio
from foundation.rundir import (
    SUMMARY,
    WHATIF,
    WHATIF_POINTS,
    read_summary,
    read_validation,
    regular_file,
    run_slug,
    series_path,
)
from foundation.timeseries import Snapshot, read_series

#: The charts' rates are over half the detector's rate window (30 s at the study's scale): a
#: run's own, as its plan recorded it, so a scaled run's charts are the study's at its scale.
RATE_WINDOW_SHARE = 0.5
RATE_WINDOW_S = WINDOWS.rate_s * RATE_WINDOW_SHARE
# Calls arriving (first attempts) and calls delivered within the deadline, per second over each
# step of the series: the finest it holds, so a replayed trace's bursts are drawn unsmoothed.
STEP_SIGNALS: tuple[str, str] = ("call_arrival_rate_step", "delivered_within_deadline_rate_step")
MAX_RUNS = 5000
# The largest metrics series drawn: a study-scale run's is ~2 MB; a day of 1-s snapshots ~500 MB,
# more than a page should parse in a request.
MAX_SERIES_BYTES = 256 * 1024 * 1024


def capacity_deadline(run: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """Ĉ (calls/s) and the client deadline (s) as the run's summary entry gives them; None for
    one it leaves out (the run's series may export it)."""
    capacity, deadline = run.get("capacity"), run.get("deadline_s")
    return (None if capacity is None else float(capacity), None if deadline is None else float(deadline))


@dataclass
class RunsDir:
    """A loaded reproduce output: the summary's runs and each run's detector alerts."""

    root: Path
    runs: list[dict[str, Any]]
    # run key -> validation.json's alerts for it; a run without an entry is replayed on demand
    alerts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _replayed: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)

    def run_alerts(self, run: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
        """The detector's alerts over a run and where they come from: ``validation.json``, or
        the detector's replay of the run's series (computed once, then kept)."""
        key = run_key(run)
        if key in self.alerts:
            return self.alerts[key], "validation.json"
        if key not in self._replayed:
            episodes = replay_reproduce_run(
                self.series_path(run), *capacity_deadline(run), ReplaySettings.of_entry(run)
            )
            self._replayed[key] = [
                {
                    "alertname": ep.alertname,
                    "severity": ep.severity,
                    "fired_at_s": ep.started_at,
                    "resolved_at_s": ep.resolved_at,
                }
                for ep in episodes
            ]
        return self._replayed[key], "the detector's replay"

    def run(self, run_id: str) -> dict[str, Any]:
        for run in self.runs:
            if run_key(run) == run_id:
                return run
        raise KeyError(f"no run {run_id!r} in {self.root}")

    def series_path(self, run: Mapping[str, Any]) -> Path:
        """The run's metrics series, if it is a regular file inside the DIR of at most
        ``MAX_SERIES_BYTES`` (RunDirError otherwise: a FIFO there would block its reader)."""
        return regular_file(series_path(self.root, run), self.root, MAX_SERIES_BYTES)


run_key = run_slug  # a run's identifier on the pages: its slug


def run_identity(run: Mapping[str, Any]) -> tuple[str, ...]:
    """(block, condition, variant, model, run): how validation.json names the runs of
    summary.json (a trace replayed at two loads differs only in its variant)."""
    return (
        str(run.get("block", "")),
        str(run.get("condition", "")),
        str(run.get("variant") or ""),
        str(run.get("model", "")),
        str(run.get("run", "")),
    )


def condition_text(run: Mapping[str, Any]) -> str:
    """A run's condition with its variant where the condition does not already name it (the
    trigger sweep's pulse multiple, a replayed trace's name and load)."""
    condition = str(run.get("condition", ""))
    variant = str(run.get("variant") or "")
    return f"{condition} ({variant})" if variant and variant not in condition else condition


def run_label(run: Mapping[str, Any]) -> str:
    state = "recovered" if run.get("recovered") else "not recovered"
    parts = [str(run.get("block", "")), condition_text(run), str(run.get("model", ""))]
    return f"{' · '.join(parts)} · run {run.get('run', '')} ({state})"


def load_runs(root: Path | str) -> RunsDir:
    """Read ``summary.json`` (required) and ``validation.json`` (optional) under ``root``
    (``foundation.rundir``); of a what-if's DIR (``whatif.json``), those of its points."""
    root = Path(root)
    if not (root / SUMMARY).exists() and (root / WHATIF).exists():  # a what-if's DIR: its points
        root = root / WHATIF_POINTS
    summary = read_summary(root)
    runs = [r for r in summary["runs"] if isinstance(r, dict)][:MAX_RUNS]
    alerts: dict[str, list[dict[str, Any]]] = {}
    validation = read_validation(root)
    if validation is not None:
        by_identity: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for entry in validation["runs"]:
            if isinstance(entry, Mapping):
                found = [dict(a) for a in entry.get("alerts") or [] if isinstance(a, Mapping)]
                by_identity[run_identity(entry)] = found
        for run in runs:
            if run_identity(run) in by_identity:
                alerts[run_key(run)] = by_identity[run_identity(run)]
    return RunsDir(root=root, runs=runs, alerts=alerts)


# --- signals of a run from its metrics series --------------------------------------------


def _counter_rate(t: np.ndarray, values: np.ndarray, window_s: float) -> np.ndarray:
    """Per-second increase over the last ``window_s`` at each snapshot (NaN where too early
    or where the counter reset)."""
    starts = np.searchsorted(t, t - window_s - 1e-9, side="left")
    dt = t - t[starts]
    dv = values - values[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where((dt > 0) & (dv >= 0), dv / np.where(dt > 0, dt, 1.0), math.nan)
    return rate


def _column(snaps: Sequence[Snapshot], name: str, **labels: str) -> np.ndarray:
    return np.array([math.nan if (v := s.value(name, **labels)) is None else v for s in snaps], dtype=float)


def series_signals(
    snapshots: Sequence[Snapshot],
    *,
    capacity: float | None = None,
    deadline_s: float | None = None,
    window_s: float = RATE_WINDOW_S,
    windows: Windows = WINDOWS,
) -> dict[str, np.ndarray]:
    """The live panels' signals (names of detector/signals.py) from a run's snapshots,
    with ``t`` in seconds from the run's start. Rates are over ``window_s``; the delivery SLO's
    burn rates over the detector's own two windows (``windows``), as its alert reads them; the
    ``STEP_SIGNALS`` (calls arriving, calls delivered within the deadline) over the series' own
    step, so a burst keeps its shape."""
    if not snapshots:
        return {}
    t = np.array([s.t for s in snapshots], dtype=float)

    def rate(name: str, **labels: str) -> np.ndarray:
        return _counter_rate(t, _column(snapshots, name, **labels), window_s)

    def pts(values: np.ndarray) -> np.ndarray:
        return np.column_stack([t, values])

    out: dict[str, np.ndarray] = {}
    first, retry = rate(mn.ATTEMPTS, kind="first"), rate(mn.ATTEMPTS, kind="retry")
    out["attempt_rate_first"] = pts(first)
    out["attempt_rate_retry"] = pts(retry)
    out["attempt_rate"] = pts(first + np.nan_to_num(retry))
    out["execution_creation_rate"] = pts(rate(mn.EXECUTIONS_CREATED))
    cap = _column(snapshots, mn.CAPACITY)
    if capacity is not None:
        cap = np.where(np.isfinite(cap), cap, capacity)
    out["capacity"] = pts(cap)
    dl = _column(snapshots, mn.CLIENT_DEADLINE)
    if deadline_s is not None:
        dl = np.where(np.isfinite(dl), dl, deadline_s)
    out["deadline"] = pts(dl)
    out["vllm_waiting"] = pts(_column(snapshots, mn.VLLM_NUM_WAITING))
    out["proxy_queued"] = pts(_column(snapshots, mn.EXECUTIONS_QUEUED))
    for fate in mn.FATES:
        out[f"completion_rate_{fate}"] = pts(rate(mn.EXECUTIONS_FINISHED, fate=fate))
    out["shed_rate"] = pts(rate(mn.ATTEMPTS_SHED))
    out["attached_rate"] = pts(rate(mn.ATTEMPTS_ATTACHED))
    out["delivered_rate_within_deadline"] = pts(rate(mn.CALLS_DELIVERED, within_deadline="true"))
    out["delivered_rate_late"] = pts(rate(mn.CALLS_DELIVERED, within_deadline="false"))
    step = float(np.median(np.diff(t))) if t.size > 1 else window_s
    arriving, in_time = STEP_SIGNALS
    out[arriving] = pts(_counter_rate(t, _column(snapshots, mn.ATTEMPTS, kind="first"), step))
    out[in_time] = pts(_counter_rate(t, _column(snapshots, mn.CALLS_DELIVERED, within_deadline="true"), step))
    counted, admitted = rate(mn.VLLM_PROMPT_TOKENS), rate(mn.VLLM_PREFIX_CACHE_QUERIES)
    out["prompt_tokens_counted_rate"] = pts(counted)
    out["prompt_tokens_admitted_rate"] = pts(admitted)
    out["prompt_token_gap"] = pts(_ratio_series(PROMPT_TOKEN_GAP, out))
    missed, good = (
        _column(snapshots, mn.CALLS_MISSED_DEADLINE),
        _column(snapshots, mn.CALLS_DELIVERED, within_deadline="true"),
    )
    for span, width in (("short", windows.slo_short_s), ("long", windows.slo_long_s)):
        bad, judged = _counter_rate(t, missed, width), _counter_rate(t, missed + good, width)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(judged > 0, bad / np.where(judged > 0, judged, 1.0), math.nan)
        out[f"delivery_burn_rate_{span}"] = pts(ratio / (1 - DELIVERY_OBJECTIVE))
    # Drop signals the series does not carry at all, so panels say "no data" honestly.
    return {k: v for k, v in out.items() if np.isfinite(v[:, 1]).any()}


def _ratio_series(ratio: Ratio, signals: Mapping[str, np.ndarray]) -> np.ndarray:
    """``ratio`` (the detector's definition) at every snapshot, NaN where unknown."""
    columns = {name: signals[name][:, 1] for name in ratio.inputs}
    out = np.full(len(next(iter(columns.values()))), math.nan)
    for i in range(out.size):
        value = ratio.value({name: None if math.isnan(c[i]) else float(c[i]) for name, c in columns.items()})
        if value is not None:
            out[i] = value
    return out


def run_signals(runs_dir: RunsDir, run: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Read a run's metrics series and compute its signals."""
    snapshots = list(read_series(runs_dir.series_path(run)))
    capacity, deadline = capacity_deadline(run)
    windows = ReplaySettings.of_entry(run).windows  # the detector's, in the run's seconds
    return series_signals(
        snapshots,
        capacity=capacity,
        deadline_s=deadline,
        window_s=windows.rate_s * RATE_WINDOW_SHARE,
        windows=windows,
    )
