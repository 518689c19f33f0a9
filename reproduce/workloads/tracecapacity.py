"""Ĉ of a trace's own token mix, by the protocol's calibration, and its cache.

The study's Ĉ is measured on its 12,000-token prompts; a trace's short prompts and responses
give the engine another capacity. :func:`trace_capacity` runs docs/protocol.md §5's calibration
(``reproduce.calibrate.calibrate``: 300-s stages at 1.5× the previous rate, no retries, until
the waiting queue grows by 0.1 calls/s; Ĉ = arrival rate − growth) on the simulator's engine
model, with each stage's calls at Poisson arrivals and their (prompt, output) lengths drawn from
the trace's token mix (``TraceFacts.mix``, a sample of the window's calls).

NOTE: the result is cached in one JSON file (``capacity.json`` under ``RETRYWATCH_CACHE_DIR``,
``~/.cache/retrywatch`` by default), keyed by the model, the engine settings, the calibration's
seed and the digest of the mix (every call's lengths, in order), so a sweep of loads or
conditions on one trace calibrates once. A cache that cannot be read is recalibrated over.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reproduce.calibrate import CalibrationError, calibrate, sim_stage_runner
from reproduce.engine.config import EngineConfig
from reproduce.workloads.calls import PlannedCall
from reproduce.workloads.trace import TraceFacts

__all__ = ["CACHE_ENV", "TraceCapacity", "cache_path", "mix_stage_calls", "trace_capacity"]

#: Where the cache lives (a directory); ``~/.cache/retrywatch`` when unset.
CACHE_ENV = "RETRYWATCH_CACHE_DIR"
_CACHE_FILE = "capacity.json"
#: The first stage's rate, calls/s, as ``retrywatch reproduce calibrate`` starts; each next
#: stage's rate is ``STAGE_FACTOR`` times the last, for at most ``MAX_STAGES`` (docs/protocol.md §5).
START_RATE = 1.0
STAGE_FACTOR = 1.5
MAX_STAGES = 12


@dataclass(frozen=True)
class TraceCapacity:
    """Ĉ (calls per study second) of a trace's token mix and how it was found."""

    capacity: float
    method: str
    cached: bool
    key: str

    def describe(self) -> dict[str, object]:
        return {"capacity": self.capacity, "method": self.method, "cached": self.cached, "key": self.key}


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "retrywatch") / _CACHE_FILE


def mix_stage_calls(mix: Sequence[tuple[int, int]]) -> Callable[[float, float, int], list[PlannedCall]]:
    """A stage's calls for ``sim_stage_runner``: Poisson arrivals at the stage's rate, each
    call's lengths drawn uniformly from ``mix``; seeded by the stage."""
    prompts = np.array([p for p, _ in mix], dtype=np.int64)
    outputs = np.array([o for _, o in mix], dtype=np.int64)

    def draw(rate: float, duration_s: float, seed: int) -> list[PlannedCall]:
        rng = np.random.Generator(np.random.PCG64(seed))
        n = int(rng.poisson(rate * duration_s))
        times = np.sort(rng.uniform(0.0, duration_s, size=n))
        picks = rng.integers(0, len(prompts), size=n)
        return [
            PlannedCall(f"mix-{seed}-{i:06d}", float(times[i]), int(prompts[j]), 0, int(outputs[j]), "stage")
            for i, j in enumerate(picks.tolist())
        ]

    return draw


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _write_cache(path: Path, entries: Mapping[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".capacity.", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dict(entries), fh, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written costs a recalibration next time, nothing else


def trace_capacity(
    model: str, config: EngineConfig, facts: TraceFacts, *, settings: str = "", seed: int = 0
) -> TraceCapacity:
    """Ĉ of ``facts``' token mix on the engine ``config`` (``model``'s preset with the run's
    settings, ``settings`` naming them in the cache key): from the cache, or calibrated now."""
    key = f"{model}|{settings}|seed={seed}|mix={facts.mix_digest}"
    path = cache_path()
    entries = _read_cache(path)
    hit = entries.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("capacity"), int | float) and hit["capacity"] > 0:
        return TraceCapacity(float(hit["capacity"]), str(hit.get("method", "")), True, key)
    runner = sim_stage_runner(config, seed=seed, stage_calls=mix_stage_calls(facts.mix))
    try:
        result = calibrate(runner, START_RATE, factor=STAGE_FACTOR, max_stages=MAX_STAGES)
    except CalibrationError:  # a mix of very short calls: Ĉ beyond the last stage
        last = START_RATE * STAGE_FACTOR ** (MAX_STAGES - 1)
        raise CalibrationError(
            f"the trace's token mix (mean prompt {facts.mean_prompt_tokens:.0f}, mean output "
            f"{facts.mean_output_tokens:.0f} tokens) did not saturate {model} by {last:.0f} calls/s, "
            "the calibration's last stage: give Ĉ with --backend-option capacity=C (calls/s)"
        ) from None
    method = (
        f"docs/protocol.md §5 on the simulator, the trace's token mix (mean prompt "
        f"{facts.mean_prompt_tokens:.0f}, mean output {facts.mean_output_tokens:.0f} tokens; "
        f"{len(facts.mix)} calls sampled): {result.method}; saturated at stage {result.saturated_stage}"
    )
    entries[key] = {"capacity": result.capacity, "method": method, "stages": len(result.stages)}
    _write_cache(path, entries)
    return TraceCapacity(result.capacity, method, False, key)
