"""Wiring of the emulated engine: a preset's engine model, its driver and the ASGI app."""

from __future__ import annotations

from collections.abc import Sequence

from reproduce.emulate.app import EmulatorApp, EmulatorSettings
from reproduce.emulate.driver import EngineDriver
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = ["build_app"]


def build_app(
    preset: str,
    *,
    served_model_name: str | None = None,
    clock: RunClock = STUDY_CLOCK,
    max_num_queued_reqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    vocab_size: int = 152_064,
    max_live: int = 16_384,
    max_body_bytes: int = 4 * 1024 * 1024,
) -> EmulatorApp:
    """The app serving ``preset`` at ``clock`` (raises ``reproduce.engine.PresetError``, a
    ValueError, if unknown)."""
    from reproduce.engine import EngineModel, EngineRequest
    from reproduce.engine import preset as engine_preset

    if max_num_batched_tokens is None:  # the preset's own budget
        config = engine_preset(preset, max_num_queued_reqs=max_num_queued_reqs)
    else:
        config = engine_preset(
            preset, max_num_batched_tokens=max_num_batched_tokens, max_num_queued_reqs=max_num_queued_reqs
        )
    engine = EngineModel(config)

    def make_request(request_id: str, segments: Sequence[tuple[int, int]], max_tokens: int) -> EngineRequest:
        return EngineRequest(request_id, tuple(segments), max_tokens)

    driver = EngineDriver(engine, make_request, clock=clock, max_live=max_live)
    settings = EmulatorSettings(
        served_model=served_model_name or preset,
        vocab_size=vocab_size,
        max_model_len=config.max_model_len,
        max_body_bytes=max_body_bytes,
    )
    return EmulatorApp(driver, settings)
