"""``retrywatch doctor``'s verdicts: what a vLLM (and a proxy, a Prometheus) serves of what the
alerts read, and so which alerts can evaluate there, and why the others cannot; the report as a
few plain lines or JSON. Pure: ``detector.doctorread`` reads the endpoints.

What each alert needs comes from its declaration (``detector.needs``); the verdict of an alert
follows its condition tree: a comparison needs its signal, ``All`` every term, ``AnyOf`` one term
(an alert left with fewer alternatives says which it lost). A signal evaluates when one of its
alternatives has every series present, where Ĉ and the deadline count as present once stated
(``--capacity``, ``--deadline``) or exported (the proxy's gauges, the stated rules' records); Ĉ
also once learned (the rules' online estimate at saturation, in Prometheus), or as predicted from
vLLM's counters where vLLM serves every series the fit reads (``detector.capacity``: vLLM 0.10.2
on). A deadline is never assumed: without one the alerts that read it cannot evaluate (the rules'
VLLMDeadlineMissing and the tier's NoData fire). The vLLM tier reads requests finished within the
deadline off vLLM's e2e latency bucket at the deadline (``deadline_bucket``): a bucket vLLM does
not serve cannot tell the deadline, and a deadline between buckets is read at the bound below it.
Nothing read is shown but series names and the two numbers (no sample of a prompt), and every URL
is shown masked (``foundation.redact``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from detector.capacity import PREDICTOR_SERIES
from detector.needs import Need, Selector, is_learned, signal_needs
from detector.signals import TIERS, UP, Tier, deadline_bucket
from detector.thresholds import ALERTS, AlertRule, AnyOf, Cmp, Condition, leaves
from foundation import metricnames as mn
from foundation.timeseries import Sample
from foundation.vllmbuckets import le_label
from foundation.vllmreleases import CANONICAL, FAMILIES, ReleaseFamily, canonical_name, release_for

Status = Literal["ok", "approximate", "partial", "blocked", "n/a"]
#: Exit status when a page (an alert of severity critical) cannot fire.
EXIT_PAGE_BLOCKED = 1
#: The series of the two numbers an operator states (the rules read each "> 0").
STATED = (mn.CAPACITY, mn.CLIENT_DEADLINE)
_E2E_BUCKET = f"{mn.VLLM_E2E_LATENCY}_bucket"
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
NO_CAPACITY = "no Ĉ stated (--capacity), predicted or learned yet"
#: How Ĉ is learned at saturation when not stated (both evaluators' online estimate).
LEARNING = "learned online once vLLM's queue has stayed non-empty for 5 minutes"
NO_DEADLINE = "no deadline: not stated (--deadline) nor exported by the proxy"


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part.removeprefix("post")) for part in version.split("."))


def _predictor_family(sample_name: str) -> str:
    base = sample_name.removesuffix("_sum").removesuffix("_count")
    return base if base in CANONICAL else sample_name


#: The canonical series Ĉ's prediction reads (``detector.capacity``), by family name.
PREDICTOR_FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(map(_predictor_family, PREDICTOR_SERIES)))
#: The first vLLM release serving every series the prediction reads under its name (the rules
#: read no older name for them): ``foundation.vllmreleases``' facts.
PREDICTING_SINCE = min(
    (f.first for f in FAMILIES if all(f.exported(c) == c for c in PREDICTOR_FAMILIES)), key=_release_key
)
#: How Ĉ is predicted when not stated (the rules' fit of ``detector.capacity``, as the detector's).
PREDICTING = (
    f"predicted from vLLM's counters over its first minutes of decoding (vLLM {PREDICTING_SINCE} on), "
    "before any saturation"
)
NO_PROXY = "no proxy (--proxy URL)"
#: Where keeping vLLM's colons through a Prometheus scrape is told.
COLONS_DOC = "docs/operator.md, Keep vLLM's colons"


@dataclass
class PrometheusView:
    """What a Prometheus holds of the series the alerts read (names and label names only)."""

    samples: list[Sample]
    learned: frozenset[str]  # learned records present (the Ĉ estimate)
    jobs: frozenset[str]  # the jobs the rules read ``up`` of that have a target, up or down
    # alert name -> (health, last error, evaluated yet); None when the rules could not be read
    rules: dict[str, tuple[str, str, bool]] | None
    #: vLLM's series held with each colon written as _ (scraped as OpenMetrics): their names
    colons_lost: tuple[str, ...] = ()


# --- the verdicts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    role: str  # "vLLM", "proxy", "Prometheus"
    url: str  # masked
    error: str | None = None  # None: it answered

    @property
    def answered(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Number:
    """Ĉ or the deadline: its value in force and where it comes from."""

    value: float | None
    # Ĉ: "stated", "exported", "learned", "predicted" or "not stated"; the deadline: "stated",
    # "exported" or "missing"
    source: str
    #: Ĉ not stated: the series its prediction reads that are missing (none: it can be predicted)
    lacking: tuple[str, ...] = ()


@dataclass(frozen=True)
class AlertVerdict:
    name: str
    severity: str
    tier: Tier
    status: Status
    reasons: tuple[str, ...] = ()  # why it cannot evaluate (blocked)
    notes: tuple[str, ...] = ()  # what it lacks while it still evaluates

    @property
    def page(self) -> bool:
        return self.severity == "critical"


@dataclass(frozen=True)
class Report:
    endpoints: tuple[Endpoint, ...]
    release: str | None  # the vLLM release family it looks like, None: unknown
    series_present: tuple[str, ...]  # vLLM's series the alerts read
    series_missing: tuple[str, ...]  # ... and those missing, each with what the release serves instead
    proxy_families: tuple[str, ...] | None  # retrywatch_* families the proxy serves; None: no proxy read
    lacking_in_prometheus: tuple[str, ...]  # series vLLM/the proxy serve that Prometheus lacks
    rules: str | None  # what Prometheus' rules say, one line; None: no Prometheus
    capacity: Number
    deadline: Number  # the vLLM tier's
    tiers: tuple[Tier, ...]
    alerts: tuple[AlertVerdict, ...]

    @property
    def pages_blocked(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.alerts if a.page and a.status == "blocked")

    @property
    def exit_code(self) -> int:
        return EXIT_PAGE_BLOCKED if self.pages_blocked else 0

    def to_json(self) -> str:
        obj = asdict(self)
        obj["pages_blocked"] = list(self.pages_blocked)
        obj["exit_code"] = self.exit_code
        return json.dumps(obj, indent=2, ensure_ascii=False)


@dataclass
class _Facts:
    """The series at hand (names and labels) and how to say why one is missing."""

    samples: Sequence[Sample]
    learned: frozenset[str]
    family: ReleaseFamily | None
    no_proxy: str | None  # why no proxy series can be there; None: a proxy was read
    no_vllm: str | None  # why no vLLM series can be there; None: vLLM's were read
    deadline: float | None  # None: missing
    by_name: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, labels, value in self.samples:
            if name in STATED and not (math.isfinite(value) and value > 0):
                continue  # the rules read them "> 0": a proxy not told its deadline exports NaN
            self.by_name.setdefault(name, []).append(labels)

    def effective(self, series: str) -> Selector | None:
        """The series as read at the deadline in force: the e2e bucket at its bound (None below
        vLLM's first bound; any bucket without a deadline, whose absence is said apart)."""
        sel = Selector.parse(series)
        if sel.name != _E2E_BUCKET or self.deadline is None:
            return sel
        bound = deadline_bucket(self.deadline)
        if bound is None:
            return None
        matchers = sorted((*(m for m in sel.matchers if m[0] != "le"), ("le", "=", le_label(bound))))
        return Selector(sel.name, tuple(matchers))

    def present(self, series: str) -> bool:
        if is_learned(series):
            return series in self.learned
        sel = self.effective(series)
        return sel is not None and any(sel.matches(sel.name, lb) for lb in self.by_name.get(sel.name, ()))

    def why(self, series: str) -> str:
        sel = Selector.parse(series)
        name = sel.name
        if name == UP:
            return "Prometheus scrapes no target of the jobs the rules read (--vllm-job)"
        if name == mn.CAPACITY or is_learned(series):
            return NO_CAPACITY
        if name == mn.CLIENT_DEADLINE:
            return NO_DEADLINE
        if name.startswith("retrywatch_"):
            return self.no_proxy or f"missing {series}"
        if self.no_vllm is not None:
            return self.no_vllm
        if name == _E2E_BUCKET and name in self.by_name:
            return self._bucket_why()
        return f"missing {_family_name(name)}{self._hint(_family_name(name))}"

    def _bounds(self) -> list[float]:
        les = {lb.get("le", "") for lb in self.by_name.get(_E2E_BUCKET, ())}
        return sorted(float(le) for le in les if le not in ("", "+Inf"))

    def _bucket_why(self) -> str:
        d = self.deadline
        if d is None:
            return f"missing {_E2E_BUCKET}"
        bound = deadline_bucket(d)
        bounds = self._bounds()
        if bound is None:
            return f"a {d:g}-s deadline is below vLLM's first e2e latency bucket"
        if bounds and bounds[-1] < d:
            return f"vLLM's e2e latency buckets end at {bounds[-1]:g} s: they cannot tell a {d:g}-s deadline"
        return f"vLLM's e2e latency histogram has no bucket at {bound:g} s, where a {d:g}-s deadline is read"

    def _hint(self, canonical: str) -> str:
        if self.family is None or canonical not in self.family.series:
            return ""
        served = self.family.series[canonical]
        if served is None:
            return " (this release does not serve it)"
        if served.name != canonical:
            return f" (this release serves it as {served.name})"
        if served.kind == "histogram":
            return " (vLLM serves it once a request has finished)"
        return ""

    def note_between_buckets(self) -> str | None:
        d = self.deadline
        if d is None:
            return None
        bound = deadline_bucket(d)
        if bound is None or math.isclose(bound, d):
            return None
        return (
            f"a {d:g}-s deadline falls between vLLM's e2e latency buckets: read at {bound:g} s, "
            f"requests finished between {bound:g} s and {d:g} s count as late"
        )


def _family_name(sample_name: str) -> str:
    """The canonical series a sample name belongs to (a histogram's _bucket/_count/_sum, an older
    release's name for it)."""
    sample_name = canonical_name(sample_name)
    for suffix in _HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and base in CANONICAL:
            return base
    return sample_name


@dataclass(frozen=True)
class _Judged:
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def blocked(self) -> bool:
        return bool(self.reasons)


def _judge_need(need: Need, facts: _Facts) -> _Judged:
    if not need:
        return _Judged(("never evaluates",))
    missing = [(alt, [s for s in sorted(alt) if not facts.present(s)]) for alt in need]
    usable = [alt for alt, lacking in missing if not lacking]
    if usable:
        note = facts.note_between_buckets()
        reads_bucket = all(any(Selector.parse(s).name == _E2E_BUCKET for s in alt) for alt in usable)
        return _Judged(notes=(note,) if note and reads_bucket else ())
    fewest = min(len(lacking) for _, lacking in missing)
    reasons = [facts.why(s) for _, lacking in missing if len(lacking) == fewest for s in lacking]
    return _Judged(tuple(dict.fromkeys(reasons)))


def _unique_signals(term: Condition, others: Iterable[Condition]) -> list[str]:
    elsewhere = {leaf.signal for other in others for leaf in leaves(other)}
    mine = list(dict.fromkeys(leaf.signal for leaf in leaves(term)))
    return [s for s in mine if s not in elsewhere] or mine


def _judge(cond: Condition, facts: _Facts) -> _Judged:
    if isinstance(cond, Cmp):
        return _judge_need(signal_needs(cond.signal), facts)
    judged = [_judge(term, facts) for term in cond.terms]
    if isinstance(cond, AnyOf):
        ok = [j for j in judged if not j.blocked]
        if not ok:
            return _Judged(tuple(dict.fromkeys(r for j in judged for r in j.reasons)))
        notes = [n for j in ok for n in j.notes]
        for i, j in enumerate(judged):
            if j.blocked:
                others = [t for k, t in enumerate(cond.terms) if k != i]
                on = ", ".join(_unique_signals(cond.terms[i], others))
                notes.append(f"its alternative on {on} cannot evaluate: {'; '.join(j.reasons)}")
        return _Judged(notes=tuple(dict.fromkeys(notes)))
    return _Judged(
        tuple(dict.fromkeys(r for j in judged for r in j.reasons)),
        tuple(dict.fromkeys(n for j in judged for n in j.notes)),
    )


def _verdict(
    rule: AlertRule, facts: _Facts, rules: Mapping[str, tuple[str, str, bool]] | None, prometheus: bool
) -> AlertVerdict:
    judged = _judge(rule.condition, facts)
    reasons, notes = list(judged.reasons), list(judged.notes)
    if prometheus and rules is not None:
        loaded = rules.get(rule.name)
        if loaded is None:
            reasons.append("not loaded in Prometheus' rules (retrywatch mixin)")
        else:
            health, error, evaluated = loaded
            if health not in ("ok", "unknown"):
                reasons.append(f"its rule in Prometheus is {health}: {error}".rstrip(": "))
            elif not evaluated:
                notes.append("loaded in Prometheus, not evaluated yet")
    status: Status = "ok"
    if reasons and _no_queue_cap(reasons, facts):
        # The queue-cap loop needs a cap: a vLLM that cannot refuse has no such loop to page on.
        status, reasons = "n/a", []
        notes.insert(0, "this vLLM has no engine queue cap (--max-num-queued-reqs): no such loop can form")
    elif reasons:
        status = "blocked"
    elif any(n.startswith("its alternative") for n in notes):
        status = "partial"
    elif notes:
        status = "approximate"
    return AlertVerdict(rule.name, rule.severity, rule.tier, status, tuple(reasons), tuple(notes))


def _no_queue_cap(reasons: Sequence[str], facts: _Facts) -> bool:
    """Whether the alert is blocked by, among others, the admission-rejections counter of a release
    that serves none (vLLM before 0.32 has no ``--max-num-queued-reqs``): whatever else it
    lacks, there is no cap for it to page on."""
    family = facts.family
    return (
        family is not None
        and mn.VLLM_ADMISSION_REJECTIONS in family.series
        and family.series[mn.VLLM_ADMISSION_REJECTIONS] is None
        and any(mn.VLLM_ADMISSION_REJECTIONS in r for r in reasons)
    )


def _value(samples: Iterable[Sample], name: str) -> float | None:
    values = [v for n, _, v in samples if n == name and math.isfinite(v) and v > 0]
    return max(values) if values else None


def diagnose(
    *,
    endpoints: Sequence[Endpoint],
    vllm_samples: Sequence[Sample] | None,
    proxy_samples: Sequence[Sample] | None,
    prometheus: PrometheusView | None,
    capacity: float | None,
    deadline: float | None,
) -> Report:
    """The report over what was read (None: not given, or it did not answer) and the numbers
    stated on the command line."""
    direct = [*(vllm_samples or ()), *(proxy_samples or ())]
    seen = prometheus.samples if prometheus is not None else direct
    vllm_view = [s for s in (vllm_samples or proxy_samples or seen) if s[0].startswith("vllm:")]
    family = release_for(vllm_view) if vllm_view else None
    learned = prometheus.learned if prometheus is not None else frozenset()

    dl_seen = _value(seen, mn.CLIENT_DEADLINE)
    if deadline is not None:
        dl = Number(deadline, "stated")
    elif dl_seen is not None:
        dl = Number(dl_seen, "exported")
    else:
        dl = Number(None, "missing")
    # the numbers stated here count as the series that state them in the rules (rules.stated)
    stated: list[Sample] = []
    if capacity is not None:
        stated.append((mn.CAPACITY, {}, capacity))
    if deadline is not None:
        stated.append((mn.CLIENT_DEADLINE, {}, deadline))
    # NoData reads ``up``: the detector records every scrape, answered or not; a Prometheus, its targets
    up = bool(prometheus.jobs) if prometheus is not None else True
    samples = [*seen, *stated, *([(UP, {}, 1.0)] if up else [])]
    proxy_given = any(e.role == "proxy" for e in endpoints)
    # the proxy's own series (the stated rules record the two numbers under its names too)
    proxy_seen = proxy_samples is not None or any(
        s[0].startswith("retrywatch_") and s[0] not in STATED for s in seen
    )
    facts = _Facts(
        samples,
        learned,
        family,
        no_proxy=None if proxy_seen else ("the proxy did not answer" if proxy_given else NO_PROXY),
        no_vllm=None if any(s[0].startswith("vllm:") for s in seen) else _no_vllm(endpoints, prometheus),
        deadline=dl.value,
    )
    cap_seen = _value(seen, mn.CAPACITY)
    cap_learned = any(is_learned(r) and r in learned and "capacity" in r for r in learned)
    lacking_prediction = tuple(
        f + facts._hint(f)
        for f in PREDICTOR_FAMILIES
        if not all(facts.present(s) for s in PREDICTOR_SERIES if _predictor_family(s) == f)
    )
    if capacity is not None:
        cap = Number(capacity, "stated")
    elif cap_seen is not None:
        cap = Number(cap_seen, "exported")
    elif cap_learned:
        cap = Number(None, "learned")
    elif not lacking_prediction:
        cap = Number(None, "predicted")
    else:
        cap = Number(None, "not stated", lacking_prediction)
    tiers: tuple[Tier, ...] = TIERS if proxy_seen or proxy_given else ("vllm",)
    rules = prometheus.rules if prometheus is not None else None
    alerts = tuple(
        _verdict(rule, facts, rules, prometheus is not None)
        for tier in tiers
        for rule in ALERTS
        if rule.tier == tier
    )
    if any(e.role == "Prometheus" and not e.answered for e in endpoints):
        # the rules run there: none fires while it does not answer
        down = "Prometheus did not answer"
        alerts = tuple(
            AlertVerdict(a.name, a.severity, a.tier, "blocked", (down, *a.reasons), a.notes) for a in alerts
        )

    needed = sorted(
        {
            _family_name(Selector.parse(s).name)
            for rule in ALERTS
            for signal in dict.fromkeys(leaf.signal for leaf in leaves(rule.condition))
            for alt in signal_needs(signal)
            for s in alt
            if s.startswith("vllm:")
        }
    )
    present = tuple(n for n in needed if any(_family_name(s[0]) == n for s in seen))
    missing = tuple(n + facts._hint(n) for n in needed if n not in present)
    lacking: tuple[str, ...] = ()
    if prometheus is not None and direct:
        held = {s[0] for s in prometheus.samples}
        lacking = tuple(
            sorted({_family_name(n) for n, _, _ in direct if n not in held and _family_name(n) in needed})
        )
    proxy_families = None
    if proxy_samples is not None:
        proxy_families = tuple(
            sorted({_family_name(n) for n, _, _ in proxy_samples if n.startswith("retrywatch_")})
        )
    return Report(
        endpoints=tuple(endpoints),
        release=family.name if family is not None else None,
        series_present=present,
        series_missing=missing,
        proxy_families=proxy_families,
        lacking_in_prometheus=lacking,
        rules=_rules_line(prometheus, tiers),
        capacity=cap,
        deadline=dl,
        tiers=tiers,
        alerts=alerts,
    )


def _no_vllm(endpoints: Sequence[Endpoint], prometheus: PrometheusView | None) -> str:
    """Why none of vLLM's series is at hand."""
    if prometheus is not None and prometheus.colons_lost:
        return (
            f"Prometheus holds vLLM's series with each colon written as _ ({prometheus.colons_lost[0]}): "
            f"keep the colons ({COLONS_DOC})"
        )
    if prometheus is not None:
        return "Prometheus holds none of vLLM's series (is vLLM scraped, under --selector?)"
    if any(e.answered for e in endpoints):
        return "no vLLM series in what answered (is it vLLM's /metrics?)"
    return "no endpoint serving vLLM's series answered"


def _rules_line(prometheus: PrometheusView | None, tiers: Sequence[Tier]) -> str | None:
    if prometheus is None:
        return None
    if prometheus.rules is None:
        return "its rules could not be read (/api/v1/rules)"
    wanted = [r.name for r in ALERTS if r.tier in tiers]
    loaded = [n for n in wanted if n in prometheus.rules]
    evaluating = [n for n in loaded if prometheus.rules[n][2] and prometheus.rules[n][0] == "ok"]
    return f"{len(loaded)} of {len(wanted)} retrywatch alerts loaded, {len(evaluating)} evaluating"


# --- the text a newcomer pastes -------------------------------------------------------------

_STATUS_WORD: dict[Status, str] = {
    "ok": "ok",
    "approximate": "approx",
    "partial": "partial",
    "blocked": "CANNOT",
    "n/a": "n/a",
}


def _number_line(label: str, n: Number, unit: str, unknown: str) -> str:
    """``unknown``: how a number without a value will be known (or why it will not)."""
    if n.value is not None:
        return f"{label:<11} {n.value:g} {unit} ({n.source})"
    if n.source == "learned":
        return f"{label:<11} learned (Prometheus' rules)"
    if n.source == "predicted":
        return f"{label:<11} {unknown}"
    return f"{label:<11} {n.source}: {unknown}"


def _capacity_missing(n: Number) -> str:
    """What the Ĉ line says where Ĉ has no value: how it will be known."""
    if n.source == "predicted":
        return f"{PREDICTING}; --capacity C states yours"
    return (
        f"the alerts that need it cannot evaluate until it is (--capacity C) or {LEARNING}; "
        f"no prediction from vLLM's counters (vLLM {PREDICTING_SINCE} on): missing {', '.join(n.lacking)}"
    )


def render_text(report: Report) -> str:
    """The report in a few plain lines, the same for the same endpoints."""
    lines = ["retrywatch doctor"]
    for e in report.endpoints:
        state = "answered" if e.answered else f"did not answer: {e.error}"
        lines.append(f"{e.role:<11} {e.url}: {state}")
    total = len(report.series_present) + len(report.series_missing)
    if report.release:
        release = f"vLLM {report.release}"
    elif report.series_present:
        release = "unknown (no vLLM release 0.6.0-0.34 matches)"
    else:
        release = "unknown: no vLLM series read"
    lines.append(f"{'release':<11} {release}")
    series = f"{len(report.series_present)} of {total} vLLM series the alerts read are present"
    if report.series_missing and report.series_present:
        series += "; missing " + ", ".join(report.series_missing)
    lines.append(f"{'series':<11} {series}")
    if report.lacking_in_prometheus:
        lines.append(f"{'':<11} Prometheus lacks what is served: {', '.join(report.lacking_in_prometheus)}")
    if report.proxy_families is not None:
        lines.append(f"{'proxy':<11} {len(report.proxy_families)} retrywatch_* families")
    if report.rules is not None:
        lines.append(f"{'rules':<11} {report.rules}")
    lines.append(
        _number_line(
            "Ĉ",
            report.capacity,
            "calls/s",
            _capacity_missing(report.capacity),
        )
    )
    tiers = "either tier's" if "proxy" in report.tiers else "the"
    lines.append(
        _number_line(
            "deadline",
            report.deadline,
            "s",
            f"not stated (--deadline S) nor exported by a proxy: {tiers} alerts that read it cannot "
            "evaluate until it is (none is assumed); VLLMTierNoData and VLLMDeadlineMissing fire",
        )
    )
    if "proxy" not in report.tiers:
        lines.append(f"{'proxy tier':<11} not judged: {NO_PROXY}")
    for tier in report.tiers:
        lines.append(f"alerts ({tier} tier)")
        for a in (a for a in report.alerts if a.tier == tier):
            kind = "page" if a.page else a.severity
            why = "; ".join((*a.reasons, *a.notes))
            lines.append(f"  {_STATUS_WORD[a.status]:<8} {a.name} ({kind})" + (f": {why}" if why else ""))
    blocked = report.pages_blocked
    pages = sum(1 for a in report.alerts if a.page and a.status != "n/a")
    verdict = f"{len(blocked)} of {pages} pages cannot fire" if blocked else f"every page ({pages}) can fire"
    lines.append(f"{'verdict':<11} {verdict}")
    return "\n".join(lines) + "\n"
