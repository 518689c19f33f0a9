"""The engine model: vLLM V1's scheduler, stepped by a driver (simulator or emulated engine).

NOTE: one step follows vLLM's ``Scheduler.schedule()`` under a token budget
(``max_num_batched_tokens``): running executions first (each decode takes one token, a
prefill continues with as many prompt tokens as the budget allows: chunked prefill), then
waiting executions in FCFS order while budget, sequence slots and KV blocks allow (blocks for
the whole sequence, as vLLM's ``scheduler_reserve_full_isl`` asks), each first matched against
the prefix cache. When a running execution cannot get a KV block, the newest
running execution is preempted (its blocks freed, still cached) and later recomputed from the
waiting queue's head; a step that preempted admits nobody new.

NOTE (asynchronous scheduling): vLLM keeps up to two steps in flight. Its engine core
schedules step k+1 as soon as step k is issued (``EngineCore.step_with_batch_queue``), then
waits for step k, processes the aborts that arrived meanwhile, and only then step k's outputs.
So, in this model:
- an abort of a running execution that arrives during step k takes effect after step k+1:
  neither step's output reaches anyone (no token, no first token for
  ``vllm:prompt_tokens_total``), but both compute (their prompt blocks stay cached);
- step k+1 admits only executions that were waiting when step k started (one that arrives
  during step k waits for step k+2), and an abort of such a waiting execution that arrives
  during step k cannot stop step k+1 from admitting it: it is admitted (its prompt queried),
  computes one chunk in flight, and leaves after that step. Any other waiting execution leaves
  at once when aborted. The trace's ``scheduled_at`` is when vLLM's scheduler decided.

NOTE (speed): a step costs O(executions that change phase), not O(running): decodes are
counted, not iterated (one global step index; each decode execution knows the step at which
it finishes, kept in a heap, and the step at which it needs its next KV block, kept in a
bucket per step); sums of running and context tokens are maintained incrementally.

vLLM's counters, gauges and histograms follow vLLM's real rules, written down (with the vLLM
source function of each) in ``reproduce.engine.vllmstats``: ``vllm:prompt_tokens_total`` adds a
prompt's full length at its first output token; ``vllm:prefix_cache_queries_total`` adds it once
when the execution is first admitted to the running batch; a client abort adds nothing to
``vllm:request_success_total`` nor to any per-request histogram. Gauges refresh once per step.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from foundation import metricnames as mn
from foundation.timeseries import Sample
from reproduce.engine.config import EngineConfig
from reproduce.engine.kvcache import BlockPool, layout_and_length
from reproduce.engine.vllmstats import VllmStats

__all__ = [
    "FINISHED_REASONS",
    "EngineEvent",
    "EngineModel",
    "EngineRequest",
    "EngineRequestError",
    "EngineStateError",
    "EventKind",
    "ExecutionTrace",
    "Sample",
    "StepRecord",
]

# label values created up front, as vLLM does (vllm/v1/engine FINISH_REASON_STRINGS and
# vllm/v1/metrics/loggers.py ADMISSION_REASONS)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

_WAITING, _PREFILL, _DECODE, _DONE = 0, 1, 2, 3


class EngineRequestError(ValueError):
    """A request the engine cannot take (too long, no tokens, duplicate id)."""


class EngineStateError(RuntimeError):
    """The driver called the engine out of order (a step started twice, finished unstarted)."""


class EventKind(StrEnum):
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"
    ABORTED = "aborted"


class EngineRequest(NamedTuple):
    """One execution sent to the engine: its prompt as chained segments and its output length.

    (A named tuple, like ``EngineEvent``: immutable, and made once or twice per call.)"""

    request_id: str
    segments: tuple[tuple[Hashable, int], ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return sum(n for _, n in self.segments)


class EngineEvent(NamedTuple):
    """Something the driver must learn about an execution, at simulated/engine time ``t``.

    ``output_tokens``: tokens output so far (the full length for FINISHED).
    ``computed_prompt_tokens``: prompt tokens this execution computed (recomputes included).
    For ABORTED: ``in_flight_prompt_tokens`` of those were computed by steps that ran after
    the abort arrived, and ``in_flight_steps`` are those steps' indices.
    """

    kind: EventKind
    request_id: str
    t: float
    output_tokens: int = 0
    computed_prompt_tokens: int = 0
    in_flight_prompt_tokens: int = 0
    in_flight_steps: tuple[int, ...] = ()


@dataclass(slots=True)
class ExecutionTrace:
    """Per-execution trace (``trace=True``): queued, steps with prompt tokens, first token, end."""

    request_id: str
    prompt_len: int
    max_tokens: int
    queued_at: float
    refused: bool = False
    admitted_at: list[float] = field(default_factory=list)  # start of the step it was admitted to
    scheduled_at: list[float] = field(default_factory=list)  # when vLLM's scheduler decided it
    prefill_steps: list[tuple[int, float, int]] = field(default_factory=list)  # (step, start, tokens)
    # (first step, last step) of each decode run; an abort's runs end with its in-flight steps
    decode_spans: list[tuple[int, int]] = field(default_factory=list)
    cache_hit_tokens: list[int] = field(default_factory=list)  # per admission
    preemptions: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    abort_requested_at: float | None = None
    aborted_at: float | None = None
    in_flight_steps: tuple[int, ...] = ()
    output_tokens: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        return sum(n for _, _, n in self.prefill_steps)

    def prompt_tokens_in_flight(self) -> int:
        """Prompt tokens computed by steps that ran after the abort arrived (0 if not aborted)."""
        steps = set(self.in_flight_steps)
        return sum(n for s, _, n in self.prefill_steps if s in steps)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step (``trace=True``)."""

    index: int
    start: float
    duration: float
    prompt_tokens: int
    num_decode: int
    num_prefill: int
    context_tokens: int
    num_waiting: int
    num_running: int
    num_preempted: int
    num_steps: int = 1  # coalesced decode-only steps in this record


