"""Signals through the Prometheus HTTP API (Prometheus, Thanos, Mimir, VictoriaMetrics).

Uses ``prometheus-api-client``. The first fetch backfills the windows with one range query
(so verdicts are available at once); later fetches take one instant query per evaluation.
Only the raw series the signals need are asked for (plus ``up``, to see a target that is down).
Every answer must arrive whole within the timeout and a size bound (:class:`WholeAnswerSession`).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from requests.exceptions import RequestException, Timeout
from urllib3.util.retry import Retry

from detector.signals import MAX_INSTANCES, PROMETHEUS_JOB, SERVED_NAMES, UP
from detector.sources import AnswerTooLarge, AnswerTooSlow, FetchResult, read_whole
from foundation.redact import redact_text, redact_url
from foundation.timeseries import Sample, Snapshot

#: Series one engine may have under the selector: about twice the 60 that a proxy and its vLLM
#: export there (attempts by kind, executions by fate, ..., vLLM's gauges and counters, the e2e
#: histogram's 21 buckets and the other vLLM series the vLLM tier reads, up).
SERIES_PER_ENGINE = 128
#: The largest answer read: the first fetch's 10-minute backfill of SERIES_PER_ENGINE series for
#: 256 engines is about 120 MB of JSON.
MAX_ANSWER_BYTES = 256 * 1024 * 1024


class WholeAnswerSession(requests.Session):
    """A ``requests`` session (for ``PrometheusConnect``) whose every answer must arrive whole
    within ``timeout_s`` and ``max_bytes`` (:func:`detector.sources.read_whole`), else ``Timeout``
    or ``RequestException``. TLS certificates are not verified, as ``disable_ssl=True`` did."""

    def __init__(self, timeout_s: float, max_bytes: int) -> None:
        super().__init__()
        self.verify = False
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def request(self, method: str, url: Any, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs["stream"] = True
        started = time.monotonic()
        response = super().request(method, url, *args, **kwargs)
        # read1: whatever has arrived (decoded), where iter_content waits for a whole chunk
        arrived = iter(lambda: response.raw.read1(64 * 1024, decode_content=True), b"")
        try:
            body = read_whole(arrived, started=started, timeout_s=self.timeout_s, max_bytes=self.max_bytes)
        except AnswerTooSlow as exc:
            raise Timeout(str(exc)) from exc
        except AnswerTooLarge as exc:
            raise RequestException(str(exc)) from exc
        finally:
            response.close()
        response._content = body  # read whole: .json() and .content use it
        return response


def _selector(job: str | None) -> str:
    names = sorted(SERVED_NAMES)
    pattern = "|".join(re.escape(n) for n in names)
    job_part = f',job="{job}"' if job else ""
    return f'{{__name__=~"{pattern}"{job_part}}}'


class PrometheusSource:
    name = "prometheus"

    def __init__(
        self,
        url: str,
        *,
        job: str | None = PROMETHEUS_JOB,
        backfill_s: float = 600.0,
        step_s: float = 5.0,
        timeout_s: float = 10.0,
        max_engines: int = MAX_INSTANCES,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL must be http(s)://..., got {redact_url(url)!r}")
        self.url = url
        self.display_url = redact_url(url)  # its credentials masked, for messages
        self.backfill_s = backfill_s
        self.step_s = step_s
        self.query = _selector(job)
        self.max_engines = max_engines
        self.max_series = SERIES_PER_ENGINE * max_engines  # an answer beyond it is refused
        self._client = PrometheusConnect(
            url=url,
            session=WholeAnswerSession(timeout_s, MAX_ANSWER_BYTES),
            timeout=int(max(1, timeout_s)),
            retry=Retry(total=1, backoff_factor=0.1),
        )
        self._backfilled = False
        self.known: set[str] = set()

    def _samples(self, metric: dict[str, str], value: float) -> tuple[str, dict[str, str], float]:
        labels = {k: v for k, v in metric.items() if k != "__name__"}
        return (metric.get("__name__", ""), labels, value)

    def fetch(self, now: float) -> FetchResult:
        try:
            if not self._backfilled:
                snapshots = self._range(now - self.backfill_s, now)
                self._backfilled = True
            else:
                snapshots = [self._instant(now)]
        except (PrometheusApiClientException, RequestException, ValueError, KeyError) as exc:
            error = f"{self.display_url}: {redact_text(str(exc), [self.url])}"
            return FetchResult(down=sorted(self.known) or [self.display_url], error=error)
        down: set[str] = set()
        named: set[str] = set()
        for snap in snapshots:
            keep: list[Sample] = []
            for name, labels, value in snap.samples:
                inst = labels.get("instance", "")
                if name == UP:
                    if value == 0:
                        down.add(inst)
                        continue
                    if snap is snapshots[-1]:
                        down.discard(inst)
                    named.add(inst)
                    keep.append((name, labels, value))  # answered: named, with or without series
                    continue
                named.add(inst)
                keep.append((name, labels, value))
            snap.samples = keep
        self.known = named  # the engines with data now: those a failed fetch marks down
        return FetchResult(snapshots=[s for s in snapshots if s.samples], down=sorted(down))

    def _instant(self, now: float) -> Snapshot:
        data = self._client.custom_query(query=self.query, params={"time": f"{now:.3f}"})
        self._check_size(data)
        return Snapshot(t=now, samples=[self._samples(d["metric"], float(d["value"][1])) for d in data])

    def _range(self, start: float, end: float) -> list[Snapshot]:
        data = self._client.custom_query_range(
            query=self.query,
            start_time=datetime.fromtimestamp(start, tz=UTC),
            end_time=datetime.fromtimestamp(end, tz=UTC),
            step=f"{self.step_s:g}s",
        )
        self._check_size(data)
        by_t: dict[float, list[Sample]] = defaultdict(list)
        for d in data:
            for t, v in d["values"]:
                by_t[float(t)].append(self._samples(d["metric"], float(v)))
        return [Snapshot(t=t, samples=by_t[t]) for t in sorted(by_t)]

    def _check_size(self, data: list[dict[str, object]]) -> None:
        if len(data) > self.max_series:
            raise ValueError(
                f"{len(data)} series match; at most {self.max_series}"
                f" ({SERIES_PER_ENGINE} an engine for --max-engines {self.max_engines})"
            )

    def close(self) -> None:
        return None
