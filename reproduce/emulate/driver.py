"""The stepping loop of the emulated engine: the engine model paced by the wall clock.

One asyncio task steps the engine model exactly as the simulator does (``start_step(now)``,
then ``finish_step(now + duration)``), but sleeps the step's duration in wall seconds (its run
clock's ``run_s``, K engine seconds per wall second) in between. The engine's clock is virtual:
it advances by each step's duration and the wall clock only paces it, so asyncio's sleep
overshoot does not shrink the engine's capacity (a late step is followed by a shorter sleep).
When the engine is idle its clock jumps to the scaled wall clock at the next arrival. Requests
join at step boundaries, as in vLLM.

Each request has an :class:`Execution` handle that HTTP handlers await: the driver updates its
generated-token count after every step (only for executions that are producing tokens, so a
step costs O(running), not O(live)) and sets its ``changed`` event.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from reproduce.workloads.plan import STUDY_CLOCK, RunClock

__all__ = [
    "EngineDriver",
    "EngineLike",
    "EngineRefused",
    "Execution",
    "TooManyLive",
]

log = logging.getLogger(__name__)

#: Wall seconds the engine may trail the wall clock before the driver warns (CPU starvation).
LAG_WARNING_S = 1.0


class EngineLike(Protocol):
    """The part of ``reproduce.engine.EngineModel`` the driver uses (docs/architecture.md)."""

    def add_request(self, request: Any, now: float) -> bool: ...
    def abort_request(self, request_id: str, now: float) -> list[Any] | None: ...
    def start_step(self, now: float) -> float | None: ...
    def drain_events(self) -> list[Any]: ...
    def finish_step(self, now: float) -> list[Any]: ...
    def output_tokens(self, request_id: str) -> int: ...
    def has_request(self, request_id: str) -> bool: ...
    def metrics_samples(self, labels: dict[str, str]) -> list[Any]: ...


class EngineRefused(Exception):
    """The engine's queue cap refused the execution (vLLM answers 503)."""


class TooManyLive(Exception):
    """The emulator's own bound on live requests was reached (a safety bound, not vLLM's)."""


@dataclass(eq=False)
class Execution:
    """One request inside the emulated engine, as the HTTP layer sees it."""

    request_id: str
    max_tokens: int
    prompt_tokens: int
    tokens: int = 0
    finished: bool = False
    aborted: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.finished or self.aborted


def _kind(event: Any) -> str:
    """The event kind as an upper-case name, whether the model uses an enum or a string."""
    kind = getattr(event, "kind", None)
    name = getattr(kind, "name", kind)
    return str(name).upper()


class EngineDriver:
    """Steps ``engine`` in wall time at ``clock`` (its K: engine seconds per wall second);
    ``monotonic`` is the wall clock."""

    def __init__(
        self,
        engine: EngineLike,
        make_request: Callable[[str, Sequence[tuple[int, int]], int], Any],
        *,
        clock: RunClock = STUDY_CLOCK,
        max_live: int = 16_384,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_live < 1:
            raise ValueError(f"max_live must be >= 1, got {max_live!r}")
        self.engine = engine
        self._make_request = make_request
        self.clock = clock
        self.max_live = max_live
        self._monotonic = monotonic
        self._wall0 = monotonic()
        self._engine_now = 0.0
        self._idle = True
        self._live: dict[str, Execution] = {}
        self._producing: dict[str, Execution] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self.steps = 0
        self.lag_s = 0.0  # how far (engine seconds) the engine clock trails the scaled wall clock
        self._lag_warned_at = -math.inf

    # --- clock -----------------------------------------------------------------------------
    def scaled_wall(self) -> float:
        """The wall clock since the start in engine seconds."""
        return self.clock.study_s(self._monotonic() - self._wall0)

    def wall_s(self, engine_s: float) -> float:
        """``engine_s`` engine seconds in wall seconds."""
        return self.clock.run_s(engine_s)

    def now(self) -> float:
        """The engine's clock (seconds); it jumps to the scaled wall clock only while idle.

        While steps run back to back the clock advances by their durations alone, so a late
        wake-up is made up by a shorter sleep instead of being lost from the engine's time.
        """
        if self._idle:
            self._engine_now = max(self._engine_now, self.scaled_wall())
        return self._engine_now

    # --- requests --------------------------------------------------------------------------
    @property
    def live(self) -> int:
        return len(self._live)

    def submit(self, segments: Sequence[tuple[int, int]], prompt_tokens: int, max_tokens: int) -> Execution:
        """Add an execution; raises :class:`EngineRefused` (queue cap) or :class:`TooManyLive`."""
        if len(self._live) >= self.max_live:
            raise TooManyLive(f"the emulated engine holds its maximum of {self.max_live} live requests")
        request_id = f"emu-{next(self._ids)}"
        if not self.engine.add_request(
            self._make_request(request_id, tuple(segments), max_tokens), self.now()
        ):
            raise EngineRefused(request_id)
        execution = Execution(request_id, max_tokens, prompt_tokens)
        self._live[request_id] = execution
        self._wake.set()
        return execution

    def abort(self, execution: Execution) -> None:
        """Abort as a client disconnect does in vLLM: steps in flight still finish."""
        if execution.done or execution.request_id not in self._live:
            return
        # A waiting execution usually leaves at once (its ABORTED event comes back here); a
        # running one after the steps in flight (its event comes from ``finish_step``).
        events = self.engine.abort_request(execution.request_id, self.now())
        if events:
            self._after_step(events)
        self._wake.set()

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Step forever (cancel the task to stop)."""
        while True:
            duration = self.engine.start_step(self.now())
            if duration is None:
                self._after_step(self.engine.drain_events())
                self._idle = True
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle = False
            start = self._engine_now
            end = start + float(duration)
            # Sleep until the wall time at which the engine clock reaches ``end``.
            delay = self.wall_s(end) - (self._monotonic() - self._wall0)
            await asyncio.sleep(max(0.0, delay))
            self._engine_now = end
            self.lag_s = max(0.0, self.scaled_wall() - end)
            if self.wall_s(self.lag_s) > LAG_WARNING_S:
                self._warn_lag()
            events = self.engine.finish_step(end)
            self.steps += 1
            self._after_step(events)

    def _warn_lag(self) -> None:
        wall = self._monotonic()
        if wall - self._lag_warned_at >= 10.0:
            self._lag_warned_at = wall
            log.warning(
                "the engine clock trails the scaled wall clock by %.1f engine seconds: this machine cannot "
                "step the engine at time scale %g (capacity in wall time is lower than the preset's)",
                self.lag_s,
                self.clock.k,
            )

    def _after_step(self, events: list[Any]) -> None:
        """Apply a step's events, then publish the new token counts of producing executions."""
        for event in events:
            kind = _kind(event)
            execution = self._live.get(getattr(event, "request_id", ""))
            if execution is None:
                continue
            if kind == "FIRST_TOKEN":
                self._producing[execution.request_id] = execution
            elif kind in ("FINISHED", "ABORTED"):
                self._producing.pop(execution.request_id, None)
                del self._live[execution.request_id]
                if kind == "FINISHED":
                    execution.tokens = int(getattr(event, "output_tokens", 0) or execution.max_tokens)
                    execution.finished = True
                else:
                    execution.aborted = True
                execution.changed.set()
        engine = self.engine
        for request_id, execution in self._producing.items():
            tokens = engine.output_tokens(request_id)
            if tokens != execution.tokens:
                execution.tokens = tokens
                execution.changed.set()
