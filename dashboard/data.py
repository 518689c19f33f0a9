"""Data access for the dashboard: the detector API client (the one place that knows its JSON
shapes, see docs/architecture.md) and an optional Prometheus source for the same signals.

Everything the pages show comes through ``DetectorClient`` (alerts, episodes, health) and a
``SignalSource`` (the detector's ``/signals`` or Prometheus). A shape change is one edit here.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import numpy as np

from detector.signals import MAX_INSTANCES
from detector.sources import AnswerTooLarge, AnswerTooSlow, read_whole
from foundation.redact import redact_text, redact_url

FETCH_WORKERS = 3  # more threads only contend for the GIL on both sides
MAX_ENGINES = MAX_INSTANCES  # engines listed in the selector: as many as a detector follows
# One answer's bound: the detector's largest (every engine's 6-h history of one signal) is ~12 MB per
# 64 engines (~48 MB at its 256).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# Unix times a page can show (gmtime and Plotly's dates): year 1970 to 9999.
MAX_UNIX_TIME = 253402300799.0
# Signals that are levels or ratios: several series of one engine are averaged, not summed.
NON_ADDITIVE = frozenset(
    {
        "capacity",
        "deadline",
        "prompt_token_gap",
        "executions_per_first_attempt",
        "creation_capacity_ratio",
        "waiting_littles_law_ratio",
        "queue_littles_law_ratio",
        "backlog_seconds",
        "goodput_ratio",
    }
)


class DetectorError(RuntimeError):
    """The detector could not be reached or answered with an unexpected shape."""


class DetectorUnavailable(DetectorError):
    """The detector did not answer (connection refused, timeout, HTTP error)."""


class ShapeError(DetectorError):
    """The detector answered JSON that does not match docs/architecture.md."""


class _EngineLabels:
    """The engine an alert or episode is about, read from its ``labels``."""

    labels: dict[str, str]

    @property
    def engine(self) -> str:
        """The engine's key: its ``instance`` (vLLM's ``engine`` label is "0" on every vLLM)."""
        return engine_of(self.labels)

    @property
    def engine_name(self) -> str:
        """The engine for people: its instance, and its model when known."""
        return engine_name(self.labels)


@dataclass(frozen=True)
class Alert(_EngineLabels):
    """An alert the detector currently reports as firing."""

    alertname: str
    severity: str
    labels: dict[str, str]
    state: str
    started_at: float
    value: float | None
    summary: str
    description: str
    resolving_since: float | None = None  # the condition cleared; it keeps firing a while
    resolves_at: float | None = None  # when it resolves unless the condition returns
    runbook_url: str = ""  # the alert's runbook section, when the detector says

    @property
    def resolving(self) -> bool:
        """Still listed (keep-firing) though its condition no longer holds."""
        return self.state == "resolving" or self.resolving_since is not None


@dataclass(frozen=True)
class Episode(_EngineLabels):
    """One alert episode from the detector's history; ``resolved_at`` None while firing."""

    id: str
    alertname: str
    severity: str
    labels: dict[str, str]
    started_at: float
    resolved_at: float | None
    summary: str
    description: str
    runbook_url: str = ""  # the alert's runbook section, when the detector says

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "alertname": self.alertname,
            "severity": self.severity,
            "labels": dict(self.labels),
            "started_at": self.started_at,
            "resolved_at": self.resolved_at,
            "summary": self.summary,
            "description": self.description,
        }


@dataclass(frozen=True)
class SignalIndex:
    """The signal names the source offers and the engines it has seen."""

    names: list[str]
    engines: list[str]


@dataclass(frozen=True)
class SignalSeries:
    """One labelled series of a signal: ``points`` is an (n, 2) array of (Unix t, value)."""

    labels: dict[str, str]
    points: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class Health:
    status: str
    source_up: bool
    last_scrape_at: float | None


@dataclass(frozen=True)
class Known:
    """One input of the detector's (Ĉ or the deadline) as it knows it now: its value (None:
    missing), where it comes from (``stated``, ``saturated``, ``predicted``, ``learned``, ...)
    and since when it has been known."""

    value: float | None
    source: str | None
    since: float | None


