"""The HTTP backends' own parts that need no engine: the proxy's address for a Prometheus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reproduce.harness.backend import announce_proxy
from reproduce.registry import get_backend


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
