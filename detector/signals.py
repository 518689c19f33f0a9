"""Signals: what the detector derives from raw counters, per engine, over sliding windows.

Owns the signal names and units, their PromQL recording rules (rendered into
``rules/retrywatch.rules.yml`` by ``rules/generate.py``), and their Python computation from a
sequence of :class:`foundation.timeseries.Snapshot` s.

Engines are grouped by the ``instance`` label, which every source adds (the scraped URL, the
Prometheus target, or the replayed run's slug): the proxy's series carry no engine label, so
``engine`` and ``model`` come from vLLM's ``engine`` / ``model_name`` labels within the same
instance (one vLLM per proxy instance; a data-parallel vLLM's engines are summed, and named
``engine="all"``).

NOTE: rates follow Prometheus' ``rate()`` over a range that includes both ends ([now-W, now]):
the increase between the first and last sample in the window (counter resets handled) divided
by the time between them; gauges take the latest sample within the lookback; ``deriv`` is the
least-squares slope. With samples on the evaluation grid the two evaluators agree exactly.
"""

from __future__ import annotations

import bisect
import logging
import math
import typing
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from detector import capacity as predictor
from foundation import metricnames as mn
from foundation.ratios import RATIOS, Ratio
from foundation.timeseries import Sample, Snapshot
from foundation.vllmbuckets import REQUEST_LATENCY_BUCKETS, le_label
from foundation.vllmreleases import SAMPLE_ALIASES, WAITING_FOR_CAPACITY

log = logging.getLogger("retrywatch.detector")


@dataclass(frozen=True)
class Windows:
    """The windows signals are computed over (seconds); PromQL ranges use the same values."""

    rate_s: float = 60.0
    prompt_gap_s: float = 300.0
    capacity_estimate_s: float = 3600.0
    gauge_lookback_s: float = 300.0  # like Prometheus' lookback delta
    # The delivery SLO's two windows (multiwindow burn-rate alerting, as in the SRE workbook):
    # the short one says the burn is still going on, the long one that it is not a blip.
    slo_short_s: float = 60.0
    slo_long_s: float = 300.0
    # Ĉ predicted below saturation (``detector.capacity``): the fit's window and its sub-windows
    predict_s: float = predictor.PREDICT_WINDOW_S
    predict_part_s: float = predictor.PART_S

    def scaled(self, time_scale: float) -> Windows:
        """Every window divided by ``time_scale`` (K, checked by whoever holds it: a run's plan,
        a command's option); K = 1: itself."""
        if time_scale == 1.0:
            return self
        return replace(self, **{f.name: getattr(self, f.name) / time_scale for f in fields(self)})


WINDOWS = Windows()

#: The delivery objective: the share of calls to deliver within the clients' deadline, the
#: protocol's recovery rule (docs/protocol.md §6: a window delivers at least 98 % of its calls
#: within the deadline). The error budget is 1 − objective; a burn rate of 1 spends it exactly.
DELIVERY_OBJECTIVE = 0.98


def check_objective(objective: float) -> float:
    """Validate a delivery objective: a share strictly between 0 and 1."""
    o = float(objective)
    if not (math.isfinite(o) and 0.0 < o < 1.0):
        raise ValueError(
            f"the delivery objective must be a share strictly between 0 and 1, got {objective!r}"
        )
    return o


# What a signal (and an alert reading it) needs: vLLM's own series and two numbers the operator
# states ("vllm": no proxy in the path), or the proxy's series as well ("proxy"). Each tier's
# signals and alerts are one rule group that reads nothing of the other's.
Tier = Literal["vllm", "proxy"]
TIERS: tuple[Tier, ...] = typing.get_args(Tier)
#: Prometheus' scrape job of each tier's targets: the proxies, or vLLM itself (its NoData reads
#: that job's ``up``).
PROMETHEUS_JOBS: dict[Tier, str] = {"proxy": "retrywatch", "vllm": "vllm"}
PROMETHEUS_JOB = PROMETHEUS_JOBS["proxy"]
#: The study's clients' deadline (a common client timeout): what a replay assumes where no series
#: states one (``SignalConfig.assumed_deadline``), what ``retrywatch mixin --deadline`` and
#: ``rules.stated`` state by default, and the deadlines the vLLM tier's held alerts' ``for`` s are
#: counted in. The rendered rules assume none (``vllm_deadline``: the series, else absent), nor
#: does ``retrywatch detect``: stated, else the proxy's, else missing. It must be one of vLLM's
#: latency buckets, so that a deadline stated by default is read off the e2e histogram exactly.
DEFAULT_DEADLINE_S = 120.0
ENGINE_INFO_RECORD = "instance:retrywatch_engine:info"
VLLM_ENGINE_INFO_RECORD = "instance:retrywatch_vllmtier_engine:info"
#: The ``engine`` label of an instance whose vLLM runs several engines (data parallel).
ALL_ENGINES = "all"
#: Prometheus' ``up`` series: a sample of it with a value other than 0 names an instance whose
#: target answered (the scrape source adds one per answer), with or without the raw series.
UP = "up"
#: Engines one detector follows at most (``retrywatch detect --max-engines``).
MAX_INSTANCES = 256
#: Counter series whose last value one engine's history keeps (those the signals read; the
#: least recently seen goes first): a vLLM engine has about 30 (the e2e histogram's buckets most
#: of them), so room for 100 data-parallel engines; label sets that churn (a new ``model_name``
#: every scrape) must not grow it without bound.
MAX_COUNTER_SERIES = 4096

# --- raw quantities: sums of samples per instance ---------------------------------------

