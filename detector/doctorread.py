"""``retrywatch doctor``'s reading: a ``/metrics`` and a Prometheus's API, each answer whole within a
timeout and a size bound (``foundation.bounds``, ``detector.sources.read_whole``), every error
with its URL's credentials masked; :func:`run` reads what is given and hands it to
``detector.doctor.diagnose``.

vLLM's ``/metrics`` is asked for the plain text format, so its colons survive (as the scrape source
asks). Of a Prometheus only series names, label names and the two stated numbers' values are read:
``group by`` over the names the rules read, never a sample of the series themselves.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from detector.doctor import STATED, Endpoint, PrometheusView, Report, diagnose
from detector.needs import Selector, signal_needs
from detector.signals import PROMETHEUS_JOBS
from detector.sources import read_whole
from detector.thresholds import ALERTS, leaves
from foundation.bounds import MAX_METRICS_BYTES, ends_at_api_root, without_api_root
from foundation.redact import redact_text, redact_url
from foundation.timeseries import Sample, parse_exposition
from foundation.vllmreleases import FAMILIES

#: The largest answer of a Prometheus read: a fleet's series names and label names.
MAX_PROMETHEUS_BYTES = 64 * 1024 * 1024
#: The largest proxy /metrics: vLLM's, which it passes through, and its own (as the detector reads).
MAX_PROXY_BYTES = 2 * MAX_METRICS_BYTES
_PLAIN_TEXT = {"Accept": "text/plain;version=0.0.4"}


class ReadError(Exception):
    """An endpoint that did not answer as expected; the message has its credentials masked."""


def metrics_url(url: str) -> str:
    """A ``/metrics`` URL from a server's address (``http://HOST:PORT``), its OpenAI base URL
    (``.../v1``) or the ``/metrics`` URL itself."""
    if ends_at_api_root(url):
        url = without_api_root(url)
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def _get(client: httpx.Client, url: str, max_bytes: int, timeout_s: float, **params: str) -> bytes:
    started = time.monotonic()
    try:
        with client.stream("GET", url, params=params or None, headers=_PLAIN_TEXT) as resp:
            body = read_whole(resp.iter_bytes(), started=started, timeout_s=timeout_s, max_bytes=max_bytes)
            if resp.status_code != 200:
                raise ReadError(f"HTTP {resp.status_code}")
    except (httpx.HTTPError, ValueError) as exc:
        raise ReadError(redact_text(str(exc) or type(exc).__name__, [url])) from None
    return body


def read_metrics(client: httpx.Client, url: str, *, max_bytes: int, timeout_s: float) -> list[Sample]:
    """The samples of one ``/metrics`` (histograms kept), or :class:`ReadError`."""
    body = _get(client, url, max_bytes, timeout_s)
    try:
        return parse_exposition(body.decode("utf-8", errors="replace"), keep_histograms=True)
    except ValueError as exc:
        raise ReadError(f"not a Prometheus exposition ({exc})") from None


def _query(client: httpx.Client, base: str, query: str, timeout_s: float) -> list[dict[str, Any]]:
    body = _get(client, f"{base}/api/v1/query", MAX_PROMETHEUS_BYTES, timeout_s, query=query)
    try:
        answer = json.loads(body)
        result = answer["data"]["result"]
        assert isinstance(result, list)
        return result
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ReadError("not a Prometheus query API answer") from None


def _labels_read() -> list[str]:
    """The label names worth keeping: those vLLM's series carry in any release, and those the
    rules match on."""
    names = {lb for f in FAMILIES for s in f.served() for lb in s.labels}
    for rule in ALERTS:
        for signal in dict.fromkeys(leaf.signal for leaf in leaves(rule.condition)):
            for alt in signal_needs(signal):
                names |= {m[0] for series in alt for m in Selector.parse(series).matchers}
    return sorted(names | {"le"})


def read_prometheus(
    client: httpx.Client, url: str, *, selector: str, vllm_job: str, timeout_s: float
) -> PrometheusView:
    """Query a Prometheus for vLLM's and the proxy's series under ``selector`` (label matchers,
    or ""), the learned records, the targets up and the alerting rules loaded."""
    base = url.rstrip("/")
    extra = f",{selector}" if selector else ""
    by = ", ".join(["__name__", *_labels_read()])
    pattern = "vllm[:_].+|retrywatch_.+"  # vllm_: scraped as OpenMetrics, its colons lost
    rows = _query(client, base, f'group by ({by}) ({{__name__=~"{pattern}"{extra}}})', timeout_s)
    samples: list[Sample] = []
    colons_lost: set[str] = set()
    for row in rows:
        metric = dict(row.get("metric", {}))
        name = str(metric.pop("__name__", ""))
        if name.startswith("vllm_"):
            colons_lost.add(name)
        elif name not in STATED:  # their values, below
            samples.append((name, {str(k): str(v) for k, v in metric.items()}, 1.0))
    stated = "|".join(STATED)
    for row in _query(client, base, f'max by (__name__) ({{__name__=~"{stated}"{extra}}} > 0)', timeout_s):
        samples.append((str(row["metric"]["__name__"]), {}, float(row["value"][1])))
    records = _query(client, base, 'group by (__name__) ({__name__=~"instance:retrywatch_.+"})', timeout_s)
    learned = frozenset(str(r["metric"]["__name__"]) for r in records)
    # each job as a PromQL string (JSON's escaping is PromQL's), not in a regular expression
    ups = " or ".join(
        f"up{{job={json.dumps(job)}{extra}}}" for job in sorted({vllm_job, PROMETHEUS_JOBS["proxy"]})
    )
    up = _query(client, base, f"group by (job) ({ups})", timeout_s)
    jobs = frozenset(str(r["metric"].get("job", "")) for r in up)
    rules: dict[str, tuple[str, str, bool]] | None = None
    try:
        body = _get(client, f"{base}/api/v1/rules", MAX_PROMETHEUS_BYTES, timeout_s, type="alert")
        rules = {}
        for group in json.loads(body)["data"]["groups"]:
            for rule in group["rules"]:
                evaluated = not str(rule.get("lastEvaluation", "")).startswith("0001-")
                rules[str(rule["name"])] = (
                    str(rule.get("health", "")),
                    str(rule.get("lastError", "")),
                    evaluated,
                )
    except (ReadError, ValueError, KeyError, TypeError):
        rules = None
    return PrometheusView(samples, learned, jobs, rules, tuple(sorted(colons_lost)))


def run(
    *,
    vllm: str | None,
    proxy: str | None,
    prometheus: str | None,
    selector: str = "",
    vllm_job: str = PROMETHEUS_JOBS["vllm"],
    capacity: float | None = None,
    deadline: float | None = None,
    timeout_s: float = 5.0,
    transport: httpx.BaseTransport | None = None,
) -> Report:
    """Read what is given and diagnose it."""
    endpoints: list[Endpoint] = []
    vllm_samples = proxy_samples = None
    view = None
    with httpx.Client(timeout=timeout_s, transport=transport, follow_redirects=False) as client:
        for role, url, max_bytes in (("vLLM", vllm, MAX_METRICS_BYTES), ("proxy", proxy, MAX_PROXY_BYTES)):
            if url is None:
                continue
            target = metrics_url(url)
            try:
                read = read_metrics(client, target, max_bytes=max_bytes, timeout_s=timeout_s)
            except ReadError as exc:
                endpoints.append(Endpoint(role, redact_url(target), str(exc)))
                continue
            endpoints.append(Endpoint(role, redact_url(target)))
            if role == "vLLM":
                vllm_samples = read
            else:
                proxy_samples = read
        if prometheus is not None:
            try:
                view = read_prometheus(
                    client, prometheus, selector=selector, vllm_job=vllm_job, timeout_s=timeout_s
                )
                endpoints.append(Endpoint("Prometheus", redact_url(prometheus)))
            except ReadError as exc:
                endpoints.append(Endpoint("Prometheus", redact_url(prometheus), str(exc)))
    return diagnose(
        endpoints=endpoints,
        vllm_samples=vllm_samples,
        proxy_samples=proxy_samples,
        prometheus=view,
        capacity=capacity,
        deadline=deadline,
    )
