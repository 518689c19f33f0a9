"""Client profiles: how the clients of a run retry, by name (``--client``), as data.

Each profile is a ``reproduce.workloads.client.ClientConfig`` at the study's scale, read from its
library's source (the version and the file are cited at each); the client model carries them
out in both drivers. ``parse_client`` reads ``--client``: a profile's name, or ``KEY=VALUE``
pairs (``KEYS``) on top of the study's client or of a named profile given first
(``openai-sdk,retries=5``). ``with_client`` gives a run that client.

Every profile keeps the study's ``deadline_s`` (120 s): the deadline a call is judged on is the
study's yardstick, not a client's setting; only when a client gives an attempt up changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from reproduce.conditions import RunSpec
from reproduce.workloads.client import Backoff, ClientConfig, ClientConfigError

__all__ = ["KEYS", "PROFILES", "ClientSpec", "parse_client", "with_client"]

#: The statuses the OpenAI and Anthropic SDKs retry (``_should_retry``): 408, 409, 429, >= 500.
_SDK_STATUSES = frozenset({408, 409, 429, *range(500, 600)})


@dataclass(frozen=True)
class ClientSpec:
    """A client by name: its settings and where they come from."""

    name: str
    config: ClientConfig
    source: str


PROFILES: dict[str, ClientSpec] = {
    p.name: p
    for p in (
        # docs/protocol.md §4: 4 attempts, each given up 120 s after it was sent, U(0.25, 3) s.
        ClientSpec("study", ClientConfig(), "docs/protocol.md §4 (the study's client)"),
        # openai 3.63.0 (PyPI wheel): openai/_constants.py DEFAULT_MAX_RETRIES = 2,
        # DEFAULT_TIMEOUT = httpx2.Timeout(timeout=600, connect=5.0) (read, write and pool 600 s:
        # a read timeout bounds each wait for bytes, nothing bounds the whole attempt),
        # INITIAL_RETRY_DELAY = 0.5, MAX_RETRY_DELAY = 8.0, MAX_RETRY_AFTER_DELAY = 2 * 60;
        # openai/_base_client.py _calculate_retry_timeout: retry-after-ms, then Retry-After,
        # honoured when 0 < it <= 120 s, else min(0.5 x 2^n, 8) x (1 - 0.25 U);
        # _should_retry: a Retry-After over 120 s is not retried, then x-should-retry, then
        # 408, 409, 429, >= 500; timeouts and connection errors are retried. A stream is
        # returned to the caller once its response begins: a failure after that is not retried.
        ClientSpec(
            "openai-sdk",
            ClientConfig(
                retries=2,
                backoff=Backoff.EXPONENTIAL,
                backoff_min_s=0.5,
                backoff_max_s=8.0,
                jitter_fraction=0.25,
                attempt_timeout_s=None,
                read_timeout_s=600.0,
                retry_statuses=_SDK_STATUSES,
                retry_after_first_byte=False,
                should_retry_header=True,
                retry_after_max_s=120.0,
                retry_after_over_max_gives_up=True,
                retry_after_any_status=True,
                zero_retry_after_is_backoff=True,
            ),
            "openai 3.63.0: openai/_constants.py, openai/_base_client.py",
        ),
        # anthropic 2.17.0 (PyPI wheel): anthropic/_constants.py DEFAULT_MAX_RETRIES = 2,
        # DEFAULT_TIMEOUT = httpx2.Timeout(timeout=10 * 60, connect=5.0), INITIAL_RETRY_DELAY =
        # 0.5, MAX_RETRY_DELAY = 8.0 (no Retry-After limit); anthropic/_base_client.py
        # _calculate_retry_timeout: retry-after-ms, then Retry-After, honoured whenever > 0
        # (capped only at time.sleep's 4,294,967 s), else min(0.5 x 2^n, 8) x (1 - 0.25 U);
        # _should_retry: x-should-retry, then 408, 409, 429, >= 500; transport failures retried.
        ClientSpec(
            "anthropic-sdk",
            ClientConfig(
                retries=2,
                backoff=Backoff.EXPONENTIAL,
                backoff_min_s=0.5,
                backoff_max_s=8.0,
                jitter_fraction=0.25,
                attempt_timeout_s=None,
                read_timeout_s=600.0,
                retry_statuses=_SDK_STATUSES,
                retry_after_first_byte=False,
                should_retry_header=True,
                retry_after_max_s=None,
                retry_after_any_status=True,
                zero_retry_after_is_backoff=True,
            ),
            "anthropic 2.17.0: anthropic/_constants.py, anthropic/_base_client.py",
        ),
        # litellm 1.110.2 (PyPI wheel), its Router (what the LiteLLM gateway runs): num_retries
        # defaults to 2 (litellm/router_rust/core.py) and the inner completion gets max_retries
        # = 0 (litellm/main.py, a router call), so the router's loop is the only one. Its wait is
        # litellm/utils.py calculate_retry_after: Retry-After (integer seconds) honoured when
        # 0 < it <= 60, else min(0.5 x 2^n, 8) (litellm/constants.py INITIAL_RETRY_DELAY,
        # MAX_RETRY_DELAY), plus JITTER = 0.75 x U seconds either way. The per-attempt timeout
        # is completion's COMPLETION_HTTP_FALLBACK_SECONDS = 600 (litellm/constants.py; an httpx
        # read timeout). Which errors it retries is decided in its compiled router core
        # (litellm/rust_bridge/_native.pyi: should_retry, and a stream "that failed before
        # content" is retried): with no retry_policy and one deployment, every error class.
        ClientSpec(
            "litellm",
            ClientConfig(
                retries=2,
                backoff=Backoff.EXPONENTIAL,
                backoff_min_s=0.5,
                backoff_max_s=8.0,
                jitter_s=0.75,
                attempt_timeout_s=None,
                read_timeout_s=600.0,
                retry_statuses=None,
                retry_after_first_byte=False,
                retry_after_max_s=60.0,
                retry_after_over_max_gives_up=False,
                retry_after_any_status=True,
                zero_retry_after_is_backoff=True,
            ),
            "litellm 1.110.2: litellm/constants.py, litellm/utils.py, litellm/router_rust/core.py",
        ),
        ClientSpec("none", ClientConfig(retries=0), "the study's client with retries off"),
    )
}

#: ``--client KEY=VALUE`` keys -> (``ClientConfig`` field, what the value is).
KEYS: dict[str, tuple[str, str]] = {
    "retries": ("retries", "retries per call (0 = none)"),
    "deadline": ("attempt_timeout_s", "seconds on the whole attempt, or none"),
    "read-timeout": ("read_timeout_s", "seconds without a byte before giving up, or none"),
    "backoff": ("backoff", "uniform:MIN:MAX or exponential:FIRST:CAP (seconds)"),
    "jitter": ("jitter_fraction", "exponential: the wait times 1 - J x U(0, 1)"),
    "jitter-s": ("jitter_s", "seconds of U(0, 1) jitter added to every wait"),
    "statuses": ("retry_statuses", "the HTTP statuses retried, joined by + (408+429+5xx), or any"),
    "after-first-byte": ("retry_after_first_byte", "yes: retry an attempt whose response began"),
    "should-retry": ("should_retry_header", "yes: obey x-should-retry"),
    "retry-after-max": ("retry_after_max_s", "the longest Retry-After honoured (seconds), or none"),
    "over-max": ("retry_after_over_max_gives_up", "give-up or backoff, past retry-after-max"),
    "retry-after-any": ("retry_after_any_status", "yes: honour Retry-After on any retried status"),
}
_BOOLS = {"yes": True, "true": True, "on": True, "no": False, "false": False, "off": False}


def parse_client(text: str) -> ClientSpec:
    """``--client``'s value: a profile's name, or ``[NAME,]KEY=VALUE,...`` (``KEYS``).

    Raises ``ClientConfigError`` naming the bad part and what is allowed."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ClientConfigError(f"an empty client; give one of {', '.join(PROFILES)} or KEY=VALUE,...")
    base = PROFILES["study"]
    if "=" not in parts[0]:
        name = parts.pop(0)
        if name not in PROFILES:
            known = ", ".join(PROFILES)
            raise ClientConfigError(f"unknown client {name!r}: one of {known}, or KEY=VALUE,...")
        base = PROFILES[name]
        if not parts:
            return base
    changes: dict[str, object] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            allowed = ", ".join(f"{k} ({what})" for k, (_, what) in KEYS.items())
            raise ClientConfigError(f"{part!r} is not KEY=VALUE with a known key; keys: {allowed}")
        changes.update(_value(key, raw.strip()))
    config = replace(base.config, **changes)  # type: ignore[arg-type]  # each value checked by ClientConfig
    label = ",".join([base.name, *parts])
    return ClientSpec(label, config, f"{base.source}, with {','.join(parts)}")


