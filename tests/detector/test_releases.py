"""Every vLLM release family through the Python detector: a healthy steady state, exported as the
family serves it, evaluates every vLLM-tier signal the family's series support (older names read
where the new one is absent, never both), and every alert ``retrywatch doctor`` calls ok evaluates."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from detector.doctor import Endpoint, diagnose
from detector.needs import Selector, signal_needs
from detector.signals import (
    DEFAULT_DEADLINE_S,
    VLLM_DEADLINE_LE,
    SignalConfig,
    SignalEngine,
    SignalFrame,
    tier_signals,
)
from detector.thresholds import ALERTS, AnyOf, Cmp, Condition
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, parse_exposition
from foundation.vllmbuckets import le_label
from foundation.vllmreleases import (
    ALIASES,
    FAMILIES,
    SAMPLE_ALIASES,
    WAITING_DEFERRED,
    WAITING_FOR_CAPACITY,
    ReleaseFamily,
    canonical_name,
)

MAX_MODEL_LEN = 2048
CAPACITY = 4.0  # calls/s, stated
STEP_S = 5.0
SCRAPES = 80  # 400 s: every window of the vLLM tier but the learned Ĉ's
FINISHED_PER_STEP = 10  # 2 requests/s
PROMPT = 100  # tokens per request
OUTPUT = 50
E2E_S = 3.0  # every request finishes in 3 s, in time for the 120-s default deadline
WAITING, RUNNING = 3.0, 6.0
#: Of the waiting requests, those vLLM defers (0.20 on: a KV transfer in flight, a grammar compiling,
#: the LoRA budget): not waiting for capacity, so no part of the queues the tiers read.
DEFERRED = 1.0


def _scrapes(family: ReleaseFamily) -> list[Snapshot]:
    """One vLLM of ``family`` serving 2 requests/s in steady state, scraped every 5 s: every
    series it serves (its deprecated names beside, as it serves them), one engine, one model."""
    registry = CollectorRegistry()
    counters: list[tuple[str, Any]] = []
    gauges: list[tuple[float, Any]] = []
    histograms: list[tuple[str, Any]] = []
    series = [*((c, s) for c, s in family.series.items() if s is not None), *family.deprecated.items()]
    level = {mn.VLLM_NUM_WAITING: WAITING, mn.VLLM_NUM_RUNNING: RUNNING, mn.VLLM_KV_CACHE_USAGE: 0.4}
    # vLLM's waiting queue by reason: the two parts of the whole (vllmreleases' WAITING_* facts)
    by_reason = {WAITING_FOR_CAPACITY: WAITING - DEFERRED, WAITING_DEFERRED: DEFERRED}
    for canonical, s in series:
        label_values = {"engine": "0", "model_name": "m", "finished_reason": "stop"}
        label_values["reason"] = "max_num_queued_reqs"
        values = [label_values[lb] for lb in s.labels]
        if s.kind == "counter":
            counters.append((canonical, Counter(s.name, "help", s.labels, registry=registry).labels(*values)))
        elif canonical == mn.VLLM_NUM_WAITING_BY_REASON:
            gauge = Gauge(s.name, "help", s.labels, registry=registry)
            for reason, value in by_reason.items():
                label_values["reason"] = reason
                gauges.append((value, gauge.labels(*(label_values[lb] for lb in s.labels))))
        elif s.kind == "gauge":
            child = Gauge(s.name, "help", s.labels, registry=registry).labels(*values)
            gauges.append((level.get(canonical, 1.0), child))
        else:
            h = Histogram(s.name, "help", s.labels, registry=registry, buckets=s.bounds(MAX_MODEL_LEN))
            histograms.append((canonical, h.labels(*values)))
    per_request = {
        mn.VLLM_PROMPT_TOKENS: PROMPT,
        mn.VLLM_PREFIX_CACHE_QUERIES: PROMPT,
        mn.VLLM_PREFIX_CACHE_HITS: PROMPT / 4,
        mn.VLLM_GENERATION_TOKENS: OUTPUT,
        mn.VLLM_REQUEST_SUCCESS: 1,
        mn.VLLM_NUM_PREEMPTIONS: 0,
        mn.VLLM_ADMISSION_REJECTIONS: 0,
    }
    observed = {
        mn.VLLM_QUEUE_TIME: 0.5,
        mn.VLLM_TTFT: 0.6,
        mn.VLLM_E2E_LATENCY: E2E_S,
        mn.VLLM_PREFILL_TIME: 0.1,
        mn.VLLM_DECODE_TIME: 2.4,
        mn.VLLM_INTER_TOKEN_LATENCY: 0.05,
        mn.VLLM_REQUEST_PROMPT_TOKENS: PROMPT,
        mn.VLLM_REQUEST_GENERATION_TOKENS: OUTPUT,
    }
    snapshots = []
    for i in range(SCRAPES):
        if i:
            for name, c in counters:
                c.inc(per_request[name] * FINISHED_PER_STEP)
            for name, h in histograms:
                for _ in range(FINISHED_PER_STEP):
                    h.observe(observed[name])
        for value, g in gauges:
            g.set(value)
        samples = parse_exposition(generate_latest(registry).decode(), keep_histograms=True)
        snapshots.append(Snapshot(t=i * STEP_S, samples=[*samples, ("up", {}, 1.0)]))
    return snapshots


def _served(family: ReleaseFamily) -> dict[str, list[dict[str, str]]]:
    """Each canonical sample name ``family`` serves, under whatever name (the facts, not the
    rules' aliases) -> the label sets it is read with (a bucket's ``le``)."""
    out: dict[str, list[dict[str, str]]] = {"up": [{}]}
    for canonical, s in family.series.items():
        if s is None:
            continue
        for name in replace(s, name=canonical).sample_names():
            out[name] = [{}]
            if name.endswith("_bucket"):
                out[name] = [{"le": le} for le in (*map(le_label, s.bounds(MAX_MODEL_LEN)), "+Inf")]
    return out


def supported(signal: str, family: ReleaseFamily) -> bool:
    """Whether one of ``signal``'s alternatives reads only series ``family`` serves (Ĉ and the
    deadline as stated: the e2e bucket read at the default deadline's)."""
    served = _served(family)
    bucket = f"{mn.VLLM_E2E_LATENCY}_bucket"
    for alternative in signal_needs(signal):
        selectors = [Selector.parse(series) for series in alternative]
        at_deadline = Selector(bucket, (("le", "=", VLLM_DEADLINE_LE),))
        selectors = [at_deadline if s.name == bucket else s for s in selectors]
        if all(
            sel.name in (mn.CAPACITY, mn.CLIENT_DEADLINE)
            or any(sel.matches(sel.name, lb) for lb in served.get(sel.name, ()))
            for sel in selectors
        ):
            return True
    return False


