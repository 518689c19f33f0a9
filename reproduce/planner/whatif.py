"""The what-if: one workload under each named proxy policy, and each policy's headroom.

An operator asks which of the proxy's policies keeps the service out of the retry loop, at what
cost in late and failed calls, and how much more load the engine takes under each before it
tips. This module answers both on any workload (``reproduce.workloads``): ``--load`` is its
``Workload.load`` (the pulse's multiple of Ĉ, a trace's mean rate, a stepped load's top step).

* :data:`POLICIES`: the named policies, each taken from a condition the study declared;
* :func:`compare`: the workload at one load under each policy, judged per policy (delivered
  within the deadline, late, failed; executions per call; collapses and whether a retry loop
  formed, by ``reproduce.judge.groundtruth``; the alerts the detector's replay fired, as
  ``reproduce validate`` replays them);
* :func:`headroom`: per policy, the largest load at which it still meets the delivery objective
  (:class:`Objective`: the share of calls delivered within the deadline, and every collapse over
  soon after arrivals fall back below Ĉ), by bisection to a stated precision on a fixed grid of
  loads (:class:`Grid`), cold or warm from a given load such as yesterday's answer
  (:class:`HeadroomSearch`; every policy's next load runs in one batch, so the batch fans out over
  ``jobs`` processes); beside it, from every load run, where the retry loop first forms (*loop
  onset*) and where the engine is simply overloaded (the objective missed without a loop).
  ``--criterion`` keeps the older answers (:data:`CRITERIA`);
* :func:`curve`: per policy, every load run in DIR judged (delivered within the deadline, late,
  failed against load): the curve, not only the point (:func:`headroom_with_curves`: the
  headroom and the curves from the same points, each judged once).

Every point (policy, load, seed) is a run of ``reproduce.runner.run_many`` in ``DIR/points`` (a
reproduce output directory of its own: ``reproduce validate DIR/points`` reads it). A rerun
into the same DIR skips the points already there, so an interrupted what-if resumes; a DIR whose
points were run with other settings is refused, never mixed, and so is a DIR holding any one point
whose own record (the sweep's settings it was run with, ``STAMP``, and the run's condition, model,
seed and time scale) is not this sweep's. One sweep writes a DIR at a time (``reproduce.dirlock``).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detector.signals import DELIVERY_OBJECTIVE, check_objective
from foundation.groundtruth import Collapse, GroundTruth
from foundation.rundir import SUMMARY, WHATIF, WHATIF_POINTS, RunDirError, read_summary
from reproduce.conditions import (
    ClientProfile,
    Condition,
    ProxyPolicy,
    RunSpec,
    Workload,
    block,
)
from reproduce.dirlock import hold
from reproduce.executors import Executor
from reproduce.judge.groundtruth import CALLS_FILE, CallTimes, read_calls
from reproduce.judge.validate import RunInfo, load_runs, replay_firings, truth_of
from reproduce.registry import Backend
from reproduce.runner import run_many
from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = [
    "BLOCK",
    "CRITERIA",
    "POINTS",
    "POLICIES",
    "STAMP",
    "Grid",
    "HeadroomSearch",
    "Objective",
    "Point",
    "WhatIf",
    "WhatIfError",
    "compare",
    "curve",
    "headroom",
    "headroom_with_curves",
    "marks",
    "parse_policies",
    "write_whatif",
]

#: The block name of every what-if run, and the folder under DIR that holds the points.
BLOCK = "whatif"
POINTS = WHATIF_POINTS

#: The named policies: name -> (block, condition) of the study whose proxy policy it is.
POLICY_SOURCES: dict[str, tuple[str, str]] = {
    "none": ("composition", "no-control"),
    "cancel": ("budget-cancel", "cancellation"),
    "default": ("deferral", "deferred-cancellation"),
    "coalescing": ("composition", "coalescing"),
    "budget": ("composition", "retry-budget"),
    "budget-first": ("composition", "budget-first"),
    "lookup-first": ("composition", "lookup-first"),
    "proxy-cap": ("queue-policy", "proxy-cap"),
    "deadline-check": ("queue-policy", "deadline-check"),
    "lifo": ("queue-policy", "lifo"),
}
#: What each named policy does, in words (docs/reproducing.md's table is this one).
POLICY_HELP: dict[str, str] = {
    "none": "a plain proxy: no coalescing, no budget, no cap, cancellation off",
    "cancel": "cancellation on: a client's disconnect aborts its execution at once",
    "default": "the default recipe: coalescing and cancellation deferred by 10 s",
    "coalescing": "a retry attaches to its call's execution still running",
    "budget": "a retry budget of 10% of first attempts over 60 s (Retry-After when spent)",
    "budget-first": "coalescing and the budget, the budget checked before coalescing",
    "lookup-first": "coalescing and the budget, coalescing looked up first",
    "proxy-cap": "cancellation on and at most 100 outstanding at the proxy (FIFO)",
    "deadline-check": "proxy-cap, and an attempt past its deadline is not dispatched",
    "lifo": "proxy-cap served last-in-first-out past 50 waiting",
}
POLICIES: dict[str, ProxyPolicy] = {
    name: block(b).condition(c).policy for name, (b, c) in POLICY_SOURCES.items()
}
#: Bisection bounds of ``--headroom`` (multiples of Ĉ) and its default precision.
HEADROOM_RANGE = (0.5, 6.0)
PRECISION = 0.05
#: What makes a load unsafe in the headroom search, by ``--criterion``: missing the delivery
#: objective (the default: :class:`Objective`); any collapse; or a metastable collapse only (a
#: sustained overload above Ĉ is a collapse but never metastable, so by that criterion an engine
#: overloaded for good stays "safe": it answers where the loop forms, not how much load is served).
CRITERIA = ("objective", "collapse", "metastable")
DEFAULT_CRITERION = CRITERIA[0]
#: Per criterion: what a safe load is, and what an unsafe one is (whatif.json's ``criterion``; the
#: report's and the dashboard's labels). ``{objective}``: :meth:`Objective.text`.
CRITERION_WORDS: dict[str, tuple[str, str]] = {
    "objective": ("meets the delivery objective", "misses the delivery objective"),
    "collapse": ("no collapse", "a collapse"),
    "metastable": ("no metastable collapse", "a metastable collapse"),
}
#: How long a collapse may outlast the overload behind it, in deadlines, and still meet the
#: objective. NOTE: once arrivals fall back below Ĉ, the calls already waiting miss their deadline
#: for at most one deadline; a second deadline drains the backlog they leave behind (the recovery
#: rule's queue check holds a collapse open until it has), at the study's hold of 0.6 Ĉ a backlog
#: of about 0.4 x Ĉ x 120 s. Longer, the backlog is retries feeding themselves: a loop, or
#: an engine that cannot catch up. At the study's 120-s deadline: 240 s, four recovery windows.
RECOVERY_DEADLINES = 2.0
_DIGITS = 4  # loads are rounded to this many decimals (they name the points' runs)
#: The key under which each point's summary entry records the settings of the sweep that ran it.
STAMP = "whatif_setup"
_VARIANT = "load"  # a point's variant: this and its load (``WhatIf.spec``)


class WhatIfError(ValueError):
    """A what-if that cannot be run as asked (an unknown policy, a DIR of other settings)."""


def parse_policies(text: str) -> list[str]:
    """``none,default,budget`` as names of :data:`POLICIES` (each once, in the order given)."""
    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names:
        raise WhatIfError(f"no policy given; known: {', '.join(POLICIES)}")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise WhatIfError(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    return names


@dataclass(frozen=True)
class Objective:
    """The delivery objective a load must meet to count as safe: in every seed's run, at least
    ``target`` of the calls planned in the judged span delivered within the deadline (the
    protocol's 98 % rule, the detector's :data:`DELIVERY_OBJECTIVE`), and every collapse over
    within ``recovery_deadlines`` deadlines of arrivals falling back below Ĉ."""

    target: float = DELIVERY_OBJECTIVE
    recovery_deadlines: float = RECOVERY_DEADLINES

    def __post_init__(self) -> None:
        try:
            check_objective(self.target)
        except ValueError as exc:
            raise WhatIfError(str(exc)) from None
        if not (math.isfinite(self.recovery_deadlines) and self.recovery_deadlines > 0):
            raise WhatIfError(f"the recovery limit must be a positive number of deadlines, got "
                              f"{self.recovery_deadlines!r}")  # fmt: skip

    def text(self) -> str:
        return (
            f"at least {100 * self.target:g} % of calls delivered within the deadline, and every "
            f"collapse over within {self.recovery_deadlines:g} deadlines of arrivals falling back below Ĉ"
        )

    def describe(self) -> dict[str, Any]:
        return {"target": self.target, "recovery_deadlines": self.recovery_deadlines, "text": self.text()}


def overload_end(collapse: Collapse, truth: GroundTruth, planned: Sequence[float]) -> float:
    """When arrivals fell back below Ĉ for ``collapse`` (run seconds): the pulse's end for a run
    with a pulse; otherwise the end of the last stretch one window long, starting before the
    collapse ends, in which calls were planned at Ĉ or more (``planned`` sorted); never before
    the collapse's start."""
    span = truth.span
    if span.pulse_end_s is not None:
        return max(collapse.start_s, span.pulse_end_s)
    need, w = span.capacity * span.window_s, span.window_s
    end = collapse.start_s
    for i in range(bisect.bisect_left(planned, collapse.end_s)):
        if bisect.bisect_left(planned, planned[i] + w) - i >= need:
            end = max(end, planned[i] + w)
    return end


