"""An attempt abandoned during its prefill, on a real vLLM on CPU (the ``heavy`` configuration,
whose prefill takes seconds): ``vllm:prefix_cache_queries_total`` counts its prompt when it is
admitted, ``vllm:prompt_tokens_total`` never does, and the abort is not a finished request.
Then vLLM's request histograms: one completed, one aborted while waiting and one aborted after
its first token land in the same families on the real engine and on the engine model, which
exports them with the real engine's label names and bucket boundaries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from foundation import metricnames as mn
from foundation.timeseries import Snapshot, parse_exposition
from foundation.vllmbuckets import SERIES_HISTOGRAMS
from reproduce.engine import EngineEvent, EngineModel, EngineRequest, EventKind, StepTimeModel
from reproduce.harness.attempt import AttemptResult, completion_body, run_attempt
from reproduce.harness.calibration import wait_engine_idle
from reproduce.harness.compare import cpu_engine_config
from reproduce.harness.engines import EngineEndpoint
from reproduce.harness.models import model_info
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


# --- vLLM's histograms and their counting rules, on the real engine and on the engine model -----

A_PROMPT, A_OUTPUT = 7_000, 4  # four prefill steps of 2,048 batched tokens: seconds of prefill
B_PROMPT = 500  # sent during A's prefill: waits, and leaves while still waiting
C_PROMPT = 300  # sent after A: leaves once its first token arrives
C_OUTPUT = 2_000


def _series_scrape(url: str) -> Snapshot:
    """A scrape as a metrics series records it: the series' histograms kept."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return Snapshot(0.0, parse_exposition(text, keep_histograms=SERIES_HISTOGRAMS))


def _check_vllm_counting(before: Snapshot, after: Snapshot) -> None:
    """What one completed (A), one aborted while waiting (B) and one aborted after its first
    token (C) leave in vLLM's families (``reproduce.engine.vllmstats`` says which event observes
    each); the same assertions hold on the real engine and on the engine model."""

    def delta(name: str, **labels: str) -> float:
        return (after.value(name, **labels) or 0.0) - (before.value(name, **labels) or 0.0)

    # only A finished: the aborts are in no finished-request family, not even reason "abort"
    assert delta(mn.VLLM_REQUEST_SUCCESS, finished_reason="length") == 1
    assert delta(mn.VLLM_REQUEST_SUCCESS) == 1
    for family in (mn.VLLM_E2E_LATENCY, mn.VLLM_QUEUE_TIME, mn.VLLM_PREFILL_TIME, mn.VLLM_DECODE_TIME):
        assert delta(family + "_count") == 1, family
        assert delta(family + "_bucket", le="+Inf") == 1, family
    assert delta(mn.VLLM_REQUEST_PROMPT_TOKENS + "_sum") == A_PROMPT
    assert delta(mn.VLLM_REQUEST_GENERATION_TOKENS + "_sum") == A_OUTPUT
    # A's prefill took several steps: seconds, most of its end-to-end latency
    assert delta(mn.VLLM_PREFILL_TIME + "_sum") > delta(mn.VLLM_DECODE_TIME + "_sum")
    # A and C had a first token (C's abort came later); B never ran
    assert delta(mn.VLLM_TTFT + "_count") == 2
    assert delta(mn.VLLM_PROMPT_TOKENS) == A_PROMPT + C_PROMPT
    assert delta(mn.VLLM_PREFIX_CACHE_QUERIES) == A_PROMPT + C_PROMPT
    # every token delivered is a first token or a later one (inter-token latency)
    later = delta(mn.VLLM_INTER_TOKEN_LATENCY + "_count")
    assert later >= A_OUTPUT - 1
    assert delta(mn.VLLM_GENERATION_TOKENS) == 2 + later
    assert delta(mn.VLLM_GENERATION_TOKENS) < A_OUTPUT + C_OUTPUT  # C stopped long before its end


