"""Engine presets of the study (docs/protocol.md §2): three models on one H100 80 GB at 90% memory.

Architectures and memory are facts; the step-time coefficients are fitted by
``python -m reproduce.engine.fit_presets`` to the protocol's calibration inputs only (Ĉ per model, and
Qwen2.5-7B's low-load time to first and last token), never to outcomes, and stored in
``presets_fitted.json`` beside this file. Until a fit exists a preset uses the physical prior
below (weights read once per step, 2 FLOPs per parameter per prompt token, KV bytes read per
context token), which the fit only rescales.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from reproduce.engine.config import GIB, EngineConfig, ModelSpec, StepTimeModel, kv_capacity_blocks

__all__ = [
    "GPU_H100_80GB",
    "MODELS",
    "PRESET_NAMES",
    "STUDY_CAPACITY",
    "GpuSpec",
    "PresetError",
    "fitted_step_times",
    "preset",
    "preset_capacity",
    "preset_serving",
    "prior_step_time",
]

FITTED_FILE = "presets_fitted.json"


class PresetError(ValueError):
    """An unknown preset name or an unreadable fitted-coefficients file."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """An accelerator as the engine model sees it."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    dense_flops_per_s: float


# torch reports ~79.1 GiB usable on an H100 80 GB SXM; 3.35 TB/s HBM3; ~989 TFLOP/s bf16 dense.
GPU_H100_80GB = GpuSpec("h100-80gb", 79.1 * GIB, 3.35e12, 989e12)

MODELS: dict[str, ModelSpec] = {
    "qwen2.5-7b": ModelSpec("Qwen/Qwen2.5-7B-Instruct", 28, 3584, 28, 4, 128, 7.6e9),
    "qwen3-14b": ModelSpec("Qwen/Qwen3-14B", 40, 5120, 40, 8, 128, 14.8e9),
    "llama3.1-8b": ModelSpec("meta-llama/Llama-3.1-8B-Instruct", 32, 4096, 32, 8, 128, 8.0e9),
}

PRESET_NAMES = ("qwen2.5-7b-h100", "qwen3-14b-h100", "llama3.1-8b-h100")
_PRESET_MODEL = dict(zip(PRESET_NAMES, MODELS, strict=True))


def preset_serving(model: str) -> str | None:
    """The preset whose architecture a model served by a real engine is, by its Hugging Face
    name's last part as ``reproduce/models/`` names it (``qwen2.5-7b-instruct`` is
    ``qwen2.5-7b-h100``'s); None for any other."""
    for name, key in _PRESET_MODEL.items():
        if MODELS[key].name.rsplit("/", 1)[-1].lower() == model:
            return name
    return None


#: Ĉ of each preset in calls per second: the study's calibration (docs/protocol.md §5), the target
#: that ``python -m reproduce.engine.fit_presets`` fits each preset's step time to reproduce (within ±3%).
STUDY_CAPACITY: dict[str, float] = {
    "qwen2.5-7b-h100": 2.78,
    "qwen3-14b-h100": 1.09,
    "llama3.1-8b-h100": 1.83,
}

GPU_MEMORY_UTILIZATION = 0.9
# Activation peak at 8,192 batched tokens, CUDA graphs and non-torch memory (an assumption).
RUNTIME_OVERHEAD_BYTES = 3.0 * GIB
# Achieved fraction of the peak figures, for the physical prior only (the fit rescales it).
_MFU_PREFILL = 0.6
_MFU_ATTENTION = 0.5
_HBM_EFFICIENCY = 0.7
_PER_RUNNING_S = 2.0e-5


def prior_step_time(model: ModelSpec, gpu: GpuSpec = GPU_H100_80GB) -> StepTimeModel:
    """Physical prior: weights read per step, 2 FLOPs/param per prompt token, KV read per
    context token, 4 FLOPs per head dimension, head and layer per (query, key) pair."""
    bandwidth = gpu.hbm_bytes_per_s * _HBM_EFFICIENCY
    pair_flops = 4.0 * model.q_heads * model.head_dim * model.layers
    return StepTimeModel(
        fixed_s=model.weight_bytes / bandwidth + 1.0e-3,
        per_prompt_token_s=2.0 * model.params / (gpu.dense_flops_per_s * _MFU_PREFILL),
        per_running_s=_PER_RUNNING_S,
        per_context_token_s=model.kv_bytes_per_token / bandwidth,
        per_attention_pair_s=pair_flops / (gpu.dense_flops_per_s * _MFU_ATTENTION),
    )


def fitted_step_times() -> dict[str, dict[str, Any]]:
    """The fitted table (``presets_fitted.json``): preset name -> step_time and fit figures."""
    try:
        text = resources.files("reproduce.engine").joinpath(FITTED_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PresetError(
            f"{FITTED_FILE} is not valid JSON ({exc}); rerun python -m reproduce.engine.fit_presets"
        ) from exc
    presets = data.get("presets", {})
    if not isinstance(presets, dict):
        raise PresetError(f"{FITTED_FILE}: 'presets' must be an object")
    return presets


def preset(
    name: str,
    *,
    max_num_batched_tokens: int = 8_192,
    max_num_queued_reqs: int | None = None,
    step_time: StepTimeModel | None = None,
    **options: Any,
) -> EngineConfig:
    """The engine config of a preset; ``max_num_batched_tokens=2048`` selects the small budget."""
    if name not in _PRESET_MODEL:
        raise PresetError(f"unknown engine preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    model = MODELS[_PRESET_MODEL[name]]
    if step_time is None:
        entry = fitted_step_times().get(name)
        step_time = StepTimeModel(**entry["step_time"]) if entry else prior_step_time(model)
    blocks = kv_capacity_blocks(
        model,
        gpu_memory_bytes=GPU_H100_80GB.memory_bytes,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        overhead_bytes=RUNTIME_OVERHEAD_BYTES,
        block_size=16,
    )
    return EngineConfig(
        num_gpu_blocks=blocks,
        step_time=step_time,
        model_name=model.name,
        block_size=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=256,
        max_model_len=32_768,
        enable_prefix_caching=True,
        async_scheduling=True,
        max_num_queued_reqs=max_num_queued_reqs,
        model=model,
        **options,
    )


def preset_capacity(name: str) -> float:
    """The preset's Ĉ in calls per second (:data:`STUDY_CAPACITY`)."""
    try:
        return STUDY_CAPACITY[name]
    except KeyError:
        known = ", ".join(STUDY_CAPACITY)
        raise PresetError(f"no Ĉ for preset {name!r}: use one of {known}, or give a capacity") from None
