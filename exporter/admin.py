"""The admin view: ``GET /retrywatch/executions`` lists live executions.

Each entry carries the call key's hash prefix, the state, the number of subscribers, the age and
what has been streamed so far; never prompt or completion text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.policy import Policy
from exporter.relay import Relay

KEY_HASH_CHARS = 16


def executions_listing(policy: Policy, relays: Mapping[int, Relay], now: float, limit: int) -> dict[str, Any]:
    """Live executions (queued or in the engine), oldest first, at most ``limit`` of them."""
    rows: list[dict[str, Any]] = []
    live = sorted(policy.live_executions(), key=lambda e: e.created_at)
    for execution in live[:limit]:
        relay = relays.get(execution.execution_id)
        rows.append(
            {
                "execution_id": execution.execution_id,
                "key_hash": execution.key[:KEY_HASH_CHARS] if execution.key else None,
                "state": execution.state.value,
                "subscribers": len(execution.subscribers),
                "age_s": round(now - execution.created_at, 3),
                "chunks_streamed": relay.chunks if relay is not None else 0,
                "bytes_streamed": relay.end if relay is not None else 0,
                "replay_bytes_stored": relay.stored_bytes() if relay is not None else 0,
                "attachable": relay.attachable if relay is not None else False,
                "cancel_at_in_s": (
                    round(execution.cancel_at - now, 3) if execution.cancel_at is not None else None
                ),
            }
        )
    gauges = policy.gauges()
    return {
        "executions": rows,
        "total": len(live),
        "truncated": len(live) > limit,
        "executions_live": gauges.executions_live,
        "executions_queued": gauges.executions_queued,
        "subscribers": gauges.subscribers,
    }
