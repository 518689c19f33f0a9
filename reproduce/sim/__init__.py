"""The discrete-event simulator of a pulse run: one ``simenv`` environment, one seeded RNG per run.

It drives the engine model (``reproduce.engine``), the proxy's policy core
(``exporter.policy``, the very code the real proxy runs) and the client model
(``reproduce.workloads.client``) with a docs/protocol.md §3 workload, and records a metrics snapshot every 5
simulated seconds with the names the real proxy exports. ``world`` owns the run,
``engine_link`` steps the engine model on the event heap (presets, Ĉ, calibration),
``metrics`` takes the snapshots, ``backend`` is the ``sim`` backend of ``reproduce run``.
"""

from __future__ import annotations

from reproduce.sim.world import SimResult, SimSpec, simulate

__all__ = ["SimResult", "SimSpec", "simulate"]
