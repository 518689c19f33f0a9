"""An attempt abandoned during its prefill, on a real vLLM on CPU (the ``heavy`` configuration,
whose prefill takes seconds): ``vllm:prefix_cache_queries_total`` counts its prompt when it is
admitted, ``vllm:prompt_tokens_total`` never does, and the abort is not a finished request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from exporter import metricnames as mn
from exporter.timeseries import Snapshot, parse_exposition
from reproduce.backends.engines import EngineEndpoint
from reproduce.httpdriver.attempt import completion_body, run_attempt
from reproduce.httpdriver.calibration import wait_engine_idle
from tests.reproduce.vllm_helpers import running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def heavy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    with running_vllm("heavy", tmp_path_factory.mktemp("vllm-heavy")) as endpoint:
        yield endpoint


def _scrape(url: str) -> Snapshot:
    return Snapshot(0.0, parse_exposition(httpx.get(f"{url}/metrics", timeout=10).text))


def test_attempt_abandoned_during_prefill_is_missed_by_the_prompt_token_counter(
    heavy: EngineEndpoint,
) -> None:
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    before = _scrape(heavy.url)
    prompt_len = 7_000  # ~4 steps of 2,048 prompt tokens on this model: seconds of prefill

    async def go() -> None:
        ids = [(13 * k) % 31_000 + 3 for k in range(prompt_len)]
        body = completion_body(heavy.model_name, ids, 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
            attempt = asyncio.create_task(
                run_attempt(
                    client,
                    f"{heavy.url}/v1/completions",
                    body,
                    call_id="abandoned",
                    deadline_at=time.monotonic() + 600,
                )
            )
            # Leave as soon as the engine shows it admitted the prompt (queries counted at admission).
            deadline = time.monotonic() + 300
            async with httpx.AsyncClient(timeout=10) as metrics:
                while time.monotonic() < deadline and not attempt.done():
                    text = (await metrics.get(f"{heavy.url}/metrics")).text
                    queries = Snapshot(0.0, parse_exposition(text)).value(mn.VLLM_PREFIX_CACHE_QUERIES) or 0.0
                    if queries - (before.value(mn.VLLM_PREFIX_CACHE_QUERIES) or 0.0) >= prompt_len:
                        break
                    await asyncio.sleep(0.05)
            assert not attempt.done(), "the prompt finished prefill before the test could leave"
            attempt.cancel()  # closes the connection: vLLM aborts the request
            await asyncio.gather(attempt, return_exceptions=True)

    asyncio.run(go())
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    after = _scrape(heavy.url)

    def delta(name: str, **labels: str) -> float:
        return (after.value(name, **labels) or 0.0) - (before.value(name, **labels) or 0.0)

    assert delta(mn.VLLM_PREFIX_CACHE_QUERIES) == prompt_len
    assert delta(mn.VLLM_PROMPT_TOKENS) == 0
    assert delta(mn.VLLM_GENERATION_TOKENS) == 0
    # A client abort is not counted as a finished request with reason "abort".
    assert delta(mn.VLLM_REQUEST_SUCCESS, finished_reason="abort") == 0


def test_attempt_abandoned_during_its_last_prefill_step_is_never_counted(heavy: EngineEndpoint) -> None:
    """The step that computes a prompt's last chunk (and samples its first token) is running
    when the client leaves: vLLM processes the abort before that step's outputs
    (``EngineCore.step``), so the prompt is queried but never counted, though its whole prefill
    ran (vLLM's counting rule, and the engine model's)."""
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    before = _scrape(heavy.url)
    prompt_len = 3_800  # two steps of 2,048 batched tokens on this model, seconds each

    async def go() -> list[float]:
        ids = [(17 * k + 5) % 31_000 + 3 for k in range(prompt_len)]
        first: list[float] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:
            attempt = asyncio.create_task(
                run_attempt(
                    client,
                    f"{heavy.url}/v1/completions",
                    completion_body(heavy.model_name, ids, 8),
                    call_id="abandoned",
                    deadline_at=time.monotonic() + 600,
                    on_first_byte=first.append,
                )
            )
            # The queries are published with the stats of the prompt's first step; the engine
            # schedules its second and last step at once: leave as soon as they show.
            deadline = time.monotonic() + 300
            async with httpx.AsyncClient(timeout=10) as metrics:
                while time.monotonic() < deadline and not attempt.done():
                    text = (await metrics.get(f"{heavy.url}/metrics")).text
                    queries = Snapshot(0.0, parse_exposition(text)).value(mn.VLLM_PREFIX_CACHE_QUERIES) or 0.0
                    if queries - (before.value(mn.VLLM_PREFIX_CACHE_QUERIES) or 0.0) >= prompt_len:
                        break
                    await asyncio.sleep(0.02)
            attempt.cancel()  # closes the connection: vLLM aborts the request
            await asyncio.gather(attempt, return_exceptions=True)
        return first

    assert asyncio.run(go()) == [], "the first token arrived before the test could leave"
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    after = _scrape(heavy.url)

    def delta(name: str) -> float:
        return (after.value(name) or 0.0) - (before.value(name) or 0.0)

    assert delta(mn.VLLM_PREFIX_CACHE_QUERIES) == prompt_len
    # Its last step ran to the end and sampled a first token, which nobody ever saw or counted.
    assert delta(mn.VLLM_PROMPT_TOKENS) == 0
    assert delta(mn.VLLM_GENERATION_TOKENS) == 0
