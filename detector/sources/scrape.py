"""Direct scrape of retrywatch proxies' ``/metrics`` (which carry vLLM's series too).

The embedded default: no Prometheus needed. Each target's samples get ``instance`` = its URL,
with any credentials in it masked (the instance is stored, shown and sent in notifications).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from detector.sources import FetchResult
from exporter.redact import redact_text, redact_url
from exporter.timeseries import Snapshot, parse_exposition

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_TARGETS = 64


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
        self.urls = list(urls)
        self.instances = {url: redact_url(url) for url in self.urls}
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s, transport=transport)

    def _scrape(self, url: str) -> str:
        # httpx's timeout bounds each read, not the answer: a target that drips its body would
        # hold the evaluation (and every other target's scrape) for as long as it drips.
        deadline = time.monotonic() + self.timeout_s
        with self._client.stream("GET", url, headers={"Accept": "text/plain;version=0.0.4"}) as resp:
            if resp.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request, response=resp)
            chunks: list[bytes] = []
            size = 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"{self.instances[url]}: /metrics larger than {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise ValueError(f"/metrics not read whole within {self.timeout_s:g} s")
        return b"".join(chunks).decode("utf-8", errors="replace")

    def fetch(self, now: float) -> FetchResult:
        result = FetchResult()
        for url in self.urls:
            try:
                samples = parse_exposition(self._scrape(url))
            except (httpx.HTTPError, ValueError) as exc:
                instance = self.instances[url]
                result.down.append(instance)
                result.error = f"{instance}: {redact_text(str(exc), [url])}"
                continue
            labelled = [(n, {**lb, "instance": self.instances[url]}, v) for n, lb, v in samples]
            result.snapshots.append(Snapshot(t=now, samples=labelled))
        return result

    def close(self) -> None:
        self._client.close()
