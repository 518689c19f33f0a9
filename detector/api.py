"""The detector's HTTP API (FastAPI): active alerts, episodes, signal history, health, metrics,
the runbook as a page (``/runbook``) and an index of them (``/``).

JSON shapes are the contract of docs/architecture.md (the dashboard codes against them).
Times are Unix seconds. Engines are keyed by their ``instance`` label (the scraped URL, the
Prometheus target, the replayed run's slug): ``GET /signals`` lists instances, and the
``engine=`` parameter of ``/signals`` and ``/episodes`` selects one by it; ``engine`` and
``model`` stay labels. Each alert and episode carries its ``runbook_url`` (``detector.runbook``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, HTTPException, Query, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from detector.runbook import runbook_html
from detector.service import SIGNAL_NAMES, Detector
from detector.signals import MAX_INSTANCE_CHARS, SIGNALS_BY_NAME
from detector.thresholds import PROMETHEUS_ALERTS

MAX_EPISODES = 1000
#: A ``since``/``until`` parameter: finite (``nan`` or ``inf`` gets a 422, not every episode).
UnixTime = Annotated[float | None, Query(allow_inf_nan=False, description="Unix seconds")]

#: What ``GET /`` lists.
INDEX = (
    ("/alerts", "the alerts firing now (JSON)"),
    ("/episodes", "past and open alert episodes (JSON)"),
    ("/signals", "the signals' recent history (JSON)"),
    ("/runbook", "what each alert means and what to do"),
    ("/metrics", "the detector's own metrics (Prometheus)"),
    ("/healthz", "whether the source answers (JSON)"),
    ("/docs", "the API's reference"),
)


def create_app(detector: Detector) -> FastAPI:
    app = FastAPI(title="retrywatch detector", version="1")
    # Rendered once, so a missing runbook fails at start.
    names = [rule.name for rule in detector.rules] + [alert.name for alert in PROMETHEUS_ALERTS]
    runbook_page = runbook_html(frozenset(names))

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        links = "".join(f'<li><a href="{path}">{path}</a>: {what}</li>' for path, what in INDEX)
        return (
            "<!doctype html>\n<html lang=en><head><meta charset=utf-8><title>retrywatch detector</title>"
            f"</head><body><h1>retrywatch detector</h1><ul>{links}</ul></body></html>\n"
        )

    @app.get("/runbook", response_class=HTMLResponse)
    def runbook() -> str:
        return runbook_page

    @app.get("/alerts")
    def alerts() -> dict[str, object]:
        # As of the last evaluation, which goes on past the last scrape while the source is down:
        # a page draws what fires now up to then, and knows how old the source's data is.
        evaluated_at = detector.evaluator.last_eval
        return {"alerts": detector.firing_alerts(), "evaluated_at": evaluated_at}

    @app.get("/episodes")
    def episodes(
        since: UnixTime = None,
        until: UnixTime = None,
        alertname: str | None = Query(default=None, max_length=128),
        engine: str | None = Query(default=None, max_length=MAX_INSTANCE_CHARS),
        limit: int = Query(default=MAX_EPISODES, ge=1, le=MAX_EPISODES),
    ) -> dict[str, object]:
        found = detector.store.episodes(
            since=since, until=until, alertname=alertname, engine=engine, limit=limit
        )
        return {
            "episodes": [{**ep.as_dict(), "runbook_url": detector.runbook_url(ep.alertname)} for ep in found]
        }

    @app.get("/signals")
    def signals(
        name: str | None = Query(default=None, max_length=64),
        since: UnixTime = None,
        engine: str | None = Query(default=None, max_length=MAX_INSTANCE_CHARS),
    ) -> dict[str, object]:
        if name is None:
            # Engines are keyed by instance: vLLM's engine label is "0" on every vLLM.
            engines = sorted({e.instance for e in detector.history.engines()})
            return {"signals": list(SIGNAL_NAMES), "engines": engines}
        if name not in SIGNALS_BY_NAME:
            raise HTTPException(status_code=404, detail=f"unknown signal {name!r}; GET /signals lists them")
        series = detector.history.series(name, since=since, engine=engine)
        return {
            "name": name,
            "unit": SIGNALS_BY_NAME[name].unit,
            "series": [{"labels": labels.as_dict(), "points": points} for labels, points in series],
        }

    @app.get("/healthz")
    def healthz() -> dict[str, object]:
        st = detector.status
        return {
            "status": "ok" if st.up else "degraded",
            "source": {"up": st.up, "last_scrape_at": st.last_scrape_at},
        }

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(detector.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
