"""The HTTP backends' own parts that need no engine: the proxy's address for a Prometheus, the
emulated engine's command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproduce.emulate.cli import emulate
from reproduce.harness.backend import announce_proxy
from reproduce.harness.engines import EmulatedBackend
from reproduce.registry import get_backend
from reproduce.workloads.plan import RunClock


def test_the_proxy_is_announced_for_file_based_discovery_and_withdrawn(tmp_path: Path) -> None:
    path = tmp_path / "targets.json"
    announce_proxy(path, "http://127.0.0.1:41234", "diagnostic__x__m__r1")
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:41234"], "labels": {"run": "diagnostic__x__m__r1"}}
    ]
    announce_proxy(path, None, "diagnostic__x__m__r1")
    assert json.loads(path.read_text()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["targets.json"]  # no temporary file left


def test_the_option_is_known_to_every_http_backend() -> None:
    backend = get_backend("emulated", capacity=2.0, prometheus_targets="t.json")
    assert backend.prometheus_targets == Path("t.json")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"takes no option prometheus_target .*prometheus_targets"):
        get_backend("emulated", capacity=2.0, prometheus_target="t.json")


@pytest.mark.parametrize("k", [1.0, 10.0, 1 / 3])
def test_the_emulated_engine_is_started_at_the_runs_clock_exactly(tmp_path: Path, k: float) -> None:
    argv = EmulatedBackend(tmp_path, preset="qwen2.5-7b-h100", clock=RunClock(k)).command(8000)
    ctx = emulate.make_context("emulate", argv[argv.index("emulate") + 1 :])
    assert ctx.params["time_scale"] == k  # 1/3 was "0.333333" when written with :g
    assert EmulatedBackend(tmp_path, preset="x", clock=RunClock(k)).describe()["time_scale"] == k