class _Exec:
    __slots__ = (
        "abort_requested_step",
        "abort_step",
        "aborting",
        "admitted",
        "arrival",
        "base_ctx",
        "base_out",
        "block_seq",
        "computed",
        "computed_prompt",
        "epoch",
        "first_token",
        "first_token_at",
        "held",
        "held_total",
        "last_token_at",
        "layout",
        "max_tokens",
        "next_block",
        "out",
        "private",
        "prompt_at_abort",
        "prompt_len",
        "queued_at",
        "rid",
        "s0",
        "scheduled_first",
        "state",
        "target",
        "trace",
    )

    def __init__(
        self, req: EngineRequest, layout: list[tuple[Hashable, int]], prompt_len: int, queued_at: float
    ) -> None:
        self.rid = req.request_id
        self.queued_at = queued_at  # when it (last) entered the waiting queue
        self.arrival = queued_at  # when it first did (vLLM's arrival and QUEUED times)
        self.scheduled_first = queued_at  # when vLLM's scheduler first admitted it
        self.first_token_at = queued_at
        self.last_token_at = queued_at  # its last output token that reached the frontend
        self.prompt_len = prompt_len
        self.max_tokens = req.max_tokens
        self.layout = layout
        self.held = [0] * len(layout)
        self.held_total = 0
        self.private = 0
        self.state = _WAITING
        self.computed = 0
        self.target = prompt_len
        self.out = 0
        self.first_token = False
        self.admitted = False
        self.abort_step: int | None = None
        self.abort_requested_step: int | None = None
        self.aborting = False  # counted in the engine's pending aborts
        self.prompt_at_abort = 0
        self.epoch = 0
        self.s0 = 0
        self.next_block = 0  # step at which this decode needs its next KV block
        self.block_seq = -1  # its current entry in the engine's _block_due (older ones are stale)
        self.base_ctx = 0
        self.base_out = 0
        self.computed_prompt = 0
        self.trace: ExecutionTrace | None = None


@dataclass(slots=True)
class _Step:
    index: int
    start: float
    chunks: list[tuple[_Exec, int]]
    num_decode: int
    num_steps: int = 1  # > 1: a run of identical decode-only steps (coalesced)
    ends: list[float] = field(default_factory=list)  # end time of each coalesced step
    early: list[tuple[_Exec, int, int]] = field(default_factory=list)  # (exec, first block step, count)

    @property
    def last(self) -> int:
        return self.index + self.num_steps - 1


