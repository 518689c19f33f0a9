"""Direct scrape of retrywatch proxies' ``/metrics`` (which carry vLLM's series too), or of
vLLM's own (``--tier vllm``).

The embedded default: no Prometheus needed. Each target's samples get ``instance`` = its URL,
with any credentials in it masked (the instance is stored, shown and sent in notifications), and
each answer adds ``up`` = 1, as Prometheus does: a target that answers without the series (an
empty body) is missing data, not a target that left. vLLM's histograms that the signals read
(``foundation.vllmbuckets.SERIES_HISTOGRAMS``: the e2e latency, the queue time, the prompt
tokens per request) are kept, as the series files keep them.
Targets are read at the same time, so a target that does not answer costs an evaluation one
timeout, not one per target.

An answer is refused whole, and its target counts as down (its tier's NoData names the source),
when it holds more series than ``series_limit`` (Prometheus' ``sample_limit``: a target whose
label sets churn must not take the detector's memory) or one series twice (a doubled gauge or
counter would be summed: a queue read double, a rate many times over). Each refusal is counted
(:attr:`FetchResult.refused`) and logged as an error when a target's reason changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from detector.signals import UP
from detector.sources import FetchResult, read_whole
from foundation.bounds import MAX_METRICS_BYTES, OPENAI_API_ROOT, ends_at_api_root, without_api_root
from foundation.redact import redact_text, redact_url
from foundation.timeseries import ExpositionRefused, Sample, Snapshot, parse_exposition
from foundation.vllmbuckets import SERIES_HISTOGRAMS

log = logging.getLogger("retrywatch.detector")

# A proxy's /metrics: vLLM's, which the proxy reads up to MAX_METRICS_BYTES, and its own families.
MAX_BODY_BYTES = 2 * MAX_METRICS_BYTES
#: Series one target's answer may hold (``retrywatch detect --series-limit``), as Prometheus'
#: ``sample_limit``: every sample counts, those of families the detector drops too. vLLM 0.32
#: exposes about 420 per engine (its histograms' buckets most of them), a proxy some 100 more:
#: room for a 16-engine data-parallel vLLM behind one target.
SERIES_LIMIT = 10_000
MAX_TARGETS = 64
# Targets read at once; with MAX_BODY_BYTES, it bounds what a fetch holds in memory.
_READERS = 8


class ScrapeSource:
    name = "exporter"

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 3.0,
        transport: httpx.BaseTransport | None = None,
        series_limit: int = SERIES_LIMIT,
    ) -> None:
        if series_limit < 1:
            raise ValueError(f"the series limit must be at least 1, got {series_limit}")
        if not urls:
            raise ValueError("give at least one exporter URL to scrape")
        if len(urls) > MAX_TARGETS:
            raise ValueError(f"at most {MAX_TARGETS} exporter URLs")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"exporter URL must be http(s)://.../metrics, got {redact_url(url)!r}")
            if ends_at_api_root(url):
                raise ValueError(
                    f"--exporter is a proxy's /metrics URL, not its {OPENAI_API_ROOT} API root: give "
                    f"{redact_url(without_api_root(url))}/metrics, not {redact_url(url)}"
                )
        self.urls = list(urls)
        self.instances = {url: redact_url(url) for url in self.urls}
        self.timeout_s = timeout_s
        self.series_limit = series_limit
        self._refusing: dict[str, str] = {}  # url -> the reason its last answer was refused
        self._client = httpx.Client(
            timeout=timeout_s, transport=transport, limits=httpx.Limits(max_connections=_READERS)
        )
        self._readers = ThreadPoolExecutor(
            max_workers=min(len(self.urls), _READERS), thread_name_prefix="retrywatch-scrape"
        )

    def _scrape(self, url: str) -> str:
        started = time.monotonic()
        with self._client.stream("GET", url, headers={"Accept": "text/plain;version=0.0.4"}) as resp:
            if resp.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request, response=resp)
            body = read_whole(
                resp.iter_bytes(), started=started, timeout_s=self.timeout_s, max_bytes=MAX_BODY_BYTES
            )
        return body.decode("utf-8", errors="replace")

    def _read(self, url: str) -> list[Sample] | Exception:
        try:
            text = self._scrape(url)
            return parse_exposition(
                text, keep_histograms=SERIES_HISTOGRAMS, max_series=self.series_limit, unique=True
            )
        except (httpx.HTTPError, ValueError) as exc:
            return exc

    def fetch(self, now: float) -> FetchResult:
        result = FetchResult()
        for url, read in zip(self.urls, self._readers.map(self._read, self.urls), strict=True):
            instance = self.instances[url]
            if isinstance(read, ExpositionRefused) or not isinstance(read, Exception):
                self._refused(url, read if isinstance(read, ExpositionRefused) else None)
            if isinstance(read, Exception):
                result.down.append(instance)
                result.error = f"{instance}: {redact_text(str(read), [url])}"
                if isinstance(read, ExpositionRefused):
                    result.refused.append(read.reason)
                    result.error = f"{instance}: scrape refused: {redact_text(str(read), [url])}"
                continue
            # up: the target answered, if without the series (an empty body): Prometheus' own
            labelled = [(n, {**lb, "instance": instance}, v) for n, lb, v in read if n != UP]
            labelled.append((UP, {"instance": instance}, 1.0))
            result.snapshots.append(Snapshot(t=now, samples=labelled))
        return result

    def _refused(self, url: str, refusal: ExpositionRefused | None) -> None:
        """Log a target's refused answer (``refusal``; None: an answer taken) as an error when its
        reason changes, and once when an answer of it is taken again (not on every scrape)."""
        before = self._refusing.get(url)
        instance = self.instances[url]
        if refusal is None:
            if before is not None:
                del self._refusing[url]
                log.warning("the scrape of %s is taken again", instance)
            return
        if refusal.reason != before:
            self._refusing[url] = refusal.reason
            log.error("the scrape of %s is refused, its series unread (the target counts as down): %s",
                      instance, redact_text(str(refusal), [url]))  # fmt: skip

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._client.close()
