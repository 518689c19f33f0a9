"""``retrywatch detect``: run the detector on a proxy, a Prometheus, or a replayed run.

``--tier`` says what the sources export (``detector.signals.Tier``) and so which tier's alerts
are evaluated (``detector.thresholds.tier_rules``): ``proxy`` (the default), proxies'
``/metrics``; ``vllm``, vLLM's own ``/metrics`` with no proxy, so no instance raises the proxy
tier's NoData for series it never had. The choice is explicit, not guessed per instance: a
proxy that stops exporting its series is a NoData, not a quiet fall back to the vLLM tier.

Every option can also be set by an environment variable ``RETRYWATCH_<OPTION>``
(e.g. ``RETRYWATCH_DB``, ``RETRYWATCH_CAPACITY``, ``RETRYWATCH_TIME_SCALE``).

URLs are printed and logged with their credentials masked (``foundation/redact.py``). A ``--db``
that cannot be used is a usage error (exit 2) that names the option, like every bad option here,
and so is a ``--port`` already in use: both are checked before anything is fetched. The database
is by default SQLite in the user's state directory (``detector.store.state_dir``); the start line
names it. The API is served by ``foundation.server`` with the bounds of ``foundation.bounds`` (request
heads, slow and idle clients, connections), and SIGTERM drains it.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from detector.episodes import DEFAULT_RETENTION_DAYS
from detector.runbook import DEFAULT_HOST, DEFAULT_PORT, runbook_option, served_pattern
from detector.signals import (
    MAX_INSTANCES,
    PROMETHEUS_JOBS,
    TIERS,
    WINDOWS,
    Tier,
    between_buckets,
    describe_deadline,
)
from detector.sources.scrape import SERIES_LIMIT
from detector.thresholds import scale_rules, tier_rules
from foundation.logs import announce, check_port, log_options, setup_logging
from foundation.options import FiniteFloatRange, listen_host
from foundation.redact import redact_url

# Dashboards, scripts and Prometheus read the API: far fewer clients than the proxy's.
API_MAX_CONNECTIONS = 1_000


def _env(name: str) -> str:
    return f"RETRYWATCH_{name}"


@click.command("detect")
@click.option(
    "--exporter",
    "exporters",
    multiple=True,
    envvar=_env("EXPORTER"),
    help="A proxy's /metrics URL to scrape (repeatable); with --tier vllm, vLLM's own.",
)
@click.option(
    "--tier",
    type=click.Choice(TIERS),
    default="proxy",
    show_default=True,
    envvar=_env("TIER"),
    help="What the sources export, and so which tier's alerts are evaluated: vllm (vLLM's own "
    "/metrics, no proxy: its NoData on vLLM's series alone; --prometheus reads job "
    f'"{PROMETHEUS_JOBS["vllm"]}"), or proxy (proxies\' /metrics).',
)
@click.option("--prometheus", envvar=_env("PROMETHEUS"), help="Prometheus (or compatible) base URL.")
@click.option(
    "--replay",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar=_env("REPLAY"),
    help="A reproduce run's metrics.jsonl to replay (then served).",
)
@click.option(
    "--replay-speed",
    type=FiniteFloatRange(min=0.0),
    default=0.0,
    show_default=True,
    envvar=_env("REPLAY_SPEED"),
    help="0: replay at once; S > 0: S run-seconds per wall second.",
)
@click.option(
    "--db",
    default=None,
    envvar=_env("DB"),
    help="SQLAlchemy URL (a SQLite file's directory must exist) "
    "[default: sqlite:///$XDG_STATE_HOME/retrywatch/detector.db, ~/.local/state without XDG_STATE_HOME].",
)
@click.option(
    "--interval",
    type=FiniteFloatRange(min=0.1),
    envvar=_env("INTERVAL"),
    help="Seconds between evaluations [default: 5 / --time-scale, at least 0.1].",
)
@click.option(
    "--time-scale",
    type=FiniteFloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    envvar=_env("TIME_SCALE"),
    help="K of a scaled run (reproduce --time-scale K): every signal window and alert duration is "
    "divided by K. 1: real time.",
)
@click.option(
    "--webhook", "webhooks", multiple=True, envvar=_env("WEBHOOK"), help="Webhook URL (repeatable)."
)
@click.option("--alertmanager", envvar=_env("ALERTMANAGER"), help="Alertmanager base URL (API v2).")
@click.option(
    "--capacity",
    type=FiniteFloatRange(min=0.0, min_open=True),
    envvar=_env("CAPACITY"),
    help="Ĉ in calls/s (default: the proxy's gauge, else estimated online from the finish rate "
    "while the queue never empties).",
)
@click.option(
    "--deadline",
    type=FiniteFloatRange(min=0.0, min_open=True),
    envvar=_env("DEADLINE"),
    help="Client deadline in s (default: the proxy's gauge, stated to it or learned by it from the "
    "ages at which clients abandon attempts; without either the deadline is missing and the "
    "alerts that need it say so). Only a proxy that knows the deadline counts the calls that miss it "
    "(the proxy tier's symptom alert's data).",
)
@click.option(
    "--max-engines",
    type=click.IntRange(min=1),
    default=MAX_INSTANCES,
    show_default=True,
    envvar=_env("MAX_ENGINES"),
    help="Engines followed at most; past it a new one is left out, with a warning and "
    "retrywatch_detector_engines_left_out. An engine the source stops naming is forgotten.",
)
@click.option(
    "--series-limit",
    type=click.IntRange(min=1),
    default=SERIES_LIMIT,
    show_default=True,
    envvar=_env("SERIES_LIMIT"),
    help="Series an --exporter target's answer may hold (Prometheus' sample_limit); past it, or "
    "with a series twice, the answer is refused and the target counts as down (logged, and "
    "counted in retrywatch_detector_scrapes_refused_total).",
)
@click.option(
    "--retention",
    "retention_days",
    type=FiniteFloatRange(min=0.0),
    default=DEFAULT_RETENTION_DAYS,
    show_default=True,
    envvar=_env("RETENTION"),
    help="Days a resolved episode is kept (with its notification rows); 0 keeps every one.",
)
@runbook_option(default=None, help_default="this detector's own /runbook page")
@click.option("--host", default=DEFAULT_HOST, show_default=True, envvar=_env("HOST"), callback=listen_host)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True, envvar=_env("PORT")
)
@log_options
def detect(
    exporters: tuple[str, ...],
    tier: Tier,
    prometheus: str | None,
    replay: Path | None,
    replay_speed: float,
    db: str | None,
    interval: float | None,
    time_scale: float,
    webhooks: tuple[str, ...],
    alertmanager: str | None,
    capacity: float | None,
    deadline: float | None,
    max_engines: int,
    series_limit: int,
    retention_days: float,
    runbook_pattern: str | None,
    host: str,
    port: int,
    log_level: str,
    log_format: str,
) -> None:
    """Run the detector: signals, alerts, episodes, notifications, and its HTTP API."""
    from detector.api import create_app
    from detector.lease import lease_for
    from detector.notify import AlertmanagerNotifier, Notifier, WebhookNotifier
    from detector.service import Detector
    from detector.signals import SignalConfig
    from detector.sources import Source
    from detector.sources.replay import ReplaySource
    from detector.store import EpisodeStore, SchemaError, StoreOpenError, default_url
    from foundation.bounds import HttpBounds, base_url
    from foundation.server import serve

    setup_logging(log_level, log_format, [db, prometheus, alertmanager, *webhooks, *exporters])
    chosen = [bool(exporters), bool(prometheus), replay is not None]
    if sum(chosen) != 1:
        raise click.UsageError("give exactly one of --exporter URL, --prometheus URL or --replay FILE")
    if interval is None:
        interval = max(0.1, 5.0 / time_scale)
    check_port(host, port)
    pattern = runbook_pattern or served_pattern(host, port)
    try:
        source: Source
        replay_source: ReplaySource | None = None
        if exporters:
            from detector.sources.scrape import ScrapeSource

            source = ScrapeSource(list(exporters), series_limit=series_limit)
        elif prometheus:
            from detector.sources.prometheus import PrometheusSource

            source = PrometheusSource(
                prometheus, job=PROMETHEUS_JOBS[tier], step_s=interval, max_engines=max_engines
            )
        else:
            assert replay is not None
            probe = ReplaySource(replay)
            # Shift the run so that it ends now (at once) or starts now (paced): API times stay Unix.
            offset = time.time() - (probe.end if replay_speed == 0 else probe.start)
            replay_source = ReplaySource(replay, offset=offset)
            source = replay_source
        notifiers: list[Notifier] = [
            WebhookNotifier(u, name=f"webhook{i}", runbook_pattern=pattern) for i, u in enumerate(webhooks)
        ]
        if alertmanager:
            notifiers.append(AlertmanagerNotifier(alertmanager, runbook_pattern=pattern))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        if db is None:
            db = default_url()
        store = EpisodeStore(db)
    except OSError as exc:  # the state directory cannot be created
        source.close()
        for notifier in notifiers:
            notifier.close()
        raise click.BadParameter(f"the default database's directory: {exc}", param_hint="--db") from None
    except (StoreOpenError, SchemaError) as exc:
        source.close()
        for notifier in notifiers:
            notifier.close()
        raise click.BadParameter(str(exc), param_hint="--db") from None
    try:
        lease = lease_for(store.engine)
    except OSError as exc:  # a SQLite file's lock file cannot be made beside it
        source.close()
        for notifier in notifiers:
            notifier.close()
        store.close()
        raise click.BadParameter(
            f"the writer lease's file {exc.filename}: {exc.strerror}", param_hint="--db"
        ) from None
    # No deadline assumed: stated, else the proxy's per instance, else missing (see --deadline).
    config = SignalConfig(
        capacity=capacity,
        deadline=deadline,
        windows=WINDOWS.scaled(time_scale),
        assumed_deadline=None,
        log_deadlines=True,
    )
    detector = Detector(
        source,
        store,
        notifiers=notifiers,
        config=config,
        rules=scale_rules(tier_rules(tier), time_scale),
        runbook_pattern=pattern,
        max_engines=max_engines,
        lease=lease,
        retention_days=retention_days,
    )
    app = create_app(detector)
    announce(
        f"retrywatch detector on {base_url(host, port)} (/alerts, /episodes, /runbook, /metrics) "
        f"reading {_source_text(source.name, exporters, prometheus, replay, tier)}; "
        f"episodes in {redact_url(db)}; runbook links {pattern}; {deadline_text(deadline)}"
    )
    if replay_source is not None:
        _run_replay(detector, replay_source, interval, replay_speed)
    else:
        detector.start(interval)
    try:
        # The proxy's server, with its client-side bounds at their defaults: the API answers
        # dashboards and scripts, and a slow or endless request must not hold its memory.
        bounds = HttpBounds(host=host, port=port, max_connections=API_MAX_CONNECTIONS)
        serve(app, bounds, None, log_level, fds_per_connection=1)
    finally:
        detector.stop()
        store.close()


def deadline_text(deadline: float | None) -> str:
    """The start line's word on the deadline: stated (with a warning where it falls between
    vLLM's e2e buckets), or where it will come from."""
    if deadline is None:
        return "deadline: the proxy's per instance (stated to it or learned; logged once known), else missing"
    between = between_buckets(deadline)
    text = f"deadline: {describe_deadline(deadline)}"
    return text if between is None else f"{text} (WARNING: {between})"


def _source_text(
    name: str, exporters: tuple[str, ...], prometheus: str | None, replay: Path | None, tier: Tier
) -> str:
    if exporters:
        what = "the proxies " if tier == "proxy" else "vLLM's own metrics at "
        return what + ", ".join(redact_url(u) for u in exporters)
    if prometheus:
        return f"Prometheus {redact_url(prometheus)}"
    return f"{name} of {replay}"


def _run_replay(detector, source, interval: float, speed: float) -> None:  # type: ignore[no-untyped-def]
    """Replay at once (speed 0) or paced on the scheduler (speed S run-seconds per wall second)."""
    import threading

    detector.start(interval, evaluate=False)  # notifications and retries of waiting writes
    if speed == 0:
        for t in sorted({s.t for s in source.snapshots}):
            detector.tick(t)
        return
    start_wall = time.time()
    start_run = source.start

    def pace() -> None:
        while not source.exhausted:
            detector.tick(start_run + (time.time() - start_wall) * speed)
            time.sleep(interval / speed if speed > 1 else interval)

    threading.Thread(target=pace, name="retrywatch-replay", daemon=True).start()
