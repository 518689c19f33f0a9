"""The workload seam: what every kind of workload (the study's pulse, a request trace, a stepped
load) offers the code that plans, runs, judges and draws a run, so none of it asks which kind a
workload is.

A workload is the load part of a condition (``reproduce.conditions``). It plans a run
(:meth:`Workload.plan`: its calls, its phases, its client and its clock, in run seconds);
the plan says what the run is judged on (a phase named ``pulse``: the protocol's timeline; none:
the ground truth over time, aligned on the burst behind each collapse), so judges and the
dashboard read the plan and the run's summary entry, never the workload's kind. It says what its
load is as a multiple of Ĉ and gives itself at another (``--load``, the what-if's headroom), how
its runs are named apart (``variant``), what summary.json's ``settings`` say of it, and the token
mix Ĉ is calibrated on (:class:`TokenMix`).

A backend shapes every workload the same way, with :class:`Shaping`: the protocol's token lengths
(a CPU engine's are divided by K), a recorded trace's lengths × a token scale, a pulse's hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from reproduce.workloads.calls import MAX_CONTEXT

if TYPE_CHECKING:
    from reproduce.workloads.client import ClientConfig
    from reproduce.workloads.plan import RunClock, RunPlan
    from reproduce.workloads.trace import TraceFacts

__all__ = ["STUDY_MIX", "Shaping", "TokenMix", "Workload"]

#: The keys of a backend's ``workload`` options that are not ``WorkloadSpec`` fields.
_SHAPING_KEYS = ("token_scale", "hold_s")


@dataclass(frozen=True)
class Shaping:
    """How a backend shapes a workload's calls: ``fields`` overrides a generated workload's
    ``WorkloadSpec`` fields (token lengths; a custom pulse's ``phases``), ``token_scale``
    multiplies a recorded trace's lengths, ``max_context`` cuts a prompt, ``hold_s`` is the
    pulse's hold (study seconds; None: the protocol's)."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    token_scale: float = 1.0
    hold_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.token_scale) and self.token_scale > 0):
            raise ValueError(f"token_scale must be positive, got {self.token_scale!r}")

    @property
    def max_context(self) -> int:
        return int(self.fields.get("max_context", MAX_CONTEXT))

    def options(self) -> dict[str, Any]:
        """As a backend's ``workload`` options (:meth:`of` reads them back)."""
        return {**self.fields, "token_scale": self.token_scale, "hold_s": self.hold_s}

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> Shaping:
        """A backend's ``workload`` options: ``WorkloadSpec`` fields, plus ``token_scale`` and
        ``hold_s``."""
        fields = {k: v for k, v in options.items() if k not in _SHAPING_KEYS}
        hold = options.get("hold_s")
        return cls(fields, float(options.get("token_scale", 1.0)), None if hold is None else float(hold))


@dataclass(frozen=True)
class TokenMix:
    """What Ĉ depends on besides the engine: the calls' token lengths. ``key`` tells mixes apart
    (a calibration is cached by it): the study's lengths, the study's with mixed prompts, or a
    trace's own mix (``facts``)."""

    key: str
    mixed_prompts: bool = False
    facts: TraceFacts | None = None


STUDY_MIX = TokenMix("study")


@runtime_checkable
class Workload(Protocol):
    """The load part of a condition; see the module docstring."""

    #: The workload's name in ``reproduce.workloads.WORKLOADS`` (and what-if setups).
    kind: ClassVar[str]

    @property
    def load(self) -> float:
        """Its load as a multiple of Ĉ: a pulse's multiple, a trace's mean rate, the top step."""
        ...

    def at_load(self, load: float) -> Workload:
        """The same workload at ``load`` × Ĉ (``load`` as :attr:`load` means it)."""
        ...

    @property
    def variant(self) -> str:
        """What tells this workload's runs apart from others of the same condition."""
        ...

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (summary.json's ``settings``)."""
        ...

    def identity(self) -> dict[str, object]:
        """What a run's calls depend on besides the load (a what-if's points are reused only
        for the same identity)."""
        ...

    def text(self) -> str:
        """The workload in words, its load as ``LOAD``."""
        ...

    def label(self) -> str:
        """The workload in words at its load (summary.json's ``workload``, the dashboard's)."""
        ...

    def mix(self) -> TokenMix:
        """The token mix Ĉ is calibrated on."""
        ...

    def check_capacity(self, capacity: float) -> None:
        """Raise when a run at Ĉ = ``capacity`` would grow past the bounds a run may reach (a
        backend calls it once Ĉ is known, before any run starts)."""
        ...

    def plan(
        self, capacity: float, client: ClientConfig, *, seed: int, clock: RunClock, shaping: Shaping
    ) -> RunPlan:
        """The run, planned once at ``clock``: ``capacity`` is Ĉ in calls per run-second,
        ``client`` at the study's scale; every time of the plan in run seconds."""
        ...
