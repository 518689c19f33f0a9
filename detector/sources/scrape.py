"""Direct scrape of retrywatch proxies' ``/metrics`` (which carry vLLM's series too).

The embedded default: no Prometheus needed. Each target's samples get ``instance`` = its URL,
with any credentials in it masked (the instance is stored, shown and sent in notifications), and
each answer adds ``up`` = 1, as Prometheus does: a target that answers without the series (an
empty body) is missing data, not a target that left.
Targets are read at the same time, so a target that does not answer costs an evaluation one
timeout, not one per target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from detector.signals import UP
from detector.sources import FetchResult, read_whole
from foundation.bounds import MAX_METRICS_BYTES, OPENAI_API_ROOT, ends_at_api_root, without_api_root
from foundation.redact import redact_text, redact_url
from foundation.timeseries import Sample, Snapshot, parse_exposition

# A proxy's /metrics: vLLM's, which the proxy reads up to MAX_METRICS_BYTES, and its own families.
MAX_BODY_BYTES = 2 * MAX_METRICS_BYTES
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
    ) -> None:
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
            return parse_exposition(self._scrape(url))
        except (httpx.HTTPError, ValueError) as exc:
            return exc

    def fetch(self, now: float) -> FetchResult:
        result = FetchResult()
        for url, read in zip(self.urls, self._readers.map(self._read, self.urls), strict=True):
            instance = self.instances[url]
            if isinstance(read, Exception):
                result.down.append(instance)
                result.error = f"{instance}: {redact_text(str(read), [url])}"
                continue
            # up: the target answered, if without the series (an empty body): Prometheus' own
            labelled = [(n, {**lb, "instance": instance}, v) for n, lb, v in read if n != UP]
            labelled.append((UP, {"instance": instance}, 1.0))
            result.snapshots.append(Snapshot(t=now, samples=labelled))
        return result

    def close(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._client.close()
