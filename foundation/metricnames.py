"""The metric-name contract shared by the proxy, the simulator, the detector, the rules and
the dashboard. Changing a name here is a breaking change for every one of them.

Our own names carry the ``retrywatch_`` prefix, base units and ``_total`` on counters;
vLLM's names keep their colons and are passed through unchanged.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

# --- label vocabularies ---------------------------------------------------------------


class ShedReason(StrEnum):
    """Why the proxy shed an attempt (``reason`` of ``ATTEMPTS_SHED``)."""

    RETRY_BUDGET = "retry_budget"
    PROXY_QUEUE = "proxy_queue"
    DEADLINE = "deadline"


class Fate(StrEnum):
    """How an execution ended (``fate`` of ``EXECUTIONS_FINISHED``)."""

    COMPLETED = "completed"
    ORPHANED = "orphaned"
    CANCELLED = "cancelled"
    DROPPED = "dropped"
    REFUSED = "refused"
    FAILED = "failed"


# --- retrywatch counters -------------------------------------------------------------
ATTEMPTS: Final = "retrywatch_attempts_total"  # {kind="first"|"retry"}
ATTEMPTS_ATTACHED: Final = "retrywatch_attempts_attached_total"
ATTEMPTS_SHED: Final = "retrywatch_attempts_shed_total"  # {reason=...}
EXECUTIONS_CREATED: Final = "retrywatch_executions_created_total"
EXECUTIONS_DISPATCHED: Final = "retrywatch_executions_dispatched_total"
EXECUTIONS_FINISHED: Final = "retrywatch_executions_finished_total"  # {fate=...}
CALLS_DELIVERED: Final = "retrywatch_calls_delivered_total"  # {within_deadline="true"|"false"}
UPSTREAM_FAULTS: Final = "retrywatch_upstream_faults_total"  # {kind=UPSTREAM_FAULT_KINDS}
# calls whose first attempt's deadline passed before delivery; only while the deadline is known
CALLS_MISSED_DEADLINE: Final = "retrywatch_calls_missed_deadline_total"
# the retry memory at its bounds: calls forgotten before their deadline passed, undelivered
# (neither delivered in time nor missed), and departures forgotten before their time
CALLS_FORGOTTEN: Final = "retrywatch_calls_forgotten_total"
DEPARTURES_EVICTED: Final = "retrywatch_departures_evicted_total"

# --- retrywatch gauges ---------------------------------------------------------------
EXECUTIONS_LIVE: Final = "retrywatch_executions_live"
EXECUTIONS_QUEUED: Final = "retrywatch_executions_queued"
SUBSCRIBERS: Final = "retrywatch_subscribers"
CAPACITY: Final = "retrywatch_capacity_calls_per_second"
CLIENT_DEADLINE: Final = "retrywatch_client_deadline_seconds"  # the deadline in force; NaN: unknown
UPSTREAM_UP: Final = "retrywatch_upstream_up"

# --- retrywatch histograms -----------------------------------------------------------
TIME_TO_FIRST_TOKEN: Final = "retrywatch_time_to_first_token_seconds"
ATTEMPT_DURATION: Final = "retrywatch_attempt_duration_seconds"  # {outcome=...}

# --- derived gauges over a sliding window (for users without Prometheus) --------------
EXECUTION_CREATION_RATE: Final = "retrywatch_execution_creation_rate"
ATTEMPT_RATE: Final = "retrywatch_attempt_rate"
CREATION_CAPACITY_RATIO: Final = "retrywatch_creation_capacity_ratio"
WAITING_LITTLES_LAW_RATIO: Final = "retrywatch_waiting_littles_law_ratio"
PROMPT_TOKEN_GAP_RATIO: Final = "retrywatch_prompt_token_gap_ratio"

# --- bounded label values, created up front (the policy's own enums) ---------------------
SHED_REASONS: Final = tuple(reason.value for reason in ShedReason)
FATES: Final = tuple(fate.value for fate in Fate)
DELIVERY_LABELS: Final = ("true", "false")
ATTEMPT_OUTCOMES: Final = ("delivered", "disconnected", "shed", "refused", "failed")
# What the upstream did that HTTP does not allow and the proxy guards against (exporter.upstream):
# bytes past the end of an answer, which no request asked for; a response head over the bounds.
STRAY_BYTES: Final = "stray_bytes"
HEAD_TOO_LARGE: Final = "head_too_large"
UPSTREAM_FAULT_KINDS: Final = (STRAY_BYTES, HEAD_TOO_LARGE)

# --- vLLM's own names (served unchanged; vLLM 0.32's: foundation.vllmreleases has older ones) --
VLLM_PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"
VLLM_PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits_total"
VLLM_GENERATION_TOKENS: Final = "vllm:generation_tokens_total"
VLLM_REQUEST_SUCCESS: Final = "vllm:request_success_total"  # {finished_reason=...}
VLLM_NUM_WAITING: Final = "vllm:num_requests_waiting"
VLLM_NUM_RUNNING: Final = "vllm:num_requests_running"
VLLM_NUM_WAITING_BY_REASON: Final = "vllm:num_requests_waiting_by_reason"  # {reason=...}
VLLM_NUM_PREEMPTIONS: Final = "vllm:num_preemptions_total"
VLLM_ADMISSION_REJECTIONS: Final = "vllm:admission_rejections_total"  # {reason=...}
VLLM_KV_CACHE_USAGE: Final = "vllm:kv_cache_usage_perc"
# vLLM's histograms (bucket boundaries: foundation.vllmbuckets); each exports _bucket{le}, _sum, _count
VLLM_QUEUE_TIME: Final = "vllm:request_queue_time_seconds"
VLLM_TTFT: Final = "vllm:time_to_first_token_seconds"
VLLM_E2E_LATENCY: Final = "vllm:e2e_request_latency_seconds"
VLLM_PREFILL_TIME: Final = "vllm:request_prefill_time_seconds"
VLLM_DECODE_TIME: Final = "vllm:request_decode_time_seconds"
VLLM_INTER_TOKEN_LATENCY: Final = "vllm:inter_token_latency_seconds"
VLLM_REQUEST_PROMPT_TOKENS: Final = "vllm:request_prompt_tokens"
VLLM_REQUEST_GENERATION_TOKENS: Final = "vllm:request_generation_tokens"

# --- the clients' deadline learned from abandon ages (exporter.deadlines), appended -------
# where the deadline in force comes from: 1 on one of DEADLINE_SOURCES, 0 on the others
CLIENT_DEADLINE_SOURCE: Final = "retrywatch_client_deadline_source"  # {source=...}
DEADLINE_STATED: Final = "stated"  # --deadline S
DEADLINE_LEARNED: Final = "learned"  # from the ages at which clients abandoned attempts
DEADLINE_UNKNOWN: Final = "unknown"  # neither, yet
DEADLINE_SOURCES: Final = (DEADLINE_STATED, DEADLINE_LEARNED, DEADLINE_UNKNOWN)
# each client class's learned deadline (NaN: no such class now) and the abandons it rests on;
# classes ranked by abandons, "1" the most (the one whose deadline is in force when learned)
CLIENT_DEADLINE_LEARNED: Final = "retrywatch_client_deadline_learned_seconds"  # {class=...}
CLIENT_DEADLINE_ABANDONS: Final = "retrywatch_client_deadline_abandons"  # {class=...}
DEADLINE_CLASSES: Final = ("1", "2", "3")
