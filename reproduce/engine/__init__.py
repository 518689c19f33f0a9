"""The engine model of vLLM's V1 scheduler: config, presets, KV blocks and prefix cache,
step-time model, ``EngineModel`` and its simenv driver ``EngineProcess``."""

from reproduce.engine.config import (
    EngineConfig,
    EngineConfigError,
    ModelSpec,
    StepTimeModel,
    kv_capacity_blocks,
)
from reproduce.engine.model import (
    EngineEvent,
    EngineModel,
    EngineRequest,
    EngineRequestError,
    EngineStateError,
    EventKind,
    ExecutionTrace,
    Sample,
    StepRecord,
)
from reproduce.engine.presets import PRESET_NAMES, PresetError, preset

__all__ = [
    "PRESET_NAMES",
    "EngineConfig",
    "EngineConfigError",
    "EngineEvent",
    "EngineModel",
    "EngineRequest",
    "EngineRequestError",
    "EngineStateError",
    "EventKind",
    "ExecutionTrace",
    "ModelSpec",
    "PresetError",
    "Sample",
    "StepRecord",
    "StepTimeModel",
    "kv_capacity_blocks",
    "preset",
]
