"""``retrywatch dashboard``: serve the operators' Dash app (127.0.0.1 by default).

The Flask app under Dash is served through a2wsgi (WSGI in a thread pool under ASGI) by the
server the proxy and the detector use (``foundation.server``: request heads, slow and idle clients
and connections bounded, SIGTERM drained), never by Flask's development server, with no access
log: a port already in use is a usage error (exit 2) before anything is announced.
"""

from __future__ import annotations

from pathlib import Path

import click

from detector.runbook import DEFAULT_HOST, DEFAULT_PORT
from foundation.logs import announce, check_port, log_options, setup_logging
from foundation.options import FiniteFloatRange, listen_host
from foundation.redact import redact_url

#: Worker threads: each serves one request (a page or a callback) at a time.
THREADS = 8
#: Connections at once (a browser tab holds a few).
MAX_CONNECTIONS = 100
#: A request body's bound (Flask answers 413 past it; a callback sends small JSON).
MAX_BODY_BYTES = 4 * 1024 * 1024
#: The live page's refresh bounds, in seconds.
MIN_REFRESH_S = 1.0
MAX_REFRESH_S = 3600.0


def _http_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An http:// or https:// URL (or none): anything else is a usage error naming the option,
    the URL's credentials masked."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"must start with http:// or https://, got {redact_url(value)!r}")
    return value


@click.command("dashboard")
@click.option(
    "--detector",
    "detector_url",
    envvar="RETRYWATCH_DETECTOR_URL",
    default=f"http://{DEFAULT_HOST}:{DEFAULT_PORT}",
    show_default=True,
    callback=_http_url,
    help="Base URL of the detector API (alerts, episodes, signals).",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    envvar="RETRYWATCH_PROMETHEUS_URL",
    default=None,
    callback=_http_url,
    help="Read the time series from this Prometheus API instead of the detector's /signals.",
)
@click.option(
    "--runs",
    "runs_dir",
    envvar="RETRYWATCH_RUNS_DIR",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A `retrywatch reproduce run` output directory for the Experiments page.",
)
@click.option(
    "--plan",
    "plan_dir",
    envvar="RETRYWATCH_PLAN_DIR",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A `retrywatch reproduce plan-daily` state directory (its --out) for the Headroom page.",
)
@click.option(
    "--host", envvar="RETRYWATCH_DASHBOARD_HOST", default="127.0.0.1", show_default=True, callback=listen_host
)
@click.option(
    "--port",
    envvar="RETRYWATCH_DASHBOARD_PORT",
    type=click.IntRange(1, 65535),
    default=8050,
    show_default=True,
)
@click.option(
    "--refresh",
    "refresh_s",
    type=FiniteFloatRange(min=MIN_REFRESH_S, max=MAX_REFRESH_S),
    default=5.0,
    show_default=True,
    help="Live page auto-refresh interval in seconds.",
)
@log_options
def dashboard(
    detector_url: str,
    prometheus_url: str | None,
    runs_dir: Path | None,
    plan_dir: Path | None,
    host: str,
    port: int,
    refresh_s: float,
    log_level: str,
    log_format: str,
) -> None:
    """Run the operators' Dash dashboard."""
    from a2wsgi import WSGIMiddleware

    from dashboard.app import create_app  # lazy: Dash is heavy
    from dashboard.context import DashboardConfig
    from foundation.bounds import HttpBounds, base_url
    from foundation.server import serve

    setup_logging(log_level, log_format, [detector_url, prometheus_url])
    try:
        config = DashboardConfig(
            detector_url=detector_url,
            prometheus_url=prometheus_url,
            runs_dir=runs_dir,
            plan_dir=plan_dir,
            refresh_s=refresh_s,
        )
        app = create_app(config)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    check_port(host, port)
    source = f"detector {redact_url(detector_url)}"
    if prometheus_url:
        source += f", Prometheus {redact_url(prometheus_url)}"
    runs = f"; runs from {runs_dir}" if runs_dir else ""
    runs += f"; daily what-if from {plan_dir}" if plan_dir else ""
    announce(f"retrywatch dashboard on {base_url(host, port)}/ ({source}){runs}; state: none of its own")
    app.server.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    bounds = HttpBounds(host=host, port=port, max_connections=MAX_CONNECTIONS)
    serve(WSGIMiddleware(app.server, workers=THREADS), bounds, None, log_level, fds_per_connection=1)
