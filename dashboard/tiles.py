"""The live page's at-a-glance tiles: five ratios that say whether an engine serves clients
or retries, each coloured by the detector's verdict (the alerts that read it), never by a
threshold of the dashboard's own: thresholds have one definition, in detector/thresholds.py;
and, before them, the two numbers every alert counts in, Ĉ and the clients' deadline, each with
where it comes from (stated, learned, or missing and what it needs: :func:`input_tiles`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from dashboard.data import EngineInputs, Known
from dashboard.figures import Points, latest
from detector.capacity import PREDICT_WINDOW_S
from foundation.ratios import RATIOS

RATIOS_BY_NAME = {ratio.name: ratio for ratio in RATIOS}

Status = Literal["ok", "alert", "nodata"]


@dataclass(frozen=True)
class TileSpec:
    key: str
    label: str
    explanation: str
    percent: bool
    alerts: tuple[str, ...]


TILE_SPECS: tuple[TileSpec, ...] = (
    TileSpec(
        "creation_capacity_ratio",
        "executions created / Ĉ",
        "at or above 1 the engine is offered more work than it can complete",
        False,
        ("VLLMExecutionsAboveCapacity", "VLLMMetastableRetryLoop"),
    ),
    TileSpec(
        "queue_littles_law_ratio",
        "queue against the deadline",
        "executions waiting (vLLM + proxy queue) over those created in one deadline: near 1 every "
        "execution waits out its client's deadline",
        False,
        ("VLLMBacklogBeyondDeadline", "VLLMMetastableRetryLoop"),
    ),
    TileSpec(
        "prompt_token_gap",
        "prompt-token gap",
        "admitted prompt tokens vLLM's own counter never shows",
        True,
        ("VLLMPromptTokensUncounted",),
    ),
    TileSpec(
        "delivered_share",
        "completions delivered",
        "share of completed executions that still had a client waiting",
        True,
        ("VLLMOrphanedExecutions", "VLLMMetastableRetryLoop"),
    ),
    TileSpec(
        "delivered_within_deadline",
        "calls delivered within the deadline",
        "of the calls delivered in the last minute; late ones arrived after their deadline",
        True,
        ("VLLMCallsNotDeliveredInTime", "VLLMBacklogBeyondDeadline", "VLLMMetastableRetryLoop"),
    ),
)


@dataclass(frozen=True)
class Tile:
    key: str
    label: str
    explanation: str
    value: float | None
    text: str
    status: Status
    firing: tuple[str, ...]
    detail: str = ""  # shown beside the value, smaller (the late share beside the delivered one)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def tile_value(key: str, signals: Mapping[str, Points | None]) -> float | None:
    """The newest value of a tile's ratio: the detector's signal, else computed from its parts
    with the detector's own definition (``foundation.ratios``)."""
    ratio = RATIOS_BY_NAME.get(key)
    if ratio is not None:
        direct = latest(signals.get(key))
        if direct is not None:
            return direct
        parts = {name: latest(signals.get(name)) for name in ratio.inputs}
        if "vllm_waiting" in parts and parts["vllm_waiting"] is None:
            return None  # as in the detector: without vLLM's waiting queue, no signal at all
        return ratio.value(parts)
    if key == "delivered_share":
        completed = latest(signals.get("completion_rate_completed"))
        orphaned = latest(signals.get("completion_rate_orphaned")) or 0.0
        return _ratio(completed, None if completed is None else completed + orphaned)
    if key == "delivered_within_deadline":
        within = latest(signals.get("delivered_rate_within_deadline"))
        late = latest(signals.get("delivered_rate_late")) or 0.0
        return _ratio(within, None if within is None else within + late)
    raise KeyError(f"unknown tile {key!r}")


# NOTE: a ratio with nothing to divide by (no executions created, no prompts admitted, nothing
# completed or delivered in its window) is not missing data: its source answers, with zeros. The
# tile says so, in words: "idle" when no attempt arrived in the last minute, else what is missing
# (the loop: calls arriving, none delivered). "no data" is kept for a source that is down or a
# series that is absent, so an idle engine and a broken one never look the same.
IDLE_TEXT = "idle"
IDLE_DETAIL = "no calls in the last minute"
NOTHING_TO_DIVIDE: dict[str, tuple[tuple[str, ...], str]] = {
    # tile: (the signals of its denominator, the first one required; what it says when they are 0)
    "queue_littles_law_ratio": (("execution_creation_rate", "deadline"), "none created"),
    "prompt_token_gap": (("prompt_tokens_admitted_rate",), "none admitted"),
    "delivered_share": (("completion_rate_completed", "completion_rate_orphaned"), "none completed"),
    "delivered_within_deadline": (("delivered_rate_within_deadline", "delivered_rate_late"), "none"),
}


def _nothing_to_divide(key: str, signals: Mapping[str, Points | None]) -> bool:
    """Whether tile ``key`` has no value because its denominator is known and zero (the source
    answers), not because a series is missing."""
    if key not in NOTHING_TO_DIVIDE:
        return False
    names, _ = NOTHING_TO_DIVIDE[key]
    ratio = RATIOS_BY_NAME.get(key)
    if ratio is not None and "vllm_waiting" in ratio.inputs and latest(signals.get("vllm_waiting")) is None:
        return False  # as in tile_value: without vLLM's waiting queue, no signal at all
    values = [latest(signals.get(name)) for name in names]
    if values[0] is None:
        return False
    if ratio is not None and ratio.product:  # a product: zero when a factor is, unknown when one is
        return all(v is not None for v in values) and any(v is not None and v <= 0 for v in values)
    return sum(v for v in values if v is not None) <= 0