# key -> (metric name, required label or None)
RAW: dict[str, tuple[str, tuple[str, str] | None]] = {
    "attempts_first": (mn.ATTEMPTS, ("kind", "first")),
    "attempts_retry": (mn.ATTEMPTS, ("kind", "retry")),
    "attached": (mn.ATTEMPTS_ATTACHED, None),
    "shed": (mn.ATTEMPTS_SHED, None),
    "created": (mn.EXECUTIONS_CREATED, None),
    "dispatched": (mn.EXECUTIONS_DISPATCHED, None),
    **{f"finished_{fate}": (mn.EXECUTIONS_FINISHED, ("fate", fate)) for fate in mn.FATES},
    "delivered_within": (mn.CALLS_DELIVERED, ("within_deadline", "true")),
    "delivered_late": (mn.CALLS_DELIVERED, ("within_deadline", "false")),
    "missed_deadline": (mn.CALLS_MISSED_DEADLINE, None),
    "waiting": (mn.VLLM_NUM_WAITING, None),
    # the part of it waiting for capacity, not deferred (vLLM 0.20 on): what the queues read
    "waiting_for_capacity": (mn.VLLM_NUM_WAITING_BY_REASON, ("reason", WAITING_FOR_CAPACITY)),
    "running": (mn.VLLM_NUM_RUNNING, None),
    "queued": (mn.EXECUTIONS_QUEUED, None),
    "capacity_gauge": (mn.CAPACITY, None),
    "deadline_gauge": (mn.CLIENT_DEADLINE, None),
    # where the proxy's deadline comes from, and the abandons a learned one rests on
    "deadline_stated": (mn.CLIENT_DEADLINE_SOURCE, ("source", mn.DEADLINE_STATED)),
    "deadline_learned": (mn.CLIENT_DEADLINE_SOURCE, ("source", mn.DEADLINE_LEARNED)),
    "deadline_abandons": (mn.CLIENT_DEADLINE_ABANDONS, ("class", mn.DEADLINE_CLASSES[0])),
    "prompt_tokens": (mn.VLLM_PROMPT_TOKENS, None),
    "prefix_queries": (mn.VLLM_PREFIX_CACHE_QUERIES, None),
    "upstream_up": (mn.UPSTREAM_UP, None),
    # vLLM's own series that only the vLLM tier reads (it reads the gauges and prefix-cache queries
    # above too): every finish, the e2e latency histogram's count and its bucket at each bound
    # (the deadline's is chosen when it is known), the queue time's sum and count, and the prompt
    # tokens of finished requests.
    "vllm_finished": (mn.VLLM_REQUEST_SUCCESS, None),
    "vllm_e2e_count": (f"{mn.VLLM_E2E_LATENCY}_count", None),
    **{
        f"vllm_e2e_le_{le_label(bound)}": (f"{mn.VLLM_E2E_LATENCY}_bucket", ("le", le_label(bound)))
        for bound in REQUEST_LATENCY_BUCKETS
    },
    "vllm_queue_time_sum": (f"{mn.VLLM_QUEUE_TIME}_sum", None),
    "vllm_queue_time_count": (f"{mn.VLLM_QUEUE_TIME}_count", None),
    "vllm_finished_prompt_tokens": (f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum", None),
    # the requests vLLM's queue cap refused (vLLM 0.32 on; every reason): an older vLLM has none,
    # and the signals that read it are absent there, never missing data
    "vllm_refused": (mn.VLLM_ADMISSION_REJECTIONS, None),
    # what Ĉ's prediction below saturation reads (``detector.capacity``)
    **{f"predictor {name}": (name, None) for name in predictor.PREDICTOR_SERIES},
}
RAW_KEYS: tuple[str, ...] = tuple(RAW)
_RAW_INDEX = {key: i for i, key in enumerate(RAW_KEYS)}
_BY_NAME: dict[str, list[tuple[int, tuple[str, str] | None]]] = {}
for _i, (_key, (_name, _flt)) in enumerate(RAW.items()):
    _BY_NAME.setdefault(_name, []).append((_i, _flt))

# Other names older vLLM releases serve a raw series under (``foundation.vllmreleases``: the
# ``gpu_`` prefix-cache counters and KV gauge, time per output token): alias sample name -> the
# raw name it stands for, and each raw name's aliases. Both evaluators read an alias only where
# the raw name is absent (PromQL ``rate(new[w]) or rate(old[w])``; :func:`_by_instance`).
_ALIAS_OF: dict[str, str] = {a: c for a, c in SAMPLE_ALIASES.items() if c in _BY_NAME}
_ALIASES: dict[str, tuple[str, ...]] = {
    c: tuple(a for a, of in _ALIAS_OF.items() if of == c) for c in set(_ALIAS_OF.values())
}
#: Every sample name the raw quantities are read from: their own and their aliases, and ``up``.
SERVED_NAMES: frozenset[str] = frozenset({name for name, _ in RAW.values()} | set(_ALIAS_OF) | {UP})

# counters: vLLM's and the proxy's ``_total`` s, and a histogram's buckets, count and sum
_COUNTER_IDX: tuple[int, ...] = tuple(
    i for i, key in enumerate(RAW_KEYS) if RAW[key][0].endswith(("_total", "_bucket", "_count", "_sum"))
)
_REFUSED = _RAW_INDEX["vllm_refused"]
_PREDICTOR_COLUMNS = {name: _RAW_INDEX[f"predictor {name}"] for name in predictor.PREDICTOR_SERIES}
_COUNTER_NAMES: frozenset[str] = frozenset(RAW[RAW_KEYS[i]][0] for i in _COUNTER_IDX)

# Series without which no verdict is possible (NoData fires when one is missing). The proxy
# counts missed deadlines only while it knows the deadline (its --deadline): without that counter
# the symptom alert is blind, so it is needed, as the deadline is.
NEEDED_RAW: tuple[str, ...] = ("attempts_first", "created", "waiting", "missed_deadline")
# The vLLM tier's: vLLM's queue, its finishes and its e2e histogram (Ĉ and the deadline too).
NEEDED_VLLM_RAW: tuple[str, ...] = ("waiting", "vllm_finished", "vllm_e2e_count")


def deadline_bucket(deadline: float) -> float | None:
    """The e2e latency bucket that counts finishes within ``deadline``: the largest of vLLM's
    bounds at or below it (a deadline between bounds counts the finishes just under it as late);
    None below the first bound."""
    i = bisect.bisect_right(REQUEST_LATENCY_BUCKETS, deadline + 1e-9)
    return REQUEST_LATENCY_BUCKETS[i - 1] if i else None


def _seconds(x: float) -> str:
    """Seconds as a deadline is said: three significant digits, whole seconds from 1000."""
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def between_buckets(deadline: float) -> str | None:
    """None when ``deadline`` is one of vLLM's e2e bounds; else a sentence saying which bucket
    counts as in time. NOTE: the bucket at or below the deadline, deliberately: finishes just
    under the deadline count as late, so the vLLM tier's late share and error ratio err high
    (an alert a little early), never low (a loop missed)."""
    bucket = deadline_bucket(deadline)
    if bucket is not None and abs(bucket - deadline) <= 1e-9:
        return None
    if bucket is None:
        return (
            f"the deadline {_seconds(deadline)} s is below vLLM's first e2e bucket "
            f"({REQUEST_LATENCY_BUCKETS[0]:g} s): finishes in time cannot be told"
        )
    return (
        f"the deadline {_seconds(deadline)} s falls between vLLM's e2e buckets: finishes within "
        f"{bucket:g} s count as in time, those from {bucket:g} to {_seconds(deadline)} s as late"
    )


def describe_deadline(
    stated: float | None,
    exported: float | None = None,
    source: str | None = None,
    abandons: float | None = None,
    assumed: float | None = None,
) -> str:
    """How a deadline was found, for a start line or a log line: ``stated 120 s`` (the
    operator's), ``stated by the proxy 120 s``, ``learned 93 s from 57 abandons`` (or ``from the
    timeout its clients declare``, before any abandon), ``the
    proxy's 120 s`` (no source series), ``assumed 120 s`` or ``missing``."""
    if stated is not None:
        return f"stated {_seconds(stated)} s"
    if exported is not None:
        if source == mn.DEADLINE_STATED:
            return f"stated by the proxy {_seconds(exported)} s"
        if source == mn.DEADLINE_LEARNED:
            if not abandons:  # before any abandon: the timeout its clients' SDKs declare
                return f"learned {_seconds(exported)} s from the timeout its clients declare"
            return f"learned {_seconds(exported)} s from {int(abandons)} abandons"
        return f"the proxy's {_seconds(exported)} s"
    return "missing" if assumed is None else f"assumed {_seconds(assumed)} s"


@dataclass(frozen=True)
class SignalSpec:
    name: str
    unit: str
    help: str
    record: str  # the recording rule's name
    promql: str  # its expression
    tier: Tier = "proxy"  # the rule group it is recorded in, and what it needs


def _j(expr: str) -> str:
    """Attach engine/model labels (from vLLM's series) to a ``by (instance)`` expression."""
    return f"({expr}) * on (instance) group_left (engine, model) {ENGINE_INFO_RECORD}"


def _rates(metric: str, window: str, selector: str = "") -> str:
    """``rate(metric[window])``, or where a vLLM release serves ``metric`` under another name too,
    the rate of the first name served (``or`` matches label sets, the metric name left out)."""
    names = (metric, *_ALIASES.get(metric, ()))
    return " or ".join(f"rate({name}{selector}[{window}])" for name in names)


def _rate(metric: str, window: str, selector: str = "") -> str:
    return _j(f"sum by (instance) ({_rates(metric, window, selector)})")


def _gauge(metric: str, agg: str = "sum", flt: str = "") -> str:
    return _j(f"{agg} by (instance) ({metric}{flt})")


#: vLLM's requests waiting for capacity: where vLLM splits its waiting queue by reason (0.20 on),
#: those not deferred (``foundation.vllmreleases.WAITING_FOR_CAPACITY``), else the whole queue.
_WAITING_FOR_CAPACITY = (
    f'sum by (instance) ({mn.VLLM_NUM_WAITING_BY_REASON}{{reason="{WAITING_FOR_CAPACITY}"}})'
    f" or sum by (instance) ({mn.VLLM_NUM_WAITING})"
)
_W = f"{int(WINDOWS.rate_s)}s"
_GW = f"{int(WINDOWS.prompt_gap_s)}s"


def _r(name: str) -> str:
    return f"instance:retrywatch_{name}"


def _data_missing_promql(tier: Tier, needed: tuple[str, ...]) -> str:
    """1 where the tier's target (its job's ``up``) is down, or scraped without one of the
    ``needed`` series (raw series, or records such as Ĉ); 0 elsewhere, as the detector's
    ``data_missing`` / ``vllm_data_missing``. Only ``instance`` labels here: without vLLM's
    series there are no engine/model labels."""
    up = f'up{{job="{PROMETHEUS_JOBS[tier]}"}}'
    one = f"(count by (instance) ({up}) * 0 + 1)"
    return (
        f"(max by (instance) ({up}) == 0) + 1"
        + "".join(f" or ({one} unless on (instance) count by (instance) ({series}))" for series in needed)
        + f" or max by (instance) ({up}) * 0"
    )


_BASE_SIGNALS: tuple[SignalSpec, ...] = (
    SignalSpec(
        "attempt_rate_first",
        "1/s",
        "First attempts per second.",
        _r("attempts_first:rate1m"),
        _rate(mn.ATTEMPTS, _W, '{kind="first"}'),
    ),
    SignalSpec(
        "attempt_rate_retry",
        "1/s",
        "Retries per second.",
        _r("attempts_retry:rate1m"),
        _rate(mn.ATTEMPTS, _W, '{kind="retry"}'),
    ),
    SignalSpec("attempt_rate", "1/s", "Attempts per second.", _r("attempts:rate1m"), _rate(mn.ATTEMPTS, _W)),
    SignalSpec(
        "execution_creation_rate",
        "1/s",
        "Executions the proxy creates per second.",
        _r("executions_created:rate1m"),
        _rate(mn.EXECUTIONS_CREATED, _W),
    ),
    *(
        SignalSpec(
            f"completion_rate_{fate}",
            "1/s",
            f"Executions finished with fate {fate} per second.",
            _r(f"executions_{fate}:rate1m"),
            _rate(mn.EXECUTIONS_FINISHED, _W, f'{{fate="{fate}"}}'),
        )
        for fate in mn.FATES
    ),
    SignalSpec(
        "shed_rate",
        "1/s",
        "Attempts shed per second.",
        _r("attempts_shed:rate1m"),
        _rate(mn.ATTEMPTS_SHED, _W),
    ),
    SignalSpec(
        "attached_rate",
        "1/s",
        "Attempts attached to a live execution per second.",
        _r("attempts_attached:rate1m"),
        _rate(mn.ATTEMPTS_ATTACHED, _W),
    ),
    SignalSpec(
        "delivered_rate_within_deadline",
        "1/s",
        "Calls delivered within the deadline per second.",
        _r("calls_delivered_within_deadline:rate1m"),
        _rate(mn.CALLS_DELIVERED, _W, '{within_deadline="true"}'),
    ),
    SignalSpec(
        "delivered_rate_late",
        "1/s",
        "Calls delivered after the deadline per second.",
        _r("calls_delivered_late:rate1m"),
        _rate(mn.CALLS_DELIVERED, _W, '{within_deadline="false"}'),
    ),
    SignalSpec(
        "prompt_tokens_counted_rate",
        "tokens/s",
        "vllm:prompt_tokens_total per second (5 min).",
        _r("prompt_tokens_counted:rate5m"),
        _rate(mn.VLLM_PROMPT_TOKENS, _GW),
    ),
    SignalSpec(
        "prompt_tokens_admitted_rate",
        "tokens/s",
        "Prompt tokens admitted per second (5 min).",
        _r("prompt_tokens_admitted:rate5m"),
        _rate(mn.VLLM_PREFIX_CACHE_QUERIES, _GW),
    ),
    SignalSpec(
        "vllm_waiting",
        "executions",
        "vLLM's requests waiting for capacity (its waiting queue less those it defers, 0.20 on).",
        _r("vllm_waiting:sum"),
        _j(_WAITING_FOR_CAPACITY),
    ),
    SignalSpec(
        "vllm_running",
        "executions",
        "vLLM's running batch.",
        _r("vllm_running:sum"),
        _gauge(mn.VLLM_NUM_RUNNING),
    ),
    SignalSpec(
        "proxy_queued",
        "executions",
        "Executions waiting in the proxy's own queue.",
        _r("executions_queued:sum"),
        _gauge(mn.EXECUTIONS_QUEUED),
    ),
    SignalSpec(
        "capacity",
        "calls/s",
        "Ĉ: configured, exported by the proxy, or estimated online.",
        _r("capacity:calls_per_second"),
        # An estimate of 0 (a hung engine: its queue full, nothing finishing) is no estimate.
        _j(f"max by (instance) ({mn.CAPACITY} > 0) or ({_r('capacity_estimate:avg1h')} > 0)"),
    ),
    SignalSpec(
        "deadline",
        "s",
        "The clients' deadline on an attempt.",
        _r("client_deadline:seconds"),
        _gauge(mn.CLIENT_DEADLINE, "max", " > 0"),
    ),
)

# The derived ratios (foundation/ratios.py: one definition each) and their recording rules.
RATIO_RECORDS: dict[str, str] = {
    "prompt_token_gap": "prompt_token_gap:ratio5m",
    "executions_per_first_attempt": "executions_per_first_attempt:ratio1m",
    "creation_capacity_ratio": "creation_capacity:ratio1m",
    "completion_capacity_ratio": "completion_capacity:ratio1m",
    "waiting_littles_law_ratio": "waiting_littles_law:ratio1m",
    "queue_littles_law_ratio": "queue_littles_law:ratio1m",
    "backlog_seconds": "backlog:seconds",
    "backlog_deadline_ratio": "backlog_deadline:ratio",
    "goodput_ratio": "goodput:ratio1m",
    "orphaned_fraction": "orphaned:ratio1m",
    "cancelled_fraction": "cancelled:ratio1m",
}


def _ratio_specs() -> list[SignalSpec]:
    """One signal per derived ratio, its PromQL over the records of the signals it reads (the
    signals above, and the ratios before it)."""
    records = {spec.name: spec.record for spec in _BASE_SIGNALS}
    specs = []
    for ratio in RATIOS:
        record = _r(RATIO_RECORDS[ratio.name])
        specs.append(SignalSpec(ratio.name, ratio.unit, ratio.help, record, ratio.promql(records)))
        records[ratio.name] = record
    return specs


def _delivery_error_promql(window: str) -> str:
    """The delivery SLI's error ratio over ``window``: calls missed over calls judged (missed, or
    delivered within the deadline), both counted when they are judged (see the policy's NOTE on
    missed deadlines); absent when no call was judged in the window."""
    missed = f"sum by (instance) (rate({mn.CALLS_MISSED_DEADLINE}[{window}]))"
    good = f'sum by (instance) (rate({mn.CALLS_DELIVERED}{{within_deadline="true"}}[{window}]))'
    return _j(f"{missed} / (({missed} + {good}) > 0)")


def _range(seconds: float) -> str:
    """A PromQL range: whole hours as ``1h``, whole minutes as ``5m``, else seconds."""
    whole = int(seconds)
    if whole % 3600 == 0:
        return f"{whole // 3600}h"
    return f"{whole // 60}m" if whole % 60 == 0 else f"{whole}s"


_SLO_SHORT = _range(WINDOWS.slo_short_s)
_SLO_LONG = _range(WINDOWS.slo_long_s)


def _slo_specs() -> list[SignalSpec]:
    """The delivery SLO's error ratios and burn rates (error ratio / (1 − objective)) over its
    two windows."""
    specs = []
    for span, window in (("short", _SLO_SHORT), ("long", _SLO_LONG)):
        ratio_record = _r(f"calls_missed_deadline:ratio_rate{window}")
        specs.append(
            SignalSpec(
                f"delivery_error_ratio_{span}",
                "ratio",
                f"Share of the calls judged over {window} that missed the deadline (the SLI's errors).",
                ratio_record,
                _delivery_error_promql(window),
            )
        )
        specs.append(
            SignalSpec(
                f"delivery_burn_rate_{span}",
                "ratio",
                f"The delivery error ratio over {window} in error budgets (1 − the {DELIVERY_OBJECTIVE:.0%} "
                "objective): 1 spends the budget exactly.",
                _r(f"calls_missed_deadline:burn_rate{window}"),
                f"{ratio_record} / (1 - {DELIVERY_OBJECTIVE!r})",
            )
        )
    return specs


# --- the vLLM tier: vLLM's own series and the two numbers the operator states -------------
# Its own records (``instance:retrywatch_vllmtier_*``), joined onto its own engine-info record, so
# that its rule group reads nothing of the proxy's group (and a Prometheus scraping only vLLM
# evaluates it).


def vllm_record(name: str) -> str:
    """The name of the vLLM tier's record ``name`` (``instance:retrywatch_vllmtier_<name>``)."""
    return f"instance:retrywatch_vllmtier_{name}"


def vllm_join(expr: str) -> str:
    """:func:`_j` for the vLLM tier: engine/model labels from its own engine-info record."""
    return f"({expr}) * on (instance) group_left (engine, model) {VLLM_ENGINE_INFO_RECORD}"


def _sum_rate(metric: str, window: str, selector: str = "") -> str:
    return f"sum by (instance) ({_rates(metric, window, selector)})"


_E2E_BUCKET = f"{mn.VLLM_E2E_LATENCY}_bucket"
_E2E_COUNT = f"{mn.VLLM_E2E_LATENCY}_count"
_PROMPT_SUM = f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum"
#: How far back the vLLM tier looks for the queue cap's refusals: the window Ĉ is estimated over.
_REFUSAL_LOOKBACK = _range(WINDOWS.capacity_estimate_s)
_DEFAULT_BUCKET = deadline_bucket(DEFAULT_DEADLINE_S)
assert _DEFAULT_BUCKET == DEFAULT_DEADLINE_S, "the default deadline must be one of vLLM's latency buckets"
#: The e2e bucket of the default deadline (``le`` label): the rules choose theirs per instance
#: from the deadline in force (:data:`DEADLINE_BUCKET_RECORD`), never this one.
VLLM_DEADLINE_LE = le_label(_DEFAULT_BUCKET)
#: Ĉ predicted below saturation from vLLM's own counters: the fit of ``detector.capacity`` in
#: PromQL, recorded by the helper records of ``rules.learned`` (rules only: the detector fits in
#: Python).
CAPACITY_PREDICTED_RECORD = vllm_record("capacity_predicted:calls_per_second")
#: vLLM's e2e bucket at or below the deadline in force, labelled ``le``, valued the seconds from
#: that bound up to the deadline (``rules.learned`` records it; the detector picks the bucket
#: with :func:`deadline_bucket`). Absent without a deadline, or one below vLLM's first bound.
DEADLINE_BUCKET_RECORD = vllm_record("client_deadline_beyond_bucket:seconds")
#: The raw series each of the two records above reads (what ``detector.needs`` follows them to,
#: their PromQL being the rules'): the prediction's, as the detector's; the deadline's series.
RULES_ONLY_RECORDS: dict[str, tuple[str, ...]] = {
    CAPACITY_PREDICTED_RECORD: predictor.PREDICTOR_SERIES,
    DEADLINE_BUCKET_RECORD: (mn.CLIENT_DEADLINE,),
}


def _sum_rate_in_time(window: str) -> str:
    """Requests vLLM finished within the deadline, per second over ``window``: the e2e bucket at
    or below the deadline in force (``and on (instance, le)`` its record): absent where no
    deadline is known."""
    names = (_E2E_BUCKET, *_ALIASES.get(_E2E_BUCKET, ()))
    bucket = f"and on (instance, le) {DEADLINE_BUCKET_RECORD}"
    rates = " or ".join(f"(rate({name}[{window}]) {bucket})" for name in names)
    return f"sum by (instance) ({rates})"


_STATED_CAPACITY = f"max by (instance) ({mn.CAPACITY} > 0)"
#: Where the vLLM tier's Ĉ comes from, in order of precedence (``detector.capacity.CAPACITY_SOURCES``).
VLLM_CAPACITY_SOURCES: tuple[tuple[str, str], ...] = (
    ("stated", _STATED_CAPACITY),
    # an estimate of 0 (a hung engine: its queue full, nothing finishing) is no estimate
    ("saturated", f"({vllm_record('capacity_estimate:avg1h')} > 0)"),
    ("predicted", f"({CAPACITY_PREDICTED_RECORD} > 0)"),
)
assert tuple(name for name, _ in VLLM_CAPACITY_SOURCES) == predictor.CAPACITY_SOURCES

_VLLM_BASE_SIGNALS: tuple[SignalSpec, ...] = (
    SignalSpec(
        "vllm_finish_rate",
        "1/s",
        "Requests vLLM finished per second, whatever their finished_reason (abandoned ones are in none).",
        vllm_record("requests_finished:rate1m"),
        vllm_join(_sum_rate(mn.VLLM_REQUEST_SUCCESS, _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_e2e_finish_rate",
        "1/s",
        "Requests observed by vLLM's e2e latency histogram per second (they finished).",
        vllm_record("e2e_finished:rate1m"),
        vllm_join(_sum_rate(_E2E_COUNT, _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_in_time_rate",
        "1/s",
        "Requests vLLM finished within the deadline per second (the e2e histogram's bucket at or "
        f"below the deadline: {DEADLINE_BUCKET_RECORD}'s le); absent without a deadline.",
        vllm_record("e2e_finished_in_time:rate1m"),
        vllm_join(_sum_rate_in_time(_W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_admitted_tokens_rate",
        "tokens/s",
        "Prompt tokens vLLM admitted per second (prefix-cache queries, counted at scheduling).",
        vllm_record("prompt_tokens_admitted:rate1m"),
        vllm_join(_sum_rate(mn.VLLM_PREFIX_CACHE_QUERIES, _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_finished_prompt_tokens_rate",
        "tokens/s",
        "Prompt tokens of the requests vLLM finished per second.",
        vllm_record("prompt_tokens_finished:rate1m"),
        vllm_join(_sum_rate(_PROMPT_SUM, _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_queue_time_rate",
        "s/s",
        "Seconds finished requests spent queued, per second (the queue-time histogram's sum).",
        vllm_record("queue_time_seconds:rate1m"),
        vllm_join(_sum_rate(f"{mn.VLLM_QUEUE_TIME}_sum", _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_queue_time_finish_rate",
        "1/s",
        "Requests observed by the queue-time histogram per second.",
        vllm_record("queue_time_finished:rate1m"),
        vllm_join(_sum_rate(f"{mn.VLLM_QUEUE_TIME}_count", _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_waiting_requests",
        "requests",
        "vLLM's requests waiting for capacity (its waiting queue less those it defers, 0.20 on).",
        vllm_record("requests_waiting:sum"),
        vllm_join(_WAITING_FOR_CAPACITY),
        "vllm",
    ),
    SignalSpec(
        "vllm_running_requests",
        "requests",
        "vLLM's running batch.",
        vllm_record("requests_running:sum"),
        vllm_join(f"sum by (instance) ({mn.VLLM_NUM_RUNNING})"),
        "vllm",
    ),
    SignalSpec(
        "vllm_refusal_rate",
        "1/s",
        "Requests vLLM's queue cap (--max-num-queued-reqs) refused per second, every reason (HTTP "
        f"503; {mn.VLLM_ADMISSION_REJECTIONS}, vLLM 0.32 on: absent where vLLM does not count them).",
        vllm_record("requests_refused:rate1m"),
        vllm_join(_sum_rate(mn.VLLM_ADMISSION_REJECTIONS, _W)),
        "vllm",
    ),
    SignalSpec(
        "vllm_refused_recently",
        "bool",
        f"1 where vLLM's queue cap refused a request within the last {_REFUSAL_LOOKBACK} (its queue "
        "met the cap), else 0; absent where vLLM does not count refusals.",
        vllm_record(f"requests_refused:any{_REFUSAL_LOOKBACK}"),
        vllm_join(
            f"sum by (instance) (increase({mn.VLLM_ADMISSION_REJECTIONS}[{_REFUSAL_LOOKBACK}])) > bool 0"
        ),
        "vllm",
    ),
    SignalSpec(
        "vllm_capacity",
        "calls/s",
        "Ĉ as the vLLM tier knows it: stated (--capacity, or a series "
        f"{mn.CAPACITY}), else estimated online from vLLM's finish rate while its queue never "
        "emptied (an hour's average), else predicted below saturation from vLLM's own counters "
        f"({CAPACITY_PREDICTED_RECORD}).",
        vllm_record("capacity:calls_per_second"),
        vllm_join(" or on (instance) ".join(expr for _, expr in VLLM_CAPACITY_SOURCES)),
        "vllm",
    ),
    SignalSpec(
        "vllm_deadline",
        "s",
        f"The clients' deadline: stated (--deadline, or a series {mn.CLIENT_DEADLINE}: the stated "
        "rules', or a proxy's, stated or learned), else absent: the alerts that read it cannot "
        "evaluate, and the tier's NoData fires.",
        vllm_record("client_deadline:seconds"),
        vllm_join(f"max by (instance) ({mn.CLIENT_DEADLINE} > 0)"),
        "vllm",
    ),
)

# The vLLM tier's ratios: one definition each, evaluated in Python and rendered in PromQL.
VLLM_RATIOS: tuple[Ratio, ...] = (
    Ratio(
        "vllm_finish_capacity_ratio",
        "Requests vLLM finished per second over Ĉ.",
        ("vllm_finish_rate",),
        ("vllm_capacity",),
        guard=False,
    ),
    Ratio(
        "vllm_queue_deadline_ratio",
        "vLLM's waiting queue in deadlines of work at Ĉ: above 1, a request admitted now was queued "
        "longer than its client waits.",
        ("vllm_waiting_requests",),
        ("vllm_capacity", "vllm_deadline"),
        product=True,
        guard=False,
    ),
    Ratio(
        "vllm_occupancy_deadline_ratio",
        "vLLM's unfinished requests (waiting and running) in deadlines of work at Ĉ: about how many "
        "deadlines a request admitted now takes to finish. A queue cap Q holds it under "
        "Q / (Ĉ × deadline).",
        ("vllm_waiting_requests", "vllm_running_requests"),
        ("vllm_capacity", "vllm_deadline"),
        product=True,
        guard=False,
    ),
    Ratio(
        "vllm_late_fraction",
        "Share of the requests vLLM finished that took longer than the deadline (e2e histogram).",
        ("vllm_in_time_rate",),
        ("vllm_e2e_finish_rate",),
        complement=True,
    ),
    Ratio(
        "vllm_unfinished_fraction",
        "Share of the prompt tokens vLLM admitted that no finished request accounts for (requests "
        "aborted after admission: their clients left).",
        ("vllm_finished_prompt_tokens_rate",),
        ("vllm_admitted_tokens_rate",),
        complement=True,
    ),
    Ratio(
        "vllm_queue_time_deadline_ratio",
        "Mean queue time of the requests vLLM finished, over the deadline.",
        ("vllm_queue_time_rate",),
        ("vllm_queue_time_finish_rate", "vllm_deadline"),
        product=True,
    ),
)


def _vllm_ratio_specs() -> list[SignalSpec]:
    records = {spec.name: spec.record for spec in _VLLM_BASE_SIGNALS}
    specs = []
    for ratio in VLLM_RATIOS:
        record = vllm_record(ratio.name.removeprefix("vllm_").removesuffix("_ratio") + ":ratio1m")
        specs.append(SignalSpec(ratio.name, ratio.unit, ratio.help, record, ratio.promql(records), "vllm"))
        records[ratio.name] = record
    return specs


def _vllm_error_promql(window: str) -> str:
    """The vLLM tier's delivery error ratio over ``window``: 1 − (share of the requests finished or
    refused that finished within the deadline) × (prompt tokens that reached their first token over
    those admitted, at most 1), as :func:`vllm_delivery_error` computes it; absent when nothing was
    admitted, finished nor refused. Refusals count 0 where vLLM does not count them (before 0.32)."""
    in_time = _sum_rate_in_time(window)
    count = _sum_rate(_E2E_COUNT, window)
    refused = f"({_sum_rate(mn.VLLM_ADMISSION_REJECTIONS, window)} or {count} * 0)"
    judged = f"({count} + on (instance) {refused})"
    admitted = _sum_rate(mn.VLLM_PREFIX_CACHE_QUERIES, window)
    started = _sum_rate(mn.VLLM_PROMPT_TOKENS, window)
    # nothing finished nor refused while requests were admitted: none answered in time, once a
    # deadline is known (without one, late cannot be told from not yet finished)
    nothing = f"({admitted} > 0) * 0 and on (instance) {DEADLINE_BUCKET_RECORD}"
    answered = f"({in_time} / ({judged} > 0) or {nothing} unless on (instance) {judged} > 0)"
    kept = f"(clamp_max({started} / ({admitted} > 0), 1) or ({judged} > 0) * 0 + 1)"
    return vllm_join(f"1 - {answered} * {kept}")


def vllm_delivery_error(
    in_time: float | None,
    count: float | None,
    admitted: float | None,
    started: float | None,
    refused: float | None = None,
    deadline_known: bool = True,
) -> float | None:
    """The vLLM tier's delivery error ratio from the rates over one window (see
    :func:`_vllm_error_promql`): a request not answered in time is one that finished later than
    the deadline, one its queue cap refused (``refused``: HTTP 503, counted by vLLM 0.32 on; None
    where it is not counted, as 0), or one admitted that never reached its first token (its client
    left: vLLM drops it unrecorded, so only its prompt tokens, counted at admission, show it; a
    prompt is counted again at its first token, a prefill later).

    NOTE: prompt tokens at the first token, not those of finished requests: a request's decode
    lasts tens of seconds, so over a minute the finished ones lag the admitted ones by a share
    that swings with every change of load (on the training runs that alone read as a burn above
    3 at start and after pulses), while a prefill lasts a second or two. Requests aborted during
    their decode are left out, and so are those abandoned before admission: vLLM counts neither.
    A refused request is judged when refused, a finished one when it finishes: each refusal of a
    retried call counts (a call refused three times is three requests not answered). Requests
    admitted while none finished nor was refused count as not answered only where a deadline is
    known (``deadline_known``): without one, late cannot be told from not yet finished."""
    judged = None if count is None else count + (refused or 0.0)
    if judged is not None and judged > 0:
        if in_time is None:
            return None  # no bucket at the deadline: finishes in time cannot be told
        answered = in_time / judged
    elif admitted is not None and admitted > 0:
        if not deadline_known:
            return None  # late cannot be told from not yet finished
        answered = 0.0  # nothing finished nor refused while requests were admitted
    else:
        return None
    if started is not None and admitted is not None and admitted > 0:
        kept = min(1.0, started / admitted)
    elif judged is not None and judged > 0:
        kept = 1.0
    else:
        return None
    return 1.0 - answered * kept


def _vllm_slo_specs() -> list[SignalSpec]:
    specs = []
    for span, window in (("short", _SLO_SHORT), ("long", _SLO_LONG)):
        ratio_record = vllm_record(f"requests_not_in_time:ratio_rate{window}")
        specs.append(
            SignalSpec(
                f"vllm_delivery_error_ratio_{span}",
                "ratio",
                f"Share of vLLM's requests over {window} not answered within the deadline: finished "
                "late, or admitted and dropped before their first token.",
                ratio_record,
                _vllm_error_promql(window),
                "vllm",
            )
        )
        specs.append(
            SignalSpec(
                f"vllm_delivery_burn_rate_{span}",
                "ratio",
                f"The vLLM tier's error ratio over {window} in error budgets (1 − the "
                f"{DELIVERY_OBJECTIVE:.0%} objective).",
                vllm_record(f"requests_not_in_time:burn_rate{window}"),
                f"{ratio_record} / (1 - {DELIVERY_OBJECTIVE!r})",
                "vllm",
            )
        )
    return specs


_VLLM_SIGNALS: tuple[SignalSpec, ...] = (
    *_VLLM_BASE_SIGNALS,
    *_vllm_ratio_specs(),
    *_vllm_slo_specs(),
    SignalSpec(
        "vllm_queue_growth_rate",
        "requests/s",
        "Least-squares slope of vLLM's waiting queue.",
        vllm_record("requests_waiting:deriv1m"),
        f"deriv({vllm_record('requests_waiting:sum')}[{_W}])",
        "vllm",
    ),
    SignalSpec(
        "vllm_data_missing",
        "bool",
        "1 when vLLM's target is down or one of its needed series (or Ĉ, or the deadline) is missing.",
        vllm_record("data_missing:bool"),
        _data_missing_promql(
            "vllm",
            (
                mn.VLLM_NUM_WAITING,
                mn.VLLM_REQUEST_SUCCESS,
                _E2E_COUNT,
                vllm_record("capacity:calls_per_second"),
                vllm_record("client_deadline:seconds"),
            ),
        ),
        "vllm",
    ),
)

SIGNALS: tuple[SignalSpec, ...] = (
    *_BASE_SIGNALS,
    *_ratio_specs(),
    *_slo_specs(),
    SignalSpec(
        "queue_growth_rate",
        "executions/s",
        "Least-squares slope of engine waiting + proxy queue.",
        _r("queue_growth:deriv1m"),
        f"deriv({_r('queue_executions:sum')}[{_W}])",
    ),
    SignalSpec(
        "data_missing",
        "bool",
        "1 when the source is down or a needed series is missing.",
        _r("data_missing:bool"),
        _data_missing_promql(
            "proxy",
            (
                mn.EXECUTIONS_CREATED,
                mn.VLLM_NUM_WAITING,
                mn.CALLS_MISSED_DEADLINE,
                *(spec.record for spec in _BASE_SIGNALS if spec.name in ("capacity", "deadline")),
            ),
        ),
    ),
    *_VLLM_SIGNALS,
)

SIGNALS_BY_NAME: dict[str, SignalSpec] = {s.name: s for s in SIGNALS}


def tier_signals(tier: Tier) -> tuple[SignalSpec, ...]:
    """What a dashboard (or a detector) of ``tier`` can read: the vLLM tier's signals alone for
    "vllm", every signal for "proxy" (a proxy passes vLLM's series through, so the vLLM tier's
    rule group records its signals for a proxy's instance too)."""
    return tuple(s for s in SIGNALS if tier == "proxy" or s.tier == tier)


def _engine_info_promql() -> str:
    """One series per instance, labelled with its engine and model, for :func:`_j`'s joins. A
    data-parallel vLLM has one ``engine`` label per engine under one instance: that instance gets
    ``engine=ALL_ENGINES`` (its signals are sums over them), as :func:`split_snapshot` names it."""
    info = (
        f'max by (instance, engine, model) (label_replace({mn.VLLM_NUM_WAITING} * 0 + 1, "model", "$1", '
        '"model_name", "(.*)"))'
    )
    several = f"count by (instance) ({info}) > 1"
    joined = f'label_replace(max by (instance, model) ({info}), "engine", "{ALL_ENGINES}", "", "")'
    return f"({info} unless on (instance) ({several})) or ({joined} and on (instance) ({several}))"


RECORD_NAMES: dict[str, str] = {s.name: s.record for s in SIGNALS}

# Helper recording rules some signals read (record, expression), per tier, in evaluation order.
HELPER_RECORDS: dict[Tier, tuple[tuple[str, str], ...]] = {
    "vllm": (
        (VLLM_ENGINE_INFO_RECORD, _engine_info_promql()),
        (
            vllm_record("saturated_finish:rate5m"),
            # Ĉ estimate: vLLM's finish rate over 5 minutes in which its queue never emptied.
            f"{_sum_rate(mn.VLLM_REQUEST_SUCCESS, _GW)}"
            f" and on (instance) (min by (instance) (min_over_time({mn.VLLM_NUM_WAITING}[{_GW}])) > 0)",
        ),
        (
            vllm_record("capacity_estimate:avg1h"),
            f"avg_over_time({vllm_record('saturated_finish:rate5m')}[1h])",
        ),
    ),
    "proxy": (
        (ENGINE_INFO_RECORD, _engine_info_promql()),
        (
            _r("saturated_completion:rate5m"),
            # Ĉ estimate: the engine's completion rate over 5 minutes in which its queue never emptied.
            f'sum by (instance) (rate({mn.EXECUTIONS_FINISHED}{{fate=~"completed|orphaned"}}[{_GW}]))'
            f" and on (instance) (min by (instance) (min_over_time({mn.VLLM_NUM_WAITING}[{_GW}])) > 0)",
        ),
        (_r("capacity_estimate:avg1h"), f"avg_over_time({_r('saturated_completion:rate5m')}[1h])"),
        (
            _r("queue_executions:sum"),
            _j(f"({_WAITING_FOR_CAPACITY}) + on (instance) sum by (instance) ({mn.EXECUTIONS_QUEUED})"),
        ),
    ),
}


def recording_rules(tier: Tier) -> list[tuple[str, str]]:
    """The tier's recording rules (its rule group's), in an order where each reads only rules
    defined before it, and none of another tier's."""
    return [*HELPER_RECORDS[tier], *((s.record, s.promql) for s in SIGNALS if s.tier == tier)]


# --- Python computation ------------------------------------------------------------------


#: The longest engine key (``instance``) the store keeps whole and the API takes as ``engine=``.
MAX_INSTANCE_CHARS = 512


@dataclass(frozen=True)
class EngineLabels:
    engine: str
    model: str
    instance: str

    def as_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "model": self.model, "instance": self.instance}


@dataclass
class SignalFrame:
    """One engine's signals at time ``t``; None marks a signal that cannot be computed."""

    t: float
    labels: EngineLabels
    values: dict[str, float | None]
    missing: tuple[str, ...] = ()  # what the proxy tier's NoData reports missing
    # what each tier's NoData reports missing (the proxy tier's is ``missing``)
    missing_by_tier: dict[Tier, tuple[str, ...]] = field(default_factory=dict)
    # how its deadline was found (``stated 120 s``, ``learned 93 s from 57 abandons``, ``missing``),
    # and where it falls between vLLM's e2e buckets, which one counts as in time
    deadline_note: str = ""

    def missing_for(self, tier: Tier) -> tuple[str, ...]:
        """What ``tier``'s NoData reports missing."""
        return self.missing_by_tier.get(tier, self.missing if tier == "proxy" else ())


@dataclass
class SignalConfig:
    """Operator overrides: configured Ĉ and deadline win over exported and estimated values.

    Every duration is in the source's own seconds: a scaled reproduce run's ``windows`` and
    ``assumed_deadline`` come already divided (``Windows.scaled``), like the evaluator's rules."""

    capacity: float | None = None
    deadline: float | None = None
    # the vLLM tier's deadline where none is stated nor exported (None: missing, and the tier's
    # NoData says so, as in the rendered rules): a replay assumes the study's
    assumed_deadline: float | None = DEFAULT_DEADLINE_S
    # log each instance's deadline once as found, and warn where it falls between vLLM's e2e
    # buckets (the live detector does; a replay does not)
    log_deadlines: bool = False
    windows: Windows = WINDOWS
    # the delivery SLO's objective (the Prometheus rules are rendered at the default)
    objective: float = DELIVERY_OBJECTIVE

    def __post_init__(self) -> None:
        self.objective = check_objective(self.objective)


@dataclass(frozen=True)
class EngineInputs:
    """Where one engine's Ĉ and deadline come from now (:meth:`SignalEngine.inputs`): each tier's
    Ĉ source (``predictor.CAPACITY_SOURCES``), the deadline's (stated, learned, the proxy's,
    assumed; None before any evaluation) and Ĉ predicted below saturation, if any."""

    capacity_source: Mapping[Tier, str | None]
    deadline_source: str | None
    predicted: predictor.CapacityPrediction | None


def _deadline_source(key: tuple[float | None, float | None, str | None, float | None] | None) -> str | None:
    """Where the deadline in force comes from, from :meth:`SignalEngine._note_deadline`'s key
    (stated, exported by the proxy with its source, assumed)."""
    if key is None:
        return None
    stated, exported, source, assumed = key
    if stated is not None:
        return "stated"
    if exported is not None:
        return source if source in ("stated", "learned") else "proxy"
    return "assumed" if assumed is not None else None


@dataclass
class _EngineHistory:
    times: list[float] = field(default_factory=list)
    rows: list[list[float]] = field(default_factory=list)
    engine: str = ""
    model: str = ""
    source_up: bool = True
    # where its deadline came from and its value, when last logged (``SignalEngine._note_deadline``)
    deadline_key: tuple[float | None, float | None, str | None, float | None] | None = None
    last_report: float = -math.inf  # the last scrape or down mark that named this instance
    # the online Ĉ estimate's samples per tier: (time, saturated completion or finish rate)
    capacity_samples: dict[Tier, list[tuple[float, float]]] = field(
        default_factory=lambda: {tier: [] for tier in TIERS}
    )
    # where each tier's Ĉ came from (``predictor.CAPACITY_SOURCES``), and Ĉ predicted below
    # saturation at the time of the last computation (``detector.capacity``)
    capacity_source: dict[Tier, str | None] = field(default_factory=dict)
    predicted: tuple[float, predictor.CapacityPrediction | None] = (math.nan, None)
    # counters are stored as the sum of their series' increases (monotonic), so a rate is one
    # subtraction; each series' reset is told apart from the others (see :meth:`SignalEngine.add`)
    last_adj: list[float] = field(default_factory=lambda: [math.nan] * len(RAW_KEYS))
    # each counter series' last value and when it was last seen, the least recently seen first
    # (at most MAX_COUNTER_SERIES: see :meth:`SignalEngine._increases`)
    counters: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, float]] = field(
        default_factory=OrderedDict
    )
    # vLLM's refusals over a window longer than the raw history: the time of the sample before
    # each one that counted a refusal, the last hour's (see :meth:`SignalEngine._refused_within`)
    refusal_steps: list[float] = field(default_factory=list)


def _by_instance(snapshot: Snapshot, default_instance: str) -> dict[str, list[Sample]]:
    """The samples of the raw series, grouped by their ``instance`` label (``default_instance``
    where they have none); an instance whose target answered (``up`` not 0) without any has none.
    An alias's samples (an older vLLM's name) stand for the raw series where an instance has none
    under its own name."""
    out: dict[str, list[Sample]] = {}
    aliased: dict[str, list[Sample]] = {}
    for sample in snapshot.samples:
        if sample[0] == UP and sample[2] != 0:
            out.setdefault(sample[1].get("instance", default_instance), [])
        elif sample[0] in _BY_NAME:
            out.setdefault(sample[1].get("instance", default_instance), []).append(sample)
        elif sample[0] in _ALIAS_OF:
            aliased.setdefault(sample[1].get("instance", default_instance), []).append(sample)
    for instance, samples in aliased.items():
        own = out.setdefault(instance, [])
        served = {name for name, _, _ in own}
        own.extend((_ALIAS_OF[n], labels, v) for n, labels, v in samples if _ALIAS_OF[n] not in served)
    return out


def split_snapshot(snapshot: Snapshot, default_instance: str = "") -> dict[str, tuple[list[float], str, str]]:
    """Reduce a snapshot to raw quantities per instance: {instance: (row, engine, model)}."""
    out: dict[str, tuple[list[float], str, str]] = {}
    for name, labels, value in snapshot.samples:
        targets = _BY_NAME.get(name)
        if targets is None:
            continue
        instance = labels.get("instance", default_instance)
        entry = out.get(instance)
        if entry is None:
            entry = ([math.nan] * len(RAW_KEYS), "", "")
            out[instance] = entry
        row = entry[0]
        if name.startswith("vllm:") and ("engine" in labels or "model_name" in labels):
            engine = labels.get("engine", "")
            if not entry[1] and not entry[2]:
                out[instance] = entry = (row, engine, labels.get("model_name", ""))
            elif engine != entry[1] and entry[1] != ALL_ENGINES:  # data parallel: several engines
                out[instance] = entry = (row, ALL_ENGINES, entry[2])
        if not math.isfinite(value):  # no reading: a queue or a count cannot be infinite
            continue
        for idx, flt in targets:
            if flt is not None and labels.get(flt[0]) != flt[1]:
                continue
            row[idx] = value if math.isnan(row[idx]) else row[idx] + value
    return out


# The counters whose rate over a saturated window samples Ĉ, per tier.
_FINISHES: dict[Tier, tuple[str, ...]] = {
    "proxy": ("finished_completed", "finished_orphaned"),
    "vllm": ("vllm_finished",),
}


class SignalEngine:
    """Keeps a bounded raw history per instance and computes :class:`SignalFrame` s.

    ``retention_s`` bounds the raw history (enough for the longest window); ``max_instances``
    bounds the number of engines followed: past it a new instance is not followed (:meth:`add`
    and :meth:`mark_down` say how many they left out).

    An instance the source stops naming (neither scraped nor marked down) for the gauge
    lookback while it names others has left the fleet (a replica scaled away, a pod replaced):
    it is forgotten, as Prometheus forgets a target that service discovery dropped, and its
    alerts resolve. A source that names no instance at all for that long is a silent source, not
    an empty fleet: every instance stays and reports missing data.
    """

    def __init__(
        self,
        config: SignalConfig | None = None,
        *,
        retention_s: float | None = None,
        max_instances: int = MAX_INSTANCES,
    ) -> None:
        self.config = config or SignalConfig()
        self.windows = w = self.config.windows
        self.retention_s = (
            retention_s or max(w.rate_s, w.prompt_gap_s, w.gauge_lookback_s, w.slo_long_s) + 30.0
        )
        self.max_instances = max_instances
        self._engines: dict[str, _EngineHistory] = {}
        self._last_report = -math.inf  # the last time the source named any instance

    @property
    def instances(self) -> list[str]:
        return list(self._engines)

    def inputs(self) -> dict[str, EngineInputs]:
        """Per followed instance, where its Ĉ and deadline come from now (a copy: an evaluation
        may add or forget an engine meanwhile)."""
        return {
            instance: EngineInputs(
                dict(hist.capacity_source), _deadline_source(hist.deadline_key), hist.predicted[1]
            )
            for instance, hist in list(self._engines.items())
        }

    def add(self, snapshot: Snapshot, default_instance: str = "") -> int:
        """Record one scrape (samples grouped by their ``instance`` label); returns how many of
        its instances were left out (new ones past ``max_instances``). An ``up`` sample (not 0)
        names an instance whose target answered: without its raw series, they are stale (missing
        data), and it has not left the fleet.

        A counter is the sum of its series' increases, each series' reset told apart, as
        ``sum by (instance) (rate(...))`` rates each series before summing: one of several series
        under an instance (a data-parallel vLLM's engines, several proxies behind one
        ``instance``) that restarts, vanishes or first appears is no jump of the sum. A value
        that is not finite is no reading, as NaN is (a queue of +Inf is a missing queue: its
        tier's NoData names it, where a rule on it would fire on a value it cannot report)."""
        left_out = 0
        for instance, samples in _by_instance(snapshot, default_instance).items():
            hist = self._follow(instance, snapshot.t)
            if hist is None:
                left_out += 1
                continue
            late = bool(hist.times) and snapshot.t <= hist.times[-1]
            if not late:
                samples = self._increases(hist, samples, snapshot.t)
            # a target that answered without the series: they are stale at once, as in Prometheus
            row, engine, model = split_snapshot(Snapshot(t=snapshot.t, samples=samples), instance).get(
                instance, ([math.nan] * len(RAW_KEYS), "", "")
            )
            if engine or model:
                hist.engine, hist.model = engine, model
            if late:
                continue  # a repeated or late scrape: the first one at a time stands
            for idx in _COUNTER_IDX:
                increase = row[idx]
                if math.isnan(increase):
                    continue
                prev = hist.last_adj[idx]
                hist.last_adj[idx] = row[idx] = increase if math.isnan(prev) else prev + increase
            refused = row[_REFUSED]
            if hist.rows and refused > hist.rows[-1][_REFUSED]:  # NaN on either side: False
                hist.refusal_steps.append(hist.times[-1])
            hist.times.append(snapshot.t)
            hist.rows.append(row)
            hist.source_up = True
            self._trim(hist, snapshot.t)
        return left_out

    def _increases(self, hist: _EngineHistory, samples: list[Sample], t: float) -> list[Sample]:
        """``samples`` with each counter's value replaced by its series' increase since the
        series' previous sample (a value below it: a reset, the series restarted from zero; a
        series not seen before: 0, as ``rate()`` counts from a series' first sample); NaN for a
        value that is not finite. Series unseen for the retention are forgotten, and past
        :data:`MAX_COUNTER_SERIES` the least recently seen."""
        out: list[Sample] = []
        counters = hist.counters
        for name, labels, value in samples:
            if name in _COUNTER_NAMES:
                key = (name, tuple(sorted(labels.items())))
                if not math.isfinite(value):
                    value = math.nan
                else:
                    prev = counters.pop(key, None)
                    counters[key] = (value, t)  # the most recently seen last
                    if prev is None:
                        value = 0.0
                    elif value >= prev[0]:
                        value -= prev[0]
            out.append((name, labels, value))
        horizon = t - self.retention_s
        while counters and (len(counters) > MAX_COUNTER_SERIES or next(iter(counters.values()))[1] < horizon):
            counters.popitem(last=False)
        return out

    def mark_down(self, instance: str, at: float) -> bool:
        """At ``at`` the source could not reach ``instance``: its signals report missing data.
        False when it is left out (new, past ``max_instances``)."""
        hist = self._follow(instance, at)
        if hist is not None:
            hist.source_up = False
        return hist is not None

    def _follow(self, instance: str, at: float) -> _EngineHistory | None:
        """``instance``'s history, named by the source at ``at``; None past the bound."""
        hist = self._engines.get(instance)
        if hist is None:
            if len(self._engines) >= self.max_instances:
                return None
            hist = self._engines[instance] = _EngineHistory()
        hist.last_report = max(hist.last_report, at)
        self._last_report = max(self._last_report, at)
        return hist

    def forget_departed(self, now: float) -> list[str]:
        """Forget the instances that left the fleet by ``now`` (see the class); returns them."""
        horizon = now - self.windows.gauge_lookback_s
        if self._last_report < horizon:
            return []  # a silent source: nothing has left
        gone = [inst for inst, hist in self._engines.items() if hist.last_report < horizon]
        for inst in gone:
            del self._engines[inst]
        return gone

    def shift_time(self, delta: float) -> None:
        """Move every recorded time by ``delta`` seconds (the detector's clock stepped: see
        :meth:`detector.service.Detector.tick`), so that windows and lookbacks keep their
        lengths and the next scrape is not taken for a late one."""
        for hist in self._engines.values():
            hist.times = [t + delta for t in hist.times]
            hist.capacity_samples = {
                tier: [(t + delta, v) for t, v in samples] for tier, samples in hist.capacity_samples.items()
            }
            hist.last_report += delta
        self._last_report += delta

    def _trim(self, hist: _EngineHistory, now: float) -> None:
        cut = bisect.bisect_left(hist.times, now - self.retention_s)
        if cut > 64:  # trim in chunks: amortised O(1)
            del hist.times[:cut]
            del hist.rows[:cut]
        horizon = now - self.windows.capacity_estimate_s
        steps = hist.refusal_steps
        if steps and steps[0] < horizon:
            del steps[: bisect.bisect_left(steps, horizon - 1e-9)]
        for tier, samples in hist.capacity_samples.items():
            if samples and samples[0][0] < horizon - 600:
                hist.capacity_samples[tier] = [s for s in samples if s[0] >= horizon]

    def compute(self, now: float) -> list[SignalFrame]:
        """Every followed engine's signals at ``now``, once those that left are forgotten."""
        self.forget_departed(now)
        return [self._compute_one(inst, hist, now) for inst, hist in self._engines.items()]

    # -- internals --

    def _window(self, hist: _EngineHistory, now: float, width: float) -> tuple[int, int]:
        lo = bisect.bisect_left(hist.times, now - width - 1e-9)
        hi = bisect.bisect_right(hist.times, now + 1e-9)
        return lo, hi

    def _rate(self, hist: _EngineHistory, key: str, now: float, width: float) -> float | None:
        idx = _RAW_INDEX[key]
        lo, hi = self._window(hist, now, width)
        rows, times = hist.rows, hist.times
        first = lo
        while first < hi and math.isnan(rows[first][idx]):
            first += 1
        last = hi - 1
        while last > first and math.isnan(rows[last][idx]):
            last -= 1
        if last <= first or times[last] <= times[first]:
            return None
        return (rows[last][idx] - rows[first][idx]) / (times[last] - times[first])

    def _refused_within(self, hist: _EngineHistory, now: float, width: float) -> float | None:
        """1 where vLLM counted a refusal over ``[now - width, now]``, 0 where it counted none,
        None where it does not count them (as ``increase(...[width]) > bool 0``)."""
        last = self._last_row(hist, now)
        if last is None or math.isnan(last[_REFUSED]):
            return None
        steps = hist.refusal_steps
        i = bisect.bisect_left(steps, now - width - 1e-9)
        return 1.0 if i < len(steps) and steps[i] <= now + 1e-9 else 0.0

    def _gauge(self, hist: _EngineHistory, key: str, now: float) -> float | None:
        # The latest scrape only: a series absent from it is stale, as Prometheus marks it.
        last = self._last_row(hist, now)
        if last is None or math.isnan(last[_RAW_INDEX[key]]):
            return None
        return last[_RAW_INDEX[key]]

    def _waiting_key(self, hist: _EngineHistory, now: float) -> str:
        """The raw key of vLLM's requests waiting for capacity: ``waiting_for_capacity`` where the
        latest scrape has it (vLLM 0.20 on), else the whole queue (as ``_WAITING_FOR_CAPACITY``)."""
        last = self._last_row(hist, now)
        served = last is not None and not math.isnan(last[_RAW_INDEX["waiting_for_capacity"]])
        return "waiting_for_capacity" if served else "waiting"

    def _deriv(self, hist: _EngineHistory, keys: tuple[str, ...], now: float, width: float) -> float | None:
        idxs = [_RAW_INDEX[k] for k in keys]
        lo, hi = self._window(hist, now, width)
        xs: list[float] = []
        ys: list[float] = []
        for i in range(lo, hi):
            row = hist.rows[i]
            if math.isnan(row[idxs[0]]):
                continue
            xs.append(hist.times[i])
            ys.append(sum(0.0 if math.isnan(row[j]) else row[j] for j in idxs))
        if len(xs) < 2:
            return None
        mx = sum(xs) / len(xs)
        my = sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return None
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx

    def _min_gauge(self, hist: _EngineHistory, key: str, now: float, width: float) -> float | None:
        idx = _RAW_INDEX[key]
        lo, hi = self._window(hist, now, width)
        vals = [hist.rows[i][idx] for i in range(lo, hi) if not math.isnan(hist.rows[i][idx])]
        return min(vals) if vals else None

    def _capacity(self, hist: _EngineHistory, now: float, tier: Tier) -> float | None:
        """Ĉ and its source (into ``hist.capacity_source``): stated (the operator's, else the
        exported gauge), else the tier's saturated measurement (the finish rate over windows
        where vLLM's queue never emptied, averaged), else predicted below saturation."""
        value, hist.capacity_source[tier] = self._capacity_and_source(hist, now, tier)
        return value

    def _predicted(self, hist: _EngineHistory, now: float) -> predictor.CapacityPrediction | None:
        """Ĉ predicted from vLLM's series over the last five minutes (``detector.capacity``),
        refitted once per sub-window of the fit (a five-minute figure moves little faster)."""
        w = self.windows
        if not 0.0 <= now - hist.predicted[0] < w.predict_part_s:
            lo, hi = self._window(hist, now, w.predict_s)
            prediction = predictor.predict_over(
                hist.times[lo:hi],
                hist.rows[lo:hi],
                _PREDICTOR_COLUMNS,
                now,
                window_s=w.predict_s,
                part_s=w.predict_part_s,
            )
            hist.predicted = (now, prediction)
        return hist.predicted[1]

    def _capacity_and_source(
        self, hist: _EngineHistory, now: float, tier: Tier
    ) -> tuple[float | None, str | None]:
        w = self.windows
        # The online estimate is updated on every computation, whichever Ĉ is in use.
        samples = hist.capacity_samples[tier]
        min_wait = self._min_gauge(hist, "waiting", now, w.prompt_gap_s)
        if min_wait is not None and min_wait > 0:
            rates = [self._rate(hist, key, now, w.prompt_gap_s) for key in _FINISHES[tier]]
            fresh = not samples or samples[-1][0] < now
            if any(r is not None for r in rates) and fresh:
                samples.append((now, sum(r or 0.0 for r in rates)))
        if self.config.capacity is not None:
            return self.config.capacity, "stated"
        gauge = self._gauge(hist, "capacity_gauge", now)
        if gauge is not None and gauge > 0:
            return gauge, "stated"
        recent = [v for t, v in samples if now - w.capacity_estimate_s <= t <= now]
        if recent and sum(recent) > 0:
            return sum(recent) / len(recent), "saturated"
        prediction = self._predicted(hist, now)
        return (None, None) if prediction is None else (prediction.capacity, "predicted")

    def _deadline(self, hist: _EngineHistory, now: float) -> float | None:
        """The operator's deadline, else the exported gauge; None when neither is known."""
        if self.config.deadline is not None:
            return self.config.deadline
        g = self._gauge(hist, "deadline_gauge", now)
        return g if g is not None and g > 0 else None

    def _note_deadline(self, instance: str, hist: _EngineHistory, now: float, deadline: float | None) -> str:
        """How this instance's deadline was found (:func:`describe_deadline`), with the sentence
        of :func:`between_buckets` where it falls between vLLM's e2e buckets; logged once per
        change of where it comes from or of its value (not of the abandons it rests on) when
        ``SignalConfig.log_deadlines``."""
        source = None
        if self._gauge(hist, "deadline_stated", now) == 1.0:
            source = mn.DEADLINE_STATED
        elif self._gauge(hist, "deadline_learned", now) == 1.0:
            source = mn.DEADLINE_LEARNED
        stated = self.config.deadline
        exported = self._deadline(hist, now) if stated is None else None
        assumed = self.config.assumed_deadline
        abandons = self._gauge(hist, "deadline_abandons", now)
        note = describe_deadline(stated, exported, source, abandons, assumed)
        between = None if deadline is None else between_buckets(deadline)
        key = (stated, exported, source, assumed)
        if self.config.log_deadlines and key != hist.deadline_key:
            if between is not None:
                log.warning("instance %s: deadline %s; %s", instance, note, between)
            else:
                log.info("instance %s: deadline %s", instance, note)
        hist.deadline_key = key
        return note if between is None else f"{note}; {between}"

    def _vllm_tier(self, hist: _EngineHistory, now: float, v: dict[str, float | None]) -> list[str]:
        """The vLLM tier's signals into ``v`` (they read vLLM's series, Ĉ and the deadline
        alone); returns what its NoData reports missing."""
        w = self.windows

        def rate(key: str, width: float = w.rate_s) -> float | None:
            return self._rate(hist, key, now, width)

        v["vllm_finish_rate"] = rate("vllm_finished")
        v["vllm_e2e_finish_rate"] = rate("vllm_e2e_count")
        v["vllm_admitted_tokens_rate"] = rate("prefix_queries")
        v["vllm_finished_prompt_tokens_rate"] = rate("vllm_finished_prompt_tokens")
        v["vllm_queue_time_rate"] = rate("vllm_queue_time_sum")
        v["vllm_queue_time_finish_rate"] = rate("vllm_queue_time_count")
        waiting_key = self._waiting_key(hist, now)
        v["vllm_waiting_requests"] = self._gauge(hist, waiting_key, now)
        v["vllm_running_requests"] = self._gauge(hist, "running", now)
        v["vllm_refusal_rate"] = rate("vllm_refused")
        v["vllm_refused_recently"] = self._refused_within(hist, now, w.capacity_estimate_s)
        v["vllm_capacity"] = capacity = self._capacity(hist, now, "vllm")
        deadline = self._deadline(hist, now)
        assumed = self.config.assumed_deadline
        if deadline is None and assumed is not None:
            deadline = assumed
        v["vllm_deadline"] = deadline
        bucket = None if deadline is None else deadline_bucket(deadline)
        in_time_key = None if bucket is None else f"vllm_e2e_le_{le_label(bucket)}"

        def in_time(width: float) -> float | None:
            return None if in_time_key is None else rate(in_time_key, width)

        v["vllm_in_time_rate"] = in_time(w.rate_s)
        for ratio in VLLM_RATIOS:
            v[ratio.name] = ratio.value(v)
        v["vllm_queue_growth_rate"] = self._deriv(hist, (waiting_key,), now, w.rate_s)
        for span, width in (("short", w.slo_short_s), ("long", w.slo_long_s)):
            errors = vllm_delivery_error(
                in_time(width),
                rate("vllm_e2e_count", width),
                rate("prefix_queries", width),
                rate("prompt_tokens", width),
                rate("vllm_refused", width),
                deadline_known=bucket is not None,
            )
            v[f"vllm_delivery_error_ratio_{span}"] = errors
            v[f"vllm_delivery_burn_rate_{span}"] = (
                None if errors is None else errors / (1 - self.config.objective)
            )
        missing: list[str] = []
        if not hist.source_up:
            missing.append("source")
        last = self._last_row(hist, now)
        for key in NEEDED_VLLM_RAW:
            if last is None or math.isnan(last[_RAW_INDEX[key]]):
                missing.append(RAW[key][0])
        if capacity is None:
            missing.append("capacity")
        if deadline is None:
            missing.append("deadline")
        return missing

    def _compute_one(self, instance: str, hist: _EngineHistory, now: float) -> SignalFrame:
        w = self.windows
        v: dict[str, float | None] = {}

        def rate(key: str, width: float = w.rate_s) -> float | None:
            return self._rate(hist, key, now, width)

        v["attempt_rate_first"] = first = rate("attempts_first")
        v["attempt_rate_retry"] = retry = rate("attempts_retry")
        v["attempt_rate"] = _add(first, retry)
        v["execution_creation_rate"] = rate("created")
        for fate in mn.FATES:
            v[f"completion_rate_{fate}"] = rate(f"finished_{fate}")
        v["shed_rate"] = rate("shed")
        v["attached_rate"] = rate("attached")
        v["delivered_rate_within_deadline"] = rate("delivered_within")
        v["delivered_rate_late"] = rate("delivered_late")
        v["prompt_tokens_counted_rate"] = rate("prompt_tokens", w.prompt_gap_s)
        v["prompt_tokens_admitted_rate"] = rate("prefix_queries", w.prompt_gap_s)
        waiting_key = self._waiting_key(hist, now)
        v["vllm_waiting"] = waiting = self._gauge(hist, waiting_key, now)
        v["vllm_running"] = self._gauge(hist, "running", now)
        v["proxy_queued"] = self._gauge(hist, "queued", now)
        v["capacity"] = capacity = self._capacity(hist, now, "proxy")
        v["deadline"] = deadline = self._deadline(hist, now)
        for ratio in RATIOS:  # each reads signals computed above, or a ratio before it
            v[ratio.name] = ratio.value(v)
        v["queue_growth_rate"] = self._deriv(hist, (waiting_key, "queued"), now, w.rate_s)
        for span, width in (("short", w.slo_short_s), ("long", w.slo_long_s)):
            missed, good = rate("missed_deadline", width), rate("delivered_within", width)
            judged = None if missed is None or good is None else missed + good
            errors = missed / judged if missed is not None and judged is not None and judged > 0 else None
            v[f"delivery_error_ratio_{span}"] = errors
            v[f"delivery_burn_rate_{span}"] = None if errors is None else errors / (1 - self.config.objective)

        missing_vllm = self._vllm_tier(hist, now, v)
        deadline_note = self._note_deadline(instance, hist, now, v["vllm_deadline"])
        missing: list[str] = []
        if not hist.source_up:
            missing.append("source")
        last = self._last_row(hist, now)
        for key in NEEDED_RAW:
            if last is None or math.isnan(last[_RAW_INDEX[key]]):
                missing.append(RAW[key][0])
        if capacity is None:
            missing.append("capacity")
        if deadline is None:
            missing.append("deadline")
        prediction = self._predicted(hist, now)
        v["capacity_predicted"] = None if prediction is None else prediction.capacity
        sources: tuple[tuple[Tier, str], ...] = (
            ("proxy", "capacity_source"),
            ("vllm", "vllm_capacity_source"),
        )
        for tier, key in sources:
            source = hist.capacity_source.get(tier)
            v[key] = None if source is None else float(predictor.CAPACITY_SOURCES.index(source))
        if not hist.source_up or waiting is None:
            # NOTE: like Prometheus, where a down target's series go stale at once and every
            # signal is joined on vLLM's engine labels: no signal, only the NoData verdict.
            v = dict.fromkeys(v)
        v["data_missing"] = 1.0 if missing else 0.0
        v["vllm_data_missing"] = 1.0 if missing_vllm else 0.0
        labels = EngineLabels(engine=hist.engine, model=hist.model, instance=instance)
        return SignalFrame(
            t=now,
            labels=labels,
            values=v,
            missing=tuple(missing),
            missing_by_tier={"proxy": tuple(missing), "vllm": tuple(missing_vllm)},
            deadline_note=deadline_note,
        )

    def _last_row(self, hist: _EngineHistory, now: float) -> list[float] | None:
        lo, hi = self._window(hist, now, self.windows.gauge_lookback_s)
        return hist.rows[hi - 1] if hi > lo else None


def _add(a: float | None, b: float | None) -> float | None:
    if a is None and b is None:
        return None
    return (a or 0.0) + (b or 0.0)