def _value(key: str, raw: str) -> dict[str, object]:
    field = KEYS[key][0]
    low = raw.lower()
    try:
        if key == "backoff":
            kind, _, bounds = low.partition(":")
            lo, _, hi = bounds.partition(":")
            return {"backoff": Backoff(kind), "backoff_min_s": _seconds(lo), "backoff_max_s": _seconds(hi)}
        if key == "retries":
            return {field: int(raw)}
        if key == "statuses":
            return {field: None if low == "any" else _statuses(low)}
        if key == "over-max":
            if low not in ("give-up", "backoff"):
                raise ValueError(low)
            return {field: low == "give-up"}
        if key in ("after-first-byte", "should-retry", "retry-after-any"):
            return {field: _BOOLS[low]}
        if low == "none" and key in ("deadline", "read-timeout", "retry-after-max"):
            return {field: None}
        return {field: _seconds(raw) if key != "jitter" else float(raw)}
    except (ValueError, KeyError):
        raise ClientConfigError(f"{key}={raw!r}: expected {KEYS[key][1]}") from None


def _seconds(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def _statuses(raw: str) -> frozenset[int]:
    out: set[int] = set()
    for item in raw.split("+"):
        item = item.strip()
        if item.endswith("xx") and item[:-2].isdigit():
            out.update(range(int(item[:-2]) * 100, int(item[:-2]) * 100 + 100))
        else:
            out.add(int(item))
    return frozenset(out)


def with_client(run: RunSpec, client: ClientSpec) -> RunSpec:
    """``run`` with ``client`` as its clients (a condition with retries off keeps them off)."""
    profile = replace(run.condition.client, name=client.name, base=client.config)
    return replace(run, condition=replace(run.condition, client=profile))
