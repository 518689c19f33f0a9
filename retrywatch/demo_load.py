"""The demo's load: the study's open-loop client replaying a pulse of retrying calls over real sockets.

The demos drive their engines with the same driver the experiments use
(``reproduce.harness.openloop.OpenLoopClient``): every planned call of a workload trace
starts at its planned time whether or not earlier calls were answered (open loop), and its
attempts follow the study's client model (deadline on the whole attempt, backoff, Retry-After,
giving up). The run is planned once (``reproduce.workloads.plan.plan_run``: the trace, its phases and
the client in wall seconds). The demo reads the client's live counts
(``OpenLoopStats``) for its progress lines, and bounds the calls in progress.
"""

from __future__ import annotations

from reproduce.harness.openloop import OpenLoopClient, OpenLoopStats
from reproduce.workloads.plan import RunPlan

__all__ = ["MAX_CALLS_IN_PROGRESS", "run_load"]

#: The demo's bound on calls in progress: a call arriving beyond it is not started.
MAX_CALLS_IN_PROGRESS = 2_000


async def run_load(
    base_url: str,
    plan: RunPlan,
    *,
    served_model: str,
    vocab_size: int,
    stats: OpenLoopStats,
    seed: int = 0,
    call_id_header: str = "x-call-id",
    max_calls_in_progress: int = MAX_CALLS_IN_PROGRESS,
) -> None:
    """Replay the calls of ``plan`` (arrival times in seconds from now) against ``base_url`` with its
    client, counting into ``stats``.

    Returns when every started call is over (or at the client's horizon after the last arrival).
    Cancel the task to stop early: attempts in progress are closed, which their server sees as
    client disconnects.
    """
    client = OpenLoopClient(
        base_url,
        served_model,
        vocab_size,
        plan.client,
        seed=seed,
        token_seed=seed,
        call_id_header=call_id_header,
        max_calls_in_progress=max_calls_in_progress,
        stats=stats,
    )
    await client.run(plan.calls)
