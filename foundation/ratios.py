"""Derived ratios: each defined once, here, over named signals.

A :class:`Ratio` is a sum of signals over a sum (or a product) of signals, optionally
``1 - numerator / denominator``. The detector's signal catalogue (``detector/signals.py``) is
built from these definitions: it evaluates each in Python (:meth:`Ratio.value`) and renders each
as the PromQL of its recording rule (:meth:`Ratio.promql`). The proxy's derived gauges
(``exporter/metrics.py``) and the dashboard's tiles evaluate the same definitions. The signal
names are the detector's (docs/architecture.md lists them).

Python and PromQL agree: a ratio is unknown (None; an absent series in PromQL) when its
denominator is unknown or not above zero. A sum in Python is unknown only when every term is
(a missing term counts as zero), while a product is unknown when any factor is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BACKLOG_DEADLINE_RATIO",
    "BACKLOG_SECONDS",
    "CANCELLED_FRACTION",
    "COMPLETION_CAPACITY_RATIO",
    "CREATION_CAPACITY_RATIO",
    "EXECUTIONS_PER_FIRST_ATTEMPT",
    "GOODPUT_RATIO",
    "ORPHANED_FRACTION",
    "PROMPT_TOKEN_GAP",
    "QUEUE_LITTLES_LAW_RATIO",
    "RATIOS",
    "WAITING_LITTLES_LAW_RATIO",
    "Ratio",
]


def _sum(values: Mapping[str, float | None], names: tuple[str, ...]) -> float | None:
    present = [v for v in (values.get(n) for n in names) if v is not None]
    return sum(present[1:], present[0]) if present else None


def _product(values: Mapping[str, float | None], names: tuple[str, ...]) -> float | None:
    out = 1.0
    for name in names:
        v = values.get(name)
        if v is None:
            return None
        out = v if name == names[0] else out * v
    return out


@dataclass(frozen=True)
class Ratio:
    """``numerator / denominator`` (``1 - numerator / denominator`` when ``complement``)."""

    name: str
    help: str
    numerator: tuple[str, ...]  # summed
    denominator: tuple[str, ...]  # summed, or multiplied when ``product``
    unit: str = "ratio"
    product: bool = False
    complement: bool = False
    # PromQL: compare the denominator "> 0" so a zero yields no sample (in Python a denominator
    # that is not above zero always yields None); left out where it cannot be zero (Ĉ, deadline).
    guard: bool = True

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every signal it reads, numerator first, without repeats."""
        return tuple(dict.fromkeys((*self.numerator, *self.denominator)))

    def value(self, values: Mapping[str, float | None]) -> float | None:
        """The ratio over ``values`` (signal name -> value; None or absent: unknown)."""
        num = _sum(values, self.numerator)
        den = _product(values, self.denominator) if self.product else _sum(values, self.denominator)
        if num is None or den is None or not den > 0:
            return None
        ratio = num / den
        return 1.0 - ratio if self.complement else ratio

    def promql(self, series: Mapping[str, str]) -> str:
        """The PromQL expression over ``series`` (signal name -> its recorded series)."""
        num = " + ".join(series[n] for n in self.numerator)
        if len(self.numerator) > 1:
            num = f"({num})"
        den = (" * " if self.product else " + ").join(series[n] for n in self.denominator)
        if len(self.denominator) > 1:
            den = f"({den})"
        if self.guard:
            den = f"({den} > 0)"
        expr = f"{num} / {den}"
        return f"1 - {expr}" if self.complement else expr


PROMPT_TOKEN_GAP = Ratio(
    "prompt_token_gap",
    "Share of admitted prompt tokens vLLM's counter misses (5 min).",
    ("prompt_tokens_counted_rate",),
    ("prompt_tokens_admitted_rate",),
    complement=True,
)
EXECUTIONS_PER_FIRST_ATTEMPT = Ratio(
    "executions_per_first_attempt",
    "Executions created per first attempt.",
    ("execution_creation_rate",),
    ("attempt_rate_first",),
)
CREATION_CAPACITY_RATIO = Ratio(
    "creation_capacity_ratio",
    "Execution creation rate over Ĉ.",
    ("execution_creation_rate",),
    ("capacity",),
    guard=False,
)
COMPLETION_CAPACITY_RATIO = Ratio(
    "completion_capacity_ratio",
    "Executions the engine completed (delivered or orphaned) over Ĉ.",
    ("completion_rate_completed", "completion_rate_orphaned"),
    ("capacity",),
    guard=False,
)
WAITING_LITTLES_LAW_RATIO = Ratio(
    "waiting_littles_law_ratio",
    "vLLM waiting over attempt rate × deadline.",
    ("vllm_waiting",),
    ("attempt_rate", "deadline"),
    product=True,
)
# NOTE: shed and attached attempts wait in no queue; every created execution waits in the
# proxy's queue or the engine's until it runs or its deadline passes.
QUEUE_LITTLES_LAW_RATIO = Ratio(
    "queue_littles_law_ratio",
    "Executions waiting (vLLM waiting + the proxy's queue) over execution creation rate × deadline:"
    " 1 when every execution waits out its client's deadline (Little's law).",
    ("vllm_waiting", "proxy_queued"),
    ("execution_creation_rate", "deadline"),
    product=True,
)
# NOTE: running executions count: at Ĉ a new execution completes only after everything in the
# engine ahead of and beside it (Little's law), which is what its deadline measures.
BACKLOG_SECONDS = Ratio(
    "backlog_seconds",
    "Executions in the engine (waiting + running) and the proxy queue, in seconds at Ĉ: by Little's"
    " law, how long a new execution takes to complete.",
    ("vllm_waiting", "vllm_running", "proxy_queued"),
    ("capacity",),
    unit="s",
    guard=False,
)
BACKLOG_DEADLINE_RATIO = Ratio(
    "backlog_deadline_ratio",
    "The backlog in deadlines.",
    ("backlog_seconds",),
    ("deadline",),
    guard=False,
)
GOODPUT_RATIO = Ratio(
    "goodput_ratio",
    "Calls delivered within the deadline per first attempt.",
    ("delivered_rate_within_deadline",),
    ("attempt_rate_first",),
)
ORPHANED_FRACTION = Ratio(
    "orphaned_fraction",
    "Share of the engine's completions that were orphaned.",
    ("completion_rate_orphaned",),
    ("completion_rate_completed", "completion_rate_orphaned"),
)
CANCELLED_FRACTION = Ratio(
    "cancelled_fraction",
    "Share of the executions the engine finished or aborted that were cancelled.",
    ("completion_rate_cancelled",),
    ("completion_rate_completed", "completion_rate_orphaned", "completion_rate_cancelled"),
)

#: Every derived ratio, in an order where each reads only signals and ratios before it.
RATIOS: tuple[Ratio, ...] = (
    PROMPT_TOKEN_GAP,
    EXECUTIONS_PER_FIRST_ATTEMPT,
    CREATION_CAPACITY_RATIO,
    COMPLETION_CAPACITY_RATIO,
    WAITING_LITTLES_LAW_RATIO,
    QUEUE_LITTLES_LAW_RATIO,
    BACKLOG_SECONDS,
    BACKLOG_DEADLINE_RATIO,
    GOODPUT_RATIO,
    ORPHANED_FRACTION,
    CANCELLED_FRACTION,
)