def _families(snapshot: Snapshot) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """{family: (label names, le values)} of vLLM's families in a scrape."""
    out: dict[str, tuple[set[str], list[str]]] = {}
    for name, labels, _ in snapshot.samples:
        if not name.startswith("vllm:"):
            continue
        family = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        family = family if family in SERIES_HISTOGRAMS else name
        names, les = out.setdefault(family, (set(), []))
        names.update(k for k in labels if k != "le")
        if "le" in labels and labels["le"] not in les:
            les.append(labels["le"])
    return {f: (tuple(sorted(n)), tuple(le)) for f, (n, le) in out.items()}


def test_vllm_histograms_and_counting_rules_match_the_engine_model(heavy: EngineEndpoint) -> None:
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    before = _series_scrape(heavy.url)
    url = f"{heavy.url}/v1/completions"

    def ids(n: int, salt: int) -> list[int]:
        return [(salt * 7_919 + k * 104_729) % 31_000 + 3 for k in range(n)]

    async def go() -> float:
        waiting_seen = 0.0
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10)) as client:

            def attempt(
                n: int, salt: int, output: int, on_first_byte: Callable[[float], None] | None = None
            ) -> asyncio.Task[AttemptResult]:
                body = completion_body(heavy.model_name, ids(n, salt), output)
                deadline_at = time.monotonic() + 600
                return asyncio.create_task(
                    run_attempt(
                        client,
                        url,
                        body,
                        call_id=f"h{salt}",
                        deadline_at=deadline_at,
                        on_first_byte=on_first_byte,
                    )
                )

            a = attempt(A_PROMPT, 101, A_OUTPUT)
            await asyncio.sleep(0.5)  # A is ahead: its prefill takes every batched token
            b = attempt(B_PROMPT, 102, 8)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not waiting_seen:
                waiting_seen = _series_scrape(heavy.url).value(mn.VLLM_NUM_WAITING) or 0.0
                await asyncio.sleep(0.05)
            b.cancel()  # B leaves while still waiting: vLLM aborts it
            await asyncio.gather(b, return_exceptions=True)
            await a
            first = asyncio.Event()
            c = attempt(C_PROMPT, 103, C_OUTPUT, on_first_byte=lambda _t: first.set())
            await asyncio.wait_for(first.wait(), timeout=120)
            await asyncio.sleep(0.1)  # a few more tokens: inter-token latencies
            c.cancel()
            await asyncio.gather(c, return_exceptions=True)
        return waiting_seen

    assert asyncio.run(go()) >= 1, "B was never seen waiting"
    asyncio.run(wait_engine_idle(heavy.url, timeout_s=300))
    after = _series_scrape(heavy.url)
    _check_vllm_counting(before, after)

    # The same scenario on the engine model of this engine, in simulated time.
    config = cpu_engine_config(
        model_info("heavy"),
        StepTimeModel(fixed_s=0.05, per_prompt_token_s=1e-3, per_running_s=0.0, per_context_token_s=0.0),
    )
    engine = EngineModel(config)
    labels = {"engine": "0", "model_name": heavy.model_name}
    model_before = Snapshot(0.0, engine.metrics_samples(labels))
    now = 0.0
    events: list[EngineEvent] = []

    def step() -> None:
        nonlocal now
        duration = engine.start_step(now)
        events.extend(engine.drain_events())
        if duration is not None:
            now += duration
            events.extend(engine.finish_step(now))

    engine.add_request(EngineRequest("a", (("a", A_PROMPT),), A_OUTPUT), now)
    step()
    engine.add_request(EngineRequest("b", (("b", B_PROMPT),), 8), now)
    step()
    assert engine.num_waiting == 1
    events.extend(engine.abort_request("b", now))
    while engine.has_request("a"):
        step()
    engine.add_request(EngineRequest("c", (("c", C_PROMPT),), C_OUTPUT), now)
    while not any(e.kind is EventKind.FIRST_TOKEN and e.request_id == "c" for e in events):
        step()
    step()
    events.extend(engine.abort_request("c", now))
    while engine.has_work:
        step()
    _check_vllm_counting(model_before, Snapshot(0.0, engine.metrics_samples(labels)))

    # The engine model exports vLLM's families with vLLM's label names and bucket boundaries.
    real = _families(after)
    modelled = _families(Snapshot(0.0, engine.metrics_samples(labels)))
    assert real.keys() >= SERIES_HISTOGRAMS
    assert {f: real[f] for f in modelled} == modelled