class EngineModel:
    """vLLM V1's scheduler as a pure stepping object (see the module docstring).

    NOTE (coalescing): with ``coalesce_decode_steps`` a run of decode-only steps with nothing
    waiting, no abort pending and no execution finishing before its last step is returned by
    ``start_step`` as one step whose duration is the sum of the steps' durations; their KV
    blocks are allocated at its start, only from empty blocks (nothing evicted earlier than
    step by step would). A driver that learns of a new request or an abort during it calls
    ``truncate_step(now)`` first: the run is cut at the first step boundary at or after
    ``now`` and blocks of the cut steps are returned, so events, times and counters are the
    same as stepping one by one (tested). Off by default: the emulated engine streams a token
    per step.
    """

    def __init__(
        self,
        config: EngineConfig,
        trace: bool = False,
        *,
        coalesce_decode_steps: bool = False,
        max_coalesced_steps: int = 64,
    ) -> None:
        if max_coalesced_steps < 1:
            raise ValueError(f"max_coalesced_steps must be >= 1, got {max_coalesced_steps}")
        self.config = config
        self.coalesce_decode_steps = coalesce_decode_steps
        self.max_coalesced_steps = max_coalesced_steps
        self._budget = config.max_num_batched_tokens
        self._step_time = config.step_time
        self._bs = config.block_size
        self._pool = BlockPool(config.num_gpu_blocks, enable_caching=config.enable_prefix_caching)
        self._live: dict[str, _Exec] = {}
        self._waiting: deque[_Exec] = deque()
        self._num_waiting = 0
        self._running: dict[str, _Exec] = {}  # admission order: the last is the newest
        self._prefilling: list[_Exec] = []
        self._n_dec = 0
        self._ctx_base = 0  # sum over decodes of (context after prefill - prefill's step index)
        self._finish_heap: list[tuple[int, int, int, _Exec]] = []
        # decodes by the step at which they need their next KV block, as (seq, execution): an
        # entry is current while its seq is the execution's block_seq (older ones are stale).
        # Every step's decodes are due at one later step (a bucket queue, not a heap: no step
        # before the next one to run is ever listed, ``check``).
        self._block_due: dict[int, list[tuple[int, _Exec]]] = {}
        self._abort_due: dict[int, list[_Exec]] = {}
        self._aborting = 0  # live executions whose abort is pending (in flight, or waiting)
        self._waiting_aborts: list[_Exec] = []  # aborted while the next step's admission stood
        self._cutoff: float | None = None  # when vLLM scheduled the next step (None: at once)
        self._seq = 0
        self._next_step = 0
        self._last_finished = -1
        self._step: _Step | None = None
        self._pending: list[EngineEvent] = []
        self._last_end = 0.0  # when the last step ended (its tokens reached the frontend)
        # vLLM counters and gauges
        self.prompt_tokens_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.request_success_total: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.admission_rejections_total: dict[str, int] = dict.fromkeys(REJECTION_REASONS, 0)
        self._gauge_waiting = 0
        self._gauge_running = 0
        self._gauge_kv_usage = 0.0
        self.vllm_stats = VllmStats(config.max_model_len)
        # label set -> its label dicts (``metrics_samples``): plain, by finish reason, by rejection reason
        self._label_dicts: dict[
            tuple[tuple[str, str], ...],
            tuple[dict[str, str], dict[str, dict[str, str]], dict[str, dict[str, str]]],
        ] = {}
        # traces
        self.trace_enabled = trace
        self.traces: dict[str, ExecutionTrace] = {}
        self.steps: list[StepRecord] = []

    # --- public queries -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Executions waiting (never admitted, or preempted), live value."""
        return self._num_waiting

    @property
    def num_running(self) -> int:
        """Executions in the running batch, live value."""
        return len(self._running)

    @property
    def busy(self) -> bool:
        """Whether a step is in progress."""
        return self._step is not None

    @property
    def has_work(self) -> bool:
        return bool(self._running) or self._num_waiting > 0

    @property
    def step_end(self) -> float | None:
        """When the step in progress ends (engine time); None when idle."""
        return self._step.ends[-1] if self._step is not None else None

    @property
    def steps_done(self) -> int:
        return self._last_finished + 1

    @property
    def block_pool(self) -> BlockPool:
        return self._pool

    def has_request(self, request_id: str) -> bool:
        """Whether the execution is live (waiting or running, an abort possibly in flight)."""
        return request_id in self._live

    def output_tokens(self, request_id: str) -> int:
        """Tokens output so far by a live execution (0 if unknown); O(1)."""
        ex = self._live.get(request_id)
        if ex is None:
            return 0
        if ex.state == _DECODE:
            out = ex.base_out + (self._last_finished - ex.s0)
            if ex.abort_requested_step is not None:
                out = min(out, ex.base_out + (ex.abort_requested_step - 1 - ex.s0))
            return max(ex.base_out, out)
        return ex.out

    # --- requests -------------------------------------------------------------------
    def add_request(self, request: EngineRequest, now: float) -> bool:
        """Queue an execution; False when vLLM's queue cap refuses it (HTTP 503)."""
        rid = request.request_id
        if rid in self._live:
            raise EngineRequestError(f"request {rid!r} is already live in the engine")
        if request.max_tokens < 1:
            raise EngineRequestError(f"request {rid!r}: max_tokens must be >= 1, got {request.max_tokens}")
        layout, prompt_len = layout_and_length(request.segments, self._bs)
        if prompt_len < 1:
            raise EngineRequestError(f"request {rid!r} has an empty prompt")
        total = prompt_len + request.max_tokens
        if total > self.config.max_model_len:
            raise EngineRequestError(
                f"request {rid!r}: prompt {prompt_len} + max_tokens {request.max_tokens} "
                f"exceeds max_model_len {self.config.max_model_len}"
            )
        if -(-total // self._bs) > self.config.num_gpu_blocks:
            raise EngineRequestError(f"request {rid!r} needs more KV blocks than the engine has")
        cap = self.config.max_num_queued_reqs
        # vLLM's API server counts its unfinished requests; an aborted one leaves that count at
        # once, even while its last steps are still in flight in the engine core.
        if cap is not None and self._num_waiting + len(self._running) - self._aborting + 1 > cap:
            self.admission_rejections_total["max_num_queued_reqs"] += 1
            if self.trace_enabled:
                self.traces[rid] = ExecutionTrace(rid, prompt_len, request.max_tokens, now, refused=True)
            return False
        ex = _Exec(request, layout, prompt_len, now)
        if self.trace_enabled:
            ex.trace = self.traces[rid] = ExecutionTrace(rid, prompt_len, request.max_tokens, now)
        self._live[rid] = ex
        self._waiting.append(ex)
        self._num_waiting += 1
        return True

    def abort_request(self, request_id: str, now: float) -> list[EngineEvent]:
        """Abort an execution (the client left). Unknown ids are a no-op.

        A waiting execution is dropped at once (its ABORTED event is returned here) unless the
        next step's admission already stood (see the module NOTE); a running one is aborted
        after the steps in flight. Those ABORTED events come from ``finish_step``.
        """
        ex = self._live.get(request_id)
        if ex is None or ex.aborting:
            return []
        if ex.trace is not None:
            ex.trace.abort_requested_at = now
        step = self._step
        ex.prompt_at_abort = ex.computed_prompt
        if ex.state == _WAITING:
            if self._scheduled_next(step, ex):
                assert step is not None
                # step k+1 was scheduled when step k started: it may still admit this one
                ex.abort_requested_step = step.last
                ex.aborting = True
                self._aborting += 1
                self._waiting_aborts.append(ex)
                return []
            ex.abort_requested_step = None
            return [self._remove(ex, now)]
        if step is not None:
            current = step.last
            ex.abort_requested_step = current
            due = current + 1 if self.config.async_scheduling else current
        else:
            if not self.config.async_scheduling:
                ex.abort_requested_step = None
                return [self._remove(ex, now)]
            ex.abort_requested_step = self._next_step
            due = self._next_step
        ex.abort_step = due
        ex.aborting = True
        self._aborting += 1
        self._abort_due.setdefault(due, []).append(ex)
        return []

    def _scheduled_next(self, step: _Step | None, ex: _Exec) -> bool:
        """Whether vLLM scheduled the step after ``step`` while ``ex`` was already waiting."""
        return step is not None and self.config.async_scheduling and ex.queued_at <= self._substep_start(step)

    @staticmethod
    def _substep_start(step: _Step) -> float:
        """When the last step of ``step`` (one step, or the last of a coalesced run) started."""
        return step.ends[-2] if step.num_steps > 1 else step.start

    @property
    def has_pending_events(self) -> bool:
        """Whether ``drain_events`` has events to hand on."""
        return bool(self._pending)

    def drain_events(self) -> list[EngineEvent]:
        """Events produced while scheduling (aborts of executions that never ran) that no
        ``finish_step`` will return because ``start_step`` found nothing to run."""
        events, self._pending = self._pending, []
        return events

    # --- stepping -------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule the next step; return its duration, or None when there is nothing to run."""
        if self._step is not None:
            raise EngineStateError("start_step() called while a step is in progress")
        s = self._next_step
        bs = self._bs
        pool = self._pool
        budget = self._budget
        preempted = 0

        # 1. running decodes: one token each; some need a new KV block this step.
        entries = self._block_due.pop(s, None)
        if entries:
            due = [ex for seq, ex in entries if ex.block_seq == seq and ex.state == _DECODE]
            need = len(due)
            if not pool.allocate(need):
                # preempt the newest running executions until the remaining decodes fit
                while need > pool.num_free:
                    victim = self._running[next(reversed(self._running))]
                    was_due = victim.state == _DECODE and any(ex is victim for ex in due)
                    self._preempt(victim, now)
                    preempted += 1
                    if was_due:
                        need -= 1
                pool.allocate(need)
            next_at = s + bs
            later = self._block_due.setdefault(next_at, [])
            seq = self._seq
            for ex in due:
                if ex.state == _DECODE:
                    ex.private += 1
                    ex.next_block = next_at
                    seq += 1
                    ex.block_seq = seq
                    later.append((seq, ex))
            self._seq = seq

        # 2. running prefills (chunked), in admission order.
        chunks: list[tuple[_Exec, int]] = []
        budget -= self._n_dec
        for ex in list(self._prefilling) if self._prefilling else ():
            if budget <= 0:
                break
            if ex.state != _PREFILL:
                continue
            n = min(ex.target - ex.computed, budget)
            need = -(-(ex.computed + n) // bs) - ex.held_total - ex.private
            got = True
            while not pool.allocate(need):
                victim = self._running[next(reversed(self._running))]
                self._preempt(victim, now)
                preempted += 1
                if victim is ex:
                    got = False
                    break
            if not got:
                break
            if need > 0:
                ex.private += need
            chunks.append((ex, n))
            budget -= n
        num_decode = self._n_dec  # after preemptions

        # 3. waiting executions, FCFS, unless this step preempted (as vLLM does); with
        # asynchronous scheduling, only those that were waiting when the previous step started.
        idle = not chunks and num_decode == 0
        cutoff = now if self._cutoff is None else self._cutoff
        self._cutoff = None
        if not preempted or idle:
            self._admit(now, chunks, budget, cutoff)
        if self._waiting_aborts:
            for ex in self._waiting_aborts:
                if ex.state == _WAITING:  # not admitted: it leaves without computing anything
                    self._pending.append(self._remove(ex, now))
                elif ex.state == _PREFILL:  # admitted before its abort was processed
                    ex.abort_step = s
                    self._abort_due.setdefault(s, []).append(ex)
            self._waiting_aborts = []
        if not chunks and num_decode == 0 and cutoff < now:
            # vLLM had nothing to issue for this step, so it took new requests in as they came
            cutoff = now
            self._admit(now, chunks, budget, cutoff)

        if not chunks and num_decode == 0:
            self._refresh_gauges(cutoff)
            return None
        prompt_tokens = 0
        pairs = 0
        context = self._ctx_base + num_decode * s
        for ex, n in chunks:
            prompt_tokens += n
            context += ex.computed + n
            pairs += n * ex.computed + n * (n + 1) // 2
        duration = self._step_time.duration(prompt_tokens, num_decode + len(chunks), context, pairs)
        step = self._step = _Step(s, now, chunks, num_decode, ends=[now + duration])
        if (
            self.coalesce_decode_steps
            and not chunks
            and not preempted
            and self._num_waiting == 0
            and not self._abort_due
            and self.max_coalesced_steps > 1
        ):
            duration = self._coalesce(step, now, duration)
        self._next_step = s + step.num_steps
        if self.trace_enabled:
            self.steps.append(
                StepRecord(
                    s,
                    now,
                    duration,
                    prompt_tokens,
                    num_decode,
                    len(chunks),
                    context,
                    self._num_waiting,
                    len(self._running),
                    preempted,
                    step.num_steps,
                )
            )
            for ex, n in chunks:
                if ex.trace is not None:
                    ex.trace.prefill_steps.append((s, now, n))
        self._refresh_gauges(cutoff)
        return duration

    def _coalesce(self, step: _Step, now: float, duration: float) -> float:
        """Extend a decode-only step into a run of steps up to the next finish (see the class NOTE)."""
        s = step.index
        fheap = self._finish_heap
        while fheap:
            at, _, epoch, ex = fheap[0]
            if ex.epoch == epoch and ex.state == _DECODE:
                break
            heapq.heappop(fheap)
        if not fheap:
            return duration
        m = min(self.max_coalesced_steps, fheap[0][0] - s + 1)
        if m <= 1:
            return duration
        bs = self._bs
        end = s + m  # steps s+1 .. s+m-1 are added
        block_due = self._block_due
        early: list[tuple[_Exec, int, int]] = []
        need = 0
        for at in range(s + 1, end):  # (step s's were taken by start_step)
            for seq, ex in block_due.pop(at, ()):
                if ex.block_seq == seq and ex.state == _DECODE:
                    count = 1 + (end - 1 - at) // bs
                    early.append((ex, at, count))
                    need += count
        if need > self._pool.num_free:
            for ex, at, _ in early:  # some step would preempt: step one by one instead
                self._need_block_at(ex, at)
            return duration
        # The blocks are taken when the run ends (finish_step), in the same order and from the
        # same LRU state as step by step: nothing else touches the pool during the run.
        for ex, at, count in early:
            self._need_block_at(ex, at + bs * count)
        n_dec = step.num_decode
        per_step = self._step_time.duration(0, n_dec, 0)
        per_ctx = self._step_time.per_context_token_s
        ctx = self._ctx_base + n_dec * s
        t = step.ends[0]
        ends = [t]
        for _ in range(1, m):
            ctx += n_dec
            t += per_step + per_ctx * ctx
            ends.append(t)
        step.num_steps = m
        step.ends = ends
        step.early = early
        return t - now

    def truncate_step(self, now: float) -> float | None:
        """Cut a coalesced run of steps at the first step boundary at or after ``now``.

        Returns the (possibly earlier) end time of the step in progress; None when idle.
        Call it before ``add_request``/``abort_request`` when the engine is busy.
        """
        step = self._step
        if step is None:
            return None
        ends = step.ends
        if step.num_steps <= 1:
            return ends[0]
        keep = 1
        while keep < step.num_steps and ends[keep - 1] < now:
            keep += 1
        if keep < step.num_steps:
            bs = self._bs
            cut = step.index + keep  # first step no longer run
            early = step.early
            for i, (ex, first, count) in enumerate(early):
                kept = 0 if first >= cut else min(count, 1 + (cut - 1 - first) // bs)
                if kept < count:
                    early[i] = (ex, first, kept)
                    self._need_block_at(ex, first + bs * kept)
            step.num_steps = keep
            del ends[keep:]
            self._next_step = step.index + keep
            if self.trace_enabled and self.steps and self.steps[-1].index == step.index:
                rec = self.steps[-1]
                self.steps[-1] = dataclasses.replace(rec, duration=ends[-1] - rec.start, num_steps=keep)
        return ends[-1]

    def _admit(self, now: float, chunks: list[tuple[_Exec, int]], budget: int, cutoff: float) -> None:
        bs = self._bs
        pool = self._pool
        waiting = self._waiting
        max_seqs = self.config.max_num_seqs
        reserve_full = self.config.scheduler_reserve_full_isl
        while waiting and budget > 0 and len(self._running) < max_seqs:
            ex = waiting[0]
            if ex.state != _WAITING:  # aborted while waiting (lazy removal)
                waiting.popleft()
                continue
            if ex.queued_at > cutoff:  # arrived after vLLM scheduled this step
                break
            length = ex.target
            hits, hit_blocks, free_hit = pool.lookup(ex.layout, (length - 1) // bs)
            hit_tokens = hit_blocks * bs
            n = min(length - hit_tokens, budget)
            need = -(-(hit_tokens + n) // bs) - hit_blocks
            # vLLM's --scheduler-reserve-full-isl: the whole sequence must fit, not the chunk
            gate = -(-length // bs) - hit_blocks if reserve_full else need
            if gate + free_hit > pool.free_empty + pool.free_cached:  # (``pool.num_free``)
                break
            waiting.popleft()
            self._num_waiting -= 1
            if hit_blocks:
                pool.hold_hits(ex.layout, hits)
                ex.held = hits  # (it held nothing while waiting)
            ex.held_total = hit_blocks
            pool.allocate(need)
            ex.private = need
            ex.computed = hit_tokens
            ex.state = _PREFILL
            self._running[ex.rid] = ex
            self._prefilling.append(ex)
            if not ex.admitted:
                ex.admitted = True
                ex.scheduled_first = cutoff
                self.prefix_cache_queries_total += ex.prompt_len
                self.prefix_cache_hits_total += min(hit_tokens, ex.prompt_len)
            if ex.trace is not None:
                ex.trace.admitted_at.append(now)
                ex.trace.scheduled_at.append(cutoff)
                ex.trace.cache_hit_tokens.append(hit_tokens)
            chunks.append((ex, n))
            budget -= n

    def finish_step(self, now: float) -> list[EngineEvent]:
        """End the step in progress; return FIRST_TOKEN / FINISHED / ABORTED events."""
        step = self._step
        if step is None:
            raise EngineStateError("finish_step() called with no step in progress")
        self._step = None
        s = step.last
        self._last_finished = s
        if self.config.async_scheduling:
            self._cutoff = self._substep_start(step)  # when vLLM scheduled the next step
        if step.early:
            # KV blocks the decodes of a coalesced run needed (see _coalesce)
            need = 0
            for ex, _, count in step.early:
                ex.private += count
                need += count
            if not self._pool.allocate(need):  # pragma: no cover - guarded by _coalesce
                raise EngineStateError("KV blocks of a coalesced run were not available")
        events = self._pending
        self._pending = []
        bs = self._bs
        caching = self.config.enable_prefix_caching

        # prefill chunks: KV computed, full prompt blocks become cached
        for ex, n in step.chunks:
            if ex.state != _PREFILL:
                continue
            before = ex.computed
            computed = ex.computed = before + n
            prompt_len = ex.prompt_len
            if before < prompt_len:  # prompt tokens (not a recomputed output) among these
                ex.computed_prompt += (computed if computed < prompt_len else prompt_len) - before
            if caching:
                full_blocks = (computed if computed < prompt_len else prompt_len) // bs
                if full_blocks > ex.held_total:
                    self._commit(ex, full_blocks)
            if computed >= ex.target and ex.abort_step != s:
                # an abort that arrived during this step discards its output (see the class NOTE)
                self._prefill_done(ex, s, now, events, output=ex.abort_requested_step is None)

        # decodes whose abort arrived during this step (due after the next) output nothing now
        silenced = 0
        for ex in self._abort_due.get(s + 1, ()):
            if ex.state == _DECODE and ex.s0 < s:
                silenced += 1

        # aborts taking effect after this step
        due = self._abort_due.pop(s, None)
        if due:
            for ex in due:
                if ex.state == _DONE:
                    continue
                if ex.state == _DECODE and ex.s0 < s:
                    silenced += 1
                events.append(self._remove(ex, now))

        # decodes: one token each per step; some finish
        self.generation_tokens_total += step.num_decode * step.num_steps - silenced
        if step.num_decode:
            # each decode's token follows its previous one by the step's length (vLLM's ITL)
            stats = self.vllm_stats
            prev = self._last_end
            if step.num_steps > 1:
                stats.later_token_run(prev, step.ends, step.num_decode)
                prev = step.ends[-2]
            stats.later_tokens(now - prev, step.num_decode - silenced)
        self._last_end = now
        heap = self._finish_heap
        while heap and heap[0][0] <= s:
            _, _, epoch, ex = heapq.heappop(heap)
            if ex.epoch != epoch or ex.state != _DECODE or ex.abort_step is not None:
                continue  # an execution whose abort is pending is removed when it is due
            ex.out = ex.max_tokens
            self._leave_decode(ex, s)
            events.append(self._finish(ex, now))
        return events

    # --- internals ------------------------------------------------------------------
    def _commit(self, ex: _Exec, full_blocks: int) -> None:
        """Turn newly filled prompt blocks into cached segment blocks held by ``ex``."""
        if full_blocks <= ex.held_total:
            return
        pool = self._pool
        start = 0
        held = ex.held
        for j, (segment_id, owned) in enumerate(ex.layout):
            end = start + owned
            upto = min(full_blocks, end) - start
            if upto > held[j]:
                pool.commit(segment_id, held[j], upto)
                moved = upto - held[j]
                ex.private -= moved
                ex.held_total += moved
                held[j] = upto
            if full_blocks <= end:
                break
            start = end

    def _prefill_done(
        self, ex: _Exec, s: int, now: float, events: list[EngineEvent], *, output: bool = True
    ) -> None:
        """``ex`` computed its whole prompt in step ``s``; with ``output`` False (an abort arrived
        during the step) its token is discarded: it only moves on to decode in the step in flight."""
        self._prefilling.remove(ex)
        out = ex.out
        if output:
            out = ex.out = out + 1
            self.generation_tokens_total += 1
            if ex.first_token:  # its first token after a preemption
                self.vllm_stats.later_tokens(now - ex.last_token_at, 1)
                ex.last_token_at = now
            else:
                ex.first_token = True
                ex.first_token_at = ex.last_token_at = now
                self.vllm_stats.first_token(ex.arrival, now)
                self.prompt_tokens_total += ex.prompt_len
                if ex.trace is not None:
                    ex.trace.first_token_at = now
                events.append(EngineEvent(EventKind.FIRST_TOKEN, ex.rid, now, out, ex.computed_prompt))
            if out >= ex.max_tokens:
                events.append(self._finish(ex, now))
                return
        ex.state = _DECODE
        ex.s0 = s
        target = ex.base_ctx = ex.target
        ex.base_out = out
        self._n_dec += 1
        self._ctx_base += target - s
        bs = self._bs
        seq = self._seq
        last = s + ex.max_tokens - out
        heapq.heappush(self._finish_heap, (last, seq + 1, ex.epoch, ex))
        self._seq = seq + 1
        self._need_block_at(ex, s + bs * (-(-target // bs)) - target + 1)
        if ex.trace is not None:
            ex.trace.decode_spans.append((s + 1, last))

    def _need_block_at(self, ex: _Exec, step: int) -> None:
        """The decode ``ex`` needs its next KV block at ``step`` (its earlier entry is stale)."""
        self._seq = seq = self._seq + 1
        ex.block_seq = seq
        ex.next_block = step
        entries = self._block_due.get(step)
        if entries is None:
            self._block_due[step] = [(seq, ex)]
        else:
            entries.append((seq, ex))

    def _leave_decode(self, ex: _Exec, last_step: int) -> None:
        """Take ``ex`` out of the decode sums; its output count is fixed at ``last_step``."""
        ex.out = min(ex.max_tokens, ex.base_out + (last_step - ex.s0))
        self._n_dec -= 1
        self._ctx_base -= ex.base_ctx - ex.s0
        ex.epoch += 1
        if ex.trace is not None and ex.trace.decode_spans:
            first, _ = ex.trace.decode_spans[-1]
            ex.trace.decode_spans[-1] = (first, last_step)

    def _release(self, ex: _Exec) -> None:
        self._pool.release(ex.layout, ex.held if ex.held_total else None, ex.private)
        ex.held_total = 0
        ex.private = 0

    def _leave_running(self, ex: _Exec, last_step: int) -> None:
        if ex.state == _DECODE:
            self._leave_decode(ex, last_step)
        elif ex.state == _PREFILL:
            self._prefilling.remove(ex)
        del self._running[ex.rid]
        self._release(ex)

    def _finish(self, ex: _Exec, now: float) -> EngineEvent:
        """Complete ``ex`` (already out of the prefill list and the decode sums)."""
        if ex.aborting:  # pragma: no cover - an execution with a pending abort never finishes
            ex.aborting = False
            self._aborting -= 1
        rid = ex.rid
        del self._running[rid]
        self._release(ex)
        ex.state = _DONE
        del self._live[rid]
        self.request_success_total["length"] += 1
        out = ex.out
        self.vllm_stats.finished(ex.arrival, ex.scheduled_first, ex.first_token_at, now, ex.prompt_len, out)
        if ex.trace is not None:
            ex.trace.finished_at = now
            ex.trace.output_tokens = out
        return EngineEvent(EventKind.FINISHED, rid, now, out, ex.computed_prompt)

    def _remove(self, ex: _Exec, now: float) -> EngineEvent:
        """Drop an aborted execution (waiting, or running after its in-flight steps)."""
        end_step = self._last_finished
        if ex.aborting:
            ex.aborting = False
            self._aborting -= 1
        decoding = ex.state == _DECODE
        if ex.state == _WAITING:
            self._num_waiting -= 1  # lazily removed from the deque
        else:
            # outputs of the step running when the abort arrived, and of the one in flight
            # behind it, are not delivered
            delivered = end_step if ex.abort_requested_step is None else ex.abort_requested_step - 1
            self._leave_running(ex, max(ex.s0, delivered) if decoding else delivered)
            if decoding and ex.trace is not None and ex.trace.decode_spans:
                first, _ = ex.trace.decode_spans[-1]  # its decode ran until now, output or not
                ex.trace.decode_spans[-1] = (first, end_step)
        ex.state = _DONE
        del self._live[ex.rid]
        if ex.abort_requested_step is not None and ex.abort_step is not None:
            in_flight = tuple(range(ex.abort_requested_step, min(ex.abort_step, end_step) + 1))
        else:
            in_flight = ()
        in_flight_prompt = ex.computed_prompt - ex.prompt_at_abort
        if ex.trace is not None:
            tr = ex.trace
            tr.aborted_at = now
            tr.output_tokens = ex.out
            ran = {st for st, _, _ in tr.prefill_steps}
            for first, last in tr.decode_spans:
                ran.update(range(first, last + 1))
            tr.in_flight_steps = tuple(st for st in in_flight if st in ran)
            in_flight = tr.in_flight_steps
        return EngineEvent(
            EventKind.ABORTED,
            ex.rid,
            now,
            ex.out,
            computed_prompt_tokens=ex.computed_prompt,
            in_flight_prompt_tokens=in_flight_prompt,
            in_flight_steps=in_flight,
        )

    def _preempt(self, ex: _Exec, now: float) -> None:
        """vLLM's recompute preemption: free the blocks (they stay cached), requeue at the head."""
        self.num_preemptions_total += 1
        if ex.state == _DECODE:
            ex.last_token_at = self._last_end
        self._leave_running(ex, self._last_finished)
        ex.computed = 0
        ex.target = ex.prompt_len + ex.out
        if ex.trace is not None:
            ex.trace.preemptions += 1
        if ex.abort_step is not None:
            # an abort was already on its way: nothing left in flight, drop it now
            ex.state = _WAITING
            self._num_waiting += 1
            self._pending.append(self._remove(ex, now))
            return
        ex.state = _WAITING
        ex.queued_at = now
        self._waiting.appendleft(ex)
        self._num_waiting += 1

    def _refresh_gauges(self, cutoff: float) -> None:
        # NOTE: vLLM makes its scheduler stats after a step's aborts are processed and the next
        # step is scheduled; requests that arrived after that scheduling are still in its input
        # queue. So waiting counts what the scheduler saw and could not admit, and running
        # leaves out aborts.
        unseen = 0
        for ex in reversed(self._waiting):  # arrival order: the unseen ones are at the tail
            if ex.state != _WAITING:
                continue
            if ex.queued_at <= cutoff:
                break
            unseen += 1
        self._gauge_waiting = self._num_waiting - unseen
        self._gauge_running = len(self._running) - self._aborting
        self._gauge_kv_usage = self._pool.usage

    # --- metrics --------------------------------------------------------------------
    def metrics_samples(self, labels: Mapping[str, str] | None = None) -> list[Sample]:
        """vLLM's counters, gauges and histograms (``_bucket``/``_count``/``_sum``, last) as
        ``(name, labels, value)`` with vLLM's names and label sets."""
        base = dict(labels or {})
        # NOTE (speed): the label dicts are made once per label set and shared by every export
        # (a simulated run keeps each one; samples are never mutated), as the histograms' are
        made = self._label_dicts.get(key := tuple(base.items()))
        if made is None:
            # vLLM labels the rejections by model_name and reason only (no engine)
            frontend = {k: v for k, v in base.items() if k != "engine"}
            made = self._label_dicts[key] = (
                base,
                {reason: {**base, "finished_reason": reason} for reason in FINISHED_REASONS},
                {reason: {**frontend, "reason": reason} for reason in REJECTION_REASONS},
            )
        plain, finished, rejected = made
        samples: list[Sample] = [
            (mn.VLLM_PROMPT_TOKENS, plain, float(self.prompt_tokens_total)),
            (mn.VLLM_PREFIX_CACHE_QUERIES, plain, float(self.prefix_cache_queries_total)),
            (mn.VLLM_PREFIX_CACHE_HITS, plain, float(self.prefix_cache_hits_total)),
            (mn.VLLM_GENERATION_TOKENS, plain, float(self.generation_tokens_total)),
            (mn.VLLM_NUM_PREEMPTIONS, plain, float(self.num_preemptions_total)),
            (mn.VLLM_NUM_WAITING, plain, float(self._gauge_waiting)),
            (mn.VLLM_NUM_RUNNING, plain, float(self._gauge_running)),
            (mn.VLLM_KV_CACHE_USAGE, plain, float(self._gauge_kv_usage)),
        ]
        for reason, value in self.request_success_total.items():
            samples.append((mn.VLLM_REQUEST_SUCCESS, finished[reason], float(value)))
        for reason, value in self.admission_rejections_total.items():
            samples.append((mn.VLLM_ADMISSION_REJECTIONS, rejected[reason], float(value)))
        samples.extend(self.vllm_stats.samples(base))
        return samples

    def check(self) -> None:
        """Verify that every KV block is accounted for (tests and debugging; O(running))."""
        pool = self._pool
        pool.check()
        private = sum(ex.private for ex in self._running.values())
        held = pool.held_blocks()
        total = private + held + pool.free_empty + pool.free_cached
        assert total == pool.num_blocks, (private, held, pool.free_empty, pool.free_cached, pool.num_blocks)
        aborting = sum(1 for ex in self._live.values() if ex.aborting)
        assert aborting == self._aborting, (aborting, self._aborting)
        # no decode needs a block at a step that has already run (``_block_due``)
        assert min(self._block_due, default=self._next_step) >= self._next_step, self._next_step
        for ex in self._running.values():
            blocks = ex.held_total + ex.private
            tokens = ex.computed if ex.state == _PREFILL else ex.base_ctx + (self._last_finished - ex.s0)
            assert blocks * self._bs >= tokens, (ex.rid, blocks, tokens)

    def trace_records(self) -> Sequence[ExecutionTrace]:
        """Every execution's trace, in the order they were queued (empty unless ``trace=True``)."""
        return list(self.traces.values())
