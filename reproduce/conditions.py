"""Blocks and conditions of the study (docs/protocol.md §7), as data.

A condition names the parts it sets, each its own type so that one can change without the
others (a trace replay can replace the pulse workload, say):

* ``ProxyPolicy``: cancellation off/on/deferred, coalescing, retry budget and its order, proxy
  cap with FIFO/LIFO and the deadline check;
* ``ClientProfile``: the clients (the study's, or a ``--client`` profile) and retries on or off;
* ``EngineSettings``: the engine's queue cap Q, tokens per step, per-execution tracing;
* a ``Workload`` (``reproduce.workloads``): the study's pulse (``PulseWorkload``, its multiple of Ĉ,
  mixed prompts), a request trace replayed at a load (``TraceWorkload``) or a stepped load
  (``SteppedWorkload``).

A block groups conditions with the models it ran on and the study's run counts per model.
``--block paper`` is every block. The study's "no control" is a plain proxy: no coalescing, no
budget, no cap; cancellation as the block states. Every duration a condition carries is at the
study's scale; ``ProxyPolicy.config`` gives the policy's in a run plan's seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from exporter.policy import BudgetOrder, Cancellation, PolicyConfig, QueueOrder
from reproduce.engine.presets import preset_serving
from reproduce.workloads.base import Workload
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.pulse import PulseWorkload
from reproduce.workloads.steps import SteppedWorkload
from reproduce.workloads.trace import TraceWorkload

if TYPE_CHECKING:
    from reproduce.workloads.plan import RunPlan

__all__ = [
    "BLOCKS",
    "MODELS",
    "PRIMARY_MODEL",
    "Block",
    "ClientProfile",
    "Condition",
    "ConditionError",
    "EngineSettings",
    "ProxyPolicy",
    "PulseWorkload",
    "RunSpec",
    "SteppedWorkload",
    "TraceWorkload",
    "Workload",
    "block",
    "block_slugs",
    "expand",
]

PRIMARY_MODEL = "qwen2.5-7b-h100"
MODELS: tuple[str, ...] = (PRIMARY_MODEL, "qwen3-14b-h100", "llama3.1-8b-h100")

RETRY_BUDGET = 0.1  # retries within 10% of first attempts over a sliding 60-s window
BUDGET_WINDOW_S = 60.0
DEFERRED_CANCEL_S = 10.0
PROXY_CAP = 100
LIFO_THRESHOLD = 50
RETRY_MEMORY_S = 900.0  # how long the proxy remembers a call id as seen (a later attempt is a retry)


class ConditionError(ValueError):
    """An unknown block, condition or model; the message lists what exists."""


@dataclass(frozen=True)
class ProxyPolicy:
    """What the proxy does (``exporter.policy``): cancellation, coalescing, the retry budget and
    its order, the proxy cap with its queue order, the deadline check. The study's "no control"
    is the default: a plain proxy, cancellation off."""

    cancellation: Cancellation = Cancellation.OFF
    coalesce: bool = False
    retry_budget: float | None = None
    budget_order: BudgetOrder = BudgetOrder.LOOKUP_FIRST
    proxy_cap: int | None = None
    queue_order: QueueOrder = QueueOrder.FIFO
    deadline_check: bool = False

    def config(self, plan: RunPlan) -> PolicyConfig:
        """The proxy's ``PolicyConfig`` for the run ``plan`` plans, every duration of the policy in
        its run seconds (``RunPlan.run_s``).

        The clients' deadline is the plan's; the proxy knows it so that its
        delivered-within-deadline counter and the deadline check are meaningful.
        """
        return PolicyConfig(
            coalesce=self.coalesce,
            cancellation=self.cancellation,
            cancel_after_s=plan.run_s(DEFERRED_CANCEL_S),
            retry_budget=self.retry_budget,
            budget_window_s=plan.run_s(BUDGET_WINDOW_S),
            budget_order=self.budget_order,
            max_outstanding=self.proxy_cap,
            queue_order=self.queue_order,
            lifo_threshold=LIFO_THRESHOLD,
            deadline_check=self.deadline_check,
            deadline_s=plan.deadline_s,
            retry_memory_s=plan.run_s(RETRY_MEMORY_S),
        )

    def describe(self) -> dict[str, object]:
        return {
            "cancellation": self.cancellation.value,
            "coalesce": self.coalesce,
            "retry_budget": self.retry_budget,
            "budget_order": self.budget_order.value if self.retry_budget is not None else None,
            "proxy_cap": self.proxy_cap,
            "queue_order": self.queue_order.value if self.proxy_cap is not None else None,
            "deadline_check": self.deadline_check,
        }


@dataclass(frozen=True)
class ClientProfile:
    """Who the clients are (``name`` and ``base``: the study's client unless ``--client`` names
    another, ``reproduce.workloads.clients``) and whether the condition lets them retry: ``retries`` None
    keeps the client's own, 0 turns retries off."""

    retries: int | None = None
    name: str = "study"
    base: ClientConfig = field(default_factory=ClientConfig)

    def config(self, base: ClientConfig | None = None) -> ClientConfig:
        """``base`` (this profile's client by default, at the study's scale) with these retries."""
        client = base or self.base
        return client if self.retries is None else replace(client, retries=self.retries)

    def describe(self) -> dict[str, object]:
        config = self.config()
        return {"retries": config.retries, "client": self.name, "client_settings": config.describe()}


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is started with: its queue cap Q (None: none), tokens per step, and
    per-execution tracing (the simulator's; a real engine is not traced)."""

    engine_queue_cap: int | None = None
    tokens_per_step: int = 8_192
    tracing: bool = False

    def describe(self) -> dict[str, object]:
        return {
            "engine_queue_cap": self.engine_queue_cap,
            "tokens_per_step": self.tokens_per_step,
            "tracing": self.tracing,
        }


@dataclass(frozen=True)
class Condition:
    """One experimental condition: a name and the parts it sets (proxy policy, client profile,
    engine settings, workload). Durations are at the study's scale (seconds)."""

    slug: str
    policy: ProxyPolicy = ProxyPolicy()
    client: ClientProfile = ClientProfile()
    engine: EngineSettings = EngineSettings()
    workload: Workload = field(default_factory=PulseWorkload)
    variant: str = ""  # distinguishes cells sharing a slug (the trigger sweep's pulse)

    def with_workload(self, workload: Workload) -> Condition:
        """This condition with ``workload`` instead, its runs named by the workload's variant."""
        return replace(self, workload=workload, variant=workload.variant)

    @property
    def key(self) -> str:
        """The condition's slug plus its variant: unique within a block."""
        return f"{self.slug}-{self.variant}" if self.variant else self.slug

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (summary.json's ``settings``, read by reports and the dashboard)."""
        policy, engine, workload = self.policy.describe(), self.engine.describe(), self.workload.describe()
        return {
            **self.client.describe(),
            **policy,
            "engine_queue_cap": engine["engine_queue_cap"],
            "tokens_per_step": engine["tokens_per_step"],
            **workload,
            "tracing": engine["tracing"],
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


_ON = Cancellation.ON
_NO_RETRIES = ClientProfile(retries=0)


def _no_control(cancellation: Cancellation = Cancellation.OFF) -> Condition:
    return Condition("no-control", ProxyPolicy(cancellation=cancellation))


_DIAGNOSTIC = (
    Condition("retries-off-cancel-off", client=_NO_RETRIES),
    Condition("retries-on-cancel-off"),
    Condition("retries-off-cancel-on", ProxyPolicy(cancellation=_ON), client=_NO_RETRIES),
    Condition("retries-on-cancel-on", ProxyPolicy(cancellation=_ON)),
)

_TRIGGER_SWEEP = tuple(
    Condition(slug, client=client, workload=PulseWorkload(pulse_multiple=pulse), variant=f"pulse-{pulse:g}")
    for pulse in (1.5, 2.0, 2.7)
    for slug, client in (("retries-on-cancel-off", ClientProfile()), ("retries-off-cancel-off", _NO_RETRIES))
)

_TRACING = (
    Condition("steps-2k-cancel-off", engine=EngineSettings(tokens_per_step=2_048, tracing=True)),
    Condition(
        "steps-2k-cancel-on",
        ProxyPolicy(cancellation=_ON),
        engine=EngineSettings(tokens_per_step=2_048, tracing=True),
    ),
    Condition(
        "steps-8k-cancel-on",
        ProxyPolicy(cancellation=_ON),
        engine=EngineSettings(tokens_per_step=8_192, tracing=True),
    ),
)

_COMPOSITION = (
    _no_control(),
    Condition("retry-budget", ProxyPolicy(retry_budget=RETRY_BUDGET)),
    Condition("coalescing", ProxyPolicy(coalesce=True)),
    Condition(
        "budget-first",
        ProxyPolicy(coalesce=True, retry_budget=RETRY_BUDGET, budget_order=BudgetOrder.BUDGET_FIRST),
    ),
    Condition(
        "lookup-first",
        ProxyPolicy(coalesce=True, retry_budget=RETRY_BUDGET, budget_order=BudgetOrder.LOOKUP_FIRST),
    ),
)

_QUEUE_POLICY = (
    _no_control(_ON),
    Condition("proxy-cap", ProxyPolicy(cancellation=_ON, proxy_cap=PROXY_CAP)),
    Condition("deadline-check", ProxyPolicy(cancellation=_ON, proxy_cap=PROXY_CAP, deadline_check=True)),
    Condition("lifo", ProxyPolicy(cancellation=_ON, proxy_cap=PROXY_CAP, queue_order=QueueOrder.LIFO)),
)

_ENGINE_CAP = (
    _no_control(),
    Condition("engine-cap-338", engine=EngineSettings(engine_queue_cap=338)),
    Condition(
        "engine-cap-338-cancel-on", ProxyPolicy(cancellation=_ON), engine=EngineSettings(engine_queue_cap=338)
    ),
    Condition("engine-cap-100", engine=EngineSettings(engine_queue_cap=100)),
)

_DEFERRED = Condition("deferred-cancellation", ProxyPolicy(coalesce=True, cancellation=Cancellation.DEFERRED))
_DEFERRAL = (
    _no_control(),
    Condition("coalescing", ProxyPolicy(coalesce=True)),
    Condition("coalescing-cancel-on", ProxyPolicy(coalesce=True, cancellation=_ON)),
    _DEFERRED,
)

_BUDGET_CANCEL = (
    _no_control(),
    Condition("cancellation", ProxyPolicy(cancellation=_ON)),
    Condition("retry-budget", ProxyPolicy(retry_budget=RETRY_BUDGET)),
    Condition("retry-budget-cancel-on", ProxyPolicy(retry_budget=RETRY_BUDGET, cancellation=_ON)),
    _DEFERRED,
)

_MIXED = tuple(replace(c, workload=PulseWorkload(mixed_prompts=True)) for c in _DIAGNOSTIC)


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
