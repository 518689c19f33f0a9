"""Every kind of workload by name (``Workload.kind``): a new kind is its module and a line here."""

from __future__ import annotations

from reproduce.workloads.pulse import PulseWorkload
from reproduce.workloads.steps import SteppedWorkload
from reproduce.workloads.trace import TraceWorkload

__all__ = ["WORKLOADS"]

WORKLOADS: dict[str, type] = {w.kind: w for w in (PulseWorkload, TraceWorkload, SteppedWorkload)}
