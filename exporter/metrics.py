"""The proxy's ``/metrics``: the policy's counters and gauges, histograms, derived gauges over a
sliding window, and the upstream engine's own families passed through unchanged (the last good
fetch, served until it is older than a staleness bound, only if it is a Prometheus exposition, and
without the upstream's own ``retrywatch_`` families: ``exporter.upstreamtext``).

The counters are read fresh from ``Policy.counters`` on every scrape by a custom collector, with
every label value of ``foundation.metricnames`` present from the start. The response is the
plain text format (``generate_latest`` + ``CONTENT_TYPE_LATEST``) so vLLM's colons survive a
Prometheus scrape.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.deadlines import DeadlineLearner
from exporter.policy import AttemptKind, Policy, PolicyCounters
from exporter.upstreamtext import WINDOW_VLLM_FAMILIES as WINDOW_VLLM_FAMILIES
from exporter.upstreamtext import Digest, digest, digest_sliced, scan_vllm
from foundation import metricnames as mn
from foundation.metricnames import Fate, ShedReason
from foundation.ratios import CREATION_CAPACITY_RATIO, PROMPT_TOKEN_GAP, WAITING_LITTLES_LAW_RATIO

log = logging.getLogger("retrywatch.proxy")

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 120.0, 240.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 90.0, 120.0, 180.0, 300.0)


def _base(name: str) -> str:
    return name.removesuffix("_total")


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _nan_if_unknown(value: float | None) -> float:
    return math.nan if value is None else value


@dataclass(frozen=True)
class WindowSample:
    t: float
    attempts: float
    created: float
    prompt_tokens: float | None
    prefix_queries: float | None
    waiting: float | None


def window_sample(t: float, counters: PolicyCounters, vllm: Mapping[str, float]) -> WindowSample:
    """The window's sample at ``t``: the policy's counters and the upstream's families
    (``vllm``: :data:`WINDOW_VLLM_FAMILIES` summed, absent when not known)."""
    return WindowSample(
        t=t,
        attempts=float(sum(counters.attempts.values())),
        created=float(counters.created),
        prompt_tokens=vllm.get(mn.VLLM_PROMPT_TOKENS),
        prefix_queries=vllm.get(mn.VLLM_PREFIX_CACHE_QUERIES),
        waiting=vllm.get(mn.VLLM_NUM_WAITING),
    )


class SlidingWindow:
    """A bounded ring of samples; rates are taken between the oldest sample in the window and
    the newest."""

    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self.samples: deque[WindowSample] = deque(maxlen=max_samples)

    def add(self, sample: WindowSample) -> None:
        self.samples.append(sample)
        horizon = sample.t - self.window_s
        # Keep one sample at or before the horizon so the window is covered in full.
        while len(self.samples) > 2 and self.samples[1].t <= horizon:
            self.samples.popleft()

    def _ends(self) -> tuple[WindowSample, WindowSample] | None:
        if len(self.samples) < 2 or self.samples[-1].t <= self.samples[0].t:
            return None
        return self.samples[0], self.samples[-1]

    def rate(self, field: str) -> float:
        ends = self._ends()
        if ends is None:
            return math.nan
        a, b = ends
        va, vb = getattr(a, field), getattr(b, field)
        if va is None or vb is None:
            return math.nan
        return float(vb - va) / (b.t - a.t)

    def prompt_token_gap(self) -> float:
        """``foundation.ratios.PROMPT_TOKEN_GAP`` between the oldest and the newest samples that
        carry the upstream's counters (samples taken while the passthrough had nothing, e.g. at
        start-up, are skipped); NaN when unknown."""
        known = [
            (s.t, s.prompt_tokens, s.prefix_queries)
            for s in self.samples
            if s.prompt_tokens is not None and s.prefix_queries is not None
        ]
        if len(known) < 2 or known[-1][0] <= known[0][0]:
            return math.nan
        (t0, counted0, admitted0), (t1, counted1, admitted1) = known[0], known[-1]
        rates = {
            "prompt_tokens_counted_rate": (counted1 - counted0) / (t1 - t0),
            "prompt_tokens_admitted_rate": (admitted1 - admitted0) / (t1 - t0),
        }
        return _nan_if_unknown(PROMPT_TOKEN_GAP.value(rates))

    def latest_waiting(self) -> float | None:
        return self.samples[-1].waiting if self.samples else None


class PolicyCollector(Collector):
    """Yields the retrywatch families fresh from the policy and the window on every scrape."""

    def __init__(
        self,
        policy: Policy,
        window: SlidingWindow,
        capacity: float | None,
        upstream_up: Callable[[], bool],
        deadlines: DeadlineLearner | None = None,
        deadline_stated: bool = False,
    ) -> None:
        self.policy = policy
        self.window = window
        self.capacity = capacity
        self.upstream_up = upstream_up
        self.deadlines = deadlines if deadlines is not None else DeadlineLearner()
        self.deadline_stated = deadline_stated

    def collect(self) -> Iterator[Metric]:
        c = self.policy.counters
        attempts = CounterMetricFamily(_base(mn.ATTEMPTS), "Attempts received, by kind.", labels=["kind"])
        for kind in AttemptKind:
            attempts.add_metric([kind.value], c.attempts[kind])
        yield attempts
        yield CounterMetricFamily(
            _base(mn.ATTEMPTS_ATTACHED), "Attempts attached to a live execution.", value=c.attached
        )
        shed = CounterMetricFamily(
            _base(mn.ATTEMPTS_SHED), "Attempts shed before the engine.", labels=["reason"]
        )
        for reason in ShedReason:
            shed.add_metric([reason.value], c.shed[reason])
        yield shed
        yield CounterMetricFamily(_base(mn.EXECUTIONS_CREATED), "Executions created.", value=c.created)
        yield CounterMetricFamily(
            _base(mn.EXECUTIONS_DISPATCHED), "Executions sent to the engine.", value=c.dispatched
        )
        finished = CounterMetricFamily(
            _base(mn.EXECUTIONS_FINISHED), "Executions finished, by fate.", labels=["fate"]
        )
        for fate in Fate:
            finished.add_metric([fate.value], c.finished[fate])
        yield finished
        delivered = CounterMetricFamily(
            _base(mn.CALLS_DELIVERED), "Calls delivered in full, by deadline.", labels=["within_deadline"]
        )
        for label in mn.DELIVERY_LABELS:
            delivered.add_metric([label], c.delivered[label == "true"])
        yield delivered
        if self.policy.deadline_s is not None:  # without a deadline no call can miss it: no series
            yield CounterMetricFamily(
                _base(mn.CALLS_MISSED_DEADLINE),
                "Calls whose first attempt's deadline passed before they were delivered.",
                value=c.missed_deadline,
            )
        yield CounterMetricFamily(
            _base(mn.CALLS_FORGOTTEN),
            "Calls forgotten undelivered before their deadline passed, the memory at its bound.",
            value=c.calls_forgotten,
        )
        yield CounterMetricFamily(
            _base(mn.DEPARTURES_EVICTED),
            "Departures without a call id forgotten before their time, the memory at its bound.",
            value=self.policy.departures.evicted,
        )

        g = self.policy.gauges()
        yield GaugeMetricFamily(mn.EXECUTIONS_LIVE, "Executions in the engine.", value=g.executions_live)
        yield GaugeMetricFamily(
            mn.EXECUTIONS_QUEUED, "Executions in the proxy queue.", value=g.executions_queued
        )
        yield GaugeMetricFamily(mn.SUBSCRIBERS, "Attempts waiting for an execution.", value=g.subscribers)
        capacity = self.capacity if self.capacity is not None else math.nan
        yield GaugeMetricFamily(mn.CAPACITY, "Engine capacity Ĉ in calls/s (--capacity).", value=capacity)
        yield from self._deadline_families()
        yield GaugeMetricFamily(
            mn.UPSTREAM_UP,
            "1 if the upstream answered its last probe.",
            value=1.0 if self.upstream_up() else 0.0,
        )

        w = self.window
        creation = w.rate("created")
        attempt_rate = w.rate("attempts")
        yield GaugeMetricFamily(
            mn.EXECUTION_CREATION_RATE, "Executions created per second over the window.", value=creation
        )
        yield GaugeMetricFamily(mn.ATTEMPT_RATE, "Attempts per second over the window.", value=attempt_rate)
        # The ratios are the detector's (foundation.ratios), over this window's rates.
        signals = {
            "execution_creation_rate": _none_if_nan(creation),
            "attempt_rate": _none_if_nan(attempt_rate),
            "capacity": self.capacity,
            "deadline": self.policy.deadline_s,
            "vllm_waiting": w.latest_waiting(),
        }
        ratio = _nan_if_unknown(CREATION_CAPACITY_RATIO.value(signals))
        yield GaugeMetricFamily(mn.CREATION_CAPACITY_RATIO, CREATION_CAPACITY_RATIO.help, value=ratio)
        littles = _nan_if_unknown(WAITING_LITTLES_LAW_RATIO.value(signals))
        yield GaugeMetricFamily(mn.WAITING_LITTLES_LAW_RATIO, WAITING_LITTLES_LAW_RATIO.help, value=littles)
        yield GaugeMetricFamily(
            mn.PROMPT_TOKEN_GAP_RATIO,
            "Share of admitted prompt tokens vLLM's counter misses, over the window.",
            value=w.prompt_token_gap(),
        )

    def _deadline_families(self) -> Iterator[Metric]:
        """The deadline in force, where it comes from, and each client class's learned one."""
        deadline = self.policy.deadline_s
        yield GaugeMetricFamily(
            mn.CLIENT_DEADLINE,
            "The clients' deadline on an attempt in force: stated (--deadline), else learned.",
            value=_nan_if_unknown(deadline),
        )
        if self.deadline_stated:
            source = mn.DEADLINE_STATED
        else:
            source = mn.DEADLINE_UNKNOWN if deadline is None else mn.DEADLINE_LEARNED
        sources = GaugeMetricFamily(
            mn.CLIENT_DEADLINE_SOURCE, "1 on where the deadline in force comes from.", labels=["source"]
        )
        for name in mn.DEADLINE_SOURCES:
            sources.add_metric([name], 1.0 if name == source else 0.0)
        yield sources
        classes = self.deadlines.classes()
        learned = GaugeMetricFamily(
            mn.CLIENT_DEADLINE_LEARNED,
            "Each client class's deadline learned from abandon ages, most abandons first (until they "
            "name one, from the timeouts clients declare, with no abandons); NaN: none.",
            labels=["class"],
        )
        abandons = GaugeMetricFamily(
            mn.CLIENT_DEADLINE_ABANDONS,
            "The recent abandons each learned client class's deadline rests on.",
            labels=["class"],
        )
        for i, label in enumerate(mn.DEADLINE_CLASSES):
            found = classes[i] if i < len(classes) else None
            learned.add_metric([label], math.nan if found is None else found.deadline_s)
            abandons.add_metric([label], 0.0 if found is None else float(found.abandons))
        yield learned
        yield abandons


