"""The command lines a GPU reproduction would run (no GPU here), and the shipped model configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reproduce.conditions import block, expand
from reproduce.harness.backend import HttpBackend, HttpBackendError
from reproduce.harness.commands import EngineFlagsError, cpu_flags, gpu_env, study_gpu_flags, vllm_command
from reproduce.harness.engines import CPU_ENGINE_NICENESS, VllmBackend
from reproduce.harness.models import ModelConfigError, list_models, model_info, prepare_model_dir
from reproduce.harness.protocol import STUDY_CAPACITY, scaled_queue_cap, study

GPU_MODELS = {
    # name: (layers, hidden, query heads, KV heads, head dim, vocab): docs/protocol.md §2, the model cards
    "qwen2.5-7b-instruct": (28, 3584, 28, 4, 128, 152_064),
    "qwen3-14b": (40, 5120, 40, 8, 128, 151_936),
    "llama-3.1-8b-instruct": (32, 4096, 32, 8, 128, 128_256),
}

STUDY_FLAGS = [
    "--max-model-len",
    "32768",
    "--max-num-batched-tokens",
    "8192",
    "--enable-chunked-prefill",
    "--max-num-seqs",
    "256",
    "--gpu-memory-utilization",
    "0.9",
    "--enable-prefix-caching",
]


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_shipped_models_include_the_three_gpu_models_and_the_cpu_ones() -> None:
    assert set(list_models()) >= {*GPU_MODELS, "tiny", "heavy"}


@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_gpu_model_configs_match_the_study_architectures(name: str) -> None:
    layers, hidden, heads, kv_heads, head_dim, vocab = GPU_MODELS[name]
    info = model_info(name)
    assert (info.num_layers, info.hidden_size, info.num_kv_heads, info.head_dim, info.vocab_size) == (
        layers,
        hidden,
        kv_heads,
        head_dim,
        vocab,
    )
    config = json.loads((info.path / "config.json").read_text())
    assert config["num_attention_heads"] == heads
    assert config["torch_dtype"] == "bfloat16"
    # KV bytes per token in bf16: 2 x layers x KV heads x head dim x 2 bytes.
    assert info.kv_bytes_per_token() == 2 * layers * kv_heads * head_dim * 2


def test_study_gpu_command_for_qwen(tmp_path: Path) -> None:
    backend = VllmBackend(sys.executable, "qwen2.5-7b-instruct", tmp_path, gpu=True, port=8123)
    argv = backend.command()
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert Path(_value(argv, "--model")) == tmp_path / "models" / "qwen2.5-7b-instruct"
    assert _value(argv, "--served-model-name") == "qwen2.5-7b-instruct"
    assert (_value(argv, "--host"), _value(argv, "--port")) == ("127.0.0.1", "8123")
    flags = argv[argv.index("--max-model-len") :]
    assert flags[: len(STUDY_FLAGS)] == STUDY_FLAGS
    assert _value(argv, "--load-format") == "dummy"
    assert _value(argv, "--dtype") == "bfloat16"
    assert "--max-num-queued-reqs" not in argv
    assert "--enforce-eager" not in argv  # CUDA graphs on, as in the study
    assert "--skip-tokenizer-init" not in argv  # the prepared directory carries a tokenizer
    prepared = tmp_path / "models" / "qwen2.5-7b-instruct"
    vocab = json.loads((prepared / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 152_064


@pytest.mark.parametrize("name", sorted(GPU_MODELS))
def test_every_gpu_model_gets_the_study_flags(name: str, tmp_path: Path) -> None:
    argv = VllmBackend(sys.executable, name, tmp_path, gpu=True, port=9000).command()
    assert argv[argv.index("--max-model-len") :][: len(STUDY_FLAGS)] == STUDY_FLAGS


def test_tracing_conditions_use_2048_batched_tokens(tmp_path: Path) -> None:
    runs = expand("tracing", models="qwen2.5-7b-instruct", runs=1)
    backend = HttpBackend("vllm", python=sys.executable, gpu=True, capacity=2.78)
    by_condition = {}
    for run in runs:
        engine = backend.engine_for(run, tmp_path / run.slug, None)
        assert isinstance(engine, VllmBackend)
        by_condition[run.condition.key] = _value(engine.command(), "--max-num-batched-tokens")
    assert by_condition == {
        "steps-2k-cancel-off": "2048",
        "steps-2k-cancel-on": "2048",
        "steps-8k-cancel-on": "8192",
    }


def test_engine_cap_conditions_give_the_studys_queue_caps(tmp_path: Path) -> None:
    # At the study's Ĉ and deadline the scaled cap is the study's own Q.
    deadline_s = study().plan(STUDY_CAPACITY, block("engine-cap").conditions[0], seed=0).deadline_s
    caps = {}
    backend = HttpBackend("vllm", python=sys.executable, gpu=True, capacity=STUDY_CAPACITY)
    for run in expand("engine-cap", models="qwen2.5-7b-instruct", runs=1):
        q = run.condition.engine.engine_queue_cap
        cap = None if q is None else scaled_queue_cap(q, STUDY_CAPACITY, deadline_s)
        argv = backend.engine_for(run, tmp_path / run.slug, cap).command()
        caps[run.condition.key] = (
            _value(argv, "--max-num-queued-reqs") if "--max-num-queued-reqs" in argv else None
        )
    assert caps == {
        "no-control": None,
        "engine-cap-338": "338",
        "engine-cap-338-cancel-on": "338",
        "engine-cap-100": "100",
    }
    assert {c.key for c in block("engine-cap").conditions} == set(caps)


def test_scaled_queue_cap_keeps_the_share_of_a_deadline() -> None:
    # A CPU engine at Ĉ = 1.5 calls/s with a 12-s deadline holds 18 calls per deadline.
    assert scaled_queue_cap(338, 1.5, 12.0) == 18
    assert scaled_queue_cap(100, 1.5, 12.0) == 6
    assert scaled_queue_cap(1, 0.01, 1.0) == 1


def test_real_weights_by_hub_name_pass_the_name_through(tmp_path: Path) -> None:
    backend = VllmBackend(sys.executable, "Qwen/Qwen2.5-7B-Instruct", tmp_path, gpu=True, dummy_weights=False)
    argv = backend.command()
    assert _value(argv, "--model") == "Qwen/Qwen2.5-7B-Instruct"
    assert _value(argv, "--served-model-name") == "qwen2.5-7b-instruct"
    assert "--load-format" not in argv


def test_dummy_weights_need_a_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no model configuration"):
        VllmBackend(sys.executable, "no/such-model", tmp_path, gpu=True).command()


def test_bad_flags_are_refused() -> None:
    with pytest.raises(EngineFlagsError, match="8192 or 2048"):
        study_gpu_flags(batched_tokens=4096)
    with pytest.raises(EngineFlagsError, match="--max-num-queued-reqs"):
        cpu_flags(max_num_queued_reqs=-1)
    with pytest.raises(EngineFlagsError, match="port"):
        vllm_command("python", "m", served_model_name="m", port=0, flags=cpu_flags())


def test_cpu_command_uses_eager_mode_and_the_queue_cap(tmp_path: Path) -> None:
    argv = VllmBackend(sys.executable, "tiny", tmp_path, max_num_queued_reqs=7, port=8001).command()
    assert "--enforce-eager" in argv
    assert _value(argv, "--max-num-queued-reqs") == "7"
    assert _value(argv, "--max-model-len") == "8192"
    assert "--gpu-memory-utilization" not in argv


def test_gpu_env_is_offline_only_for_dummy_weights(tmp_path: Path) -> None:
    assert gpu_env(tmp_path, base={})["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in gpu_env(tmp_path, offline=False, base={})


def test_prepare_model_dir_writes_a_tokenizer_and_never_touches_the_shipped_tree(tmp_path: Path) -> None:
    info = prepare_model_dir("tiny", tmp_path)
    assert info.path == tmp_path / "tiny"
    tokenizer = json.loads((info.path / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "WordLevel"
    assert len(tokenizer["model"]["vocab"]) == info.vocab_size == 32_000
    assert not (model_info("tiny").path / "tokenizer.json").exists()


def test_a_cpu_engine_runs_niced_and_a_gpu_engine_does_not(tmp_path: Path) -> None:
    assert VllmBackend(sys.executable, "tiny", tmp_path).niceness == CPU_ENGINE_NICENESS > 0
    assert VllmBackend(sys.executable, "qwen2.5-7b-instruct", tmp_path, gpu=True).niceness == 0
    run = expand("diagnostic", models="small", runs=1)[0]
    backend = HttpBackend("vllm", python=sys.executable, capacity=5.0, nice="3")
    engine = backend.engine_for(run, tmp_path, None)
    assert isinstance(engine, VllmBackend) and engine.niceness == 3
    assert engine.describe()["niceness"] == 3
    for bad in ("-1", "20", "low"):
        with pytest.raises(HttpBackendError, match="nice"):
            HttpBackend("vllm", python=sys.executable, capacity=5.0, nice=bad)