def _can_evaluate(cond: Condition, family: ReleaseFamily) -> bool:
    if isinstance(cond, Cmp):
        return supported(cond.signal, family)
    hold = [_can_evaluate(term, family) for term in cond.terms]
    return any(hold) if isinstance(cond, AnyOf) else all(hold)


def evaluates(cond: Condition, values: dict[str, float | None]) -> bool:
    if isinstance(cond, Cmp):
        value = values.get(cond.signal)
        return value is not None and not math.isnan(value)
    hold = [evaluates(term, values) for term in cond.terms]
    return any(hold) if isinstance(cond, AnyOf) else all(hold)


def _frame(family: ReleaseFamily) -> tuple[SignalFrame, list[Snapshot]]:
    snapshots = _scrapes(family)
    engine = SignalEngine(SignalConfig(capacity=CAPACITY))
    for snap in snapshots:
        engine.add(snap, "vllm-0")
    (frame,) = engine.compute(snapshots[-1].t)
    return frame, snapshots


VLLM_SIGNALS = tuple(s.name for s in tier_signals("vllm"))


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_vllm_tier_signal_the_family_supports_evaluates_once(family: ReleaseFamily) -> None:
    frame, _ = _frame(family)
    values = frame.values
    for signal in VLLM_SIGNALS:
        if supported(signal, family):
            assert values[signal] is not None, signal
    # the steady state's rates, whichever name the family serves them under, and never doubled
    # where it serves an old name beside the new one
    splits = family.series[mn.VLLM_NUM_WAITING_BY_REASON] is not None
    expected = {
        "vllm_finish_rate": FINISHED_PER_STEP / STEP_S,
        "vllm_e2e_finish_rate": FINISHED_PER_STEP / STEP_S,
        "vllm_in_time_rate": FINISHED_PER_STEP / STEP_S,
        "vllm_admitted_tokens_rate": PROMPT * FINISHED_PER_STEP / STEP_S,
        "vllm_finished_prompt_tokens_rate": PROMPT * FINISHED_PER_STEP / STEP_S,
        # the deferred requests not counted where vLLM tells them apart
        "vllm_waiting_requests": WAITING - DEFERRED if splits else WAITING,
        "vllm_running_requests": RUNNING,
        "vllm_unfinished_fraction": 0.0,
        "vllm_late_fraction": 0.0,
        "vllm_delivery_error_ratio_short": 0.0,
    }
    for signal, value in expected.items():
        if supported(signal, family):
            assert values[signal] == pytest.approx(value), signal
    # nothing missing for the tier's NoData where the family serves its needed series
    if supported("vllm_data_missing", family) and family.series[mn.VLLM_E2E_LATENCY] is not None:
        assert values["vllm_data_missing"] == 0.0


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_vllm_tier_alert_the_doctor_calls_ok_evaluates(family: ReleaseFamily) -> None:
    frame, snapshots = _frame(family)
    report = diagnose(
        endpoints=(Endpoint("vLLM", "http://vllm:8000/metrics"),),
        vllm_samples=[s for s in snapshots[-1].samples if s[0] != "up"],
        proxy_samples=None,
        prometheus=None,
        capacity=CAPACITY,
        deadline=DEFAULT_DEADLINE_S,  # the engine's assumed one
    )
    assert report.release == family.name
    verdicts = {a.name: a for a in report.alerts}
    rules = [rule for rule in ALERTS if rule.tier == "vllm"]
    assert set(verdicts) == {rule.name for rule in rules}
    for rule in rules:
        verdict = verdicts[rule.name]
        # the doctor, reading the exposition, agrees with the family's facts
        can = _can_evaluate(rule.condition, family)
        assert (verdict.status in ("ok", "approximate", "partial")) == can, (rule.name, verdict)
        assert (verdict.status == "ok") <= evaluates(rule.condition, frame.values), rule.name


def test_the_aliases_are_the_older_names_vllm_served() -> None:
    assert dict(ALIASES) == {
        mn.VLLM_PREFIX_CACHE_QUERIES: ("vllm:gpu_prefix_cache_queries_total",),
        mn.VLLM_PREFIX_CACHE_HITS: ("vllm:gpu_prefix_cache_hits_total",),
        mn.VLLM_KV_CACHE_USAGE: ("vllm:gpu_cache_usage_perc",),
        mn.VLLM_INTER_TOKEN_LATENCY: ("vllm:time_per_output_token_seconds",),
    }
    assert canonical_name("vllm:time_per_output_token_seconds_sum") == f"{mn.VLLM_INTER_TOKEN_LATENCY}_sum"
    assert "vllm:gpu_cache_usage_perc_sum" not in SAMPLE_ALIASES  # a gauge has no _sum
    assert canonical_name(mn.VLLM_NUM_WAITING) == mn.VLLM_NUM_WAITING
