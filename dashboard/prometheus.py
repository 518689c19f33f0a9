"""Signals straight from Prometheus (``retrywatch dashboard --prometheus URL``).

In a fleet, Prometheus runs ``rules/retrywatch.rules.yml``, whose recording rules compute every
detector signal per instance with engine/model labels. Engines are keyed by ``instance`` (the
scraped proxy), as the detector keys them: vLLM's ``engine`` label is "0" on every vLLM. This
source range-queries those recorded series (names from ``detector/signals.py``: one
definition) with ``prometheus-api-client``; alerts, episodes and health still come from the
detector.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import numpy as np
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests.exceptions import RequestException
from urllib3.util.retry import Retry

from dashboard.data import (
    MAX_ANSWER_BYTES,
    MAX_ENGINES,
    DetectorUnavailable,
    ShapeError,
    SignalIndex,
    SignalSeries,
)
from detector.signals import ENGINE_INFO_RECORD, SIGNALS_BY_NAME
from detector.sources.prometheus import WholeAnswerSession
from foundation.redact import redact_text, redact_url

MAX_POINTS_PER_QUERY = 2000  # the step grows with the range so one query stays bounded
MIN_STEP_S = 5.0
DEFAULT_LOOKBACK_S = 3600.0


def promql_string(value: str) -> str:
    """``value`` as a PromQL string literal: any label value selects itself, quotes and all."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class PrometheusSignals:
    """A ``SignalSource`` over Prometheus' HTTP API and the recording rules' series."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL must start with http:// or https://, got {redact_url(url)!r}")
        self.url = url
        self.display_url = redact_url(url)  # its credentials masked: shown on the pages
        self._client = PrometheusConnect(
            url=url,
            session=WholeAnswerSession(timeout_s, MAX_ANSWER_BYTES),
            timeout=int(max(1, timeout_s)),
            retry=Retry(total=1, backoff_factor=0.1),
        )

    def _call(self, what: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, **kwargs)
        except (RequestException, PrometheusApiClientException) as exc:
            reason = f"Prometheus at {self.display_url} did not answer {what}: {exc}"
            raise DetectorUnavailable(redact_text(reason, [self.url])) from exc

    def signal_index(self) -> SignalIndex:
        result = self._call(ENGINE_INFO_RECORD, self._client.custom_query, ENGINE_INFO_RECORD)
        engines = sorted({_engine(r.get("metric", {})) for r in result if isinstance(r, dict)} - {""})
        return SignalIndex(names=list(SIGNALS_BY_NAME), engines=engines[:MAX_ENGINES])

    def signal(
        self, name: str, *, since: float | None = None, engine: str | None = None
    ) -> list[SignalSeries]:
        spec = SIGNALS_BY_NAME.get(name)
        if spec is None:
            raise ValueError(f"unknown signal {name!r}")
        end = time.time()
        start = since if since is not None else end - DEFAULT_LOOKBACK_S
        if start >= end:
            return []
        step = max(MIN_STEP_S, (end - start) / MAX_POINTS_PER_QUERY)
        query = spec.record
        if engine:
            query = f"{spec.record}{{instance={promql_string(engine)}}}"  # the detector's engine key
        result = self._call(
            query,
            self._client.custom_query_range,
            query,
            start_time=datetime.fromtimestamp(start, UTC),
            end_time=datetime.fromtimestamp(end, UTC),
            step=f"{step:g}s",
        )
        series = []
        for item in result:
            try:
                labels = {k: str(v) for k, v in item["metric"].items() if k != "__name__"}
                points = np.array([(float(t), float(v)) for t, v in item["values"]], dtype=float).reshape(
                    -1, 2
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ShapeError(f"Prometheus answered an unexpected matrix for {query}: {exc}") from exc
            series.append(SignalSeries(labels=labels, points=points))
        return series


def _engine(metric: dict[str, str]) -> str:
    return str(metric.get("instance") or "")
