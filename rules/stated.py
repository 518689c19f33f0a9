"""The rules for an operator's own Prometheus: vLLM's scrape job, the deadline and Ĉ as stated.

``rules/retrywatch.rules.yml`` (``rules.generate``) needs nothing stated: vLLM scraped as job
``vllm`` (the tier's NoData reads that job's ``up``), the deadline from a
``retrywatch_client_deadline_seconds`` series (a proxy's, stated or learned) or missing, Ĉ stated
by a ``retrywatch_capacity_calls_per_second`` series, else estimated at saturation, else predicted
from vLLM's counters (``rules.learned``). :func:`render` gives the same file for what the
operator states:

- the vLLM tier's group reads the given job's ``up``;
- a stated deadline is recorded as ``retrywatch_client_deadline_seconds`` per vLLM target, at the
  head of the vLLM tier's group (so the rules reading it see it in the same evaluation); the rules
  count finishes within it in vLLM's e2e bucket at or below it (``detector.signals.deadline_bucket``),
  and one between two bounds fires ``VLLMDeadlineBetweenBuckets`` (info) rather than rounding;
- a stated Ĉ is recorded as ``retrywatch_capacity_calls_per_second`` there too.

The proxy tier's group is unchanged (the proxy exports both numbers itself), or left out before
there is a proxy (``proxy_tier=False``: its ``VLLMRetrywatchTargetsAbsent`` would say so forever).
"""

from __future__ import annotations

import math

from detector.runbook import DEFAULT_PATTERN
from detector.signals import DEFAULT_DEADLINE_S, PROMETHEUS_JOBS, deadline_bucket
from foundation import metricnames as mn
from rules import generate

_INTERVAL = generate.duration(generate.EVALUATION_INTERVAL_S)
_GROUP_HEAD = f"  - name: {generate.GROUP_NAMES['vllm']}\n    interval: {_INTERVAL}\n    rules:\n"


class StatedError(ValueError):
    """A stated number or job the rules cannot use; the message says which and why."""


def _up(job: str) -> str:
    return f'up{{job="{job}"}}'


def _replace(text: str, old: str, new: str) -> str:
    if old not in text:  # the rules changed shape: this module must follow
        raise RuntimeError(f"the generated rules no longer contain {old!r}")
    return text.replace(old, new)


def check_job(job: str) -> str:
    """A scrape job name that fits in a PromQL string as it is (``up{job="..."}``): one line of
    printable characters (no tab, CR or U+2028) without the string's quote and escape, ``"`` and
    ``\\``. A Prometheus label value may hold any of them; such a job is refused, not escaped."""
    if not job or not job.isprintable() or any(c in job for c in '"\\'):
        raise StatedError(
            f"not a usable scrape job name: {job!r}: one line of printable characters, without "
            "a double quote or a backslash"
        )
    return job


def check_deadline(deadline_s: float) -> float:
    """A deadline the rules can use: seconds > 0, at or above vLLM's first e2e latency bound
    (below it, no bucket counts finishes in time)."""
    if not (math.isfinite(deadline_s) and deadline_s > 0):
        raise StatedError(f"the deadline must be a number of seconds > 0, got {deadline_s!r}")
    if deadline_bucket(deadline_s) is None:
        raise StatedError(f"a deadline of {deadline_s:g} s is below vLLM's first e2e latency bucket")
    return deadline_s


def _record(comment: str, name: str, job: str, value: float) -> str:
    # A literal block, as the generated rules write PromQL: the job's characters stay as they are
    # (a plain scalar would end at " #" and break at ": ").
    return (
        f"      # {comment}\n"
        f"      - record: {name}\n"
        f"        expr: |-\n"
        f"          max by (instance) ({_up(job)}) * 0 + {value!r}\n"
    )


def render(
    runbook_pattern: str = DEFAULT_PATTERN,
    *,
    vllm_job: str = PROMETHEUS_JOBS["vllm"],
    deadline_s: float | None = DEFAULT_DEADLINE_S,
    capacity: float | None = None,
    proxy_tier: bool = True,
) -> str:
    """The rules file's text for vLLM scraped as ``vllm_job``, the clients' ``deadline_s`` (None:
    a proxy's series, else missing) and Ĉ (``capacity``, calls/s; None: estimated at saturation,
    else predicted); without the proxy tier's group unless ``proxy_tier``."""
    job = check_job(vllm_job)
    if deadline_s is not None:
        check_deadline(deadline_s)
    if capacity is not None and not (math.isfinite(capacity) and capacity > 0):
        raise StatedError(f"Ĉ must be a number of calls per second > 0, got {capacity!r}")
    text = generate.render(runbook_pattern)
    if not proxy_tier:  # the groups are rendered in tier order, the proxy's last
        proxy_head = f"  - name: {generate.GROUP_NAMES['proxy']}\n"
        text = text[: text.index(proxy_head)].rstrip("\n") + "\n"
    text = _replace(text, _up(PROMETHEUS_JOBS["vllm"]), _up(job))
    stated = ""
    if deadline_s is not None:
        stated += _record(
            "The clients' deadline, as stated (seconds).", mn.CLIENT_DEADLINE, job, float(deadline_s)
        )
    if capacity is not None:
        stated += _record("Ĉ, as stated (calls per second).", mn.CAPACITY, job, float(capacity))
    return _replace(text, _GROUP_HEAD, _GROUP_HEAD + stated)
