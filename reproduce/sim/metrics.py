"""Metrics snapshots of a simulated run, with exactly the names and labels of a real scrape.

The proxy's side is produced by the real proxy's own collector (``exporter.metrics``): the
policy core's counters and gauges, Ĉ, the deadline, and the derived gauges over the same sliding
window, fed at every snapshot as the proxy feeds it at every scrape. The engine's side is the
engine model's ``metrics_samples`` (vLLM's names and counting rules), passed through as the proxy
passes vLLM's through, histograms included (those the series format keeps:
``foundation.vllmbuckets.SERIES_HISTOGRAMS``); the proxy's own histograms are left out, as a
recorded series leaves them out.
"""

from __future__ import annotations

from collections.abc import Callable

from exporter.metrics import WINDOW_VLLM_FAMILIES, PolicyCollector, SlidingWindow, window_sample
from exporter.policy import Policy
from foundation.timeseries import Sample, Snapshot

__all__ = ["PROXY_WINDOW_S", "Scraper"]

PROXY_WINDOW_S = 60.0  # the proxy's default window for its derived gauges, at the study's scale
_WINDOW = frozenset(WINDOW_VLLM_FAMILIES)


class Scraper:
    """Takes the snapshots of one run; ``window_s`` is the (scaled) derived-gauge window."""

    def __init__(
        self,
        policy: Policy,
        engine_samples: Callable[[], list[Sample]],
        *,
        capacity: float,
        window_s: float = PROXY_WINDOW_S,
    ) -> None:
        self.policy = policy
        self.engine_samples = engine_samples
        self.window = SlidingWindow(window_s)
        # the run's proxy is given the clients' deadline (the plan's), as the study's was: stated
        stated = policy.deadline_s is not None
        self.collector = PolicyCollector(policy, self.window, capacity, lambda: True, deadline_stated=stated)

    def snapshot(self, t: float) -> Snapshot:
        """One scrape at simulated time ``t``: the proxy's series, then the engine's passthrough."""
        self.policy.sweep_deadlines(t)  # as the proxy does before each scrape
        engine = self.engine_samples()
        totals: dict[str, float] = {}
        # (filtered first: most of the engine's samples are histogram buckets)
        for name, _, value in [s for s in engine if s[0] in _WINDOW]:
            totals[name] = totals.get(name, 0.0) + value
        self.window.add(window_sample(t, self.policy.counters, totals))
        samples: list[Sample] = [
            (s.name, dict(s.labels), float(s.value))
            for family in self.collector.collect()
            for s in family.samples
        ]
        samples.extend(engine)
        return Snapshot(t, samples)
