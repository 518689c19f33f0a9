"""``retrywatch proxy``: run the execution-aware proxy (served by ``exporter.server``).

Every option can also be set by an environment variable ``RETRYWATCH_<OPTION>`` (upper case,
dashes as underscores), e.g. ``RETRYWATCH_UPSTREAM``, ``RETRYWATCH_CANCEL_AFTER``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from exporter.callkey import DEFAULT_CALL_ID_HEADER, KeyWithoutId
from exporter.policy import BudgetOrder, Cancellation, PolicyConfigError, QueueOrder
from exporter.routes import DEFAULT_FORWARDED, DEFAULT_ROUTES
from exporter.settings import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_HEADERS,
    ProxySettings,
    SettingsError,
)
from exporter.upstream import DEFAULT_MAX_IDLE_S

FC = TypeVar("FC", bound=Callable[..., Any])


def _env(name: str) -> str:
    return "RETRYWATCH_" + name.upper().replace("-", "_")


def _opt(name: str, *decls: str, **kwargs: Any) -> Callable[[FC], FC]:
    """A click option whose environment variable is ``RETRYWATCH_<NAME>``."""
    return click.option(f"--{name}", *decls, envvar=_env(name), show_envvar=True, show_default=True, **kwargs)


def _parse_deadline(value: str | None) -> tuple[float | None, bool]:
    if value is None or value == "":
        return None, False
    if value.strip().lower() == "auto":
        return None, True
    try:
        seconds = float(value)
    except ValueError:
        raise click.BadParameter("must be a number of seconds or 'auto'", param_hint="--deadline") from None
    if not seconds > 0:
        raise click.BadParameter("must be > 0 seconds", param_hint="--deadline")
    return seconds, False


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@_opt("upstream", required=True, help="Base URL of the engine (vLLM), e.g. http://127.0.0.1:8000.")
@_opt("host", default="127.0.0.1", help="Address to listen on.")
@_opt("port", default=8100, type=click.IntRange(0, 65535), help="Port to listen on.")
@_opt(
    "cancellation",
    type=click.Choice([c.value for c in Cancellation]),
    default=Cancellation.DEFERRED.value,
    help="Last subscriber gone: off (run on), on (abort now), deferred (abort after --cancel-after).",
)
@_opt("cancel-after", type=click.FloatRange(min=0), default=10.0, help="Seconds of deferred cancellation.")
@click.option(
    "--coalesce/--no-coalesce",
    envvar=_env("coalesce"),
    show_envvar=True,
    default=True,
    show_default=True,
    help="Attach retries to their call's live execution.",
)
@_opt(
    "call-id-header",
    default=DEFAULT_CALL_ID_HEADER,
    help="Header carrying the call id (Idempotency-Key is honoured too).",
)
@_opt(
    "key-without-id",
    type=click.Choice([k.value for k in KeyWithoutId]),
    default=KeyWithoutId.BODY.value,
    help=(
        "Key of an attempt without a call id: the hash of the caller's credentials and the body "
        "(only an evident retry attaches: the SDK retry counter says so, or an identical attempt "
        "left unanswered), or none (never coalesce)."
    ),
)
@_opt(
    "retry-budget",
    type=click.FloatRange(min=0),
    default=None,
    help="Max retries per first attempt over --budget-window (e.g. 0.1); unset = no budget.",
)
@_opt(
    "budget-window", type=click.FloatRange(min=0, min_open=True), default=60.0, help="Budget window, seconds."
)
@_opt(
    "budget-order",
    type=click.Choice([b.value for b in BudgetOrder]),
    default=BudgetOrder.LOOKUP_FIRST.value,
    help="lookup-first: the budget sees only retries that would create an execution.",
)
@_opt(
    "max-outstanding",
    type=click.IntRange(min=1),
    default=None,
    help="Executions in the engine at once; more wait in the proxy queue. Unset = no proxy cap.",
)
@_opt("max-queued", type=click.IntRange(min=0), default=10_000, help="Bound on the proxy queue.")
@_opt(
    "queue-order",
    type=click.Choice([q.value for q in QueueOrder]),
    default=QueueOrder.FIFO.value,
    help="Proxy queue order; lifo serves the newest first once over --lifo-threshold are queued.",
)
@_opt("lifo-threshold", type=click.IntRange(min=0), default=50, help="Queue length above which LIFO applies.")
@click.option(
    "--deadline-check",
    envvar=_env("deadline-check"),
    show_envvar=True,
    is_flag=True,
    default=False,
    help="Refuse (503) an attempt the proxy estimates will miss the clients' deadline.",
)
@_opt(
    "capacity",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Engine capacity Ĉ in calls/s, for retrywatch_creation_capacity_ratio.",
)
@_opt("deadline", default=None, help="Clients' deadline on an attempt: seconds, or 'auto' to infer it.")
@_opt(
    "vocab-size",
    type=click.IntRange(min=1),
    default=None,
    help="Refuse token-ID prompts with an ID outside [0, N) before they reach the engine.",
)
@_opt("admin-token", default=None, help="Bearer token required by GET /retrywatch/executions.")
@_opt(
    "max-body-bytes",
    type=click.IntRange(min=1024),
    default=DEFAULT_MAX_BODY_BYTES,
    help="Request body limit (413).",
)
@_opt(
    "replay-limit-bytes",
    type=click.IntRange(min=1024),
    default=4 * 1024 * 1024,
    help="Replay buffer stored per execution; past it the execution takes no new subscribers.",
)
@_opt(
    "max-live-executions",
    type=click.IntRange(min=1),
    default=20_000,
    help="Hard bound on executions held (queued + in the engine).",
)
@_opt(
    "window",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    help="Sliding window of the derived gauges, seconds.",
)
@click.option(
    "--metrics-passthrough/--no-metrics-passthrough",
    envvar=_env("metrics-passthrough"),
    show_envvar=True,
    default=True,
    show_default=True,
    help="Serve the upstream's /metrics families on the proxy's /metrics.",
)
@_opt(
    "metrics-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    help="Longest a scrape of /metrics waits for the upstream's /metrics, seconds.",
)
@_opt(
    "metrics-max-staleness",
    type=click.FloatRange(min=0, min_open=True),
    default=15.0,
    help="Serve the last good upstream /metrics this long while a refresh is slow or failing.",
)
@_opt(
    "upstream-max-idle",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_MAX_IDLE_S,
    help=(
        "Seconds a kept-alive connection to the engine may stay idle and still be reused; keep it "
        "below the engine's own keep-alive timeout (5 s in vLLM)."
    ),
)
@_opt(
    "max-head-bytes",
    type=click.IntRange(min=1024),
    default=DEFAULT_MAX_HEAD_BYTES,
    help="Request line and headers limit (431).",
)
@_opt(
    "max-headers", type=click.IntRange(min=8), default=DEFAULT_MAX_HEADERS, help="Header fields limit (431)."
)
@_opt(
    "head-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_HEAD_TIMEOUT_S,
    help="Seconds from a request's first byte to the end of its head (408).",
)
@_opt(
    "body-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_BODY_TIMEOUT_S,
    help="Seconds from the end of a request's head to the end of its body (408).",
)
@_opt(
    "keep-alive-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_KEEP_ALIVE_S,
    help="Seconds a client connection may stay open without starting a request.",
)
@_opt(
    "max-connections",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_CONNECTIONS,
    help="Client connections open at once; past it a new one gets 503 and is closed.",
)
@_opt(
    "drain-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_DRAIN_TIMEOUT_S,
    help="On SIGTERM, seconds requests in flight get to finish before they end with an error.",
)
@_opt(
    "passthrough",
    multiple=True,
    default=(DEFAULT_ROUTES,),
    help=(
        "Paths forwarded to the engine (repeat; a /prefix/* pattern, '*' for all, 'none'); "
        f"'{DEFAULT_ROUTES}' is {' '.join(DEFAULT_FORWARDED)}. Others get 404."
    ),
)
@_opt("log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="warning")
def proxy(**options: Any) -> None:
    """Run the execution-aware proxy in front of a vLLM engine."""
    from exporter.proxy import Proxy
    from exporter.server import serve

    deadline_s, deadline_auto = _parse_deadline(options.pop("deadline"))
    log_level = options.pop("log_level")
    try:
        settings = ProxySettings(
            upstream=options["upstream"],
            host=options["host"],
            port=options["port"],
            cancellation=Cancellation(options["cancellation"]),
            cancel_after_s=options["cancel_after"],
            coalesce=options["coalesce"],
            call_id_header=options["call_id_header"],
            key_without_id=KeyWithoutId(options["key_without_id"]),
            retry_budget=options["retry_budget"],
            budget_window_s=options["budget_window"],
            budget_order=BudgetOrder(options["budget_order"]),
            max_outstanding=options["max_outstanding"],
            max_queued=options["max_queued"],
            queue_order=QueueOrder(options["queue_order"]),
            lifo_threshold=options["lifo_threshold"],
            deadline_check=options["deadline_check"],
            deadline_s=deadline_s,
            deadline_auto=deadline_auto,
            max_live_executions=options["max_live_executions"],
            capacity=options["capacity"],
            vocab_size=options["vocab_size"],
            admin_token=options["admin_token"],
            max_body_bytes=options["max_body_bytes"],
            replay_limit_bytes=options["replay_limit_bytes"],
            window_s=options["window"],
            metrics_passthrough=options["metrics_passthrough"],
            upstream_metrics_timeout_s=options["metrics_timeout"],
            upstream_metrics_max_staleness_s=options["metrics_max_staleness"],
            upstream_max_idle_s=options["upstream_max_idle"],
            max_head_bytes=options["max_head_bytes"],
            max_headers=options["max_headers"],
            head_timeout_s=options["head_timeout"],
            body_timeout_s=options["body_timeout"],
            keep_alive_s=options["keep_alive_timeout"],
            max_connections=options["max_connections"],
            drain_timeout_s=options["drain_timeout"],
            passthrough=options["passthrough"],
        )
    except (SettingsError, PolicyConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    app = Proxy(settings)
    serve(app.app, settings, app.end_executions, log_level)
