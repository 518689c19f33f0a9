"""Each alert scored against the runs' ground truth, by its kind (``AlertRule.kind``,
docs/protocol.md "Ground truth over time"), and each tier's pages side by side.

- a **cause** alert (the loop, the backlog, orphaned work) is scored per run: recall over the
  runs that did not recover (§6) and over the runs with a metastable collapse; a false positive
  is a firing that starts outside every collapse and outside the overload's own stretch (from
  the pulse's start to the end of the collapse it caused, or to the pulse's end when it caused
  none); lead after the pulse's end, and after the collapse turned metastable; the resolution of
  the last firing between the pulse and a recovery, against the recovery time;
- a **symptom** alert (calls not delivered within the deadline, whatever the cause) is scored
  per collapse: recall over collapses, delay from the collapse's start, whether it stays firing
  to the collapse's end, firings that start outside every collapse, and its resolution after
  the collapse ended. A call's miss is known one deadline after it arrived, so a symptom firing
  that starts within one deadline after a collapse's end still belongs to it;
- a **data** alert (no data) is reported, not scored: it says the detector could not judge.

Each tier of alerts (``AlertRule.tier``: what series an alert needs) is scored side by side with
the others: a tier's pages (its critical alerts of a kind, taken together as one alert) get the
figures above, the runs they missed or fired in while the run recovered, and, against the tier
that needs the most series, the runs where one tier's cause pages fired and the other's did not.

Runs without a ground truth over time (an old entry without its call records): cause alerts fall
back on the recovery verdict (a false positive fires before the pulse or after the recovery), and
symptom alerts skip them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from detector.thresholds import TIERS, AlertKind, AlertRule
from foundation.groundtruth import Collapse
from reproduce.judge.groundtruth import collapsed_to_the_end
from reproduce.judge.validation.runs import Firing, RunResult, firings_of, first_after, stats


def _until(c: Collapse, tail: float = 0.0) -> float:
    """Where a collapse stops counting: its end (plus ``tail``), or never if it had not ended."""
    return c.end_s + tail if c.ended else math.inf


def expected_stretches(r: RunResult) -> list[tuple[float, float]]:
    """Where a cause alert may start firing in a run: inside any collapse, and from the overload's
    start (the pulse's) to the end of the collapse it caused (the first one under way after the
    pulse began), or to the pulse's end when it caused none. A collapse that ran to the end of
    the judged span had not ended there: it stretches to the run's end. Without a ground truth
    over time: from the pulse's start to the recovery (to the end when the run did not recover)."""
    info = r.info
    if r.collapses is None:
        end = info.recovery_at_s if info.recovered else math.inf
        return [(info.pulse_start_s, math.inf if end is None else end)]
    stretches = [(c.start_s, _until(c)) for c in r.collapses]
    caused = [c for c in r.collapses if c.end_s > info.pulse_start_s]
    stretches.append((info.pulse_start_s, _until(caused[0]) if caused else info.pulse_end_s))
    return stretches


def false_positive(r: RunResult, alertname: str) -> list[Firing]:
    """A cause alert's firings in the run that start outside :func:`expected_stretches`."""
    stretches = expected_stretches(r)
    return [
        f
        for f in firings_of(r, alertname)
        if not any(a - 1e-9 <= f.fired_at_s <= b + 1e-9 for a, b in stretches)
    ]


def _metastable(r: RunResult) -> Collapse | None:
    return next((c for c in r.collapses or [] if c.metastable), None)