@dataclass(frozen=True)
class WhatIf:
    """What every point shares: the backend (by name and options), the model, the clients, the
    workload (its load set per point), the seeds and the clock the points run at."""

    backend: Backend
    backend_name: str
    backend_options: Mapping[str, Any]
    model: str
    client: ClientProfile
    workload: Workload
    seed: int = 0
    seeds: int = 1
    clock: RunClock = STUDY_CLOCK
    jobs: int = 1
    progress: bool = True
    executor: Executor | None = None  # where the points run (None: ``jobs`` local processes)

    def setup(self) -> dict[str, Any]:
        """What a DIR's points were run with (a rerun must match it to reuse them)."""
        return {
            "backend": self.backend_name,
            "backend_options": dict(self.backend_options),
            "model": self.model,
            "client": self.client.describe(),
            "workload": {"kind": self.workload.kind, **self.workload.identity()},
            "seed": self.seed,
            **self.clock.record(),
        }

    def spec(self, policy: str, load: float, run: int) -> RunSpec:
        condition = Condition(
            policy,
            POLICIES[policy],
            client=self.client,
            workload=self.workload.at_load(load),
            variant=f"{_VARIANT}{load:g}",
        )
        return RunSpec(BLOCK, condition, self.model, run, self.seed + run)


@dataclass(frozen=True)
class Point:
    """One (policy, load) judged over its seeds' runs."""

    policy: str
    load: float
    runs: int
    calls: int
    within_deadline: int
    late: int
    failed: int
    executions: float
    collapses: int
    loops: int  # runs that entered a metastable collapse (or one of unknown kind)
    loop_at_s: list[float | None]  # per run: when its first metastable collapse began, or None
    loop_for_s: list[float]  # per run: how long its loop held in all (0: none)
    pulse: dict[str, int] | None = None  # the pulse cohort's within / late / failed (pulse runs)
    alerts: dict[str, list[float]] = field(default_factory=dict)  # alertname -> first fired, per run
    recovered: int = 0
    met: int = 0  # runs that met the objective
    slow_collapses: int = 0  # collapses not over within the objective's limit (one never over too)
    run_shares: list[float | None] = field(default_factory=list)  # per run: delivered within the deadline

    @property
    def safe(self) -> bool:
        """No run entered a metastable collapse (a collapse whose kind is unknown counts as one)."""
        return self.loops == 0

    @property
    def meets_objective(self) -> bool:
        """Every run met the delivery objective it was judged by."""
        return self.runs > 0 and self.met == self.runs

    def safe_under(self, criterion: str) -> bool:
        """Safe by ``criterion`` (:data:`CRITERIA`): the delivery objective met in every run, no
        collapse at all, or no metastable collapse."""
        if criterion == "objective":
            return self.meets_objective
        return self.safe and (criterion == "metastable" or self.collapses == 0)

    @property
    def state(self) -> str:
        """What happened at this load: ``loop`` (a metastable collapse formed), ``overload`` (the
        objective missed without one) or ``meets`` (the objective met)."""
        if not self.safe:
            return "loop"
        return "meets" if self.meets_objective else "overload"

    def to_dict(self) -> dict[str, Any]:
        def share(n: int) -> float | None:
            return round(n / self.calls, 4) if self.calls else None

        out: dict[str, Any] = {
            "load": self.load,
            "runs": self.runs,
            "calls": self.calls,
            "within_deadline": self.within_deadline,
            "late": self.late,
            "failed": self.failed,
            "within_deadline_share": share(self.within_deadline),
            "late_share": share(self.late),
            "failed_share": share(self.failed),
            "executions_per_call": round(self.executions / self.calls, 4) if self.calls else None,
            "collapses": self.collapses,
            "loops": self.loops,
            "loop_at_s": self.loop_at_s,
            "loop_for_s": self.loop_for_s,
            "recovered": self.recovered,
            "safe": self.safe,
            "meets_objective": self.meets_objective,
            "runs_meeting_objective": self.met,
            "slow_collapses": self.slow_collapses,
            "run_within_deadline_shares": self.run_shares,
            "state": self.state,
        }
        if self.pulse is not None:
            out["pulse"] = self.pulse
        if self.alerts:
            out["alerts"] = self.alerts
        return out


