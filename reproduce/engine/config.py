"""Engine configuration: the model's architecture, KV capacity in blocks, and the step-time model.

KV bytes per token follow the architecture (docs/protocol.md §2): ``2 (K and V) * layers * kv_heads *
head_dim * dtype_bytes``. The number of KV blocks is what vLLM's memory profiling leaves for
the cache: ``gpu_memory * utilization - weights - activation/runtime overhead``, divided by
``block_size * kv_bytes_per_token``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = [
    "EngineConfig",
    "EngineConfigError",
    "ModelSpec",
    "StepTimeModel",
    "kv_capacity_blocks",
]

GIB = 1024**3


class EngineConfigError(ValueError):
    """An engine configuration that cannot run; the message names the field to fix."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The parts of a model's architecture that set KV memory and weight memory."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float
    dtype_bytes: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head, in bytes per token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Duration of one engine step in seconds.

    ``fixed_s + per_prompt_token_s * prompt tokens computed + per_running_s * executions in
    the step + per_context_token_s * context tokens attended + per_attention_pair_s *
    (query, key) pairs of prefill attention``. The fixed cost covers weight reads and launch
    overhead, the prompt term the prefill matmuls, the running term per-sequence sampling and
    bookkeeping, the context term attention's KV reads (each decode reads its whole context, a
    prefill chunk the context before it plus itself), the pair term prefill attention's
    compute, which grows with the square of the prompt (a chunk of n tokens after c computed
    ones has n*c + n(n+1)/2 causal pairs): without it a model fitted on 12k-token prompts
    would overcharge 3k-token ones per token.
    """

    fixed_s: float
    per_prompt_token_s: float
    per_running_s: float
    per_context_token_s: float
    per_attention_pair_s: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "fixed_s",
            "per_prompt_token_s",
            "per_running_s",
            "per_context_token_s",
            "per_attention_pair_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise EngineConfigError(f"step time {name} must be finite and >= 0, got {value!r}")
        if self.fixed_s <= 0:
            raise EngineConfigError("step time fixed_s must be > 0 so that every step takes time")

    def duration(
        self, prompt_tokens: int, running: int, context_tokens: int, attention_pairs: int = 0
    ) -> float:
        return (
            self.fixed_s
            + self.per_prompt_token_s * prompt_tokens
            + self.per_running_s * running
            + self.per_context_token_s * context_tokens
            + self.per_attention_pair_s * attention_pairs
        )

    def scaled(self, factor: float) -> StepTimeModel:
        """Every coefficient multiplied by ``factor`` (a uniformly faster or slower accelerator)."""
        return StepTimeModel(
            self.fixed_s * factor,
            self.per_prompt_token_s * factor,
            self.per_running_s * factor,
            self.per_context_token_s * factor,
            self.per_attention_pair_s * factor,
        )


def kv_capacity_blocks(
    model: ModelSpec,
    *,
    gpu_memory_bytes: float,
    gpu_memory_utilization: float,
    overhead_bytes: float,
    block_size: int,
) -> int:
    """KV blocks left after weights and runtime overhead within the utilization share."""
    budget = gpu_memory_bytes * gpu_memory_utilization - model.weight_bytes - overhead_bytes
    if budget <= 0:
        raise EngineConfigError(
            f"{model.name}: no memory left for the KV cache "
            f"({gpu_memory_bytes / GIB:.1f} GiB x {gpu_memory_utilization} minus weights and overhead)"
        )
    return int(budget // (block_size * model.kv_bytes_per_token))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine model needs; presets (``reproduce.engine.presets``) fill it in.

    ``max_num_queued_reqs`` is vLLM's engine queue cap Q (None: no cap): an execution that
    would leave more than Q waiting or running is refused. ``scheduler_reserve_full_isl`` is
    vLLM's admission gate of the same name (on by default in vLLM 0.32): a waiting execution is
    admitted only if KV blocks for its whole sequence are free, not only for its first chunk.
    """

    num_gpu_blocks: int
    step_time: StepTimeModel
    model_name: str = "model"
    block_size: int = 16
    max_num_batched_tokens: int = 8_192
    max_num_seqs: int = 256
    max_model_len: int = 32_768
    enable_prefix_caching: bool = True
    async_scheduling: bool = True
    scheduler_reserve_full_isl: bool = True
    max_num_queued_reqs: int | None = None
    model: ModelSpec | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise EngineConfigError(f"block_size must be > 0, got {self.block_size!r}")
        if self.num_gpu_blocks <= 0:
            raise EngineConfigError(f"num_gpu_blocks must be > 0, got {self.num_gpu_blocks!r}")
        if self.max_num_seqs <= 0:
            raise EngineConfigError(f"max_num_seqs must be > 0, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError("max_num_batched_tokens must be >= max_num_seqs (one decode token each)")
        if self.max_model_len <= 1:
            raise EngineConfigError(f"max_model_len must be > 1, got {self.max_model_len!r}")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs <= 0:
            raise EngineConfigError(f"max_num_queued_reqs must be > 0 or None: {self.max_num_queued_reqs}")

    def with_options(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed (e.g. ``max_num_batched_tokens=2048``)."""
        return replace(self, **changes)  # type: ignore[arg-type]