def score_cause(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A cause alert's figures: per run, against the recovery verdict and metastable collapses."""
    not_recovered = [r for r in results if not r.info.recovered]
    recovered = [r for r in results if r.info.recovered]
    hits = 0
    lead_times: list[float] = []
    for r in not_recovered:
        first = first_after(firings_of(r, alertname), r.info.pulse_start_s)
        if first is not None:
            hits += 1
            lead_times.append(first.fired_at_s - r.info.pulse_end_s)
    metastable = [(r, c) for r in results if (c := _metastable(r)) is not None]
    meta_hits = 0
    after_loop: list[float] = []
    for r, c in metastable:
        during = [f for f in firings_of(r, alertname) if f.overlaps(c.start_s, c.end_s)]
        if during:
            meta_hits += 1
            if c.metastable_at_s is not None:
                after_loop.append(during[0].fired_at_s - c.metastable_at_s)
    fp = [(r, false_positive(r, alertname)) for r in results]
    resolve_times: list[float] = []
    still_firing = 0
    for r in recovered:
        recovery_at = r.info.recovery_at_s
        assert recovery_at is not None
        during = [f for f in firings_of(r, alertname) if r.info.pulse_start_s <= f.fired_at_s <= recovery_at]
        if during:
            last = during[-1]
            if last.resolved_at_s is None:
                still_firing += 1
            else:
                resolve_times.append(last.resolved_at_s - recovery_at)
    return {
        "kind": "cause",
        "recall": round(hits / len(not_recovered), 4) if not_recovered else None,
        "runs_not_recovered": len(not_recovered),
        "false_positive_runs": sum(1 for _, f in fp if f),
        "false_positive_firings": sum(len(f) for _, f in fp),
        "runs": len(results),
        "runs_recovered": len(recovered),
        "lead_time_s": stats(lead_times),
        "recall_metastable": round(meta_hits / len(metastable), 4) if metastable else None,
        "runs_metastable": len(metastable),
        "lead_after_metastable_s": stats(after_loop),
        "resolve_after_recovery_s": stats(resolve_times),
        "still_firing_after_recovery_runs": still_firing,
    }


def _covers(firings: Sequence[Firing], start: float, end: float) -> bool:
    """The firings, taken together, fire without a gap from ``start`` to ``end``."""
    t = start
    for f in sorted(firings, key=lambda f: f.fired_at_s):
        if f.fired_at_s > t + 1e-9:
            return False
        if f.resolved_at_s is None or f.resolved_at_s >= end:
            return True
        t = max(t, f.resolved_at_s)
    return False


def score_symptom(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A symptom alert's figures: per collapse (runs with a ground truth over time)."""
    judged = [r for r in results if r.collapses is not None]
    collapses = 0
    hits = 0
    held = 0
    delays: list[float] = []
    lags: list[float] = []
    still_firing = 0
    fp_runs = fp_firings = 0
    for r in judged:
        own = firings_of(r, alertname)
        grace = r.info.deadline_s  # a call's miss is known one deadline after it arrived
        stretches = [(c.start_s, _until(c, grace)) for c in r.collapses or []]
        outside = [f for f in own if not any(a - 1e-9 <= f.fired_at_s <= b + 1e-9 for a, b in stretches)]
        fp_runs += bool(outside)
        fp_firings += len(outside)
        for c in r.collapses or []:
            collapses += 1
            during = [f for f in own if f.overlaps(c.start_s, _until(c, grace))]
            if not during:
                continue
            hits += 1
            first = during[0]
            delays.append(first.fired_at_s - c.start_s)
            if _covers(during, max(first.fired_at_s, c.start_s), c.end_s):
                held += 1
            if c.ended:
                last = during[-1]
                if last.resolved_at_s is None:
                    still_firing += 1
                else:
                    lags.append(last.resolved_at_s - c.end_s)
    return {
        "kind": "symptom",
        "recall": round(hits / collapses, 4) if collapses else None,
        "collapses": collapses,
        "collapses_detected": hits,
        "held_to_collapse_end": held,
        "runs_not_recovered": sum(1 for r in results if not r.info.recovered),
        "false_positive_runs": fp_runs,
        "false_positive_firings": fp_firings,
        "runs": len(judged),
        "runs_recovered": sum(1 for r in results if r.info.recovered),
        "lead_time_s": stats(delays),
        "resolve_after_collapse_s": stats(lags),
        "still_firing_after_collapse": still_firing,
        "resolve_after_recovery_s": stats([]),
    }


def score_data(alertname: str, results: Sequence[RunResult]) -> dict[str, Any]:
    """A data alert is reported, not scored: where it fired, the detector could not judge."""
    fired = [r for r in results if firings_of(r, alertname)]
    return {
        "kind": "data",
        "recall": None,
        "runs_not_recovered": sum(1 for r in results if not r.info.recovered),
        "false_positive_runs": None,
        "runs": len(results),
        "runs_recovered": sum(1 for r in results if r.info.recovered),
        "runs_fired": len(fired),
        "firings": sum(len(firings_of(r, alertname)) for r in fired),
        "fired_in": [r.info.slug for r in fired],
        "lead_time_s": stats([]),
        "resolve_after_recovery_s": stats([]),
    }


SCORERS: dict[str, Callable[[str, Sequence[RunResult]], dict[str, Any]]] = {
    "cause": score_cause,
    "symptom": score_symptom,
    "data": score_data,
}


def score_alert(alertname: str, results: Sequence[RunResult], kind: AlertKind = "cause") -> dict[str, Any]:
    """The per-alert figures of ``validation.json``, by the alert's kind."""
    return SCORERS[kind](alertname, results)


# --- by tier ---------------------------------------------------------------------------------
# Each tier's pages, side by side: the alerts a tier needs (``AlertRule.tier``: vLLM's series
# alone, or the proxy's too) that page (critical), taken together per kind, scored as one alert.
# The last tier of ``TIERS`` needs the most series and is the reference the others are held to.
TIER_KINDS: tuple[AlertKind, ...] = ("cause", "symptom")  # a data alert is reported, not scored


def tier_pages(rules: Sequence[AlertRule], alertnames: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """Per tier (in ``TIERS`` order), per scored kind (cause, symptom), the names of the tier's
    critical alerts among ``alertnames``; a tier or kind with none gets an empty list."""
    wanted = set(alertnames)
    return {
        tier: {
            kind: [
                r.name
                for r in rules
                if r.name in wanted and r.tier == tier and r.kind == kind and r.severity == "critical"
            ]
            for kind in TIER_KINDS
        }
        for tier in TIERS
    }


def _union(firings: Sequence[Firing], label: str) -> list[Firing]:
    """Overlapping or touching firings merged into one episode named ``label``."""
    merged: list[Firing] = []
    for f in sorted(firings, key=lambda f: f.fired_at_s):
        last = merged[-1] if merged else None
        if last is not None and (last.resolved_at_s is None or f.fired_at_s <= last.resolved_at_s):
            end = (
                None
                if last.resolved_at_s is None or f.resolved_at_s is None
                else max(last.resolved_at_s, f.resolved_at_s)
            )
            merged[-1] = replace(last, resolved_at_s=end)
        else:
            merged.append(Firing(label, f.fired_at_s, f.resolved_at_s, f.why, f.value))
    return merged


def as_one_alert(results: Sequence[RunResult], names: Sequence[str], label: str) -> list[RunResult]:
    """The runs with only the firings of ``names``, merged into one alert named ``label``."""
    return [
        RunResult(
            r.info, _union([f for f in r.firings if f.alertname in names], label), r.collapses, r.windows
        )
        for r in results
    ]


def _fired_from_pulse(r: RunResult, label: str) -> Firing | None:
    return first_after(firings_of(r, label), r.info.pulse_start_s)


def score_tier_cause(names: Sequence[str], results: Sequence[RunResult]) -> dict[str, Any]:
    """A tier's cause pages as one alert: :func:`score_cause`'s figures, and the runs that recover
    in which it fired at all, and the runs that did not recover in which it never fired."""
    label = " or ".join(names)
    merged = as_one_alert(results, names, label)
    scores = score_cause(label, merged)
    scores["fired_in_recovered_runs"] = [
        r.info.slug for r in merged if r.info.recovered and firings_of(r, label)
    ]
    scores["missed_runs"] = [
        r.info.slug for r in merged if not r.info.recovered and _fired_from_pulse(r, label) is None
    ]
    return scores


def compare_to_reference(
    names: Sequence[str], reference: Sequence[str], results: Sequence[RunResult]
) -> dict[str, Any]:
    """A tier's cause pages against the reference tier's, run by run (from the pulse's start on):
    the runs where the reference fired and it did not, where it fired and the reference did not,
    and in the runs where both fired, its first firing minus the reference's."""
    own = as_one_alert(results, names, "own")
    ref = as_one_alert(results, reference, "reference")
    silent_where_fired: list[str] = []
    fired_where_silent: list[str] = []
    after_reference: list[float] = []
    for mine, theirs in zip(own, ref, strict=True):
        first, ref_first = _fired_from_pulse(mine, "own"), _fired_from_pulse(theirs, "reference")
        if ref_first is not None and first is None:
            silent_where_fired.append(mine.info.slug)
        elif first is not None and ref_first is None:
            fired_where_silent.append(mine.info.slug)
        elif first is not None and ref_first is not None:
            after_reference.append(first.fired_at_s - ref_first.fired_at_s)
    return {
        "silent_where_reference_fired": silent_where_fired,
        "fired_where_reference_silent": fired_where_silent,
        "after_reference_s": stats(after_reference),
    }


def score_tiers(
    results: Sequence[RunResult], rules: Sequence[AlertRule], alertnames: Sequence[str]
) -> dict[str, Any]:
    """Each tier's pages scored side by side (``validation.json``'s ``tiers``): per tier, its
    cause pages as one alert (:func:`score_tier_cause`) and against the reference tier's
    (:func:`compare_to_reference`), its symptom pages as one alert (:func:`score_symptom`)."""
    pages = tier_pages(rules, alertnames)
    reference = TIERS[-1]
    out: dict[str, Any] = {}
    for tier, kinds in pages.items():
        cause, symptom = kinds["cause"], kinds["symptom"]
        label = " or ".join(symptom)
        out[tier] = {
            "cause": {"alerts": cause, **score_tier_cause(cause, results)} if cause else None,
            "symptom": (
                {"alerts": symptom, **score_symptom(label, as_one_alert(results, symptom, label))}
                if symptom
                else None
            ),
            "against_reference": (
                compare_to_reference(cause, pages[reference]["cause"], results)
                if cause and tier != reference and pages[reference]["cause"]
                else None
            ),
        }
    return {"reference": reference, "tiers": out}


def ground_truth_summary(results: Sequence[RunResult]) -> dict[str, Any]:
    judged = [r for r in results if r.collapses is not None]
    disagree = [
        r.info.slug
        for r in judged
        if collapsed_to_the_end(r.collapses or [], 0.0 if r.info.trace else r.info.pulse_start_s)
        == r.info.recovered
    ]
    collapses = [c for r in judged for c in r.collapses or []]
    return {
        "runs": len(results),
        "runs_with_call_records": len(judged),
        "collapses": len(collapses),
        "metastable_collapses": sum(1 for c in collapses if c.metastable),
        "collapses_to_the_end": sum(1 for c in collapses if not c.ended),
        "agrees_with_recovered": len(judged) - len(disagree),
        "disagreeing_runs": disagree,
    }