def _fates(calls: Sequence[CallTimes], deadline_s: float) -> tuple[int, int, int]:
    """Delivered within the deadline, delivered late, never delivered."""
    within = sum(c.within(deadline_s) for c in calls)
    failed = sum(c.delivered_at is None for c in calls)
    return within, len(calls) - within - failed, failed


def _judge(
    policy: str,
    load: float,
    infos: Sequence[RunInfo],
    entries: Mapping[str, Mapping[str, Any]],
    alerts: bool,
    objective: Objective,
) -> Point:
    calls = within = late = failed = collapses = loops = recovered = met = slow = 0
    shares: list[float | None] = []
    executions = 0.0
    loop_at: list[float | None] = []
    loop_for: list[float] = []
    pulse: dict[str, int] | None = None
    fired: dict[str, list[float]] = {}
    for info in infos:
        entry = entries[info.slug]
        if info.calls is None:
            raise RunDirError(f"run {info.slug!r} has no {CALLS_FILE}: it cannot be judged")
        truth = truth_of(info)
        records = read_calls(info.calls)
        if truth is not None:  # the calls of the judged span (a pulse run's: every planned call)
            records = [c for c in records if truth.span.start_s <= c.planned_at < truth.span.end_s]
        w, lt, f = _fates(records, info.deadline_s)
        calls, within, late, failed = calls + len(records), within + w, late + lt, failed + f
        share = w / len(records) if records else None
        shares.append(None if share is None else round(share, 4))
        n_slow = _slow_collapses(truth, records, info.deadline_s, objective)
        slow += n_slow
        met += truth is not None and (share is None or share >= objective.target) and n_slow == 0
        executions += float(entry.get("executions", {}).get("created") or 0.0)
        recovered += bool(entry.get("recovered"))
        if not info.trace:
            cohort = [c for c in records if info.pulse_start_s <= c.planned_at < info.pulse_end_s]
            w, lt, f = _fates(cohort, info.deadline_s)
            pulse = pulse or {"calls": 0, "within_deadline": 0, "late": 0, "failed": 0}
            for key, n in (("calls", len(cohort)), ("within_deadline", w), ("late", lt), ("failed", f)):
                pulse[key] += n
        found = [] if truth is None else truth.collapses
        collapses += len(found)
        loop = [c for c in found if c.metastable is not False]
        loops += bool(loop) or truth is None
        loop_at.append(next((c.metastable_at_s for c in loop if c.metastable_at_s is not None), None))
        loop_for.append(round(sum(c.metastable_for_s or 0.0 for c in loop), 3))
        if alerts:
            for firing in replay_firings(info):
                fired.setdefault(firing.alertname, [])
                fired[firing.alertname].append(firing.fired_at_s)
    return Point(
        policy, load, len(infos), calls, within, late, failed, executions, collapses, loops, loop_at,
        loop_for, pulse, {k: sorted(v) for k, v in sorted(fired.items())}, recovered, met, slow, shares,
    )  # fmt: skip


