"""The client model of the study (docs/protocol.md §4): one call = at most R+1 attempts.

NOTE: pure and clock-injected, like the proxy's policy core. The simulator drives it in
simulated time and the HTTP drivers in wall time; neither this module nor its records do any
I/O. The driver owns the transport: it sends an attempt when told, gives up on it at
``attempt.deadline_at`` (a limit on the whole attempt, not per byte), and reports how the
attempt ended. The model answers with the time of the next attempt, or ``None`` when the call
is over (delivered, or failed for good).

Rules:

* every attempt is given up ``deadline_s`` after it was sent;
* with retries on, a failed attempt (timed out, refused with 503, failed) is retried after a
  uniform random wait of ``backoff_min_s``–``backoff_max_s``;
* after a 429 with Retry-After the client waits that long instead, and gives up the call if
  that wait would exceed ``deadline_s``;
* a call fails after ``retries + 1`` failed attempts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "AttemptOutcome",
    "AttemptRecord",
    "CallRecord",
    "ClientConfig",
    "ClientConfigError",
    "ClientModel",
]


class ClientConfigError(ValueError):
    """A client setting is out of range; the message says which and what is allowed."""


class AttemptOutcome(StrEnum):
    """How an attempt ended, from the client's side (names of ``metricnames.ATTEMPT_OUTCOMES``)."""

    DELIVERED = "delivered"  # the complete response arrived
    DISCONNECTED = "disconnected"  # the client gave up at the attempt's deadline
    SHED = "shed"  # HTTP 429 (retry budget), with Retry-After
    REFUSED = "refused"  # HTTP 503 (engine queue cap, proxy queue, deadline check)
    FAILED = "failed"  # any other error (upstream down, broken stream)


@dataclass(frozen=True)
class ClientConfig:
    """The client's knobs; defaults are the study's (deadline 120 s, 3 retries, 0.25–3 s)."""

    deadline_s: float = 120.0
    retries: int = 3
    backoff_min_s: float = 0.25
    backoff_max_s: float = 3.0
    horizon_s: float = 840.0  # a call counts as delivered only within this of its planned arrival

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ClientConfigError(
                f"deadline_s must be a positive number of seconds, got {self.deadline_s!r}"
            )
        if self.retries < 0:
            raise ClientConfigError(f"retries must be >= 0 (0 = retries off), got {self.retries!r}")
        if not (0 <= self.backoff_min_s <= self.backoff_max_s < math.inf):
            raise ClientConfigError("need 0 <= backoff_min_s <= backoff_max_s (finite seconds)")
        if not (math.isfinite(self.horizon_s) and self.horizon_s > 0):
            raise ClientConfigError(f"horizon_s must be a positive number of seconds, got {self.horizon_s!r}")

    def scaled(self, time_scale: float) -> ClientConfig:
        """The same client with every duration divided by ``time_scale``."""
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ClientConfigError(f"time_scale must be positive, got {time_scale!r}")
        k = float(time_scale)
        return ClientConfig(
            deadline_s=self.deadline_s / k,
            retries=self.retries,
            backoff_min_s=self.backoff_min_s / k,
            backoff_max_s=self.backoff_max_s / k,
            horizon_s=self.horizon_s / k,
        )


@dataclass
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


@dataclass
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
        if call.attempts and call.attempts[-1].open:
            raise ValueError(f"call {call.call_id!r} still has an attempt outstanding")
        attempt = AttemptRecord(
            index=len(call.attempts), sent_at=now, deadline_at=now + self.config.deadline_s
        )
        call.attempts.append(attempt)
        return attempt

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
    ) -> float | None:
        """The outstanding attempt ended without the response. Returns when to send the next
        attempt, or None when the call is over (no retry left, retries off, or a Retry-After
        beyond the deadline)."""
        if outcome is AttemptOutcome.DELIVERED:
            raise ValueError("use delivered() for an attempt that received its response")
        attempt = self._open_attempt(call)
        attempt.ended_at = now
        attempt.outcome = outcome
        attempt.retry_after_s = retry_after_s
        if len(call.attempts) > self.config.retries:
            call.done = True
            return None
        if outcome is AttemptOutcome.SHED and retry_after_s is not None:
            if retry_after_s > self.config.deadline_s:
                call.done = True
                return None
            return now + max(retry_after_s, 0.0)
        return now + self.rng.uniform(self.config.backoff_min_s, self.config.backoff_max_s)

    def _open_attempt(self, call: CallRecord) -> AttemptRecord:
        if not call.attempts or not call.attempts[-1].open:
            raise ValueError(f"call {call.call_id!r} has no attempt outstanding")
        return call.attempts[-1]
