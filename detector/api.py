"""The detector's HTTP API (FastAPI): active alerts, episodes, signal history, health, metrics,
the runbook as a page (``/runbook``) and an index of them (``/``).

JSON shapes are the contract of docs/architecture.md (the dashboard codes against them).
Times are Unix seconds. Engines are keyed by their ``instance`` label (the scraped URL, the
Prometheus target, the replayed run's slug): ``GET /signals`` lists instances, and the
``engine=`` parameter of ``/signals`` and ``/episodes`` selects one by it; ``engine`` and
``model`` stay labels. Each alert and episode carries its ``runbook_url`` (``detector.runbook``).
``engine=`` or ``since=`` on ``/signals`` without ``name=`` is a 400, not ignored (which would
return every engine's list); ``/episodes`` while the database does not answer is a 503.
``/inputs`` says, per engine, where Ĉ and the deadline come from (stated, learned, or missing),
with the prediction's range and since when each is known.
"""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
import orjson
from fastapi import FastAPI, HTTPException, Query, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from detector.runbook import runbook_html
from detector.service import SIGNAL_NAMES, Detector
from detector.signals import MAX_INSTANCE_CHARS, SIGNALS_BY_NAME
from detector.store import store_error
from detector.thresholds import ALERTS, PROMETHEUS_ALERTS

MAX_EPISODES = 1000
#: A ``since``/``until`` parameter: finite (``nan`` or ``inf`` gets a 422, not every episode).
UnixTime = Annotated[float | None, Query(allow_inf_nan=False, description="Unix seconds")]

#: What ``GET /`` lists.
INDEX = (
    ("/alerts", "the alerts firing now (JSON)"),
    ("/episodes", "past and open alert episodes (JSON)"),
    ("/signals", "the signals' recent history (JSON)"),
    ("/inputs", "where each engine's Ĉ and deadline come from (JSON)"),
    ("/runbook", "what each alert means and what to do"),
    ("/metrics", "the detector's own metrics (Prometheus)"),
    ("/healthz", "whether the source answers (JSON)"),
    ("/docs", "the API's reference"),
)


#: Each tier's signals of Ĉ and of the deadline in force (``detector.signals``).
INPUT_SIGNALS = {"proxy": ("capacity", "deadline"), "vllm": ("vllm_capacity", "vllm_deadline")}


def known_since(points: np.ndarray) -> tuple[float | None, float | None]:
    """The newest value of a signal's history and the time from which it has had a value at every
    evaluation since (None, None while it has none now)."""
    if not points.shape[0] or not math.isfinite(points[-1, 1]):
        return None, None
    gaps = np.flatnonzero(~np.isfinite(points[:, 1]))
    first = int(gaps[-1]) + 1 if gaps.size else 0
    return float(points[-1, 1]), float(points[first, 0])


def engine_inputs(detector: Detector) -> list[dict[str, object]]:
    """Per engine: each tier's Ĉ and deadline (value, source, since when known), the prediction
    below saturation with its range, and when the detector's history of it begins."""
    followed = detector.signals.inputs()
    out: list[dict[str, object]] = []
    for labels in detector.history.engines():
        hist = followed.get(labels.instance)
        tiers: dict[str, object] = {}
        begins: float | None = None
        for tier, (cap_name, dl_name) in INPUT_SIGNALS.items():
            got: dict[str, tuple[float | None, float | None]] = dict.fromkeys(
                (cap_name, dl_name), (None, None)
            )
            for name in (cap_name, dl_name):
                for _, points in detector.history.series(name, engine=labels.instance):
                    got[name] = known_since(points)
                    begins = float(points[0, 0]) if points.shape[0] else begins
            cap_source = None if hist is None else hist.capacity_source.get(tier)  # type: ignore[call-overload]
            dl_source = None if hist is None else hist.deadline_source
            tiers[tier] = {
                "capacity": {"value": got[cap_name][0], "since": got[cap_name][1],
                             "source": cap_source if got[cap_name][0] is not None else None},
                "deadline": {"value": got[dl_name][0], "since": got[dl_name][1],
                             "source": dl_source if got[dl_name][0] is not None else None},
            }  # fmt: skip
        prediction = None if hist is None else hist.predicted
        out.append(
            {
                "instance": labels.instance,
                "labels": labels.as_dict(),
                "tiers": tiers,
                "predicted": None
                if prediction is None
                else {"value": prediction.capacity, "low": prediction.low, "high": prediction.high},
                "history_from": begins,
            }
        )
    return out


def create_app(detector: Detector) -> FastAPI:
    app = FastAPI(title="retrywatch detector", version="1")
    # Rendered once, so a missing runbook fails at start.
    # every alert's section, whichever tier this detector evaluates: the rules' links land on it
    names = [rule.name for rule in ALERTS] + [alert.name for alert in PROMETHEUS_ALERTS]
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
        try:
            found = detector.store.episodes(
                since=since, until=until, alertname=alertname, engine=engine, limit=limit
            )
        except SQLAlchemyError as exc:  # a database that does not answer: a 503 that says so
            raise HTTPException(
                status_code=503, detail=f"the episodes' database does not answer: {store_error(exc)}"
            ) from None
        return {
            "episodes": [{**ep.as_dict(), "runbook_url": detector.runbook_url(ep.alertname)} for ep in found]
        }

    @app.get("/signals", response_model=None)
    def signals(
        name: str | None = Query(default=None, max_length=64),
        since: UnixTime = None,
        engine: str | None = Query(default=None, max_length=MAX_INSTANCE_CHARS),
    ) -> dict[str, object] | Response:
        if name is None:
            given = [f"{k}=" for k, v in (("engine", engine), ("since", since)) if v is not None]
            if given:  # a filter of points without the signal they are points of: not ignored
                raise HTTPException(
                    status_code=400,
                    detail=f"{' and '.join(given)} select the points of one signal: give name= too"
                    " (GET /signals lists the signals and the engines)",
                )
            # Engines are keyed by instance: vLLM's engine label is "0" on every vLLM.
            engines = sorted({e.instance for e in detector.history.engines()})
            return {"signals": list(SIGNAL_NAMES), "engines": engines}
        if name not in SIGNALS_BY_NAME:
            raise HTTPException(status_code=404, detail=f"unknown signal {name!r}; GET /signals lists them")
        series = detector.history.series(name, since=since, engine=engine)
        # NOTE: serialised by orjson from the arrays (NaN as null): FastAPI's encoder walked every
        # point in Python, 4.7 s of CPU for 256 engines' 6 h of one signal, against 0.1 s.
        body = {
            "name": name,
            "unit": SIGNALS_BY_NAME[name].unit,
            "series": [{"labels": labels.as_dict(), "points": points} for labels, points in series],
        }
        return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    @app.get("/inputs")
    def inputs() -> dict[str, object]:
        return {"engines": engine_inputs(detector), "evaluated_at": detector.evaluator.last_eval}

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
