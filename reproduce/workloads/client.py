"""The client model of the study (docs/protocol.md §4): one call = at most R+1 attempts.

NOTE: pure and clock-injected, like the proxy's policy core. The simulator drives it in
simulated time and the HTTP drivers in wall time; neither this module nor its records do any
I/O. The driver owns the transport: it sends an attempt when told, gives up on it at
``attempt.deadline_at`` (a limit on the whole attempt, not per byte), and reports how the
attempt ended. The model answers with the time of the next attempt, or ``None`` when the call
is over (delivered, or failed for good).

The study's client (the defaults of ``ClientConfig``):

* every attempt is given up ``deadline_s`` after it was sent;
* with retries on, a failed attempt (timed out, refused with 503, failed) is retried after a
  uniform random wait of ``backoff_min_s``–``backoff_max_s``;
* after a 429 with Retry-After the client waits that long instead, and gives up the call if
  that wait would exceed ``deadline_s``;
* a call fails after ``retries + 1`` failed attempts.

Clients as they retry in production (``reproduce.workloads.clients`` holds their settings, read from each
library's source) differ in every rule, so each is a setting here, not a branch:

* the attempt's limits: ``attempt_timeout_s`` bounds the whole attempt (the study's), and
  ``read_timeout_s`` bounds each wait for a byte (httpx's read timeout): the wait for the first
  byte from when the attempt was sent, then each gap between bytes. A driver gives up at
  ``give_up_at``; after the first byte a read timeout moves with every byte;
* the backoff: ``UNIFORM`` waits U(``backoff_min_s``, ``backoff_max_s``); ``EXPONENTIAL`` waits
  min(``backoff_min_s`` x 2^n, ``backoff_max_s``) for the n-th retry (n = 0 first), times
  1 - ``jitter_fraction`` x U(0, 1); either then adds ``jitter_s`` x U(0, 1) seconds;
* which failures are retried: every one (``retry_statuses`` None), or those whose HTTP status
  is in ``retry_statuses`` plus every failure without a status (a timeout, a broken
  connection); with ``retry_after_first_byte`` off, nothing once the response began (an SDK
  hands a stream to its caller once it begins and never retries it); with
  ``should_retry_header`` on, the server's ``x-should-retry: true|false`` decides first;
* Retry-After: honoured on a 429 (or, with ``retry_after_any_status``, on any retried status)
  when it is at most
  ``retry_after_max_s``; a longer one gives the call up (``retry_after_over_max_gives_up``) or
  falls back to the backoff; one of zero or less is a wait of zero, or (with
  ``zero_retry_after_is_backoff``, the SDKs' ``0 < retry_after``) the backoff.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from enum import StrEnum

__all__ = [
    "STUDY_DEADLINE_S",
    "AttemptOutcome",
    "AttemptRecord",
    "Backoff",
    "CallRecord",
    "ClientConfig",
    "ClientConfigError",
    "ClientModel",
]


STUDY_DEADLINE_S = 120.0  # the study's deadline: on each attempt, and the one a call is judged on
MAX_BACKOFF_EXPONENT = 1000  # the SDKs cap n before 2^n (no float overflow)


class ClientConfigError(ValueError):
    """A client setting is out of range; the message says which and what is allowed."""


class AttemptOutcome(StrEnum):
    """How an attempt ended, from the client's side (names of ``metricnames.ATTEMPT_OUTCOMES``)."""

    DELIVERED = "delivered"  # the complete response arrived
    DISCONNECTED = "disconnected"  # the client gave up at the attempt's deadline
    SHED = "shed"  # HTTP 429 (retry budget), with Retry-After
    REFUSED = "refused"  # HTTP 503 (engine queue cap, proxy queue, deadline check)
    FAILED = "failed"  # any other error (upstream down, broken stream)


class Backoff(StrEnum):
    """How the wait before a retry grows (module docstring)."""

    UNIFORM = "uniform"  # U(min, max): the study's
    EXPONENTIAL = "exponential"  # min(min x 2^n, max) with jitter: the SDKs' and LiteLLM's


