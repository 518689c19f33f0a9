"""Presets: KV bytes per token from the architecture, KV capacity on one H100, options."""

from __future__ import annotations

import pytest

from reproduce.calibrate import sim_latency
from reproduce.engine import PRESET_NAMES, PresetError, preset
from reproduce.engine.presets import MODELS, prior_step_time


@pytest.mark.parametrize(
    ("model", "kv_bytes"),
    [
        ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),
        ("qwen3-14b", 2 * 40 * 8 * 128 * 2),
        ("llama3.1-8b", 2 * 32 * 8 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_from_the_architecture(model: str, kv_bytes: int) -> None:
    assert MODELS[model].kv_bytes_per_token == kv_bytes


def test_presets_fit_the_study_settings() -> None:
    tokens = {}
    for name in PRESET_NAMES:
        cfg = preset(name)
        assert cfg.max_num_batched_tokens == 8_192 and cfg.max_num_seqs == 256
        assert cfg.block_size == 16 and cfg.enable_prefix_caching and cfg.async_scheduling
        tokens[name] = cfg.num_gpu_blocks * cfg.block_size
        # room for at least a handful of 12k-token executions, below 256 of them
        assert 12 * 13_000 < tokens[name] < 256 * 13_000
    # the 14B model has the largest KV per token and the largest weights
    assert tokens["qwen3-14b-h100"] < tokens["llama3.1-8b-h100"] < tokens["qwen2.5-7b-h100"]
    small = preset("qwen2.5-7b-h100", max_num_batched_tokens=2_048, max_num_queued_reqs=338)
    assert small.max_num_batched_tokens == 2_048 and small.max_num_queued_reqs == 338


def test_unknown_preset_is_a_clear_error() -> None:
    with pytest.raises(PresetError, match="choose one of"):
        preset("gpt-5-h100")


def test_prior_scales_with_model_size() -> None:
    small, big = prior_step_time(MODELS["qwen2.5-7b"]), prior_step_time(MODELS["qwen3-14b"])
    assert big.per_prompt_token_s > small.per_prompt_token_s
    assert big.fixed_s > small.fixed_s
    assert big.per_context_token_s > small.per_context_token_s


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_fitted_presets_meet_the_calibration_inputs(name: str) -> None:
    """The checked-in fit still holds for the engine model as it is (rerun fit_presets if not)."""
    from reproduce.engine.fit_presets import TOLERANCE, mean_capacity
    from reproduce.engine.presets import STUDY_CAPACITY

    config = preset(name)
    assert mean_capacity(name, config.step_time) == pytest.approx(STUDY_CAPACITY[name], rel=TOLERANCE)


def test_qwen_low_load_reference() -> None:
    from reproduce.engine.fit_presets import LOW_LOAD_RATE, REFERENCE_PRESET, TTFT_TARGET, TTLT_TARGET

    summary = sim_latency(preset(REFERENCE_PRESET), LOW_LOAD_RATE)
    assert summary.median_ttft_s == pytest.approx(TTFT_TARGET, rel=0.05)
    assert summary.median_ttlt_s == pytest.approx(TTLT_TARGET, rel=0.05)
