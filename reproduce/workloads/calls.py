"""Workload traces of the study's protocol (docs/protocol.md §3): open-loop Poisson arrivals per phase.

A trace fixes every call's planned arrival time, prompt length (with the shared prefix) and
response length before the run starts, from a seeded ``numpy`` Generator, so the same spec
always gives the same trace. This module also turns a planned call into what an engine needs:
prompt segments for the engine model (``prompt_segments``) and real token IDs for HTTP
backends (``prompt_token_ids``). Prompt content is random token IDs, never text.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "MAX_CONTEXT",
    "PULSE_MULTIPLE",
    "PULSE_PROTOCOL",
    "PlannedCall",
    "WorkloadError",
    "WorkloadSpec",
    "generate_trace",
    "paper_phases",
    "phase_rates",
    "prompt_segments",
    "prompt_token_ids",
    "segment_token_ids",
    "shared_prefix_segment_id",
]

#: The longest context a call may have (the study's engine: docs/protocol.md §2).
MAX_CONTEXT = 32_768

# median 300, mean ~400: mean = median * exp(sigma^2 / 2)  =>  sigma = sqrt(2 ln(4/3))
_RESPONSE_SIGMA_DEFAULT = math.sqrt(2.0 * math.log(400.0 / 300.0))

#: The study's pulse protocol (docs/protocol.md §3), declared here only: ``(name, duration_s,
#: multiple_of_capacity)`` at the study's scale: base 0.6 Ĉ for 120 s, pulse 2.7 Ĉ for 107 s,
#: hold 0.6 Ĉ for 720 s. The trigger sweep changes the pulse's multiple, a CI run the hold.
PULSE_PROTOCOL: tuple[tuple[str, float, float], ...] = (
    ("base", 120.0, 0.6),
    ("pulse", 107.0, 2.7),
    ("hold", 720.0, 0.6),
)
_PAPER_PHASE_NAMES = tuple(name for name, _, _ in PULSE_PROTOCOL)
#: The pulse's multiple of Ĉ in the study's protocol (2.7).
PULSE_MULTIPLE: float = next(m for name, _, m in PULSE_PROTOCOL if name == "pulse")


class WorkloadError(ValueError):
    """A workload spec that cannot produce a trace; the message says which field to fix."""


def paper_phases(
    pulse_multiple: float | None = None, *, hold_s: float | None = None
) -> tuple[tuple[float, float], ...]:
    """The protocol's base / pulse / hold ``(duration_s, multiple)`` (study seconds), with the pulse
    at ``pulse_multiple`` Ĉ and the hold ``hold_s`` long where given (the protocol's otherwise)."""
    out: list[tuple[float, float]] = []
    for name, duration, multiple in PULSE_PROTOCOL:
        if name == "pulse" and pulse_multiple is not None:
            multiple = pulse_multiple
        if name == "hold" and hold_s is not None:
            duration = hold_s
        out.append((float(duration), float(multiple)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Every parameter of a trace, explicit. Lengths are in tokens, times in seconds.

    ``phases`` is a sequence of ``(duration_s, multiple_of_capacity)``; the arrival rate in a
    phase is ``multiple * capacity`` calls/s, at the study's scale: a run's plan
    (``reproduce.workloads.plan.plan_run``) puts its calls and phases in the run's seconds.
    ``phase_names`` defaults to base/pulse/hold for three phases, ``phase<i>`` otherwise.
    """

    capacity: float
    seed: int = 0
    phases: tuple[tuple[float, float], ...] = paper_phases()
    phase_names: tuple[str, ...] | None = None
    prompt_mean: float = 12_000.0
    prompt_std: float = 1_200.0
    shared_prefix_len: int = 2_000
    mixed_prompts: bool = False
    mixed_prompt_len: int = 3_000
    mixed_fraction: float = 0.5
    response_median: float = 300.0
    response_sigma: float = _RESPONSE_SIGMA_DEFAULT
    max_context: int = MAX_CONTEXT
    call_id_prefix: str = field(default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple((float(d), float(m)) for d, m in self.phases))
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise WorkloadError(f"capacity must be a positive call rate, got {self.capacity!r}")
        if not self.phases:
            raise WorkloadError("phases must hold at least one (duration_s, multiple_of_capacity)")
        for duration, multiple in self.phases:
            if not (math.isfinite(duration) and duration > 0):
                raise WorkloadError(f"phase duration must be positive, got {duration!r}")
            if not (math.isfinite(multiple) and multiple >= 0):
                raise WorkloadError(f"phase multiple of capacity must be >= 0, got {multiple!r}")
        if self.phase_names is not None and len(self.phase_names) != len(self.phases):
            raise WorkloadError(
                f"phase_names has {len(self.phase_names)} names for {len(self.phases)} phases"
            )
        if self.shared_prefix_len < 0:
            raise WorkloadError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len!r}")
        if self.prompt_mean <= self.shared_prefix_len or self.prompt_std < 0:
            raise WorkloadError("prompt_mean must exceed shared_prefix_len and prompt_std must be >= 0")
        if self.mixed_prompts and self.mixed_prompt_len <= self.shared_prefix_len:
            raise WorkloadError("mixed_prompt_len must exceed shared_prefix_len")
        if not 0.0 <= self.mixed_fraction <= 1.0:
            raise WorkloadError(f"mixed_fraction must be in [0, 1], got {self.mixed_fraction!r}")
        if self.response_median < 1 or self.response_sigma < 0:
            raise WorkloadError("response_median must be >= 1 token and response_sigma >= 0")
        if self.max_context <= self.shared_prefix_len + 1:
            raise WorkloadError("max_context must leave room for a prompt and one output token")

    @property
    def names(self) -> tuple[str, ...]:
        """The phase names, one per phase."""
        if self.phase_names is not None:
            return self.phase_names
        if len(self.phases) == 3:
            return _PAPER_PHASE_NAMES
        return tuple(f"phase{i}" for i in range(len(self.phases)))

    @property
    def duration_s(self) -> float:
        """Total planned duration of the arrivals."""
        return sum(d for d, _ in self.phases)

    def phase_bounds(self) -> list[tuple[str, float, float]]:
        """``(name, start_s, end_s)`` of every phase."""
        out: list[tuple[str, float, float]] = []
        t = 0.0
        for name, (duration, _) in zip(self.names, self.phases, strict=True):
            out.append((name, t, t + duration))
            t += duration
        return out


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """One call of a trace: when it arrives, its prompt and its response length (tokens)."""

    call_id: str
    arrival_s: float
    prompt_len: int
    shared_prefix_len: int
    response_len: int
    phase: str


def generate_trace(spec: WorkloadSpec) -> list[PlannedCall]:
    """Draw the trace of ``spec``: Poisson arrivals per phase, then lengths; sorted by arrival."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    arrivals: list[float] = []
    phases: list[str] = []
    start = 0.0
    for name, (duration, multiple) in zip(spec.names, spec.phases, strict=True):
        rate = multiple * spec.capacity
        end = start + duration
        if rate > 0:
            # Draw gaps in chunks until the phase is filled (vectorised, still one stream).
            t = start
            expected = int(rate * duration * 1.2) + 16
            while True:
                gaps = rng.exponential(1.0 / rate, size=expected)
                times = t + np.cumsum(gaps)
                inside = times[times < end]
                arrivals.extend(inside.tolist())
                phases.extend([name] * len(inside))
                if len(inside) < len(times):
                    break
                t = float(times[-1])
        start = end
    n = len(arrivals)
    prompt = np.rint(rng.normal(spec.prompt_mean, spec.prompt_std, size=n)).astype(np.int64)
    if spec.mixed_prompts:
        short = rng.random(size=n) < spec.mixed_fraction
        prompt = np.where(short, spec.mixed_prompt_len, prompt)
    prompt = np.clip(prompt, spec.shared_prefix_len + 1, spec.max_context - 1)
    response = np.rint(rng.lognormal(math.log(spec.response_median), spec.response_sigma, size=n))
    response = np.clip(response.astype(np.int64), 1, spec.max_context - prompt)
    prefix = spec.call_id_prefix or f"s{spec.seed}"
    return [
        PlannedCall(
            call_id=f"{prefix}-{i:06d}",
            arrival_s=arrivals[i],
            prompt_len=int(prompt[i]),
            shared_prefix_len=spec.shared_prefix_len,
            response_len=int(response[i]),
            phase=phases[i],
        )
        for i in range(n)
    ]


def _stable_id(*parts: object) -> int:
    """A 63-bit id stable across processes (Python's ``hash`` of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@functools.cache  # one per prefix length: asked once per call, computed once per run
def shared_prefix_segment_id(shared_prefix_len: int) -> int:
    """Segment id of the shared prefix: the same for every call with this prefix length."""
    return _stable_id("shared-prefix", shared_prefix_len)


def prompt_segments(call: PlannedCall) -> tuple[tuple[int, int], ...]:
    """The prompt as chained-unique segments ``(segment_id, n_tokens)`` for the engine model.

    The shared prefix is one segment common to all calls; the rest of the prompt is a segment
    whose id depends on the call and on the prefix before it, so every attempt of a call (a
    retry resends the identical prompt) has the same segments and can hit its cached blocks.
    """
    segments: list[tuple[int, int]] = []
    shared = min(call.shared_prefix_len, call.prompt_len)
    prefix_id = shared_prefix_segment_id(call.shared_prefix_len)
    if shared > 0:
        segments.append((prefix_id, shared))
    unique = call.prompt_len - shared
    if unique > 0:
        segments.append((_stable_id("call", call.call_id, prefix_id, shared), unique))
    return tuple(segments)


def prompt_token_ids(call: PlannedCall, vocab_size: int, seed: int = 0, *, low: int = 0) -> list[int]:
    """Real token IDs for ``call``'s prompt, in ``[low, vocab_size)``.

    The shared prefix is identical across the calls of a trace (it depends only on ``seed``);
    the rest depends on the call id, so a retry sends exactly the same IDs.
    """
    if vocab_size <= low or low < 0:
        raise WorkloadError(f"need 0 <= low < vocab_size, got low={low!r}, vocab_size={vocab_size!r}")
    shared = min(call.shared_prefix_len, call.prompt_len)
    prefix_rng = np.random.Generator(np.random.PCG64(_stable_id("prefix-ids", seed)))
    prefix = prefix_rng.integers(low, vocab_size, size=shared)
    call_rng = np.random.Generator(np.random.PCG64(_stable_id("call-ids", seed, call.call_id)))
    rest = call_rng.integers(low, vocab_size, size=call.prompt_len - shared)
    ids: list[int] = np.concatenate([prefix, rest]).astype(np.int64).tolist()
    return ids


def segment_token_ids(
    segments: Sequence[tuple[int, int]], vocab_size: int, seed: int = 0, *, low: int = 0
) -> list[int]:
    """Real token IDs for a prompt given as chained segments (a replayed trace's prefix blocks,
    ``reproduce.workloads.traces.planned``), in ``[low, vocab_size)``: each segment's IDs depend only on
    its id and ``seed``, so calls that share leading blocks send the same leading IDs (a real
    engine's prefix cache finds them, as the engine model's does) and a retry the same prompt."""
    if vocab_size <= low or low < 0:
        raise WorkloadError(f"need 0 <= low < vocab_size, got low={low!r}, vocab_size={vocab_size!r}")
    parts = [
        np.random.Generator(np.random.PCG64(_stable_id("segment-ids", seed, segment_id))).integers(
            low, vocab_size, size=n_tokens
        )
        for segment_id, n_tokens in segments
    ]
    ids: list[int] = np.concatenate(parts).astype(np.int64).tolist() if parts else []
    return ids


def phase_rates(spec: WorkloadSpec) -> Sequence[float]:
    """Planned arrival rate of each phase in calls per second."""
    return [m * spec.capacity for _, m in spec.phases]
