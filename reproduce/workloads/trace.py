"""The trace workload: a request trace replayed as a run's calls (``--trace FILE``).

A :class:`TraceWorkload` is the workload part of a condition that replays a trace instead of
the protocol's pulse (``reproduce.conditions.PulseWorkload``): which file, its layout, a window
of it and the load, a multiple of Ĉ. It reads the file twice, streaming both times (a week-long
trace is never in memory):

* :meth:`TraceWorkload.scan` is the first pass: how many calls, the window's mean rate (the one
  ``--load X`` rescales to X × Ĉ), when its last call arrives, and the trace's **token mix**: a
  digest of every call's (prompt, output) lengths and a seeded sample of them, from which Ĉ is
  calibrated (``reproduce.workloads.tracecapacity``);
* :meth:`TraceWorkload.calls` is the second: the window's calls as ``TraceCall``s, arrivals
  rescaled so that the mean rate is ``load`` × Ĉ (every ratio of inter-arrival times kept: the
  burst shape), in the run's own seconds.

A bad file raises ``reproduce.workloads.traces.TraceError``: one line naming the file, line and column.
So does a trace that is not a regular file (a pipe cannot be read twice), and a load that would
make the replay last longer than ``MAX_REPLAY_S`` (its span is (calls - 1) / (load × Ĉ), so the
run's memory and time stay bounded whatever ``--load`` says).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from reproduce.workloads.base import Shaping, TokenMix
from reproduce.workloads.calls import MAX_CONTEXT, PlannedCall
from reproduce.workloads.client import ClientConfig
from reproduce.workloads.plan import REPLAY_TAIL_WINDOWS, Phase, RunClock, RunPlan, make_plan
from reproduce.workloads.traces import (
    FORMATS,
    TraceCall,
    TraceError,
    TraceRecord,
    is_regular_file,
    rate_factor,
    read_trace,
    to_trace_calls,
    window,
)
from reproduce.workloads.traces.planned import TRACE_PHASE, Segments

__all__ = [
    "MAX_CONTEXT",
    "MAX_REPLAY_CALLS",
    "MAX_REPLAY_S",
    "MIX_SAMPLE",
    "TraceFacts",
    "TraceWorkload",
    "plan_trace",
    "scale_tokens",
    "scaled_length",
]

#: How many (prompt, output) pairs of a trace's token mix the calibration draws from (a seeded
#: reservoir sample over the whole window: memory stays bounded whatever the trace's length).
MIX_SAMPLE = 20_000
#: The longest replay, in run seconds from its first call to its last (a day): what ``--load``
#: may stretch a trace to. The simulator's series and an HTTP run's wall time grow with it.
MAX_REPLAY_S = 86_400.0
#: The most calls a replay holds (its plan keeps every call): a longer window is refused.
MAX_REPLAY_CALLS = 1_000_000


def scaled_length(tokens: int, token_scale: float) -> int:
    """``tokens`` × ``token_scale``, rounded, never below one token."""
    if not (math.isfinite(token_scale) and token_scale > 0):
        raise TraceError(f"a token scale must be positive, got {token_scale!r}")
    return max(1, round(tokens * token_scale))


def scale_tokens(record: TraceRecord, token_scale: float) -> TraceRecord:
    """``record`` with its prompt, output and prefix-block lengths × ``token_scale``."""
    return replace(
        record,
        prompt_tokens=scaled_length(record.prompt_tokens, token_scale),
        output_tokens=scaled_length(record.output_tokens, token_scale),
        block_tokens=scaled_length(record.block_tokens, token_scale) if record.block_tokens else 0,
    )


@dataclass(frozen=True)
class TraceFacts:
    """What the first pass over a trace's window found."""

    calls: int
    source_rate: float  # calls/s of the window as recorded: (calls - 1) / span
    span_s: float  # first to last arrival, as recorded
    mix_digest: str  # every call's (prompt, output) lengths, in order
    mix: tuple[tuple[int, int], ...]  # a seeded sample of them
    mean_prompt_tokens: float
    mean_output_tokens: float


