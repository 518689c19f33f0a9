"""A small simulated engine whose capacity is easy to reason about, for tests that simulate runs.

Prefill dominates (10k prompt tokens/s, 1,000 uncached tokens a call), so Ĉ is close to 10 calls/s
(9.77 by calibration, at the study's scale). Its KV cache holds about 50 prompts, like the study's
engine held a few dozen of its own.
"""

from __future__ import annotations

from typing import Any

from reproduce.engine.config import EngineConfig, StepTimeModel

ENGINE = EngineConfig(
    num_gpu_blocks=4_000,
    step_time=StepTimeModel(0.002, 1e-4, 0.0, 0.0),
    model_name="test",
    max_model_len=4096,
)
WORKLOAD: dict[str, Any] = {
    "prompt_mean": 1200,
    "prompt_std": 0,
    "shared_prefix_len": 200,
    "response_median": 20,
    "response_sigma": 0,
}
CAPACITY = 9.77
