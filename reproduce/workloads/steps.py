"""A stepped load as a workload (``--steps 0.5,1,1.5,2``): calls arrive at each multiple of Ĉ in
turn, each step held for the same time, Poisson arrivals within a step, the study's token
lengths.

Where the pulse asks whether one burst tips the engine, a stepped load walks the load up (or
down) and shows at which step the service stops delivering within the deadline and whether it
comes back. It has no designated pulse: its runs are judged by their ground truth over time
(``reproduce.judge.groundtruth``), each collapse aligned on the burst behind it, as a replayed trace's.

The default hold of a step, :data:`STEP_S` = 300 s (study seconds), is the length of the
protocol's calibration stages (docs/protocol.md §5), long enough to see a queue grow at a load,
and longer than what judging a step needs: a deadline (120 s) for a backlog to show as missed
calls, then two recovery windows (2 x 60 s) for a load the engine holds to be seen as recovered.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from reproduce.workloads.base import STUDY_MIX, Shaping, TokenMix
from reproduce.workloads.plan import REPLAY_TAIL_WINDOWS, plan_generated

if TYPE_CHECKING:
    from reproduce.workloads.client import ClientConfig
    from reproduce.workloads.plan import RunClock, RunPlan

__all__ = ["STEP_S", "SteppedWorkload", "parse_steps"]

#: How long each step is held by default (study seconds; the module docstring says why).
STEP_S = 300.0


class StepsError(ValueError):
    """Steps that cannot make a load; the message says what to fix."""


def parse_steps(text: str) -> tuple[float, ...]:
    """``0.5,1,1.5,2`` as multiples of Ĉ (each positive and finite, at least one)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        steps = tuple(float(p) for p in parts)
    except ValueError:
        raise StepsError(f"{text!r} is not a comma-separated list of multiples of Ĉ") from None
    if not steps:
        raise StepsError("give at least one step, a multiple of Ĉ")
    SteppedWorkload(steps)  # checks each
    return steps


@dataclass(frozen=True)
class SteppedWorkload:
    """Calls at each of ``steps`` × Ĉ in turn, each for ``step_s`` (study seconds)."""

    kind: ClassVar[str] = "steps"

    steps: Sequence[float] = (0.5, 1.0, 1.5, 2.0)
    step_s: float = STEP_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(float(m) for m in self.steps))
        if not self.steps:
            raise StepsError("a stepped load needs at least one step")
        for m in self.steps:
            if not (math.isfinite(m) and m > 0):
                raise StepsError(f"a step must be a positive multiple of Ĉ, got {m!r}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise StepsError(f"a step's hold must be a positive number of seconds, got {self.step_s!r}")

    @property
    def load(self) -> float:
        """The top step."""
        return max(self.steps)

    def at_load(self, load: float) -> SteppedWorkload:
        """Every step scaled so that the top one is at ``load``."""
        factor = float(load) / self.load
        return replace(self, steps=tuple(m * factor for m in self.steps))

    @property
    def variant(self) -> str:
        held = "" if self.step_s == STEP_S else f"-{self.step_s:g}s"
        return "steps-" + "-".join(f"{m:g}" for m in self.steps) + held

    def describe(self) -> dict[str, object]:
        return {"steps": list(self.steps), "step_s": self.step_s}

    def identity(self) -> dict[str, object]:
        top = self.load
        return {"steps_of_top": [round(m / top, 6) for m in self.steps], "step_s": self.step_s}

    def text(self) -> str:
        shape = ", ".join(f"{m / self.load:g}" for m in self.steps)
        return f"a stepped load ({shape} x LOAD x Ĉ, {self.step_s:g} s each)"

    def label(self) -> str:
        return f"steps of {', '.join(f'{m:g}' for m in self.steps)}x Ĉ, {self.step_s:g} s each"

    def mix(self) -> TokenMix:
        return STUDY_MIX

    def check_capacity(self, capacity: float) -> None:
        """Its length does not depend on Ĉ: nothing to check."""

    def plan(
        self, capacity: float, client: ClientConfig, *, seed: int, clock: RunClock, shaping: Shaping
    ) -> RunPlan:
        fields = {
            **shaping.fields,
            "phases": tuple((self.step_s, m) for m in self.steps),
            "phase_names": tuple(f"step{i + 1}" for i in range(len(self.steps))),
        }
        return plan_generated(
            capacity, client, seed=seed, clock=clock, tail_windows=REPLAY_TAIL_WINDOWS, **fields
        )
