"""Factories for the detector's tests: snapshots with the proxy's and vLLM's real names."""

from __future__ import annotations

from foundation import metricnames as mn
from foundation.timeseries import Sample, Snapshot


def snapshot(
    t: float,
    *,
    first: float = 0.0,
    retry: float = 0.0,
    created: float | None = None,
    completed: float = 0.0,
    orphaned: float = 0.0,
    cancelled: float = 0.0,
    within: float = 0.0,
    missed: float = 0.0,
    waiting: float = 0.0,
    running: float = 0.0,
    queued: float = 0.0,
    capacity: float | None = 2.0,
    deadline: float | None = 120.0,
    prompt: float = 0.0,
    queries: float = 0.0,
    instance: str | None = None,
    model: str = "m",
    omit: tuple[str, ...] = (),
) -> Snapshot:
    """One scrape with cumulative counters as given (``created`` defaults to all attempts)."""
    vl = {"engine": "0", "model_name": model}
    samples: list[Sample] = [
        (mn.ATTEMPTS, {"kind": "first"}, first),
        (mn.ATTEMPTS, {"kind": "retry"}, retry),
        (mn.ATTEMPTS_ATTACHED, {}, 0.0),
        (mn.ATTEMPTS_SHED, {"reason": "retry_budget"}, 0.0),
        (mn.EXECUTIONS_CREATED, {}, first + retry if created is None else created),
        (mn.EXECUTIONS_FINISHED, {"fate": "completed"}, completed),
        (mn.EXECUTIONS_FINISHED, {"fate": "orphaned"}, orphaned),
        (mn.EXECUTIONS_FINISHED, {"fate": "cancelled"}, cancelled),
        (mn.CALLS_DELIVERED, {"within_deadline": "true"}, within),
        (mn.CALLS_DELIVERED, {"within_deadline": "false"}, 0.0),
        (mn.EXECUTIONS_QUEUED, {}, queued),
        (mn.VLLM_NUM_WAITING, vl, waiting),
        (mn.VLLM_NUM_RUNNING, vl, running),
        (mn.VLLM_PROMPT_TOKENS, vl, prompt),
        (mn.VLLM_PREFIX_CACHE_QUERIES, vl, queries),
    ]
    if capacity is not None:
        samples.append((mn.CAPACITY, {}, capacity))
    if deadline is not None:  # the proxy counts missed deadlines only while it knows the deadline
        samples.append((mn.CLIENT_DEADLINE, {}, deadline))
        samples.append((mn.CALLS_MISSED_DEADLINE, {}, missed))
    samples = [s for s in samples if s[0] not in omit]
    if instance is not None:
        samples = [(n, {**lb, "instance": instance}, v) for n, lb, v in samples]
    return Snapshot(t=t, samples=samples)


def steady(t_end: float, step: float = 5.0, *, t0: float = 0.0, **rates: float) -> list[Snapshot]:
    """Snapshots every ``step`` s whose counters grow at constant ``rates`` (per second) and whose
    gauges (``waiting``, ``running``, ``queued``, ``capacity``, ``deadline``) stay constant."""
    gauges = {k: rates.pop(k) for k in ("waiting", "running", "queued", "capacity", "deadline") if k in rates}
    out = []
    t = t0
    while t <= t_end + 1e-9:
        out.append(snapshot(t, **{k: v * t for k, v in rates.items()}, **gauges))  # type: ignore[arg-type]
        t += step
    return out