class UpstreamFaultsCollector(Collector):
    """``retrywatch_upstream_faults_total``: what the upstream did that HTTP does not allow and
    the proxy guarded against (``exporter.upstream``), by kind."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(mn.UPSTREAM_FAULT_KINDS, 0)

    def collect(self) -> Iterator[Metric]:
        faults = CounterMetricFamily(
            _base(mn.UPSTREAM_FAULTS),
            "Faults of the upstream's the proxy guarded against (connection closed), by kind.",
            labels=["kind"],
        )
        for kind, count in self.counts.items():
            faults.add_metric([kind], count)
        yield faults


class ProxyMetrics:
    """Everything ``/metrics`` serves, on a registry of its own."""

    def __init__(
        self,
        policy: Policy,
        window_s: float,
        capacity: float | None,
        max_staleness_s: float = 15.0,
        upstream_name: str = "the upstream",
        deadline_stated: bool | None = None,
    ) -> None:
        """``deadline_stated``: whether the policy's deadline is the operator's (default: whether
        the policy has one now); where it is not, the proxy sets the learned one on the policy."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = SlidingWindow(window_s)
        self.upstream_name = upstream_name  # for the log: its credentials masked
        self._upstream_up: bool | None = None  # None: not known yet
        self.max_staleness_s = max_staleness_s
        self.upstream_text = ""  # last good upstream exposition
        self.upstream_vllm: dict[str, float] = {}  # its window families, scanned once per fetch
        self.upstream_good_at = -math.inf  # when it was fetched
        self.upstream_fetched_at = -math.inf  # when the last fetch ended, good or not
        # The last upstream text read by ``digest`` and what it found (its check's verdict and the
        # text to pass through); the reading of a text in progress, if any.
        self._digested: tuple[str, Digest] = ("", Digest(True, "", 0))
        self._digesting: tuple[str, asyncio.Task[Digest]] | None = None
        self._upstream_text_usable = True
        self._upstream_own_families = False  # the upstream's text carries retrywatch_ families
        self.deadlines = DeadlineLearner()
        stated = policy.deadline_s is not None if deadline_stated is None else deadline_stated
        self.collector = PolicyCollector(
            policy, self.window, capacity, lambda: self.upstream_up, self.deadlines, stated
        )
        self.registry.register(self.collector)
        self.ttft = Histogram(
            _base(mn.TIME_TO_FIRST_TOKEN),
            "Seconds from an execution's creation to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.attempt_duration = Histogram(
            _base(mn.ATTEMPT_DURATION),
            "Seconds from an attempt's arrival to its end, by outcome.",
            labelnames=["outcome"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._duration_children = {o: self.attempt_duration.labels(outcome=o) for o in mn.ATTEMPT_OUTCOMES}
        self.policy = policy
        self.faults = UpstreamFaultsCollector()
        self.registry.register(self.faults)

    def upstream_fault(self, kind: str) -> None:
        """Count one fault of the upstream's (``exporter.upstream`` logs it)."""
        self.faults.counts[kind] += 1

    @property
    def upstream_up(self) -> bool:
        return bool(self._upstream_up)

    @upstream_up.setter
    def upstream_up(self, up: bool) -> None:
        """One warning per change (down, back up), not per failure; a first success is silent."""
        before = self._upstream_up
        if up == before:
            return
        self._upstream_up = up
        if not up:
            log.warning("upstream %s is down: no answer from it", self.upstream_name)
        elif before is not None:
            log.warning("upstream %s is back up", self.upstream_name)

    def observe_attempt(self, outcome: str, duration_s: float) -> None:
        self._duration_children[outcome].observe(duration_s)
        if outcome == "disconnected":
            self.deadlines.observe(duration_s)

    def upstream_fetched(self, now: float, text: str, vllm: dict[str, float] | None = None) -> None:
        """The upstream answered its probe (``text``: its exposition, "" if not passed through;
        ``vllm``: its window families, ``scan_vllm`` of it, scanned here unless given: the proxy
        scans in slices, ``scan_vllm_sliced``)."""
        self.upstream_up = True
        self.upstream_text = text
        self.upstream_vllm = (scan_vllm(text) if text else {}) if vllm is None else vllm
        self.upstream_good_at = self.upstream_fetched_at = now

    def upstream_failed(self, now: float) -> None:
        """The probe failed; the last good text is kept until it is ``max_staleness_s`` old."""
        self.upstream_up = False
        self.upstream_fetched_at = now

    def _upstream_fresh(self, now: float) -> bool:
        return now - self.upstream_good_at <= self.max_staleness_s

    async def digest_upstream_text(self) -> None:
        """Read the current upstream text for the passthrough (``digest``) in slices, letting the
        event loop run between them, unless it was read already; scrapes that arrive meanwhile
        wait for the same reading."""
        text = self.upstream_text
        if text is self._digested[0]:
            return
        if self._digesting is None or self._digesting[0] is not text:
            self._digesting = (text, asyncio.ensure_future(digest_sliced(text)))
        task = self._digesting[1]
        found = await asyncio.shield(task)
        if self._digesting is not None and self._digesting[1] is task:
            self._digesting = None
        self._digested_as(text, found)

    def _digested_as(self, text: str, found: Digest) -> None:
        """Keep what ``digest`` found of ``text``; one warning per change of what it says."""
        self._digested = (text, found)
        if found.usable != self._upstream_text_usable:
            self._upstream_text_usable = found.usable
            if not found.usable:
                log.warning(
                    "upstream %s answered /metrics with text that is not a Prometheus exposition: "
                    "its families are left out of the proxy's /metrics",
                    self.upstream_name,
                )
        own = found.own_lines_dropped > 0
        if own != self._upstream_own_families:
            self._upstream_own_families = own
            if own:
                log.warning(
                    "upstream %s serves retrywatch_ families of its own (a proxy in front of a proxy?): "
                    "they are left out of the proxy's /metrics, which serves its own",
                    self.upstream_name,
                )

    def passthrough_text(self, now: float) -> str:
        """The last good upstream exposition, or "" once it is older than the staleness bound
        (so a dead or hung upstream shows as missing ``vllm:`` families, not as frozen values),
        or when it is not an exposition at all (``is_exposition``; one warning per change);
        without the upstream's own ``retrywatch_`` families (one warning when they appear).

        NOTE: read here, at a scrape, once per text fetched, not at each fetch: the check
        reads every byte (about 15 ns each), and the upstream is fetched every second while the
        proxy is scraped every few. The proxy reads it beforehand in slices
        (``digest_upstream_text``); a text not read yet is read here at once."""
        if not self._upstream_fresh(now):
            return ""
        text = self.upstream_text
        if text is not self._digested[0]:
            self._digested_as(text, digest(text))
        found = self._digested[1]
        return found.passthrough if found.usable else ""

    def sample(self, now: float) -> None:
        """Take one window sample (on a 1-s timer and at scrape time), once the calls whose
        deadline has passed are counted."""
        self.policy.sweep_deadlines(now)
        vllm = self.upstream_vllm if self.upstream_text and self._upstream_fresh(now) else {}
        self.window.add(window_sample(now, self.policy.counters, vllm))

    def exposition(self, passthrough: bool, now: float) -> bytes:
        ours = generate_latest(self.registry)
        text = self.passthrough_text(now) if passthrough else ""
        if not text:
            return ours
        return ours + (text if text.endswith("\n") else text + "\n").encode()
