"""``retrywatch dashboard``: serve the operators' Dash app (127.0.0.1 by default)."""

from __future__ import annotations

from pathlib import Path

import click

from exporter.redact import redact_url


@click.command("dashboard")
@click.option(
    "--detector",
    "detector_url",
    envvar="RETRYWATCH_DETECTOR_URL",
    default="http://127.0.0.1:8200",
    show_default=True,
    help="Base URL of the detector API (alerts, episodes, signals).",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    envvar="RETRYWATCH_PROMETHEUS_URL",
    default=None,
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
@click.option("--host", envvar="RETRYWATCH_DASHBOARD_HOST", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    envvar="RETRYWATCH_DASHBOARD_PORT",
    type=click.IntRange(0, 65535),
    default=8050,
    show_default=True,
)
@click.option(
    "--refresh",
    "refresh_s",
    type=click.FloatRange(min=1.0),
    default=5.0,
    show_default=True,
    help="Live page auto-refresh interval in seconds.",
)
def dashboard(
    detector_url: str,
    prometheus_url: str | None,
    runs_dir: Path | None,
    host: str,
    port: int,
    refresh_s: float,
) -> None:
    """Run the operators' Dash dashboard."""
    from dashboard.app import DashboardConfig, create_app  # lazy: Dash is heavy

    try:
        config = DashboardConfig(
            detector_url=detector_url, prometheus_url=prometheus_url, runs_dir=runs_dir, refresh_s=refresh_s
        )
        app = create_app(config)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    source = f"detector {redact_url(detector_url)}"
    if prometheus_url:
        source += f", Prometheus {redact_url(prometheus_url)}"
    click.echo(f"retrywatch dashboard on http://{host}:{port}/ ({source})", err=True)
    app.run(host=host, port=port, debug=False)