@dataclass(frozen=True)
class EngineInputs(_EngineLabels):
    """An engine's Ĉ and deadline per tier (``/inputs``), and Ĉ predicted below saturation with
    its range (value, low, high) where there is one."""

    labels: dict[str, str]
    capacity: dict[str, Known]  # tier -> Ĉ
    deadline: dict[str, Known]  # tier -> the deadline
    predicted: tuple[float, float, float] | None
    history_from: float | None  # where the detector's history (and so "since") begins


class SignalSource(Protocol):
    """Where time series of the detector's signals come from."""

    def signal_index(self) -> SignalIndex: ...

    def signal(
        self, name: str, *, since: float | None = None, engine: str | None = None
    ) -> list[SignalSeries]: ...


# --- parsing ----------------------------------------------------------------------------


def _field(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise ShapeError(f"detector {where}: missing field {key!r}")
    return obj[key]


def _float(value: Any, key: str, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"detector {where}: field {key!r} is not a number ({value!r})") from exc


def _opt_float(value: Any, key: str, where: str) -> float | None:
    return None if value is None else _float(value, key, where)


def _time(value: Any, key: str, where: str) -> float:
    t = _float(value, key, where)
    if not 0.0 <= t <= MAX_UNIX_TIME:  # NaN too
        raise ShapeError(f"detector {where}: field {key!r} is not a Unix time ({value!r})")
    return t


def _opt_time(value: Any, key: str, where: str) -> float | None:
    return None if value is None else _time(value, key, where)


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = _field(obj, key, where)
    if not isinstance(value, list):
        raise ShapeError(f"detector {where}: field {key!r} must be a list")
    return value


def _labels(obj: Mapping[str, Any], where: str) -> dict[str, str]:
    labels = obj.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise ShapeError(f"detector {where}: labels must be an object")
    return {str(k): str(v) for k, v in labels.items()}


def parse_alerts(payload: Any) -> list[Alert]:
    where = "/alerts"
    alerts = []
    for item in _list(payload, "alerts", where):
        alerts.append(
            Alert(
                alertname=str(_field(item, "alertname", where)),
                severity=str(item.get("severity") or "warning"),
                labels=_labels(item, where),
                state=str(item.get("state") or "firing"),
                started_at=_time(_field(item, "started_at", where), "started_at", where),
                value=_opt_float(item.get("value"), "value", where),
                summary=str(item.get("summary") or ""),
                description=str(item.get("description") or ""),
                resolving_since=_opt_time(item.get("resolving_since"), "resolving_since", where),
                resolves_at=_opt_time(item.get("resolves_at"), "resolves_at", where),
                runbook_url=_http_url(item.get("runbook_url")),
            )
        )
    return alerts


def parse_evaluated_at(payload: Any) -> float | None:
    """When the detector evaluated the alerts of an ``/alerts`` answer (None when it does not say:
    an older detector, or none yet)."""
    return _opt_time(payload.get("evaluated_at"), "evaluated_at", "/alerts")


def _http_url(value: Any) -> str:
    """A link the page may show: an http(s) URL or a relative one (resolved against the
    detector's URL by the page); anything else (``javascript:``, ``file:``) is dropped."""
    text = str(value or "").strip()
    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.netloc:
        return text
    return text if text and not parts.scheme and not parts.netloc else ""


def parse_episodes(payload: Any) -> list[Episode]:
    where = "/episodes"
    episodes = []
    for item in _list(payload, "episodes", where):
        episodes.append(
            Episode(
                id=str(item.get("id", "")),
                alertname=str(_field(item, "alertname", where)),
                severity=str(item.get("severity") or "warning"),
                labels=_labels(item, where),
                started_at=_time(_field(item, "started_at", where), "started_at", where),
                resolved_at=_opt_time(item.get("resolved_at"), "resolved_at", where),
                summary=str(item.get("summary") or ""),
                description=str(item.get("description") or ""),
                runbook_url=_http_url(item.get("runbook_url")),
            )
        )
    return episodes


def _known(obj: Any, key: str, where: str) -> Known:
    if not isinstance(obj, Mapping):
        raise ShapeError(f"detector {where}: {key} must be an object")
    value = _opt_float(obj.get("value"), "value", where)
    source = obj.get("source")
    return Known(
        value=value if value is not None and math.isfinite(value) and value > 0 else None,
        source=None if source is None else str(source),
        since=_opt_time(obj.get("since"), "since", where),
    )


def parse_inputs(payload: Any) -> list[EngineInputs]:
    where = "/inputs"
    out = []
    for item in _list(payload, "engines", where):
        tiers = _field(item, "tiers", where)
        if not isinstance(tiers, Mapping):
            raise ShapeError(f"detector {where}: tiers must be an object")
        capacity = {str(t): _known(_field(v, "capacity", where), "capacity", where) for t, v in tiers.items()}
        deadline = {str(t): _known(_field(v, "deadline", where), "deadline", where) for t, v in tiers.items()}
        pred = item.get("predicted")
        predicted = None
        if isinstance(pred, Mapping):
            predicted = tuple(_float(pred.get(k), k, where) for k in ("value", "low", "high"))
        labels = _labels(item, where)
        labels.setdefault("instance", str(_field(item, "instance", where)))
        out.append(
            EngineInputs(
                labels=labels,
                capacity=capacity,
                deadline=deadline,
                predicted=predicted,  # type: ignore[arg-type]  # three floats
                history_from=_opt_time(item.get("history_from"), "history_from", where),
            )
        )
    return out


def parse_points(points: Any, where: str) -> np.ndarray:
    if not isinstance(points, Sequence) or isinstance(points, str):
        raise ShapeError(f"detector {where}: points must be a list of [t, v]")
    if not points:
        return np.empty((0, 2))
    try:
        arr = np.array(points, dtype=float)  # null values become NaN
    except (TypeError, ValueError) as exc:
        raise ShapeError(f"detector {where}: points must be [t, v] number pairs ({exc})") from exc
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ShapeError(f"detector {where}: points must be [t, v] number pairs, got shape {arr.shape}")
    if np.any(np.abs(arr[:, 0]) > MAX_UNIX_TIME):  # a null t (NaN) is dropped where it is drawn
        raise ShapeError(f"detector {where}: a point's t is not a Unix time")
    return arr


def parse_signal(payload: Any, name: str) -> list[SignalSeries]:
    where = f"/signals?name={name}"
    series = []
    for item in _list(payload, "series", where):
        series.append(
            SignalSeries(
                labels=_labels(item, where), points=parse_points(_field(item, "points", where), where)
            )
        )
    return series


def parse_signal_index(payload: Any) -> SignalIndex:
    where = "/signals"
    names = [str(n) for n in _list(payload, "signals", where)]
    engines = sorted({str(e) for e in _list(payload, "engines", where)})[:MAX_ENGINES]
    return SignalIndex(names=names, engines=engines)


def parse_health(payload: Any) -> Health:
    where = "/healthz"
    source = payload.get("source") or {} if isinstance(payload, Mapping) else {}
    if not isinstance(source, Mapping):
        raise ShapeError(f"detector {where}: source must be an object")
    return Health(
        status=str(_field(payload, "status", where)),
        source_up=bool(source.get("up", False)),
        last_scrape_at=_opt_time(source.get("last_scrape_at"), "last_scrape_at", where),
    )


# --- the client -------------------------------------------------------------------------


class DetectorClient:
    """A small synchronous client of the detector API (one pooled HTTP connection set)."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None
    ):
        if not base_url.startswith(("http://", "https://")):
            shown = redact_url(base_url)
            raise ValueError(f"detector URL must start with http:// or https://, got {shown!r}")
        self.base_url = base_url.rstrip("/")
        self.display_url = redact_url(self.base_url)  # its credentials masked: shown on the pages
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        clean = {k: v for k, v in (params or {}).items() if v is not None and v != ""}
        started = time.monotonic()
        try:
            with self._http.stream("GET", path, params=clean) as response:
                response.raise_for_status()
                body = read_whole(
                    response.iter_bytes(),
                    started=started,
                    timeout_s=self.timeout_s,
                    max_bytes=MAX_ANSWER_BYTES,
                )
        except AnswerTooLarge as exc:
            raise ShapeError(f"detector {path}: {exc}") from exc
        except (httpx.HTTPError, AnswerTooSlow) as exc:
            reason = f"detector at {self.display_url} did not answer {path}: {exc}"
            raise DetectorUnavailable(redact_text(reason, [self.base_url])) from exc
        try:
            return json.loads(body)
        except ValueError as exc:
            raise ShapeError(f"detector {path}: answer is not JSON") from exc

    def alerts(self) -> list[Alert]:
        return parse_alerts(self._get("/alerts"))

    def alerts_at(self) -> tuple[list[Alert], float | None]:
        """The firing alerts and the time of the evaluation they are as of (it goes on past the
        last scrape while the source is down), when the detector says."""
        payload = self._get("/alerts")
        return parse_alerts(payload), parse_evaluated_at(payload)

    def episodes(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        alertname: str | None = None,
        engine: str | None = None,
    ) -> list[Episode]:
        params = {"since": since, "until": until, "alertname": alertname, "engine": engine}
        return parse_episodes(self._get("/episodes", params))

    def signal_index(self) -> SignalIndex:
        return parse_signal_index(self._get("/signals"))

    def signal(
        self, name: str, *, since: float | None = None, engine: str | None = None
    ) -> list[SignalSeries]:
        return parse_signal(self._get("/signals", {"name": name, "since": since, "engine": engine}), name)

    def health(self) -> Health:
        return parse_health(self._get("/healthz"))

    def inputs(self) -> list[EngineInputs]:
        """Each engine's Ĉ and deadline with where they come from (a detector before ``/inputs``
        answers 404: ``DetectorUnavailable``)."""
        return parse_inputs(self._get("/inputs"))


def engine_of(labels: Mapping[str, str]) -> str:
    """The engine a series, alert or episode belongs to: its ``instance`` (the scraped proxy URL,
    the Prometheus target or the replayed run), as the detector keys engines; vLLM's ``engine``
    label is "0" on every vLLM, so it only stands in when there is no instance."""
    return labels.get("instance") or labels.get("engine") or ""


def instance_label(instance: str) -> str:
    """An instance as people read it: a scraped URL (``http://10.0.0.7:8100/metrics``) as its
    ``host:port``; anything else (a Prometheus target, a replayed run) as it is."""
    parts = urlsplit(instance)
    if parts.scheme in ("http", "https") and parts.netloc:
        return parts.netloc.rsplit("@", 1)[-1]  # never a URL's credentials
    return instance


def engine_name(labels: Mapping[str, str]) -> str:
    """An engine as an operator reads it: ``host:port (model)``, or the instance alone."""
    key, model = instance_label(engine_of(labels)), labels.get("model", "")
    return f"{key} ({model})" if key and model else key


def signals_for_engine(
    source: SignalSource, names: Sequence[str], *, engine: str | None, since: float | None
) -> dict[str, np.ndarray]:
    """Fetch ``names`` for one engine; a signal with several series for the engine (e.g.
    several proxies of one engine) is summed over them, or averaged for levels and ratios."""
    # Fetched concurrently: each signal is one request, and the detector answers them in parallel.
    with ThreadPoolExecutor(max_workers=FETCH_WORKERS) as pool:
        fetched = list(pool.map(lambda n: source.signal(n, since=since, engine=engine), names))
    out: dict[str, np.ndarray] = {}
    for name, all_series in zip(names, fetched, strict=True):
        series = [s for s in all_series if not engine or engine_of(s.labels) == engine]
        if not series:
            continue
        if len(series) == 1:
            out[name] = series[0].points
            continue
        out[name] = _combine([s.points for s in series], average=name in NON_ADDITIVE)
    return out


def _combine(arrays: Sequence[np.ndarray], *, average: bool) -> np.ndarray:
    """Several series of one engine on the union of their times: summed (or averaged) over the
    series that exist at each time, so one that stopped (e.g. before the engine's model changed)
    or has not started yet neither hides the others' times nor is stretched over them; a gap
    (NaN) inside a series stays a gap."""
    arrays = [a[np.isfinite(a[:, 0])] for a in arrays]
    arrays = [a[np.argsort(a[:, 0], kind="stable")] for a in arrays if a.shape[0]]
    if not arrays:
        return np.empty((0, 2))
    times = np.unique(np.concatenate([a[:, 0] for a in arrays]))
    total, count = np.zeros(times.size), np.zeros(times.size)
    for a in arrays:
        present = (times >= a[0, 0]) & (times <= a[-1, 0])
        total[present] += np.interp(times[present], a[:, 0], a[:, 1])
        count += present
    if average:
        total /= count  # every time is inside at least one series' span
    return np.column_stack([times, total])
