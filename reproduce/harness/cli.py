"""``retrywatch reproduce calibrate-http``: measure Ĉ of a real (or emulated, or external) engine.

Starts the engine as ``reproduce run`` would (or uses ``--engine-url``), runs docs/protocol.md §5's
calibration over HTTP with the chosen protocol's prompts, prints Ĉ in calls per wall second
(what ``--backend-option capacity=`` takes) and writes the stages as JSON with ``--out``.
With ``--trace FILE`` the stages' calls take a request trace's own token mix (a sample of its
window's calls, lengths × the protocol's token scale), the Ĉ that ``reproduce run --trace FILE``
on the same engine needs.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import click

from foundation.redact import redact_url
from reproduce.harness.calibration import StageCalls
from reproduce.harness.engines import (
    CPU_ENGINE_NICENESS,
    BackendError,
    EmulatedBackend,
    EngineBackend,
    ExternalBackend,
    VllmBackend,
)
from reproduce.harness.models import ModelConfigError
from reproduce.harness.protocol import HttpProtocol
from reproduce.options import START_RATE, TIME_SCALE, OutputPath
from reproduce.workloads.traces import FORMATS

__all__ = ["calibrate_http_command"]


@click.command("calibrate-http")
@click.option(
    "--backend", type=click.Choice(["vllm", "emulated", "external"]), default="vllm", show_default=True
)
@click.option("--python", "python", default=".vllm-venv", show_default=True, help="vLLM's venv or python.")
@click.option("--model", default="heavy", show_default=True, help="Configuration, model dir, or preset.")
@click.option("--gpu", is_flag=True, help="Start vLLM with the study's GPU flags.")
@click.option(
    "--nice",
    type=click.IntRange(0, 19),
    default=None,
    help=f"Niceness of the vLLM started here [{CPU_ENGINE_NICENESS} on a CPU, so the harness is never "
    "starved; 0 on GPU].",
)
@click.option("--engine-url", default=None, help="With --backend external: the engine's base URL.")
@click.option(
    "--time-scale",
    type=TIME_SCALE,
    default=10.0,
    show_default=True,
    help="K: the protocol's durations divided by K (token lengths too with --sizes scaled).",
)
@click.option(
    "--sizes",
    type=click.Choice(["scaled", "study"]),
    default=None,
    help="Token lengths divided by the time scale, or the study's [scaled on a CPU vLLM].",
)
@click.option(
    "--start-rate",
    type=START_RATE,
    default=None,
    help="First stage, calls/s [probed: a multiple of what one call at a time reaches].",
)
@click.option(
    "--via-proxy", is_flag=True, help="Send the calls through a `retrywatch proxy` with no control."
)
@click.option(
    "--workdir",
    type=OutputPath(path_type=Path, file_okay=False),
    default=Path("out/calibrate-http"),
    show_default=True,
    help="The engine's and the proxy's files.",
)
@click.option(
    "--out", type=OutputPath(path_type=Path, dir_okay=False), default=None, help="Write the result here."
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Calibrate on this request trace's token mix (docs/traces.md) instead of the protocol's.",
)
@click.option("--trace-format", type=click.Choice(FORMATS), default=None, help="--trace's layout [detected].")
@click.option("--window", "window_text", default=None, metavar="START:END", help="--trace's seconds to take.")
def calibrate_http_command(
    backend: str,
    python: str,
    model: str,
    gpu: bool,
    nice: int | None,
    engine_url: str | None,
    time_scale: float,
    sizes: str | None,
    start_rate: float | None,
    via_proxy: bool,
    workdir: Path,
    out: Path | None,
    trace_path: Path | None,
    trace_format: str | None,
    window_text: str | None,
) -> None:
    """Calibrate Ĉ (docs/protocol.md §5, stages of 300 s / time scale) on an engine over HTTP."""
    from reproduce.calibrate import CalibrationError
    from reproduce.harness.calibration import calibrate_http
    from reproduce.harness.protocol import cpu_scaled, study
    from reproduce.harness.proxyproc import NO_CONTROL, ProxyProcess
    from reproduce.workloads.plan import RunClock

    clock = RunClock(time_scale)
    if gpu and backend != "vllm":
        raise click.BadParameter(f"needs --backend vllm, not {backend!r}", param_hint="'--gpu'")
    if nice is not None and backend != "vllm":
        raise click.BadParameter(f"needs --backend vllm, not {backend!r}", param_hint="'--nice'")
    if engine_url is not None and backend != "external":
        raise click.BadParameter(f"needs --backend external, not {backend!r}", param_hint="'--engine-url'")
    if backend == "external" and engine_url is None:
        raise click.UsageError("--backend external needs --engine-url")
    if trace_path is None and (trace_format is not None or window_text is not None):
        hint = "'--trace-format'" if trace_format is not None else "'--window'"
        raise click.BadParameter("needs --trace FILE", param_hint=hint)
    engine: EngineBackend
    try:
        # the user's files are read before the engine is looked for: a bad --trace is a usage
        # mistake whether or not the engine is installed
        scaled = sizes == "scaled" or (sizes is None and backend == "vllm" and not gpu)
        protocol = cpu_scaled(clock) if scaled else study(clock)
        stage_calls = None
        if trace_path is not None:
            stage_calls = _trace_stage_calls(trace_path, trace_format, window_text, protocol)
        if backend == "vllm":
            engine = VllmBackend(python, model, workdir, gpu=gpu, niceness=nice)
        elif backend == "emulated":
            engine = EmulatedBackend(workdir, preset=model, clock=clock)
        else:
            assert engine_url is not None
            engine = ExternalBackend(engine_url)
        with engine as endpoint, ExitStack() as stack:
            click.echo(f"engine {endpoint.model_name} at {redact_url(endpoint.url)}", err=True)
            send_url = None
            if via_proxy:
                proxy = ProxyProcess(
                    NO_CONTROL, upstream=endpoint.url, workdir=workdir, vocab_size=endpoint.vocab_size
                )
                send_url = stack.enter_context(proxy)
            result = calibrate_http(
                endpoint.url,
                endpoint.model_name,
                endpoint.vocab_size,
                protocol,
                start_rate=start_rate,
                send_url=send_url,
                log=lambda line: click.echo(line, err=True),
                stage_calls=stage_calls,
            )
    except (BackendError, ModelConfigError, CalibrationError) as exc:
        raise click.ClickException(str(exc)) from exc
    body = {"capacity": result.capacity, **clock.record(), "model": model, **result.to_dict()}
    if trace_path is not None:
        body["trace"] = {"path": trace_path.name, "format": trace_format, "window": window_text}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    click.echo(f"{result.capacity:.4f}")


def _trace_stage_calls(
    path: Path, trace_format: str | None, window_text: str | None, protocol: HttpProtocol
) -> StageCalls:
    """The stages' calls drawn from ``path``'s token mix, as ``reproduce run --trace`` sends them
    on this protocol (lengths × its token scale, cut to its context); a bad file or window is a
    usage error naming it."""
    from reproduce.harness.calibration import trace_mix
    from reproduce.workloads.trace import TraceWorkload
    from reproduce.workloads.tracecapacity import mix_stage_calls
    from reproduce.workloads.traces import TraceError, parse_window

    try:
        start, end = parse_window(window_text) if window_text is not None else (0.0, math.inf)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--window'") from None
    try:
        fitted = trace_mix(TraceWorkload(str(path), trace_format, 1.0, start, end), protocol)
    except TraceError as exc:
        raise click.BadParameter(str(exc), param_hint="'--trace'") from None
    prompts = sum(p for p, _ in fitted) / len(fitted)
    outputs = sum(o for _, o in fitted) / len(fitted)
    click.echo(
        f"the trace's token mix: {len(fitted)} calls sampled, mean prompt {prompts:.0f} and output "
        f"{outputs:.0f} tokens (x{protocol.token_scale:g} of the trace's)",
        err=True,
    )
    return mix_stage_calls(fitted)