def _slow_collapses(
    truth: GroundTruth | None, calls: Sequence[CallTimes], deadline_s: float, objective: Objective
) -> int:
    """The collapses of a run not over within the objective's limit after arrivals fell back
    below Ĉ (one that runs to the end of the judged span is never over)."""
    if truth is None:
        return 0  # an unknown record meets no objective anyway
    planned = sorted(c.planned_at for c in calls)
    limit = objective.recovery_deadlines * deadline_s
    return sum(
        not c.ended or c.end_s > overload_end(c, truth, planned) + limit + 1e-9 for c in truth.collapses
    )


class _Points:
    """The points of a DIR: run those missing (in one batch over ``jobs`` processes), judge any."""

    def __init__(self, whatif: WhatIf, out: Path) -> None:
        self.whatif = whatif
        self.dir = out / POINTS
        self._judged: dict[tuple[str, float, bool, Objective], Point] = {}  # DIR's points, held
        self._check_setup()

    def _check_setup(self) -> None:
        if not (self.dir / SUMMARY).exists():
            return
        meta = read_summary(self.dir).get("meta", {})
        theirs = meta.get("whatif") if isinstance(meta, dict) else None
        differ = _differing(theirs, _plain(self.whatif.setup()))
        if differ:
            raise WhatIfError(
                f"{self.dir} holds points run with other settings (they differ in "
                f"{', '.join(differ)}): pick another DIR, or move it away"
            )
        for slug, entry in self._done().items():
            why = self._foreign(entry)
            if why:
                raise WhatIfError(
                    f"{self.dir}: point {slug!r} was not run with this sweep's settings ({why}); a "
                    f"what-if never mixes it in: remove it (its entry in {SUMMARY}, runs/{slug}), "
                    "or pick another DIR"
                )

    def _foreign(self, entry: Mapping[str, Any]) -> str | None:
        """Why ``entry`` is not a point of this sweep (None: it is): what its stamp and its own
        record of the run say, against what this sweep would run under its slug."""
        theirs = entry.get(STAMP)
        if not isinstance(theirs, dict):
            return f"it records no {STAMP}: not a what-if's point"
        differ = _differing(theirs, _plain(self.whatif.setup()))
        policy, variant, run = entry.get("condition"), str(entry.get("variant")), entry.get("run")
        try:
            load = float(variant.removeprefix(_VARIANT)) if variant.startswith(_VARIANT) else math.nan
        except ValueError:
            load = math.nan
        if policy not in POLICIES or not isinstance(run, int) or not math.isfinite(load):
            return f"{policy!r} at {variant!r}, run {run!r}, names no point of a what-if"
        spec = self.whatif.spec(str(policy), load, run)
        own = {"slug": spec.slug, "settings": spec.condition.describe(), "model": spec.model,
               "seed": spec.seed, **self.whatif.clock.record()}  # fmt: skip
        differ += [k for k in _differing({k: entry.get(k) for k in own}, _plain(own)) if k not in differ]
        return f"it differs in {', '.join(differ)}" if differ else None

    def _done(self) -> dict[str, dict[str, Any]]:
        if not (self.dir / SUMMARY).exists():
            return {}
        return {
            str(r["slug"]): r for r in read_summary(self.dir)["runs"] if isinstance(r, dict) and "slug" in r
        }

    def ensure(self, asked: Sequence[tuple[str, float]]) -> None:
        """Run every (policy, load)'s seeds not yet in DIR."""
        w = self.whatif
        done = self._done()
        setup = w.setup()  # first: a trace's first pass, made here once, goes with each point's spec
        specs = [w.spec(p, load, r) for p, load in asked for r in range(w.seeds)]
        missing = list({s.slug: s for s in specs if s.slug not in done}.values())
        if missing:
            run_many(
                w.backend, missing, self.dir, jobs=w.jobs, executor=w.executor, clock=w.clock,
                progress=w.progress, meta={"block": BLOCK, "model": w.model, "seed": w.seed, "whatif": setup},
                stamp={STAMP: setup},
            )  # fmt: skip

    def loads(self, policy: str) -> list[float]:
        """Every load at which all of ``policy``'s seeds have run in DIR, in order."""
        done = self._done()
        found = set()
        for entry in done.values():
            variant = str(entry.get("variant"))
            if entry.get("condition") != policy or not variant.startswith(_VARIANT):
                continue
            try:
                load = float(variant.removeprefix(_VARIANT))
            except ValueError:
                continue
            if all(self.whatif.spec(policy, load, r).slug in done for r in range(self.whatif.seeds)):
                found.add(load)
        return sorted(found)

    def judge(self, policy: str, load: float, *, alerts: bool, objective: Objective) -> Point:
        """The point judged (once per sweep: its calls are read once, however often it is asked
        for; DIR is held, so its points do not change under it)."""
        key = (policy, load, alerts, objective)
        if key not in self._judged:
            self._judged[key] = self._judge(policy, load, alerts=alerts, objective=objective)
        return self._judged[key]

    def _judge(self, policy: str, load: float, *, alerts: bool, objective: Objective) -> Point:
        slugs = [self.whatif.spec(policy, load, r).slug for r in range(self.whatif.seeds)]
        entries = self._done()
        infos = {i.slug: i for i in load_runs(self.dir)}
        lost = [s for s in slugs if s not in infos or s not in entries]
        if lost:
            raise RunDirError(f"{self.dir}/{SUMMARY} lost point {lost[0]!r}: was DIR written by another?")
        return _judge(policy, load, [infos[s] for s in slugs], entries, alerts, objective)


