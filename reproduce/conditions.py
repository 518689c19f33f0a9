"""Blocks and conditions of the study (docs/protocol.md §7), as data.

A condition says what the client, the proxy and the engine do: retries on or off, the proxy's
policy (cancellation off/on/deferred, coalescing, retry budget and its order, proxy cap with
FIFO/LIFO and the deadline check), the engine's queue cap Q, tokens per step, the pulse's
multiple of Ĉ, mixed prompts and per-execution tracing. A block groups conditions with the
models it ran on and the study's run counts per model. ``--block paper`` is every block.

The study's "no control" is a plain proxy: no coalescing, no budget, no cap; cancellation as the
block states. Every duration a condition carries is at the study's scale; ``policy_config``
divides them by the time scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from exporter.policy import BudgetOrder, Cancellation, PolicyConfig, QueueOrder
from reproduce.engine.presets import preset_serving

__all__ = [
    "BLOCKS",
    "MODELS",
    "PRIMARY_MODEL",
    "Block",
    "Condition",
    "ConditionError",
    "RunSpec",
    "block",
    "block_slugs",
    "expand",
]

PRIMARY_MODEL = "qwen2.5-7b-h100"
MODELS: tuple[str, ...] = (PRIMARY_MODEL, "qwen3-14b-h100", "llama3.1-8b-h100")

RETRIES = 3
RETRY_BUDGET = 0.1  # retries within 10% of first attempts over a sliding 60-s window
BUDGET_WINDOW_S = 60.0
DEFERRED_CANCEL_S = 10.0
PROXY_CAP = 100
LIFO_THRESHOLD = 50


class ConditionError(ValueError):
    """An unknown block, condition or model; the message lists what exists."""


@dataclass(frozen=True)
class Condition:
    """One experimental condition. Durations are at the study's scale (seconds)."""

    slug: str
    retries: int = RETRIES
    cancellation: Cancellation = Cancellation.OFF
    coalesce: bool = False
    retry_budget: float | None = None
    budget_order: BudgetOrder = BudgetOrder.LOOKUP_FIRST
    proxy_cap: int | None = None
    queue_order: QueueOrder = QueueOrder.FIFO
    deadline_check: bool = False
    engine_queue_cap: int | None = None
    tokens_per_step: int = 8_192
    pulse_multiple: float = 2.7
    mixed_prompts: bool = False
    tracing: bool = False
    variant: str = ""  # distinguishes cells sharing a slug (the trigger sweep's pulse)

    @property
    def key(self) -> str:
        """The condition's slug plus its variant: unique within a block."""
        return f"{self.slug}-{self.variant}" if self.variant else self.slug

    def policy_config(self, deadline_s: float, time_scale: float = 1.0) -> PolicyConfig:
        """The proxy policy of this condition, every duration divided by ``time_scale``.

        ``deadline_s`` is the clients' (already scaled) deadline; the proxy knows it so that
        its delivered-within-deadline counter and the deadline check are meaningful.
        """
        k = float(time_scale)
        return PolicyConfig(
            coalesce=self.coalesce,
            cancellation=self.cancellation,
            cancel_after_s=DEFERRED_CANCEL_S / k,
            retry_budget=self.retry_budget,
            budget_window_s=BUDGET_WINDOW_S / k,
            budget_order=self.budget_order,
            max_outstanding=self.proxy_cap,
            queue_order=self.queue_order,
            lifo_threshold=LIFO_THRESHOLD,
            deadline_check=self.deadline_check,
            deadline_s=deadline_s,
            retry_memory_s=900.0 / k,
        )

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (for summary.json and reports)."""
        return {
            "retries": self.retries,
            "cancellation": self.cancellation.value,
            "coalesce": self.coalesce,
            "retry_budget": self.retry_budget,
            "budget_order": self.budget_order.value if self.retry_budget is not None else None,
            "proxy_cap": self.proxy_cap,
            "queue_order": self.queue_order.value if self.proxy_cap is not None else None,
            "deadline_check": self.deadline_check,
            "engine_queue_cap": self.engine_queue_cap,
            "tokens_per_step": self.tokens_per_step,
            "pulse_multiple": self.pulse_multiple,
            "mixed_prompts": self.mixed_prompts,
            "tracing": self.tracing,
        }


@dataclass(frozen=True)
class Block:
    """Conditions run side by side, the models they ran on and the runs per model."""

    slug: str
    conditions: tuple[Condition, ...]
    runs: dict[str, int]  # model preset -> runs per condition

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.runs)

    def condition(self, key: str) -> Condition:
        for c in self.conditions:
            if c.key == key:
                return c
        known = ", ".join(c.key for c in self.conditions)
        raise ConditionError(f"block {self.slug!r} has no condition {key!r} (known: {known})")


@dataclass(frozen=True)
class RunSpec:
    """One run to execute: a block, a condition, a model preset and a run index."""

    block: str
    condition: Condition
    model: str
    run: int
    seed: int

    @property
    def slug(self) -> str:
        return f"{self.block}__{self.condition.key}__{self.model}__r{self.run}"


def _no_control(cancellation: Cancellation = Cancellation.OFF) -> Condition:
    return Condition("no-control", cancellation=cancellation)


_DIAGNOSTIC = (
    Condition("retries-off-cancel-off", retries=0),
    Condition("retries-on-cancel-off"),
    Condition("retries-off-cancel-on", retries=0, cancellation=Cancellation.ON),
    Condition("retries-on-cancel-on", cancellation=Cancellation.ON),
)

_TRIGGER_SWEEP = tuple(
    Condition(slug, retries=retries, pulse_multiple=pulse, variant=f"pulse-{pulse:g}")
    for pulse in (1.5, 2.0, 2.7)
    for slug, retries in (("retries-on-cancel-off", RETRIES), ("retries-off-cancel-off", 0))
)

_TRACING = (
    Condition("steps-2k-cancel-off", tokens_per_step=2_048, tracing=True),
    Condition("steps-2k-cancel-on", tokens_per_step=2_048, cancellation=Cancellation.ON, tracing=True),
    Condition("steps-8k-cancel-on", tokens_per_step=8_192, cancellation=Cancellation.ON, tracing=True),
)

_COMPOSITION = (
    _no_control(),
    Condition("retry-budget", retry_budget=RETRY_BUDGET),
    Condition("coalescing", coalesce=True),
    Condition(
        "budget-first", coalesce=True, retry_budget=RETRY_BUDGET, budget_order=BudgetOrder.BUDGET_FIRST
    ),
    Condition(
        "lookup-first", coalesce=True, retry_budget=RETRY_BUDGET, budget_order=BudgetOrder.LOOKUP_FIRST
    ),
)

_ON = Cancellation.ON
_QUEUE_POLICY = (
    _no_control(_ON),
    Condition("proxy-cap", cancellation=_ON, proxy_cap=PROXY_CAP),
    Condition("deadline-check", cancellation=_ON, proxy_cap=PROXY_CAP, deadline_check=True),
    Condition("lifo", cancellation=_ON, proxy_cap=PROXY_CAP, queue_order=QueueOrder.LIFO),
)

_ENGINE_CAP = (
    _no_control(),
    Condition("engine-cap-338", engine_queue_cap=338),
    Condition("engine-cap-338-cancel-on", engine_queue_cap=338, cancellation=_ON),
    Condition("engine-cap-100", engine_queue_cap=100),
)

_DEFERRED = Condition("deferred-cancellation", coalesce=True, cancellation=Cancellation.DEFERRED)
_DEFERRAL = (
    _no_control(),
    Condition("coalescing", coalesce=True),
    Condition("coalescing-cancel-on", coalesce=True, cancellation=_ON),
    _DEFERRED,
)

_BUDGET_CANCEL = (
    _no_control(),
    Condition("cancellation", cancellation=_ON),
    Condition("retry-budget", retry_budget=RETRY_BUDGET),
    Condition("retry-budget-cancel-on", retry_budget=RETRY_BUDGET, cancellation=_ON),
    _DEFERRED,
)

_MIXED = tuple(replace(c, mixed_prompts=True) for c in _DIAGNOSTIC)


def _all_models(primary: int, others: int) -> dict[str, int]:
    return {PRIMARY_MODEL: primary, **{m: others for m in MODELS[1:]}}


BLOCKS: dict[str, Block] = {
    b.slug: b
    for b in (
        Block("diagnostic", _DIAGNOSTIC, _all_models(3, 2)),
        Block("trigger-sweep", _TRIGGER_SWEEP, _all_models(1, 1)),
        Block("tracing", _TRACING, {PRIMARY_MODEL: 3}),
        Block("composition", _COMPOSITION, _all_models(4, 2)),
        Block("queue-policy", _QUEUE_POLICY, {PRIMARY_MODEL: 2}),
        Block("engine-cap", _ENGINE_CAP, {PRIMARY_MODEL: 2}),
        Block("deferral", _DEFERRAL, {PRIMARY_MODEL: 2}),
        Block("mixed-prompts", _MIXED, {PRIMARY_MODEL: 2}),
        Block("budget-cancel", _BUDGET_CANCEL, {PRIMARY_MODEL: 2}),
    )
}
PAPER = "paper"


def block_slugs() -> list[str]:
    return [*BLOCKS, PAPER]


def block(slug: str) -> Block:
    try:
        return BLOCKS[slug]
    except KeyError:
        raise ConditionError(f"unknown block {slug!r} (known: {', '.join(block_slugs())})") from None


def expand(
    block_slug: str,
    *,
    models: str | list[str] = "all",
    runs: int | None = None,
    seed: int = 0,
    conditions: list[str] | None = None,
) -> list[RunSpec]:
    """Every run of a block (or of ``paper``, every block).

    ``models`` = "all" keeps each block's own models; a model name or list restricts to those
    (a block that never ran on a model is run on it only when named explicitly). ``runs`` =
    None uses the study's counts; an int overrides them. Run ``r`` of every condition replays
    the same trace (seed ``seed + r``), so conditions are compared on equal footing.
    """
    slugs = list(BLOCKS) if block_slug == PAPER else [block(block_slug).slug]
    if isinstance(models, str) and models != "all":
        models = [models]
    out: list[RunSpec] = []
    for slug in slugs:
        b = BLOCKS[slug]
        if models == "all":
            chosen = dict(b.runs)
        else:
            assert isinstance(models, list)
            # A real engine's model (``qwen2.5-7b-instruct``) runs as often as the study ran the
            # architecture its preset stands for; a model the study never ran, twice.
            chosen = {m: b.runs.get(m, b.runs.get(preset_serving(m) or "", 2)) for m in models}
        selected = b.conditions if conditions is None else tuple(b.condition(k) for k in conditions)
        for model, n in chosen.items():
            count = n if runs is None else runs
            if count < 1:
                raise ConditionError(f"runs must be >= 1, got {count!r}")
            for r in range(count):
                for cond in selected:
                    out.append(RunSpec(slug, cond, model, r, seed + r))
    return out


def engine_cap_for(capacity: float, deadline_s: float = 120.0) -> int:
    """Q = ⌈deadline × Ĉ⌉: the engine cap that holds one deadline of backlog (338 at Ĉ = 2.81)."""
    return math.ceil(deadline_s * capacity)