def _idle(signals: Mapping[str, Points | None]) -> bool:
    """No attempt arrived at the proxy in the last minute (the rate is known, and zero)."""
    attempts = latest(signals.get("attempt_rate"))
    return attempts is not None and attempts <= 0


def tiles(signals: Mapping[str, Points | None], firing_alertnames: Collection[str]) -> list[Tile]:
    """The tiles for one engine, given its signals and the names of its firing alerts."""
    out = []
    for spec in TILE_SPECS:
        value = tile_value(spec.key, signals)
        firing = tuple(a for a in spec.alerts if a in firing_alertnames)
        status: Status
        detail = ""
        if value is None and _nothing_to_divide(spec.key, signals):
            # rates that say nothing was created, admitted, completed or delivered: not missing data
            if _idle(signals):
                text, detail = IDLE_TEXT, IDLE_DETAIL
            else:
                text = NOTHING_TO_DIVIDE[spec.key][1]
            status = "alert" if firing else "ok"
        elif value is None:
            text, status = "no data", "nodata"
        else:
            text = f"{100 * value:.0f}%" if spec.percent else f"{value:.2f}"
            if spec.key == "delivered_within_deadline":  # the late share beside it, never hidden
                detail = f"{100 * (1 - value):.0f}% late"
            status = "alert" if firing else "ok"
        out.append(Tile(spec.key, spec.label, spec.explanation, value, text, status, firing, detail))
    return out


# --- Ĉ and the deadline: stated, learned or missing ---------------------------------------------

#: The tier whose Ĉ and deadline the tiles show: the vLLM tier's, which every detector evaluates
#: (a proxy tier's that differs is said beside it).
INPUT_TIER = "vllm"
SOURCE_WORDS = {
    "stated": "stated to the detector, or by the proxy's series",
    "saturated": "learned: measured while vLLM's queue never emptied",
    "predicted": "learned: predicted below saturation",
    "learned": "learned by the proxy from the ages at which clients abandon attempts",
    "proxy": "the proxy's",
    "assumed": "assumed (not stated, not learned)",
}
#: Beside the value: stated, learned (predicted or saturated), or how else it is known.
SOURCE_SHORT = {
    "stated": "stated",
    "saturated": "learned (saturated)",
    "predicted": "learned (predicted)",
    "learned": "learned",
    "proxy": "the proxy's",
    "assumed": "assumed",
}
CAPACITY_NEEDS = (
    "missing: state it (retrywatch detect --capacity C, calls/s), or let vLLM serve "
    f"{PREDICT_WINDOW_S / 60:g} minutes of ordinary traffic and the detector predicts it (it needs "
    "vLLM 0.10.2 or later: vllm:inter_token_latency_seconds)"
)
DEADLINE_NEEDS = (
    "missing: state it (--deadline S, to the detector or the proxy), or scrape the proxy in front of "
    "vLLM: it learns the deadline once enough clients have given up at their timeout (docs/operator.md, "
    '"How the deadline is found")'
)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _since(known: Known, history_from: float | None) -> str:
    if known.since is None:
        return ""
    if history_from is not None and known.since <= history_from:
        return f"since {_clock(known.since)} or before (the detector's history begins there)"
    return f"since {_clock(known.since)}"


def _input_tile(
    key: str, label: str, known: Known | None, unit: str, needs: str, history_from: float | None
) -> Tile:
    if known is None or known.value is None:
        return Tile(key, label, needs, None, "missing", "nodata", ())
    source = known.source or "unknown"
    words = SOURCE_WORDS.get(source, source)
    return Tile(
        key, label, f"{words}; {_since(known, history_from)}".rstrip("; "), known.value,
        f"{known.value:.3g} {unit}", "ok", (), SOURCE_SHORT.get(source, source),
    )  # fmt: skip


def input_tiles(inputs: EngineInputs | None, error: str | None = None) -> list[Tile]:
    """The tiles of an engine's Ĉ and deadline: value, source, the prediction's range, since when
    known; "missing" with what it needs. ``error``: why the detector did not say (an older one
    without ``/inputs``, or one that does not answer)."""
    if inputs is None:
        why = error or "the detector follows no such engine"
        return [
            Tile("input_capacity", "Ĉ", why, None, "no data", "nodata", ()),
            Tile("input_deadline", "deadline", why, None, "no data", "nodata", ()),
        ]
    cap = inputs.capacity.get(INPUT_TIER)
    capacity = _input_tile("input_capacity", "Ĉ", cap, "calls/s", CAPACITY_NEEDS, inputs.history_from)
    if cap is not None and cap.value is not None and cap.source == "predicted" and inputs.predicted:
        _, low, high = inputs.predicted
        capacity = replace(capacity, detail=f"learned (predicted, {low:.3g} to {high:.3g})")
    proxy = inputs.capacity.get("proxy")
    if proxy is not None and proxy.value is not None and cap is not None and proxy.source != cap.source:
        more = f"; the proxy tier's: {proxy.value:.3g} calls/s ({proxy.source})"
        capacity = replace(capacity, explanation=capacity.explanation + more)
    deadline = _input_tile(
        "input_deadline",
        "deadline",
        inputs.deadline.get(INPUT_TIER),
        "s",
        DEADLINE_NEEDS,
        inputs.history_from,
    )
    return [capacity, deadline]
