"""The daily what-if on the proxy's recorded traffic: each policy's headroom against the
delivery objective on the last window of the recording, its history, and its series.

An operator asks each day: with the traffic this service really had, how much more could it
take under the policy in force before it misses the delivery objective, and would another policy
leave more? This module answers it, pure enough to test:

* :func:`detector_capacity`: the engine's Ĉ as its detector knows it (the detector's
  ``/metrics``: ``retrywatch_detector_capacity_calls_per_second`` and its source);
* :func:`observe`: the last ``window_s`` of a recording (``retrywatch proxy --record DIR``, read
  as a trace of layout ``recording``): its calls, mean rate and peak rate (the busiest
  :data:`PEAK_WINDOW_S` of it);
* :func:`run_day`: that window replayed on the simulator under each policy (the what-if's
  :func:`~reproduce.planner.whatif.headroom`, through the same executor interface), each one's
  headroom, and the row of :class:`History` it adds; each policy's search starts warm from the
  history's newest answer (:func:`warm_start`: that load, then outwards, on the same grid as a
  cold search, so the answer is a cold search's wherever more load never helps); where there is
  none, from the load at which the window's busiest minutes reach Ĉ (:func:`starts`), which
  keeps the first day off the search's costly upper limit; its ``whatif.json`` keeps each search, its
  start, and the curves and marks the dashboard draws (:func:`~reproduce.planner.whatif.curve`,
  :func:`~reproduce.planner.whatif.marks`);
* :class:`History`: every run and each policy's headroom in SQL (SQLAlchemy; SQLite by default,
  any URL ``detector.store.make_engine`` takes);
* :class:`HeadroomCollector`: the latest run as Prometheus series, read fresh on every scrape;
* :func:`render_rules`: the ``VLLMHeadroomLow`` rule group, from :data:`MARGIN` and the series'
  names (``rules/headroom/``; ``python -m reproduce.planner.daily --check`` compares).

NOTE: the what-if's load is the replay's *mean* rate in multiples of the simulator's Ĉ, while
an operator watches the peak against the engine's Ĉ. The published headroom is therefore the
policy's safe mean load times the window's peak-to-mean ratio: the peak load, in multiples of
Ĉ, that traffic of this shape may reach under the policy. Its ratio to the observed peak is
the headroom's ratio to the observed mean: the share of growth the policy still absorbs.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from sqlalchemy import (
    Boolean,
    Column,
    Engine,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    select,
)

from detector.runbook import DEFAULT_PATTERN, runbook_url
from detector.sources.scrape import MAX_BODY_BYTES
from detector.store import make_engine
from reproduce.planner.whatif import (
    DEFAULT_CRITERION,
    PRECISION,
    Objective,
    WhatIf,
    criterion_words,
    headroom_with_curves,
    marks,
    parse_policies,
    write_whatif,
)
from reproduce.workloads.trace import MAX_REPLAY_CALLS, TraceWorkload
from reproduce.workloads.traces import read_trace

__all__ = [
    "ALERT",
    "DEFAULT_AT",
    "MARGIN",
    "PEAK_WINDOW_S",
    "POLICY_IN_FORCE",
    "WINDOW_S",
    "DailyJob",
    "Day",
    "HeadroomCollector",
    "History",
    "Window",
    "busiest_stretch",
    "detector_capacity",
    "observe",
    "parse_at",
    "render_rules",
    "replayed",
    "run_day",
    "starts",
    "warm_start",
]

#: The window of the recording each run replays: its last day.
WINDOW_S = 86_400.0
#: The observed peak: the most calls in any window this long (the detector's rate window).
PEAK_WINDOW_S = 60.0
#: The warning's margin: the policy in force must leave headroom / observed peak >= 1 + MARGIN.
MARGIN = 0.25
#: When the job runs each day, UTC (HH:MM).
DEFAULT_AT = "04:00"
#: The policy the proxy runs by default (``reproduce.planner.whatif.POLICIES``).
POLICY_IN_FORCE = "default"
#: The mean loads searched (multiples of Ĉ): lower than the what-if's, since a day's traffic peaks
#: well above its mean (a safe mean of 0.5x Ĉ is often a peak above Ĉ).
HEADROOM_RANGE = (0.05, 6.0)
#: The history's file under the state directory (SQLite) and each run's what-if DIR.
HISTORY_FILE = "history.sqlite"
RUNS_DIR = "runs"
LATEST = "latest.json"
#: The warning and the series it reads.
ALERT = "VLLMHeadroomLow"
HEADROOM_SERIES = "retrywatch_headroom_load"
BEST_SERIES = "retrywatch_headroom_best_load"
PEAK_SERIES = "retrywatch_observed_peak_load"
MARGIN_SERIES = "retrywatch_headroom_margin"
LAST_RUN_SERIES = "retrywatch_headroom_last_run_timestamp_seconds"
#: The detector's series of Ĉ in force (``detector.service.DetectorMetrics.capacity``), labelled
#: instance, tier and source; which of an engine's is taken when it has several: the stated over
#: the measured over the predicted, the proxy's tier over vLLM's.
DETECTOR_CAPACITY = "retrywatch_detector_capacity_calls_per_second"
SOURCE_ORDER = ("stated", "saturated", "predicted")
TIER_ORDER = ("proxy", "vllm")
#: How long the detector has to answer.
DETECTOR_TIMEOUT_S = 10.0
#: The most of the detector's /metrics read: the bound the detector's own scrapes keep.
DETECTOR_MAX_BYTES = MAX_BODY_BYTES
#: How long the warning's condition must hold (the series change once a day).
ALERT_FOR_S = 300.0
RULES_DIR = Path(__file__).resolve().parents[2] / "rules" / "headroom"
RULES_PATH = RULES_DIR / "headroom.rules.yml"


NO_CAPACITY = (
    "the engine's Ĉ is needed: give --capacity (calls/s) or --detector URL (the detector that "
    "follows this engine)"
)


class DailyError(ValueError):
    """A daily what-if that cannot run as asked (no recording, too few calls, bad settings)."""


def detector_capacity(url: str, instance: str | None = None) -> tuple[float, str]:
    """The engine's Ĉ (calls/s) as the detector at ``url`` publishes it on ``/metrics``, and
    where it came from; ``instance``: which engine, needed when the detector follows several."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=DETECTOR_TIMEOUT_S) as reply:
            raw = reply.read(DETECTOR_MAX_BYTES + 1)
    except (OSError, ValueError) as exc:  # refused, timed out, an HTTP error, not a URL
        why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise DailyError(f"the detector at {url} does not answer: {why}") from None
    if len(raw) > DETECTOR_MAX_BYTES:
        raise DailyError(f"{url}/metrics is over the {DETECTOR_MAX_BYTES}-byte bound; it is not read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DailyError(f"{url}/metrics is not UTF-8 text ({exc})") from None
    try:
        found = [
            (s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == DETECTOR_CAPACITY and s.value > 0 and math.isfinite(s.value)
        ]
    except ValueError as exc:
        raise DailyError(f"{url}/metrics is not a Prometheus exposition: {exc}") from None
    engines = sorted({labels.get("instance", "") for labels, _ in found})
    if not engines:
        raise DailyError(
            f"the detector at {url} publishes no Ĉ ({DETECTOR_CAPACITY}) yet: give --capacity, or run "
            "once it has measured or predicted one"
        )
    if instance is None and len(engines) > 1:
        raise DailyError(
            f"the detector at {url} follows {len(engines)} engines ({', '.join(engines)}): "
            "name one (--engine)"
        )
    chosen = engines[0] if instance is None else instance
    mine = [(labels, v) for labels, v in found if labels.get("instance") == chosen]
    if not mine:
        raise DailyError(f"the detector at {url} has no Ĉ for engine {chosen!r}; it has {', '.join(engines)}")

    def rank(item: tuple[dict[str, str], float]) -> tuple[int, int]:
        labels = item[0]
        source, tier = labels.get("source", ""), labels.get("tier", "")
        return (
            SOURCE_ORDER.index(source) if source in SOURCE_ORDER else len(SOURCE_ORDER),
            TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER),
        )

    labels, value = min(mine, key=rank)
    return value, f"the detector's ({url}): {chosen}, tier {labels.get('tier')}, {labels.get('source')}"


def parse_at(text: str) -> tuple[int, int]:
    """``HH:MM`` (UTC) as (hour, minute)."""
    hour, sep, minute = text.partition(":")
    try:
        h, m = int(hour), int(minute)
    except ValueError:
        h = m = -1
    if not sep or not (0 <= h < 24 and 0 <= m < 60):
        raise DailyError(f"{text!r} is not a time of day HH:MM (UTC)")
    return h, m


@dataclass(frozen=True)
class Window:
    """The replayed window of a recording, in seconds from its first call."""

    start_s: float
    end_s: float
    calls: int
    mean_rate: float  # calls/s: (calls - 1) / (last - first arrival), as a trace replay takes it
    peak_rate: float  # calls/s: the most calls in any PEAK_WINDOW_S, over PEAK_WINDOW_S
    # the calls in each PEAK_WINDOW_S from the first call on (observe's; the history keeps none)
    bins: tuple[int, ...] = ()
    # when this is the busiest stretch of a window holding more calls than a replay may: that
    # window's start, end and calls (observe's; the history keeps none)
    cut_from: tuple[float, float, int] | None = None

    @property
    def peak_to_mean(self) -> float:
        return self.peak_rate / self.mean_rate

    def onset_load(self, share: float) -> float:
        """The mean load (multiples of Ĉ) at which ``share`` of the window's calls arrive in its
        :data:`PEAK_WINDOW_S` bins above Ĉ: the busiest bins, holding that share between them,
        reach Ĉ. A load whose overloaded minutes hold more than the share the delivery objective
        may miss (``1 - target``) misses it, unless queueing carries them; one just below tends
        to meet it. Without bins, where the window's peak reaches Ĉ."""
        if not self.bins:
            return 1.0 / self.peak_to_mean
        ordered = sorted(self.bins, reverse=True)
        held = list(itertools.accumulate(ordered))
        k = min(bisect.bisect_left(held, share * held[-1]), len(ordered) - 1)
        return self.mean_rate * PEAK_WINDOW_S / ordered[k]


def busiest_stretch(bins: Sequence[int], most: int) -> tuple[int, int]:
    """The busiest run of whole bins that holds at most ``most`` calls and is as long as such a
    run can be wherever it lies: (its first bin, its bins). ``DailyError`` when one bin holds more."""
    prefix = list(itertools.accumulate(bins, initial=0))

    def busiest(d: int) -> tuple[int, int]:  # the busiest run of d bins: (calls, -first bin)
        return max((prefix[i + d] - prefix[i], -i) for i in range(len(bins) - d + 1))

    if not bins or busiest(1)[0] > most:
        raise DailyError(
            f"a single {PEAK_WINDOW_S:g}-s stretch holds more than {most:,} calls: nothing to replay"
        )
    lo, hi = 1, len(bins)  # the longest run whose busiest placement fits (more bins never hold fewer calls)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if busiest(mid)[0] <= most else (lo, mid - 1)
    return -busiest(lo)[1], lo


def observe(
    recording: Path,
    window_s: float = WINDOW_S,
    end_s: float | None = None,
    most: int = MAX_REPLAY_CALLS,
) -> Window:
    """The last ``window_s`` of ``recording`` up to ``end_s`` (seconds from its first call;
    None: its last call), its calls' mean rate and peak rate. Streams the recording (twice
    when ``end_s`` is None: once to find its end).

    A window of more than ``most`` calls (a replay's limit, ``MAX_REPLAY_CALLS``) is cut to its
    busiest stretch (:func:`busiest_stretch`, in whole :data:`PEAK_WINDOW_S` bins) and that
    stretch is returned, read again, with ``cut_from`` saying what it was cut from. The stretch
    holds the window's busiest minutes: the objective judged on it is judged on traffic at least
    as busy as the whole window's, a stricter test than on the whole of it."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise DailyError(f"the window must be a positive number of seconds, got {window_s!r}")
    if end_s is None:
        end_s = max((r.arrival_s for r in read_trace(recording, "recording")), default=0.0)
    start_s = max(0.0, end_s - window_s)
    arrivals: deque[float] = deque()
    bins: list[int] = []
    n = busiest = 0
    first = last = 0.0
    for record in read_trace(recording, "recording"):
        t = record.arrival_s
        if t < start_s:
            continue
        if t > end_s:
            break
        first = t if n == 0 else first
        last, n = t, n + 1
        arrivals.append(t)
        while arrivals[0] <= t - PEAK_WINDOW_S:
            arrivals.popleft()
        busiest = max(busiest, len(arrivals))
        k = int((t - first) // PEAK_WINDOW_S)
        bins.extend([0] * (k + 1 - len(bins)))
        bins[k] += 1
    if n < 2 or last <= first:
        raise DailyError(
            f"{recording}: the window {start_s:g}..{end_s:g} s holds {n} call(s); a replay needs at "
            "least two at different times"
        )
    if n > most:
        i, d = busiest_stretch(bins, most)
        cut = observe(recording, d * PEAK_WINDOW_S, first + (i + d) * PEAK_WINDOW_S - 1e-6, most)
        return replace(cut, cut_from=cut.cut_from or (start_s, end_s, n))
    mean = (n - 1) / (last - first)
    return Window(start_s, end_s, n, mean, max(busiest / PEAK_WINDOW_S, mean), tuple(bins))


@dataclass(frozen=True)
class DailyJob:
    """What every daily run shares: the recording, where its state lives, the what-if's settings
    (its workload replaced by each day's window) and the policies."""

    recording: Path
    state: Path
    whatif: WhatIf  # the backend, model, clients, seeds, time scale, executor; its workload unused
    policies: Sequence[str]
    policy_in_force: str = POLICY_IN_FORCE
    margin: float = MARGIN
    capacity: float | None = None  # the engine's Ĉ, calls/s (None: the detector's, read each run)
    window_s: float = WINDOW_S
    precision: float = PRECISION
    lo: float = HEADROOM_RANGE[0]
    hi: float = HEADROOM_RANGE[1]
    database: str | None = None  # a SQLAlchemy URL (None: SQLite in ``state``)
    detector: str | None = None  # the detector's base URL, read for Ĉ where ``capacity`` is None
    engine: str | None = None  # the detector's instance label of this engine (None: its only one)

    def __post_init__(self) -> None:
        names = parse_policies(",".join(self.policies))
        if self.policy_in_force not in names:
            raise DailyError(f"the policy in force {self.policy_in_force!r} is not among {', '.join(names)}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise DailyError(f"the margin must be a non-negative fraction, got {self.margin!r}")
        if self.capacity is not None and not (math.isfinite(self.capacity) and self.capacity > 0):
            raise DailyError(f"Ĉ must be a positive number of calls per second, got {self.capacity!r}")
        if self.capacity is None and self.detector is None:
            raise DailyError(NO_CAPACITY)

    def read_capacity(self) -> tuple[float, str]:
        """Ĉ and its source: the one stated, else the detector's now."""
        if self.capacity is not None:
            return self.capacity, "given"
        assert self.detector is not None  # __post_init__
        return detector_capacity(self.detector, self.engine)

    @property
    def url(self) -> str:
        return self.database or f"sqlite:///{self.state / HISTORY_FILE}"


@dataclass(frozen=True)
class Day:
    """One run's answer: the window, Ĉ, the observed loads and each policy's headroom."""

    run_at: float  # Unix seconds
    window: Window
    capacity: float
    capacity_source: str
    policy_in_force: str
    margin: float
    headroom: dict[str, float]  # policy -> peak load it may reach, multiples of Ĉ (0: none found safe)
    kind: dict[str, str]  # policy -> the search's kind: bracketed, at-least, below
    out: Path | None = None
    # policy -> its search as whatif.json keeps it (this run's only: the history keeps none)
    searches: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def observed_peak_load(self) -> float:
        return self.window.peak_rate / self.capacity

    @property
    def observed_mean_load(self) -> float:
        return self.window.mean_rate / self.capacity

    def ratio(self, policy: str) -> float:
        """Headroom over the observed peak (the share of growth left, plus one)."""
        return self.headroom[policy] / self.observed_peak_load

    @property
    def low(self) -> bool:
        """The warning's condition: the policy in force leaves less than the margin."""
        return self.ratio(self.policy_in_force) < 1 + self.margin

    def best(self) -> str:
        return max(self.headroom, key=lambda p: (self.headroom[p], p == self.policy_in_force))

    def says(self) -> str:
        p, best = self.policy_in_force, self.best()
        w = self.window
        cut = "" if w.cut_from is None else (
            f", the busiest stretch of {w.cut_from[2]} calls over {w.cut_from[1] - w.cut_from[0]:g} s: a "
            f"replay holds at most {MAX_REPLAY_CALLS:,}"
        )  # fmt: skip
        text = (
            f"observed peak {self.observed_peak_load:.3g}x Ĉ ({w.calls} calls over {w.end_s - w.start_s:g} s"
            f"{cut}); {p} leaves {self.ratio(p):.3g}x of it"
            + (f" (below 1 + margin {self.margin:g}: {ALERT})" if self.low else "")
        )
        if best != p:
            more, gain = self.headroom[best] - self.headroom[p], self.gain()
            text += f"; {best} leaves the most: {self.ratio(best):.3g}x (+{more:.3g}x Ĉ, {gain:.3g}x {p}'s)"
        return text

    def search_text(self, policy: str) -> str:
        """How ``policy``'s search went: where it started and the loads it ran."""
        search = self.searches.get(policy)
        if search is None:
            return ""
        start, n = search.get("start") or {}, len(search.get("tried") or [])
        began = {
            "warm": f"warm start at {start.get('load', 0):g}x (the last run's {start.get('from', 0):.4g}x)",
            "onset": f"start at {start.get('load', 0):g}x (where its busiest minutes reach Ĉ)",
        }.get(str(start.get("kind")), "cold start")
        return f"{began}, {n} load{'s' if n != 1 else ''} run"

    def gain(self) -> float:
        """The most headroom of any policy over the policy in force's (inf where it leaves none)."""
        best, mine = self.headroom[self.best()], self.headroom[self.policy_in_force]
        return best / mine if mine > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_at": self.run_at,
            "window": {"start_s": self.window.start_s, "end_s": self.window.end_s, "calls": self.window.calls,
                       "mean_rate": self.window.mean_rate, "peak_rate": self.window.peak_rate,
                       "cut_from": None if (w := self.window.cut_from) is None else
                       {"start_s": w[0], "end_s": w[1], "calls": w[2]}},
            "capacity": self.capacity,
            "capacity_source": self.capacity_source,
            "observed_peak_load": self.observed_peak_load,
            "observed_mean_load": self.observed_mean_load,
            "policy_in_force": self.policy_in_force,
            "margin": self.margin,
            "headroom_load": self.headroom,
            "kind": self.kind,
            "low": self.low,
            "best": self.best(),
            "gain": self.gain(),
            "says": self.says(),
        }  # fmt: skip


def run_day(job: DailyJob, *, now: float | None = None, end_s: float | None = None) -> Day:
    """Replay the recording's last window under each policy, find each one's headroom (each
    search warm from the history's newest answer where it has one: :func:`warm_start`), write
    the run's ``whatif.json`` (the answer, each search, the curves and their marks), and add the
    run to the history (``end_s``: the window's end, seconds from the recording's first call;
    None: its last call)."""
    run_at = time.time() if now is None else now
    window = observe(job.recording, job.window_s, end_s)
    capacity, source = job.read_capacity()  # before the replays: a detector that fails, fails fast
    stamp = datetime.fromtimestamp(run_at, UTC).strftime("%Y%m%dT%H%M%SZ")
    out = job.state / RUNS_DIR / f"{stamp}-w{window.start_s:.0f}-{window.end_s:.0f}"
    out.mkdir(parents=True, exist_ok=True)
    setup = replayed(job, window)
    previous, start = warm_start(job)
    objective = Objective()
    begin, kinds = starts(job.policies, start, window, objective)
    found, curves = headroom_with_curves(
        setup, list(job.policies), out, lo=job.lo, hi=job.hi, precision=job.precision,
        objective=objective, start=begin, start_kind=kinds,
    )  # fmt: skip
    # the safe mean load (multiples of the simulator's Ĉ) as the peak load of this traffic's shape
    # (multiples of Ĉ): the observed peak is the observed mean times the same ratio
    safe = {p: float(f["headroom_load"] or 0.0) for p, f in found.items()}
    day = Day(
        run_at, window, capacity, source, job.policy_in_force, job.margin,
        {p: round(safe[p] * window.peak_to_mean, 4) for p in job.policies},
        {p: str(found[p]["kind"]) for p in job.policies}, out, found,
    )  # fmt: skip
    write_whatif(out, {
        "daily": day.to_dict(),
        "warm_start": None if previous is None else {"run_at": previous.run_at, "safe_mean_load": start},
        "objective": objective.describe(),
        "criterion": criterion_words(DEFAULT_CRITERION, objective),
        "headroom": found,
        "curves": {p: {"curve": curves[p], **marks(curves[p])} for p in job.policies},
    })  # fmt: skip
    store = History(job.url)
    try:
        store.add(day)
    finally:
        store.close()
    (job.state / LATEST).write_text(json.dumps(day.to_dict(), indent=1) + "\n", encoding="utf-8")
    return day


def replayed(job: DailyJob, window: Window) -> WhatIf:
    """The what-if of ``window``: the job's, replaying the recording over that window (each
    point sets the load, its mean rate in multiples of Ĉ)."""
    workload = TraceWorkload(str(job.recording), "recording", 1.0, window.start_s, window.end_s + 1e-6)
    return replace(job.whatif, workload=workload)


def warm_start(job: DailyJob) -> tuple[Day | None, dict[str, float]]:
    """The history's newest run and, per policy of ``job`` it searched, its answer as the search
    took it, a safe *mean* load (its headroom over that window's peak-to-mean ratio; 0 where none
    was safe): where today's search starts (a policy it did not search starts cold)."""
    store = History(job.url)
    try:
        newest = store.days(limit=1)
    finally:
        store.close()
    if not newest:
        return None, {}
    day = newest[0]
    ratio = day.window.peak_to_mean
    return day, {p: day.headroom[p] / ratio for p in job.policies if p in day.headroom}


def starts(
    policies: Sequence[str], warm: Mapping[str, float], window: Window, objective: Objective
) -> tuple[dict[str, float], dict[str, str]]:
    """Where each policy's search starts, and what that start is: the history's answer
    (``warm``, "warm"), else the mean load at which the window's busiest minutes holding the
    share of calls the objective may miss reach Ĉ (:meth:`Window.onset_load`, "onset"), near
    which a policy's headroom lies. Either way the search ends on a cold search's answer
    wherever more load never helps; the estimate spares the first day the cold search's limits
    (its 6x point replays the window at six times Ĉ) and most of its midpoints."""
    onset = window.onset_load(1.0 - objective.target)
    begin = {p: warm.get(p, onset) for p in policies}
    return begin, {p: "warm" if p in warm else "onset" for p in policies}


# --- the history ------------------------------------------------------------------------------

metadata = MetaData()
runs = Table(
    "headroom_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_at", Float, nullable=False, index=True),
    Column("window_start_s", Float, nullable=False),
    Column("window_end_s", Float, nullable=False),
    Column("calls", Integer, nullable=False),
    Column("mean_rate", Float, nullable=False),
    Column("peak_rate", Float, nullable=False),
    Column("capacity", Float, nullable=False),
    Column("capacity_source", String(200), nullable=False),
    Column("policy_in_force", String(64), nullable=False),
    Column("margin", Float, nullable=False),
    Column("low", Boolean, nullable=False),
)
policies = Table(
    "headroom_policies",
    metadata,
    Column("run_id", Integer, ForeignKey("headroom_runs.id"), primary_key=True),
    Column("policy", String(64), primary_key=True),
    Column("headroom_load", Float, nullable=False),
    Column("kind", String(16), nullable=False),
)


class History:
    """Every daily run and each policy's headroom, in SQL; each run one committed transaction."""

    def __init__(self, url: str) -> None:
        self.engine: Engine = make_engine(url)
        metadata.create_all(self.engine)

    def add(self, day: Day) -> int:
        w = day.window
        with self.engine.begin() as conn:
            row = conn.execute(
                runs.insert().values(
                    run_at=day.run_at, window_start_s=w.start_s, window_end_s=w.end_s, calls=w.calls,
                    mean_rate=w.mean_rate, peak_rate=w.peak_rate, capacity=day.capacity,
                    capacity_source=day.capacity_source[:200], policy_in_force=day.policy_in_force,
                    margin=day.margin, low=day.low,
                )
            )  # fmt: skip
            key = row.inserted_primary_key
            assert key is not None  # an insert's own key
            run_id = int(key[0])
            conn.execute(
                policies.insert(),
                [{"run_id": run_id, "policy": p, "headroom_load": h, "kind": day.kind[p]}
                 for p, h in day.headroom.items()],
            )  # fmt: skip
        return run_id

    def days(self, limit: int | None = None) -> list[Day]:
        """The runs, newest first."""
        with self.engine.connect() as conn:
            query = select(runs).order_by(runs.c.run_at.desc(), runs.c.id.desc())
            found = conn.execute(query if limit is None else query.limit(limit)).mappings().all()
            out = []
            for r in found:
                rows = conn.execute(select(policies).where(policies.c.run_id == r["id"])).mappings().all()
                window = Window(
                    r["window_start_s"], r["window_end_s"], r["calls"], r["mean_rate"], r["peak_rate"]
                )
                heads = {x["policy"]: x["headroom_load"] for x in rows}
                kinds = {x["policy"]: x["kind"] for x in rows}
                out.append(Day(r["run_at"], window, r["capacity"], r["capacity_source"],
                               r["policy_in_force"], r["margin"], heads, kinds))  # fmt: skip
            return out

    def close(self) -> None:
        self.engine.dispose()


class HeadroomCollector(Collector):
    """The latest run of ``history`` as series, read on every scrape (none before the first run)."""

    def __init__(self, history: History) -> None:
        self.history = history

    def collect(self) -> Iterator[GaugeMetricFamily]:
        latest = self.history.days(limit=1)
        if not latest:
            return
        day = latest[0]
        head = GaugeMetricFamily(
            HEADROOM_SERIES,
            "The peak load, in multiples of Ĉ, this traffic's shape may reach under each policy and "
            "still meet the delivery objective (the daily what-if; 0: none found safe).",
            labels=["policy", "in_force"],
        )
        for p, h in sorted(day.headroom.items()):
            head.add_metric([p, str(p == day.policy_in_force).lower()], h)
        yield head
        best = GaugeMetricFamily(
            BEST_SERIES,
            "The most headroom any configured policy leaves (multiples of Ĉ), labelled with that policy "
            "(the policy in force where it ties).",
            labels=["policy"],
        )
        best.add_metric([day.best()], day.headroom[day.best()])
        yield best
        yield GaugeMetricFamily(
            PEAK_SERIES, f"The replayed window's peak load: its most calls in {PEAK_WINDOW_S:g} s, per "
            "second, in multiples of Ĉ.", value=day.observed_peak_load,
        )  # fmt: skip
        yield GaugeMetricFamily(
            MARGIN_SERIES, "The margin the policy in force must leave: headroom / peak >= 1 + this.",
            value=day.margin,
        )  # fmt: skip
        yield GaugeMetricFamily(LAST_RUN_SERIES, "When the daily what-if last ran.", value=day.run_at)


# --- the warning's rule group -----------------------------------------------------------------


def alert_expr() -> str:
    """The policy in force's headroom over the observed peak, below one plus the margin."""
    return (
        f'max without (policy, in_force) ({HEADROOM_SERIES}{{in_force="true"}}) / {PEAK_SERIES} '
        f"< 1 + {MARGIN_SERIES}"
    )


def gain_query() -> str:
    """The best policy's headroom over the policy in force's, labelled with the best policy: a
    ``printf`` format taking the instance twice (the warning's description queries it)."""
    return (
        f"{BEST_SERIES}{{instance=%q}} / ignoring (policy) group_left max without (policy, in_force) "
        f'({HEADROOM_SERIES}{{instance=%q, in_force="true"}})'
    )


def render_rules() -> str:
    """``rules/headroom/headroom.rules.yml``: the ``VLLMHeadroomLow`` warning."""
    return f"""\
# The daily what-if's warning. GENERATED by `python -m reproduce.planner.daily` from
# reproduce/planner/daily.py (MARGIN {MARGIN:g}, the series it publishes); a group of its own, since
# the series come from `retrywatch reproduce plan-daily`, not from the proxy or vLLM.
groups:
- name: retrywatch-headroom
  rules:
  - alert: {ALERT}
    # the margin is the command's --margin, published beside the headroom (default {MARGIN:g})
    expr: {alert_expr()}
    for: {ALERT_FOR_S:g}s
    labels:
      severity: warning
    annotations:
      summary: The policy in force leaves less headroom than the stated margin over the observed peak.
      description: 'On {{{{ $labels.instance }}}} the policy in force leaves {{{{ $value | printf "%.2f" }}}}x
        the window''s observed peak load before the delivery objective is missed (less than 1 + the
        margin). Most headroom: {{{{ with printf `{gain_query()}` $labels.instance $labels.instance
        | query }}}}{{{{ . | first | label "policy" }}}}, {{{{ . | first | value | printf "%.2f" }}}}x the
        policy in force''s{{{{ end }}}}.'
      runbook_url: {runbook_url(DEFAULT_PATTERN, ALERT)}
"""


def main(argv: Sequence[str]) -> int:
    """``python -m reproduce.planner.daily [--check]``: write (or compare) the rule group."""
    text = render_rules()
    if "--check" in argv:
        same = RULES_PATH.exists() and RULES_PATH.read_text(encoding="utf-8") == text
        if not same:
            print(f"{RULES_PATH} differs from what reproduce/planner/daily.py produces", file=sys.stderr)
        return 0 if same else 1
    RULES_DIR.mkdir(parents=True, exist_ok=True)
    RULES_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