@dataclass(frozen=True)
class TraceWorkload:
    """Replay ``path`` (layout ``format``, detected when None) over ``[start_s, end_s)`` of it
    (seconds from its first request) at ``load`` × Ĉ mean call rate."""

    kind: ClassVar[str] = "trace"

    path: str
    format: str | None = None
    load: float = 1.0
    start_s: float = 0.0
    end_s: float = math.inf

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise TraceError(f"unknown trace format {self.format!r}; known: {', '.join(FORMATS)}")
        if not (math.isfinite(self.load) and self.load > 0):
            raise TraceError(f"the load must be a positive multiple of Ĉ, got {self.load!r}")
        if not (0 <= self.start_s < self.end_s) or math.isnan(self.end_s):
            raise TraceError(f"a window needs 0 <= START < END, got {self.start_s!r}:{self.end_s!r}")

    @property
    def name(self) -> str:
        """The trace's name: its file name without suffixes (``azure_code_2023_30min``)."""
        return Path(self.path).name.split(".")[0] or "trace"

    @property
    def window_text(self) -> str:
        end = "" if math.isinf(self.end_s) else f"{self.end_s:g}"
        return f"{self.start_s:g}:{end}"

    @property
    def variant(self) -> str:
        """What tells this replay's runs apart from others of the same condition."""
        whole = self.start_s == 0 and math.isinf(self.end_s)
        part = "" if whole else f"-w{self.window_text.replace(':', '-')}"
        return f"{self.name}{part}-load{self.load:g}"

    def records(self) -> Iterator[TraceRecord]:
        """The window's records, arrivals counted from its start (streams)."""
        return window(read_trace(self.path, self.format), self.start_s, self.end_s)

    @cached_property
    def facts(self) -> TraceFacts:
        """The first pass (once per workload object)."""
        return self.scan()

    def scan(self, sample: int = MIX_SAMPLE, seed: int = 0) -> TraceFacts:
        """Stream the window once: count, mean rate and the token mix (digest and sample)."""
        path = Path(self.path)
        if path.exists() and not (is_regular_file(path) or path.is_dir()):
            raise TraceError(
                f"{self.path}: not a regular file (a pipe or a device): a replay reads its trace "
                "twice, once for its rate and token mix and once for its calls; save it to a file first"
            )
        rng = random.Random(f"trace-mix-{seed}")
        digest = hashlib.blake2b(digest_size=12)
        mix: list[tuple[int, int]] = []
        n = 0
        first = last = 0.0
        prompt_sum = output_sum = 0
        for call in to_trace_calls(self.records(), max_context=MAX_CONTEXT, source=self.path):
            planned = call.planned
            pair = (planned.prompt_len, planned.response_len)
            if n == 0:
                first = planned.arrival_s
            last = planned.arrival_s
            n += 1
            if n > MAX_REPLAY_CALLS:
                raise TraceError(
                    f"{self.path}: window {self.window_text} holds more than {MAX_REPLAY_CALLS:,} calls, "
                    "more than a replay holds; take a shorter --window"
                )
            prompt_sum += pair[0]
            output_sum += pair[1]
            digest.update(f"{pair[0]},{pair[1]};".encode())
            if len(mix) < sample:
                mix.append(pair)
            else:
                j = rng.randrange(n)
                if j < sample:
                    mix[j] = pair
        if n < 2 or last <= first:
            raise TraceError(
                f"{self.path}: window {self.window_text} holds {n} call(s); a replay needs at least two "
                "calls at different times"
            )
        return TraceFacts(
            calls=n,
            source_rate=(n - 1) / (last - first),
            span_s=last - first,
            mix_digest=digest.hexdigest(),
            mix=tuple(mix),
            mean_prompt_tokens=prompt_sum / n,
            mean_output_tokens=output_sum / n,
        )

    def calls(
        self, capacity: float, *, token_scale: float = 1.0, max_context: int = MAX_CONTEXT
    ) -> Iterator[TraceCall]:
        """The window's calls at ``load`` × ``capacity`` (Ĉ, calls per run-second), arrivals in
        run seconds; streams the file a second time. ``token_scale`` multiplies every length
        (prompt, output and prefix block, so blocks stay shared as the trace says), as a scaled
        protocol divides the study's lengths for an engine that cannot run faster; prompts are
        then cut to the engine's ``max_context``. A replay longer than ``MAX_REPLAY_S`` is a
        ``TraceError`` (``replay_span_s``)."""
        self.check_capacity(capacity)
        factor = rate_factor(self.load * capacity, self.facts.source_rate)  # (``rescale_to_rate``)
        records = self.records()
        if token_scale != 1.0:
            records = (scale_tokens(r, token_scale) for r in records)
        return to_trace_calls(records, max_context=max_context, source=self.path, time_factor=factor)

    def replay_span_s(self, capacity: float) -> float:
        """Run seconds from the first call to the last at ``load`` × ``capacity``: (calls - 1) /
        (load × Ĉ), whatever the trace's own span."""
        target = self.load * capacity
        if not (math.isfinite(target) and target > 0):
            raise TraceError(f"the target rate must be a positive number of calls per second, got {target!r}")
        return (self.facts.calls - 1) / target

    def check_capacity(self, capacity: float) -> None:
        """Raise ``TraceError`` unless the replay at ``load`` × ``capacity`` lasts at most
        ``MAX_REPLAY_S`` (a backend calls it once Ĉ is known, before any run starts)."""
        span = self.replay_span_s(capacity)
        if not span <= MAX_REPLAY_S:
            raise TraceError(
                f"{self.path}: at load {self.load:g} x Ĉ ({capacity:.4g} calls/s) its {self.facts.calls} "
                f"calls would replay over {span:.4g} s, more than the {MAX_REPLAY_S:g} s a replay may "
                "last; raise --load or take a shorter --window"
            )

    def scaled_mix(self, token_scale: float = 1.0) -> tuple[tuple[int, int], ...]:
        """The sampled token mix (``facts.mix``) with ``calls``' ``token_scale``: what a
        calibration on the trace's mix sends."""
        return tuple(
            (scaled_length(p, token_scale), scaled_length(o, token_scale)) for p, o in self.facts.mix
        )

    def describe(self) -> dict[str, object]:
        """A JSON-ready description (summary.json's ``settings``)."""
        return {
            "trace": self.name,
            "trace_format": self.format,
            "load": self.load,
            "window": self.window_text,
        }

    def at_load(self, load: float) -> TraceWorkload:
        """The same window at ``load``, with this one's :attr:`facts` if it has them: the first
        pass does not depend on the load, so a sweep over loads streams the trace for it once
        (and a run's spec carries them to its worker)."""
        moved = replace(self, load=float(load))
        if "facts" in self.__dict__:
            moved.__dict__["facts"] = self.__dict__["facts"]
        return moved

    def identity(self) -> dict[str, object]:
        """Its file (resolved) and its calls' digest: the same replay whatever its load."""
        described = {k: v for k, v in self.describe().items() if k != "load"}
        return {**described, "path": str(Path(self.path).resolve()), "calls": self.facts.mix_digest}

    def text(self) -> str:
        return f"trace {self.name} (window {self.window_text})"

    def label(self) -> str:
        whole = self.start_s == 0 and math.isinf(self.end_s)
        return f"trace {self.name} at {self.load:g}x Ĉ" + ("" if whole else f" (window {self.window_text} s)")

    def mix(self) -> TokenMix:
        return TokenMix(f"trace:{self.facts.mix_digest}", facts=self.facts)

    def plan(
        self, capacity: float, client: ClientConfig, *, seed: int, clock: RunClock, shaping: Shaping
    ) -> RunPlan:
        """Its calls at ``load`` × Ĉ, lengths × the shaping's token scale (``seed`` unused: the
        trace fixes every call)."""
        replay = plan_trace(
            self, capacity, client, token_scale=shaping.token_scale, max_context=shaping.max_context
        )
        return make_plan(
            replay.calls,
            replay.phases,
            client,
            clock,
            segments=replay.segments,
            tail_windows=REPLAY_TAIL_WINDOWS,
        )


