"""A load generator nobody here wrote drives the proxy: NVIDIA AIPerf (``aiperf profile``, from
PyPI) sends streaming chat completions through ``retrywatch proxy`` to ``retrywatch emulate``,
each request with its own ``X-Request-ID``, which the proxy reads as the call id
(``--call-id-header X-Request-ID``). What AIPerf reports (requests completed, errors) must be
what the proxy's ``/metrics`` counted.

AIPerf lives in its own venv (``.ci/aiperf-setup``: it pins dash and plotly older than the
dashboard's); the test runs its ``aiperf`` command from ``$RETRYWATCH_AIPERF``, ``.venv-aiperf``
or PATH, and skips without it unless ``RETRYWATCH_REQUIRE_AIPERF=1`` (CI). AIPerf needs a
tokenizer for its synthetic prompts and this machine reaches no model hub: the test writes a
small word-level one. Bounded: 40 requests, aiperf under 60 s, each server under a time bound.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from foundation.processes import ManagedProcess, free_port

MODEL = "qwen2.5-7b-h100"
REQUESTS = 40
AIPERF_BOUND_S = 60
ROOT = Path(__file__).resolve().parents[2]


def _aiperf() -> str:
    candidates = [os.environ.get("RETRYWATCH_AIPERF", ""), str(ROOT / ".venv-aiperf" / "bin" / "aiperf")]
    found = next((c for c in candidates if c and Path(c).is_file()), None) or shutil.which("aiperf")
    if found is None:
        message = "aiperf not found: run .ci/aiperf-setup (or set RETRYWATCH_AIPERF)"
        if os.environ.get("RETRYWATCH_REQUIRE_AIPERF") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found


def _tokenizer(path: Path) -> Path:
    """A word-level tokenizer as a Hugging Face tokenizer directory (nothing downloaded)."""
    words = ["[UNK]", *(f"w{i}" for i in range(2000))]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": 0, "content": "[UNK]", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "[UNK]"},
    }  # fmt: skip
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 8192}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _counters(proxy_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{proxy_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("retrywatch_")
    }


def _sum(counters: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in counters.items() if n == name and all((k, x) in ls for k, x in labels.items())
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("queue_cap", [None, 1], ids=["all-served", "engine-refuses-some"])
def test_aiperf_through_the_proxy_matches_the_proxy_counters(tmp_path: Path, queue_cap: int | None) -> None:
    engine_port, proxy_port = free_port(), free_port()
    while proxy_port == engine_port:
        proxy_port = free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    engine_argv = [sys.executable, "-m", "retrywatch", "emulate", "--model", MODEL, "--time-scale", "20"]
    if queue_cap is not None:  # vLLM's queue cap: the engine answers some requests with an error
        engine_argv += ["--max-num-queued-reqs", str(queue_cap)]
    engine_argv += ["--port", str(engine_port)]
    proxy_argv = [
        *(sys.executable, "-m", "retrywatch", "proxy", "--upstream", engine_url, "--port", str(proxy_port)),
        *("--call-id-header", "X-Request-ID"),
    ]
    with (
        ManagedProcess(
            engine_argv, log_path=tmp_path / "engine.log", bound_s=150, name="the engine"
        ) as engine,
        ManagedProcess(proxy_argv, log_path=tmp_path / "proxy.log", bound_s=150, name="the proxy") as proxy,
    ):
        engine.wait_ready(f"{engine_url}/health", timeout_s=60)
        proxy.wait_ready(f"{proxy_url}/metrics", timeout_s=60)
        artifacts = tmp_path / "aiperf"
        argv = [
            _aiperf(),
            "profile",
            *("--model", MODEL, "--tokenizer", str(_tokenizer(tmp_path / "tokenizer"))),
            *("--url", proxy_url, "--endpoint-type", "chat", "--streaming"),
            *("--request-count", str(REQUESTS), "--concurrency", "8"),
            *("--synthetic-input-tokens-mean", "64", "--output-tokens-mean", "16"),
            *("--artifact-dir", str(artifacts), "--ui-type", "none"),
        ]
        run = subprocess.run(
            argv, cwd=tmp_path, capture_output=True, text=True, timeout=AIPERF_BOUND_S, check=False
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        counters = _counters(proxy_url)

    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    failed = [r for r in records if r.get("error")]
    completed = REQUESTS - len(failed)
    request_ids = {r["metadata"]["x_request_id"] for r in records}
    assert len(request_ids) == REQUESTS  # one X-Request-ID per request: one call each
    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["request_count"]["avg"] == completed

    # Every request was one call's first attempt; no id repeated, so none was a retry.
    assert _sum(counters, "retrywatch_attempts_total", kind="first") == REQUESTS
    assert _sum(counters, "retrywatch_attempts_total", kind="retry") == 0
    assert _sum(counters, "retrywatch_calls_delivered_total") == completed
    assert _sum(counters, "retrywatch_executions_finished_total", fate="completed") == completed
    errors = _sum(counters, "retrywatch_attempts_shed_total") + sum(
        _sum(counters, "retrywatch_executions_finished_total", fate=f)
        for f in ("refused", "failed", "dropped")
    )
    assert errors == len(failed)
    if queue_cap is not None:
        assert failed, "the engine's queue cap of 1 refused nothing under 8 concurrent requests"
