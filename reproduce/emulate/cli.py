"""``retrywatch emulate``: serve the engine model over HTTP in wall time (optionally scaled).

It runs on the proxy's server (``foundation.server``): request heads, slow and idle clients and
connections bounded (``foundation.bounds``' defaults; ``--max-live`` caps the connections too), and
SIGTERM drains it for 2 s.
"""

from __future__ import annotations

import logging

import click

from foundation.logs import announce, check_port, log_options, setup_logging
from foundation.options import listen_host
from reproduce.options import TIME_SCALE

__all__ = ["emulate"]

log = logging.getLogger(__name__)

#: Large enough for the study's models (Qwen2.5's 152,064; Llama-3.1's 128,256).
DEFAULT_VOCAB_SIZE = 152_064


def _model_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty name would be taken for none (the preset's): a usage error instead."""
    if value is not None and not value.strip():
        raise click.BadParameter("an empty name: give the name clients send, or leave the option out")
    return value


@click.command("emulate")
@click.option(
    "--model",
    "preset",
    default="qwen2.5-7b-h100",
    show_default=True,
    help="Engine preset (reproduce.engine.presets); also the served model name.",
)
@click.option(
    "--served-model-name",
    default=None,
    callback=_model_name,
    help="Model name clients send (default: the preset).",
)
@click.option(
    "--time-scale",
    type=TIME_SCALE,
    default=1.0,
    show_default=True,
    help="Engine seconds per wall second (K > 1 runs faster than the real engine).",
)
@click.option(
    "--max-num-queued-reqs",
    type=click.IntRange(min=1),
    default=None,
    help="vLLM's engine queue cap Q: refuse a request that would leave more than Q waiting or running.",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Token budget per step (default: the preset's).",
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=2),
    default=DEFAULT_VOCAB_SIZE,
    show_default=True,
    help="Token IDs must lie in [0, N).",
)
@click.option(
    "--max-live",
    type=click.IntRange(min=1),
    default=16_384,
    show_default=True,
    help="Bound on live requests (waiting + running; ~25 KB each); beyond it requests get 503.",
)
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 1024 * 1024, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, callback=listen_host)
@click.option("--port", type=click.IntRange(min=1, max=65535), default=8000, show_default=True)
@log_options
def emulate(
    preset: str,
    served_model_name: str | None,
    time_scale: float,
    max_num_queued_reqs: int | None,
    max_num_batched_tokens: int | None,
    vocab_size: int,
    max_live: int,
    max_body_bytes: int,
    host: str,
    port: int,
    log_level: str,
    log_format: str,
) -> None:
    """Serve the engine model with vLLM's OpenAI API and /metrics, stepped in wall time."""
    from foundation.bounds import HttpBounds, base_url
    from foundation.server import serve
    from reproduce.emulate.server import build_app
    from reproduce.workloads.plan import RunClock

    check_port(host, port)
    setup_logging(log_level, log_format)
    try:
        app = build_app(
            preset,
            served_model_name=served_model_name,
            clock=RunClock(time_scale),
            max_num_queued_reqs=max_num_queued_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            vocab_size=vocab_size,
            max_live=max_live,
            max_body_bytes=max_body_bytes,
        )
    except (KeyError, ValueError) as exc:
        message = str(exc.args[0] if exc.args else exc)
        # The option the error is about: the preset's token budget, or else the preset itself.
        hint = "--max-num-batched-tokens" if "max_num_batched_tokens" in message else "--model"
        raise click.BadParameter(message, param_hint=f"'{hint}'") from None
    # The proxy's server (request heads, slow and idle clients bounded): a live request holds a
    # connection, so --max-live bounds both; SIGTERM gives the streams in flight 2 s.
    bounds = HttpBounds(host=host, port=port, max_connections=max_live, drain_timeout_s=2.0)
    announce(
        f"emulated engine {app.settings.served_model} (time scale {time_scale:g}) on {base_url(host, port)} "
        "(OpenAI API, /metrics, /health); state: in memory only"
    )
    serve(app, bounds, None, log_level, fds_per_connection=1)