def _plain(value: Any) -> Any:
    """``value`` as ``summary.json`` records it (JSON; NaN and infinities null)."""
    return json.loads(json.dumps(value), parse_constant=lambda _: None)


def _differing(theirs: Any, ours: Mapping[str, Any]) -> list[str]:
    """The keys in which a recorded mapping (anything else counts as empty) differs from ours."""
    given = theirs if isinstance(theirs, dict) else {}
    return sorted(k for k in {*given, *ours} if given.get(k) != ours.get(k))


def compare(
    whatif: WhatIf, policies: Sequence[str], out: Path, objective: Objective | None = None
) -> dict[str, dict[str, Any]]:
    """The workload at its own load under each policy: policy -> its point (with alerts).
    ``DirBusy`` when another sweep writes ``out``."""
    objective = objective or Objective()
    with hold(out):
        points = _Points(whatif, out)
        load = whatif.workload.load
        points.ensure([(p, load) for p in policies])
        return {p: points.judge(p, load, alerts=True, objective=objective).to_dict() for p in policies}


def curve(
    whatif: WhatIf,
    policies: Sequence[str],
    out: Path,
    loads: Sequence[float] = (),
    objective: Objective | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Per policy, every load run in DIR (the what-if's own, the headroom search's, earlier
    sweeps' of the same settings) and ``loads`` (run first where missing), each judged against
    ``objective``: policy -> its points in order of load. ``DirBusy`` when another sweep writes
    ``out``."""
    objective = objective or Objective()
    bad = [x for x in loads if not (math.isfinite(x) and x > 0)]
    if bad:
        raise WhatIfError(f"a curve's loads must be positive multiples of Ĉ, got {bad[0]!r}")
    with hold(out):
        points = _Points(whatif, out)
        points.ensure([(p, round(x, _DIGITS)) for p in policies for x in loads])
        return _curves(points, policies, objective)


def _curves(
    points: _Points, policies: Sequence[str], objective: Objective
) -> dict[str, list[dict[str, Any]]]:
    """Per policy, every load in DIR judged (each once a sweep): :func:`curve`'s answer."""
    return {
        p: [points.judge(p, x, alerts=False, objective=objective).to_dict() for x in points.loads(p)]
        for p in policies
    }


def _first(points: Sequence[Mapping[str, Any]], state: str) -> dict[str, Any]:
    """Where ``state`` (a point's) first shows on a curve: the smallest load at which it does,
    and the largest below it at which it does not (the bracket the points give)."""
    ordered = sorted(points, key=lambda q: float(q["load"]))
    at = next((float(q["load"]) for q in ordered if q["state"] == state), None)
    if at is None:
        top = float(ordered[-1]["load"]) if ordered else None
        return {
            "load": None,
            "below": top,
            "says": "not seen" + ("" if top is None else f" up to {top:g}x Ĉ"),
        }
    below = max((float(q["load"]) for q in ordered if float(q["load"]) < at), default=None)
    says = f"at {at:g}x Ĉ" + ("" if below is None else f" (not at {below:g}x)")
    return {"load": at, "below": below, "says": says}


def marks(points: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """From a policy's curve: ``loop_onset``, the smallest load at which a retry loop formed (a
    metastable collapse), and ``overload``, the smallest at which the objective was missed without
    one, each with the largest load below it at which it was not seen."""
    return {"loop_onset": _first(points, "loop"), "overload": _first(points, "overload")}


_EPS = 1e-9  # loads closer than this are the same load


@dataclass(frozen=True)
class Grid:
    """The loads a headroom search probes: the nodes of the bisection of ``[lo, hi]`` down to
    cells no wider than the precision, each node the midpoint of its cell's ends rounded to
    :data:`_DIGITS` decimals (as the bisection has always computed it), indexed from 0 (``lo``)
    to :attr:`top` (``hi``). Every search of the same bounds and precision, cold or warm, probes
    only these loads, so a threshold in load gets one answer whatever order they are probed in."""

    lo: float
    hi: float
    depth: int

    @classmethod
    def of(cls, lo: float, hi: float, precision: float) -> Grid:
        depth = 0
        while (hi - lo) / 2**depth > precision + _EPS:
            depth += 1
        return cls(lo, hi, depth)

    @property
    def top(self) -> int:
        return int(2**self.depth)

    def load(self, k: int) -> float:
        """The load of node ``k`` (0 <= k <= top), found by descending the bisection to it."""
        left, right, at_left, at_right = 0, self.top, self.lo, self.hi
        while True:
            if k == left:
                return at_left
            if k == right:
                return at_right
            mid = (left + right) // 2
            at_mid = round((at_left + at_right) / 2, _DIGITS)
            if k == mid:
                return at_mid
            if k < mid:
                right, at_right = mid, at_mid
            else:
                left, at_left = mid, at_mid

    def floor(self, load: float) -> int:
        """The largest node at or below ``load`` (-1: none)."""
        below, above = -1, self.top + 1  # load(below) <= load < load(above)
        while above - below > 1:
            mid = (below + above) // 2
            below, above = (mid, above) if self.load(mid) <= load + _EPS else (below, mid)
        return below

    def ceil(self, load: float) -> int:
        """The smallest node at or above ``load`` (top + 1: none)."""
        k = self.floor(load)
        return k if k >= 0 and self.load(k) >= load - _EPS else k + 1

    def nearest(self, load: float) -> int:
        """The node nearest ``load`` (clamped to the grid)."""
        k = min(max(self.floor(load), 0), self.top)
        if k < self.top and self.load(k + 1) - load < load - self.load(k):
            return k + 1
        return k


@dataclass
class HeadroomSearch:
    """One policy's search for the largest safe load on its :class:`Grid`: ``safe`` the largest
    load found safe, ``unsafe`` the smallest found unsafe (None: none yet); ``tried`` every load
    run, with its verdict (:meth:`add`). Cold (``start`` None): the upper limit first, then the
    lower, then bisection. Warm (``start``, a load, e.g. yesterday's answer or an estimate, which
    ``start_kind`` names): the grid's node
    nearest it first, then outwards from it one node, two, four, ... (a gallop) until a verdict
    flips, then bisection. Each probes only the grid's nodes and stops when no node lies between
    ``safe`` and ``unsafe``; when more load never makes a policy safe, both give the same answer."""

    grid: Grid
    criterion: str = DEFAULT_CRITERION
    start: float | None = None
    start_kind: str = "warm"  # what ``start`` is, as the result names it (e.g. "onset": an estimate)
    tried: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lo(self) -> float:
        return self.grid.lo

    @property
    def hi(self) -> float:
        return self.grid.hi

    @property
    def unsafe(self) -> float | None:
        return min((t["load"] for t in self.tried if not t["safe"]), default=None)

    @property
    def safe(self) -> float | None:
        """The largest safe load below the smallest unsafe one (a safe load above an unsafe one,
        seeds' noise, never raises the headroom)."""
        cap = math.inf if self.unsafe is None else self.unsafe
        return max((t["load"] for t in self.tried if t["safe"] and t["load"] < cap), default=None)

    @property
    def first(self) -> int | None:
        """The node a warm search probes first (None: a cold search)."""
        return None if self.start is None else self.grid.nearest(self.start)

    def next_load(self, precision: float) -> float | None:
        """The load to run next (None: the search is done)."""
        tried = {t["load"] for t in self.tried}
        safe, unsafe, grid, first = self.safe, self.unsafe, self.grid, self.first
        if safe is None or unsafe is None:
            if first is None:  # cold: the limits
                load = self.hi if unsafe is None else self.lo
            elif safe is None and unsafe is None:
                load = grid.load(first)
            elif unsafe is None:  # safe so far: gallop up from the first node
                assert safe is not None
                reached = grid.floor(safe) - first
                load = grid.load(min(grid.top, first + max(1, 2 * reached) if reached >= 0 else first))
            else:  # unsafe so far: gallop down
                reached = first - grid.ceil(unsafe)
                load = grid.load(max(0, first - max(1, 2 * reached) if reached >= 0 else first))
            return None if load in tried else load  # safe at the upper limit (a bound), unsafe at the lower
        below, above = grid.floor(safe), grid.ceil(unsafe)
        if above - below >= 2:  # a node between them: the middle one
            load = grid.load((below + above) // 2)
        elif unsafe - safe > precision + _EPS:  # loads already in DIR, off the grid, bracket it
            load = round((safe + unsafe) / 2, _DIGITS)
        else:
            return None
        return None if load in tried else load

    def add(self, load: float, safe: bool, **verdict: Any) -> None:
        """A load run and whether it was safe (``verdict``: what else to keep of it)."""
        self.tried.append({"load": load, "safe": safe, **verdict})

    def record(self, point: Point) -> None:
        self.add(
            point.load,
            point.safe_under(self.criterion),
            loops=point.loops,
            collapses=point.collapses,
            meets_objective=point.meets_objective,
            runs=point.runs,
        )

    def result(self, precision: float) -> dict[str, Any]:
        good, bad = CRITERION_WORDS[self.criterion]
        if self.safe is None:
            kind, text = "below", f"{bad} already at the search's lower limit, {self.lo:g}x Ĉ"
        elif self.unsafe is None:
            kind, text = (
                "at-least",
                f"still {good} at the search's upper limit, {self.hi:g}x Ĉ: a lower bound",
            )
        else:
            kind, text = "bracketed", f"{good} at {self.safe:g}x Ĉ, {bad} at {self.unsafe:g}x Ĉ"
        reached = (
            None if self.safe is None or self.unsafe is None else round(self.unsafe - self.safe, _DIGITS)
        )
        first = self.first
        return {
            "headroom_load": self.safe,
            "criterion": self.criterion,
            "kind": kind,
            "says": text,
            "precision_asked": precision,
            "precision_reached": reached,
            "lower_limit": self.lo,
            "upper_limit": self.hi,
            "start": {"kind": "cold"}
            if first is None
            else {"kind": self.start_kind, "from": self.start, "load": self.grid.load(first)},
            "tried": sorted(self.tried, key=lambda t: t["load"]),
        }


def headroom(
    whatif: WhatIf,
    policies: Sequence[str],
    out: Path,
    *,
    lo: float = HEADROOM_RANGE[0],
    hi: float = HEADROOM_RANGE[1],
    precision: float = PRECISION,
    criterion: str = DEFAULT_CRITERION,
    objective: Objective | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    start: Mapping[str, float] | None = None,
    start_kind: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per policy, the largest load in ``[lo, hi]`` at which every seed's run meets ``objective``
    (``criterion`` "collapse": has no collapse; "metastable": no metastable collapse), to within
    ``precision`` (assuming more load never helps: bisection on a :class:`Grid`).
    Every load already run in DIR counts first (the workload's own, a curve's, an earlier
    search's); then, per policy, a cold search (the upper limit, the lower, midpoints) or, where
    ``start`` gives it a load (policy -> load, e.g. the previous answer), a warm one from there
    (:class:`HeadroomSearch`; ``start_kind``, policy -> what its start is, "warm" where unsaid);
    each round runs every policy's next load in one batch. ``DirBusy`` when another sweep writes ``out``."""
    return headroom_with_curves(
        whatif, policies, out, lo=lo, hi=hi, precision=precision, criterion=criterion,
        objective=objective, on_round=on_round, start=start, start_kind=start_kind,
    )[0]  # fmt: skip


def headroom_with_curves(
    whatif: WhatIf,
    policies: Sequence[str],
    out: Path,
    *,
    lo: float = HEADROOM_RANGE[0],
    hi: float = HEADROOM_RANGE[1],
    precision: float = PRECISION,
    criterion: str = DEFAULT_CRITERION,
    objective: Objective | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    start: Mapping[str, float] | None = None,
    start_kind: Mapping[str, str] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """:func:`headroom`'s answer and, from the same points judged once, :func:`curve`'s (every
    load in DIR, nothing more run)."""
    objective = objective or Objective()
    if not (0 < lo < hi and math.isfinite(hi)):
        raise WhatIfError(f"the headroom search needs 0 < LO < HI, got {lo!r}:{hi!r}")
    if not (math.isfinite(precision) and precision > 0):
        raise WhatIfError(f"the precision must be a positive multiple of Ĉ, got {precision!r}")
    if criterion not in CRITERIA:
        raise WhatIfError(f"unknown criterion {criterion!r}; known: {', '.join(CRITERIA)}")
    bad = [x for x in (start or {}).values() if not math.isfinite(x)]
    if bad:
        raise WhatIfError(f"a search's start must be a finite load, got {bad[0]!r}")
    grid = Grid.of(lo, hi, precision)
    kinds = start_kind or {}
    searches = {
        p: HeadroomSearch(grid, criterion, (start or {}).get(p), kinds.get(p, "warm")) for p in policies
    }
    with hold(out):
        points = _Points(whatif, out)
        found = _search(points, searches, precision, objective, on_round)
        return found, _curves(points, policies, objective)


def _search(
    points: _Points,
    searches: Mapping[str, HeadroomSearch],
    precision: float,
    objective: Objective,
    on_round: Callable[[int, dict[str, float]], None] | None,
) -> dict[str, dict[str, Any]]:
    for p, search in searches.items():  # the loads already run (compare's, a curve's) bracket it too
        for load in points.loads(p):
            if search.lo <= load <= search.hi:
                search.record(points.judge(p, load, alerts=False, objective=objective))
    rounds = 0
    while True:
        asked = {p: s.next_load(precision) for p, s in searches.items()}
        todo = {p: load for p, load in asked.items() if load is not None}
        if not todo:
            break
        rounds += 1
        if on_round is not None:
            on_round(rounds, todo)
        points.ensure(list(todo.items()))
        for p, load in todo.items():
            searches[p].record(points.judge(p, load, alerts=False, objective=objective))
    return {p: s.result(precision) for p, s in searches.items()}


def criterion_words(criterion: str, objective: Objective) -> dict[str, str]:
    """whatif.json's ``criterion``: its name, what a safe and an unsafe load are, and the rule in
    a sentence (the report's and the dashboard's labels)."""
    good, bad = CRITERION_WORDS[criterion]
    rule = {
        "objective": f"A load counts as safe when every seed's run meets the delivery objective: "
        f"{objective.text()} (when arrivals fall back: a pulse's end, or else the end of the last "
        "window in which calls were planned at Ĉ or more). The share is over every call planned in "
        "the run's judged span (a pulse run: base, pulse and hold); a collapse still under way at "
        "the span's end is never over.",
        "collapse": "A load counts as safe when none of its seeds' runs collapses (a window of "
        "calls delivered below the protocol's 98 % within the deadline).",
        "metastable": "A load counts as safe when none of its seeds' runs enters a metastable "
        "collapse (first attempts below Ĉ while executions were created at or above Ĉ; one whose "
        "kind is unknown counts as one): an engine overloaded for good is never metastable, so "
        "this answers where the loop forms, not how much load is served.",
    }[criterion]
    return {"name": criterion, "safe": good, "unsafe": bad, "rule": rule + " Bisection assumes "
            "more load never makes a policy safe."}  # fmt: skip


def write_whatif(out: Path, body: Mapping[str, Any]) -> Path:
    """Write ``out/whatif.json`` (atomically enough: whole text at once)."""
    path = out / WHATIF
    tmp = out / f".{WHATIF}.tmp"
    tmp.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def policy_table() -> list[dict[str, str]]:
    """Every named policy, the study's condition it comes from and what it does."""
    return [
        {"policy": name, "from": f"{b} / {c}", "does": POLICY_HELP[name]}
        for name, (b, c) in POLICY_SOURCES.items()
    ]