def plan_trace(
    workload: TraceWorkload,
    capacity: float,
    client: ClientConfig,
    *,
    token_scale: float = 1.0,
    max_context: int = MAX_CONTEXT,
) -> RunPlan:
    """Plan a replay of ``workload`` at its load × ``capacity`` (Ĉ, calls per run-second, as the
    engine runs) for clients of ``client`` (the study's, as given: :meth:`TraceWorkload.plan`
    puts them and the recovery window in a scaled run's seconds),
    every token length × ``token_scale`` and cut to ``max_context`` (``TraceWorkload.calls``).
    Its one phase is named ``trace``: without a pulse, the run is judged by its ground truth
    over time.

    The trace is streamed: one pass for its facts (``TraceWorkload.facts``), one for its calls.
    """
    calls: list[PlannedCall] = []
    segments: dict[str, Segments] = {}
    for call in workload.calls(capacity, token_scale=token_scale, max_context=max_context):
        calls.append(call.planned)
        if call.blocks:  # prefix blocks: the engine's prefix cache needs them
            segments[call.planned.call_id] = call.segments
    end = calls[-1].arrival_s if calls else 0.0
    phase = Phase(TRACE_PHASE, 0.0, max(end, 1e-9), workload.load)
    return make_plan(calls, (phase,), client, RunClock(), segments=segments, tail_windows=REPLAY_TAIL_WINDOWS)
