"""``EngineProcess``: drives an ``EngineModel`` inside a simenv ``Environment``.

It starts a step whenever work exists, calls ``finish_step`` when the step's duration has
passed, and forwards the engine's events to ``on_event``. Like vLLM's asynchronous
scheduling, the next step is scheduled before the previous step's outputs are handed on, so a
reaction to an output (an abort after a first token) lands while the next step is in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from reproduce.engine.model import EngineEvent, EngineModel, EngineRequest
from reproduce.simenv import Environment, EventHandle

__all__ = ["EngineProcess"]


class EngineProcess:
    """One simulated engine: submit and abort executions; events come back through ``on_event``."""

    def __init__(
        self,
        env: Environment,
        engine: EngineModel,
        on_event: Callable[[EngineEvent], None] | None = None,
        on_step: Callable[[float, EngineModel], None] | None = None,
        *,
        coalesce: bool = True,
        on_events: Callable[[list[EngineEvent]], None] | None = None,
    ) -> None:
        self.env = env
        self.engine = engine
        # Safe here: every submit and abort cuts a coalesced run first (see EngineModel's NOTE).
        engine.coalesce_decode_steps = coalesce
        self.on_event = on_event
        # instead of ``on_event``: each batch of events at once, in order (a driver that loops
        # over them itself saves a call per event)
        self.on_events = on_events
        self.on_step = on_step  # called after every finished step (sampling, tests)
        self._step_handle: EventHandle | None = None

    @property
    def busy(self) -> bool:
        return self._step_handle is not None

    def sync(self) -> None:
        """Cut a coalesced run of decode steps at the next step boundary (before reading
        counters that must be exact to the step, or before changing the engine's work)."""
        if self._step_handle is None:
            return
        end = self.engine.truncate_step(self.env.now)
        if end is not None and end < self._step_handle.at:
            self.env.cancel(self._step_handle)
            self._step_handle = self.env.schedule(end, self._on_step_end)

    def submit(self, request: EngineRequest) -> bool:
        """Queue an execution now; False when the engine's queue cap refuses it."""
        if self._step_handle is not None:
            self.sync()
        accepted = self.engine.add_request(request, self.env.now)
        if accepted and self._step_handle is None:
            self._kick()
        return accepted

    def abort(self, request_id: str) -> None:
        """Abort an execution now (effective after the steps in flight)."""
        self.sync()
        events = self.engine.abort_request(request_id, self.env.now)
        self._forward(events)
        self._kick()

    def _kick(self) -> None:
        if self._step_handle is not None:
            return
        engine = self.engine
        if engine.start_step(self.env.now) is not None:
            end = engine.step_end
            assert end is not None
            self._step_handle = self.env.schedule(end, self._on_step_end)
        elif engine.has_pending_events:
            self._forward(engine.drain_events())

    def _on_step_end(self) -> None:
        self._step_handle = None
        events = self.engine.finish_step(self.env.now)
        self._kick()
        if self.on_step is not None:
            self.on_step(self.env.now, self.engine)
        self._forward(events)

    def _forward(self, events: list[EngineEvent]) -> None:
        if self.on_events is not None:
            if events:
                self.on_events(events)
        elif self.on_event is not None:
            for event in events:
                self.on_event(event)