@dataclass(frozen=True)
class ClientConfig:
    """The client's knobs; defaults are the study's (deadline 120 s, 3 retries, 0.25–3 s).

    ``deadline_s`` is the deadline a call is judged on (delivered within it or not; the proxy's
    deadline check) whatever the client; ``attempt_timeout_s`` and ``read_timeout_s`` are when
    this client gives an attempt up (None: never by that rule; at least one is set)."""

    deadline_s: float = STUDY_DEADLINE_S
    retries: int = 3
    backoff: Backoff = Backoff.UNIFORM
    backoff_min_s: float = 0.25  # UNIFORM: the shortest wait; EXPONENTIAL: the first retry's
    backoff_max_s: float = 3.0  # UNIFORM: the longest wait; EXPONENTIAL: the cap
    jitter_fraction: float = 0.0  # EXPONENTIAL: the wait times 1 - jitter_fraction x U(0, 1)
    jitter_s: float = 0.0  # every wait plus jitter_s x U(0, 1) seconds
    attempt_timeout_s: float | None = STUDY_DEADLINE_S
    read_timeout_s: float | None = None
    retry_statuses: frozenset[int] | None = None  # None: every failed attempt is retried
    retry_after_first_byte: bool = True
    should_retry_header: bool = False
    retry_after_max_s: float | None = STUDY_DEADLINE_S  # None: any Retry-After is honoured
    retry_after_over_max_gives_up: bool = True
    retry_after_any_status: bool = False
    zero_retry_after_is_backoff: bool = False
    horizon_s: float = 840.0  # a call counts as delivered only within this of its planned arrival

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ClientConfigError(
                f"deadline_s must be a positive number of seconds, got {self.deadline_s!r}"
            )
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ClientConfigError(f"retries must be an integer >= 0 (0: retries off), got {self.retries!r}")
        try:
            object.__setattr__(self, "backoff", Backoff(self.backoff))
        except ValueError:
            known = ", ".join(b.value for b in Backoff)
            raise ClientConfigError(f"backoff must be one of {known}, got {self.backoff!r}") from None
        if not (0 <= self.backoff_min_s <= self.backoff_max_s < math.inf):
            raise ClientConfigError("need 0 <= backoff_min_s <= backoff_max_s (finite seconds)")
        if not 0 <= self.jitter_fraction <= 1:
            raise ClientConfigError(f"jitter_fraction must be within 0..1, got {self.jitter_fraction!r}")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise ClientConfigError(f"jitter_s must be >= 0 seconds, got {self.jitter_s!r}")
        for name in ("attempt_timeout_s", "read_timeout_s", "retry_after_max_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ClientConfigError(f"{name} must be a positive number of seconds or None, got {value!r}")
        if self.attempt_timeout_s is None and self.read_timeout_s is None:
            raise ClientConfigError("an attempt needs a limit: set attempt_timeout_s, read_timeout_s or both")
        if self.retry_statuses is not None:
            statuses = frozenset(self.retry_statuses)
            if not all(isinstance(s, int) and 100 <= s <= 599 for s in statuses):
                raise ClientConfigError(f"retry_statuses must be HTTP statuses, got {sorted(statuses)!r}")
            object.__setattr__(self, "retry_statuses", statuses)
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ClientConfigError(f"horizon_s must be a positive number of seconds, got {self.horizon_s!r}")

    def scaled(self, time_scale: float) -> ClientConfig:
        """The same client with every duration divided by ``time_scale`` (K, checked by the plan
        that scales it: ``reproduce.workloads.plan``)."""
        k = time_scale

        def div(value: float | None) -> float | None:
            return None if value is None else value / k

        return replace(
            self,
            deadline_s=self.deadline_s / k,
            backoff_min_s=self.backoff_min_s / k,
            backoff_max_s=self.backoff_max_s / k,
            jitter_s=self.jitter_s / k,
            attempt_timeout_s=div(self.attempt_timeout_s),
            read_timeout_s=div(self.read_timeout_s),
            retry_after_max_s=div(self.retry_after_max_s),
            horizon_s=self.horizon_s / k,
        )

    def describe(self) -> dict[str, object]:
        """The client's numbers, JSON-ready (summary.json's ``settings.client_settings``)."""
        return {
            "retries": self.retries,
            "attempt_timeout_s": self.attempt_timeout_s,
            "read_timeout_s": self.read_timeout_s,
            "backoff": self.backoff.value,
            "backoff_min_s": self.backoff_min_s,
            "backoff_max_s": self.backoff_max_s,
            "jitter_fraction": self.jitter_fraction,
            "jitter_s": self.jitter_s,
            "retry_statuses": None if self.retry_statuses is None else format_statuses(self.retry_statuses),
            "retry_after_first_byte": self.retry_after_first_byte,
            "should_retry_header": self.should_retry_header,
            "retry_after_max_s": self.retry_after_max_s,
            "retry_after_over_max": "give-up" if self.retry_after_over_max_gives_up else "backoff",
            "retry_after_any_status": self.retry_after_any_status,
            "zero_retry_after_is_backoff": self.zero_retry_after_is_backoff,
        }


def format_statuses(statuses: frozenset[int]) -> str:
    """``408,409,429,5xx``: a whole hundred written as ``Nxx``."""
    parts: list[str] = []
    hundreds = {h for h in {s // 100 for s in statuses} if statuses >= set(range(h * 100, h * 100 + 100))}
    for s in sorted(statuses):
        if s // 100 in hundreds:
            if f"{s // 100}xx" not in parts:
                parts.append(f"{s // 100}xx")
        else:
            parts.append(str(s))
    return ",".join(parts)


@dataclass(slots=True)
class AttemptRecord:
    """One attempt of a call: when it was sent, its first byte, its end and how it ended."""

    index: int  # 0 = the first attempt, 1.. = retries
    sent_at: float
    deadline_at: float
    first_byte_at: float | None = None
    ended_at: float | None = None
    outcome: AttemptOutcome | None = None
    retry_after_s: float | None = None

    @property
    def is_retry(self) -> bool:
        return self.index > 0

    @property
    def open(self) -> bool:
        return self.outcome is None

    def to_dict(self) -> dict[str, object]:
        return {
            "index": self.index,
            "sent_at": self.sent_at,
            "deadline_at": self.deadline_at,
            "first_byte_at": self.first_byte_at,
            "ended_at": self.ended_at,
            "outcome": None if self.outcome is None else self.outcome.value,
            "retry_after_s": self.retry_after_s,
        }


@dataclass(slots=True)
class CallRecord:
    """One call: its plan (arrival, lengths, phase), its attempts and when it was delivered."""

    call_id: str
    planned_at: float
    prompt_len: int = 0
    response_len: int = 0
    phase: str = ""
    attempts: list[AttemptRecord] = field(default_factory=list)
    delivered_at: float | None = None
    done: bool = False  # delivered, or failed for good

    @property
    def delivered(self) -> bool:
        return self.delivered_at is not None

    @property
    def first_sent_at(self) -> float:
        return self.attempts[0].sent_at if self.attempts else self.planned_at

    def to_dict(self) -> dict[str, object]:
        return {
            "call_id": self.call_id,
            "planned_at": self.planned_at,
            "prompt_len": self.prompt_len,
            "response_len": self.response_len,
            "phase": self.phase,
            "delivered_at": self.delivered_at,
            "done": self.done,
            "attempts": [a.to_dict() for a in self.attempts],
        }

    @classmethod
    def from_dict(cls, obj: dict[str, object]) -> CallRecord:
        raw = obj.get("attempts", [])
        if not isinstance(raw, list):
            raise ValueError(f"call {obj.get('call_id')!r}: attempts must be a list")
        attempts = []
        for a in raw:
            if not isinstance(a, dict):
                raise ValueError(f"call {obj.get('call_id')!r}: every attempt must be an object")
            outcome = a.get("outcome")
            attempts.append(
                AttemptRecord(
                    index=int(a["index"]),
                    sent_at=float(a["sent_at"]),
                    deadline_at=float(a["deadline_at"]),
                    first_byte_at=_opt_float(a.get("first_byte_at")),
                    ended_at=_opt_float(a.get("ended_at")),
                    outcome=None if outcome is None else AttemptOutcome(str(outcome)),
                    retry_after_s=_opt_float(a.get("retry_after_s")),
                )
            )
        return cls(
            call_id=str(obj["call_id"]),
            planned_at=float(obj["planned_at"]),  # type: ignore[arg-type]
            prompt_len=int(obj.get("prompt_len", 0)),  # type: ignore[call-overload]
            response_len=int(obj.get("response_len", 0)),  # type: ignore[call-overload]
            phase=str(obj.get("phase", "")),
            attempts=attempts,
            delivered_at=_opt_float(obj.get("delivered_at")),
            done=bool(obj.get("done", False)),
        )


_IMPLIED_STATUS = {AttemptOutcome.SHED: 429, AttemptOutcome.REFUSED: 503}


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


class ClientModel:
    """Decides when a call's attempts are sent; owns the backoff RNG (seeded by the driver)."""

    def __init__(self, config: ClientConfig | None = None, rng: random.Random | None = None) -> None:
        self.config = config or ClientConfig()
        self.rng = rng if rng is not None else random.Random(0)

    def new_call(
        self,
        call_id: str,
        planned_at: float,
        *,
        prompt_len: int = 0,
        response_len: int = 0,
        phase: str = "",
    ) -> CallRecord:
        """A call whose first attempt is due at ``planned_at`` (open loop: it never waits)."""
        return CallRecord(call_id, planned_at, prompt_len, response_len, phase)

    def send(self, call: CallRecord, now: float) -> AttemptRecord:
        """Record that the call's next attempt is sent at ``now``; the driver gives up on it at
        ``deadline_at``."""
        if call.done:
            raise ValueError(f"call {call.call_id!r} is over; it sends no more attempts")
        attempts = call.attempts
        if attempts and attempts[-1].outcome is None:  # (``AttemptRecord.open``)
            raise ValueError(f"call {call.call_id!r} still has an attempt outstanding")
        attempt = AttemptRecord(len(attempts), now, now)
        attempt.deadline_at = self.give_up_at(attempt, now)
        attempts.append(attempt)
        return attempt

    def give_up_at(self, attempt: AttemptRecord, last_byte_at: float) -> float:
        """When the driver gives the attempt up, its latest byte (or its sending, before any)
        having come at ``last_byte_at``: the sooner of its whole-attempt limit and its read
        timeout after that byte; infinity when neither bounds it any more."""
        cfg = self.config
        end = math.inf
        if cfg.attempt_timeout_s is not None:
            end = min(end, attempt.sent_at + cfg.attempt_timeout_s)
        if cfg.read_timeout_s is not None:
            end = min(end, last_byte_at + cfg.read_timeout_s)
        return end

    def attempt_limit_at(self, attempt: AttemptRecord) -> float:
        """When the whole-attempt limit gives the attempt up (infinity: it has none). The
        simulator's output flows one token per engine step, far below any read timeout, so once
        it began only this limit gives the attempt up there."""
        return self.give_up_at(attempt, math.inf)

    def first_byte(self, call: CallRecord, now: float) -> None:
        """The outstanding attempt received its first byte of output."""
        attempt = self._open_attempt(call)
        if attempt.first_byte_at is None:
            attempt.first_byte_at = now

    def delivered(self, call: CallRecord, now: float) -> None:
        """The outstanding attempt received the complete response: the call is over."""
        attempt = self._open_attempt(call)
        if attempt.first_byte_at is None:
            attempt.first_byte_at = now
        attempt.ended_at = now
        attempt.outcome = AttemptOutcome.DELIVERED
        call.delivered_at = now
        call.done = True

    def failed(
        self,
        call: CallRecord,
        now: float,
        outcome: AttemptOutcome,
        retry_after_s: float | None = None,
        *,
        status: int | None = None,
        should_retry: bool | None = None,
    ) -> float | None:
        """The outstanding attempt ended without the response. Returns when to send the next
        attempt, or None when the call is over (no retry left, retries off, a failure this
        client does not retry, or a Retry-After it will not wait).

        ``status`` is the HTTP status the attempt was answered with, if an error status (None:
        429 for ``SHED``, 503 for ``REFUSED``, none otherwise); ``should_retry`` is the
        server's ``x-should-retry`` header, if it sent one."""
        if outcome is AttemptOutcome.DELIVERED:
            raise ValueError("use delivered() for an attempt that received its response")
        attempt = self._open_attempt(call)
        attempt.ended_at = now
        attempt.outcome = outcome
        attempt.retry_after_s = retry_after_s
        wait = None
        if len(call.attempts) <= self.config.retries and self._retried(attempt, status, should_retry):
            wait = self._wait(len(call.attempts) - 1, outcome, retry_after_s)
        if wait is None:
            call.done = True
            return None
        return now + wait

    def _retried(self, attempt: AttemptRecord, status: int | None, should_retry: bool | None) -> bool:
        cfg = self.config
        if cfg.should_retry_header and should_retry is not None:
            return should_retry
        if not cfg.retry_after_first_byte and attempt.first_byte_at is not None:
            return False
        if (status is None or status < 400) and attempt.outcome is not None:
            status = _IMPLIED_STATUS.get(attempt.outcome)
        if status is None:  # a timeout, a broken connection or stream: retried by every client
            return True
        return cfg.retry_statuses is None or status in cfg.retry_statuses

    def _wait(self, n: int, outcome: AttemptOutcome, retry_after_s: float | None) -> float | None:
        """The wait before retry ``n`` (0 = the first), or None when the call is given up."""
        cfg = self.config
        honoured = outcome is AttemptOutcome.SHED or cfg.retry_after_any_status
        if retry_after_s is not None and honoured:
            if cfg.retry_after_max_s is not None and retry_after_s > cfg.retry_after_max_s:
                if cfg.retry_after_over_max_gives_up:
                    return None
                honoured = False
            elif retry_after_s <= 0 and cfg.zero_retry_after_is_backoff:
                honoured = False
        if retry_after_s is not None and honoured:
            wait = max(retry_after_s, 0.0)
        elif cfg.backoff is Backoff.UNIFORM:
            wait = self.rng.uniform(cfg.backoff_min_s, cfg.backoff_max_s)
        else:
            wait = min(cfg.backoff_min_s * 2.0 ** min(n, MAX_BACKOFF_EXPONENT), cfg.backoff_max_s)
            if cfg.jitter_fraction:
                wait *= 1.0 - cfg.jitter_fraction * self.rng.random()
        if cfg.jitter_s:
            wait += cfg.jitter_s * self.rng.random()
        return wait

    def _open_attempt(self, call: CallRecord) -> AttemptRecord:
        attempts = call.attempts
        if not attempts or attempts[-1].outcome is not None:  # (``AttemptRecord.open``)
            raise ValueError(f"call {call.call_id!r} has no attempt outstanding")
        return attempts[-1]
