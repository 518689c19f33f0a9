"""The study's pulse (docs/protocol.md §3) as a workload: base 0.6 Ĉ, a pulse at a multiple of Ĉ,
hold 0.6 Ĉ (``reproduce.workloads.calls.PULSE_PROTOCOL``), with mixed prompt lengths or not.

Its plan has a phase named ``pulse``, so its runs are judged on the protocol's timeline
(cohorts, recovery windows aligned to the pulse's end) as well as by their ground truth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from reproduce.workloads.base import STUDY_MIX, Shaping, TokenMix
from reproduce.workloads.calls import PULSE_MULTIPLE, paper_phases
from reproduce.workloads.plan import plan_generated

if TYPE_CHECKING:
    from reproduce.conditions import RunSpec
    from reproduce.workloads.client import ClientConfig
    from reproduce.workloads.plan import RunClock, RunPlan

__all__ = ["PulseWorkload", "with_pulse"]


@dataclass(frozen=True)
class PulseWorkload:
    """The protocol's pulse at ``pulse_multiple`` Ĉ, with mixed prompt lengths or not."""

    kind: ClassVar[str] = "pulse"

    pulse_multiple: float = PULSE_MULTIPLE
    mixed_prompts: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.pulse_multiple) and self.pulse_multiple > 0):
            raise ValueError(f"a pulse multiple must be positive, got {self.pulse_multiple!r}")

    @property
    def load(self) -> float:
        return self.pulse_multiple

    def at_load(self, load: float) -> PulseWorkload:
        return replace(self, pulse_multiple=float(load))

    @property
    def variant(self) -> str:
        """As the trigger sweep names its pulses."""
        return f"pulse-{self.pulse_multiple:g}"

    def fields(self, *, hold_s: float | None = None) -> dict[str, Any]:
        """The ``WorkloadSpec`` fields this part sets (phases at the study's scale)."""
        return {
            "phases": paper_phases(self.pulse_multiple, hold_s=hold_s),
            "mixed_prompts": self.mixed_prompts,
        }

    def describe(self) -> dict[str, object]:
        return {"pulse_multiple": self.pulse_multiple, "mixed_prompts": self.mixed_prompts}

    def identity(self) -> dict[str, object]:
        return {"mixed_prompts": self.mixed_prompts}

    def text(self) -> str:
        return "the study's pulse (base 0.6x, pulse at LOAD x Ĉ, hold 0.6x)"

    def label(self) -> str:
        mixed = ", mixed prompts" if self.mixed_prompts else ""
        return f"the study's pulse at {self.pulse_multiple:g}x Ĉ{mixed}"

    def mix(self) -> TokenMix:
        return TokenMix("mixed", mixed_prompts=True) if self.mixed_prompts else STUDY_MIX

    def check_capacity(self, capacity: float) -> None:
        """Its length does not depend on Ĉ: nothing to check."""

    def plan(
        self, capacity: float, client: ClientConfig, *, seed: int, clock: RunClock, shaping: Shaping
    ) -> RunPlan:
        fields = {**self.fields(hold_s=shaping.hold_s), **shaping.fields}
        return plan_generated(capacity, client, seed=seed, clock=clock, **fields)


def with_pulse(run: RunSpec, multiple: float) -> RunSpec:
    """``run`` with its pulse at ``multiple`` x Ĉ, named as the trigger sweep names its pulses."""
    workload = run.condition.workload
    if not isinstance(workload, PulseWorkload):
        raise ValueError(f"condition {run.condition.key!r} runs a {workload.kind}: it has no pulse")
    return replace(run, condition=run.condition.with_workload(workload.at_load(multiple)))
