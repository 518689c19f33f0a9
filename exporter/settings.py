"""The proxy's configuration: one dataclass holding every flag of ``retrywatch proxy``.

The policy's knobs are inherited from ``exporter.policy.PolicyConfig``; the proxy's own are declared
here. Every knob is declared once, with its option (``foundation.knobs``): the command line
(``exporter.cli``), its environment variables and the argv of every launcher of a proxy process
(:meth:`ProxySettings.to_argv`) are derived from these fields."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from exporter.callkey import DEFAULT_CALL_ID_HEADER, KeyWithoutId
from exporter.policy import BudgetOrder, Cancellation, PolicyConfig, QueueOrder
from exporter.routes import DEFAULT_FORWARDED, DEFAULT_ROUTES, ForwardedRoutes
from exporter.upstream import DEFAULT_MAX_IDLE_S
from foundation.bounds import (
    EMPTY_HOST,
    OPENAI_API_ROOT,
    HttpBounds,
    ends_at_api_root,
    host_is_usable,
    without_api_root,
)
from foundation.knobs import check_bounds, knob, to_argv
from foundation.redact import redact_url


class SettingsError(ValueError):
    """A proxy setting is unusable; the message names the flag and what it accepts."""


AUTO_DEADLINE_PLACEHOLDER_S = 1e9


def _visible_ascii(text: str) -> bool:
    """Whether ``text`` is one or more visible ASCII characters (``!`` to ``~``)."""
    return bool(text) and all("!" <= c <= "~" for c in text)


_ENUMS = {"cancellation": Cancellation, "budget_order": BudgetOrder, "queue_order": QueueOrder}


@dataclass(frozen=True, kw_only=True)
class ProxySettings(PolicyConfig):
    """Every setting of ``retrywatch proxy``: the policy's knobs (inherited from
    :class:`~exporter.policy.PolicyConfig`) and the proxy's own. Each field made with ``knob`` is
    a command-line option and an environment variable (``foundation.knobs``); enum knobs also
    accept their string values."""

    upstream: str = knob(flag="upstream", help="Base URL of the engine (vLLM), e.g. http://127.0.0.1:8000.")
    host: str = knob(HttpBounds.host, flag="host", help="Address to listen on.")
    port: int = knob(8100, flag="port", help="Port to listen on.", minimum=1, maximum=65535)
    call_id_header: str = knob(
        DEFAULT_CALL_ID_HEADER,
        flag="call-id-header",
        help="Header carrying the call id (Idempotency-Key is honoured too).",
    )
    key_without_id: KeyWithoutId = knob(
        KeyWithoutId.BODY,
        flag="key-without-id",
        help=(
            "Key of an attempt without a call id: the hash of the caller's credentials and the body "
            "(only an evident retry attaches: the SDK retry counter says so, or an identical attempt "
            "left unanswered), or none (never coalesce)."
        ),
    )
    # --deadline auto: none stated, the learned one in force (exporter.deadlines), as without
    # --deadline; said out loud, it lets --deadline-check shed on the learned deadline
    deadline_auto: bool = False
    capacity: float | None = knob(
        None,
        flag="capacity",
        help="Engine capacity Ĉ in calls/s, for retrywatch_creation_capacity_ratio.",
        minimum=0,
        exclusive=True,
    )
    vocab_size: int | None = knob(
        None,
        flag="vocab-size",
        help="Refuse token-ID prompts with an ID outside [0, N) before they reach the engine.",
        minimum=1,
    )
    admin_token: str | None = knob(
        None, flag="admin-token", help="Bearer token required by GET /retrywatch/executions."
    )
    max_body_bytes: int = knob(
        8 * 1024 * 1024, flag="max-body-bytes", help="Request body limit (413).", minimum=1024
    )
    replay_limit_bytes: int = knob(
        4 * 1024 * 1024,
        flag="replay-limit-bytes",
        help=(
            "Replay buffer stored per execution; past it the execution takes no new subscribers, "
            "and a streaming client whose unread bytes take more than this is closed (not reading)."
        ),
        minimum=1024,
    )
    # NOTE: a non-streaming answer is held whole until its end (its length goes in the head the
    # client gets): past this, an endless or runaway answer from a broken upstream fails the
    # execution instead of growing the proxy's memory. A stream is relayed as it arrives.
    max_answer_bytes: int = knob(
        256 * 1024 * 1024,
        flag="max-answer-bytes",
        help=(
            "Limit on a non-streaming answer from the engine, held whole until its end; past it the "
            "execution fails (502 upstream_broken)."
        ),
        minimum=1024,
    )
    # NOTE: --max-answer-bytes bounds each answer, not all of them together: four answers of
    # 200 MB held at once took 1.36 GiB. Two answers of the largest size fit by default.
    answer_buffer_bytes: int = knob(
        512 * 1024 * 1024,
        flag="answer-buffer-bytes",
        help=(
            "Limit on the non-streaming answers held at once, all together (each until its clients "
            "have it); an answer that would take them past it fails (503 answer_buffer_full). At "
            "least --max-answer-bytes."
        ),
        minimum=1024,
    )
    window_s: float = knob(
        60.0, flag="window", help="Sliding window of the derived gauges, seconds.", minimum=0, exclusive=True
    )
    metrics_passthrough: bool = knob(
        True,
        flag="metrics-passthrough",
        help="Serve the upstream's /metrics families on the proxy's /metrics.",
    )
    upstream_metrics_timeout_s: float = knob(
        2.0,
        flag="metrics-timeout",
        help="Longest a scrape of /metrics waits for the upstream's /metrics, seconds.",
        minimum=0,
        exclusive=True,
    )
    upstream_metrics_max_staleness_s: float = knob(
        15.0,
        flag="metrics-max-staleness",
        help="Serve the last good upstream /metrics this long while a refresh is slow or failing.",
        minimum=0,
        exclusive=True,
    )
    upstream_connect_timeout_s: float = 5.0
    upstream_max_idle_s: float = knob(
        DEFAULT_MAX_IDLE_S,
        flag="upstream-max-idle",
        help=(
            "Seconds a kept-alive connection to the engine may stay idle and still be reused; keep it "
            "below the engine's own keep-alive timeout (5 s in vLLM)."
        ),
        minimum=0,
        exclusive=True,
    )
    passthrough_read_timeout_s: float = knob(
        60.0,
        flag="passthrough-read-timeout",
        help=(
            "Longest a GET or HEAD passed through (/health, /v1/models, ...) waits for the engine's next "
            "bytes, seconds; past it the client gets 504 (upstream_timeout). Not the generation routes "
            "nor a POST passed through: their clients' deadline decides."
        ),
        minimum=0,
        exclusive=True,
    )
    # The server's client-side bounds (foundation.bounds): request heads, slow or idle clients,
    # connections, the drain.
    max_head_bytes: int = knob(
        HttpBounds.max_head_bytes,
        flag="max-head-bytes",
        help="Request line and headers limit (431).",
        minimum=1024,
    )
    max_headers: int = knob(
        HttpBounds.max_headers, flag="max-headers", help="Header fields limit (431).", minimum=8
    )
    head_timeout_s: float = knob(
        HttpBounds.head_timeout_s,
        flag="head-timeout",
        help="Seconds from a request's first byte to the end of its head (408).",
        minimum=0,
        exclusive=True,
    )
    body_timeout_s: float = knob(
        HttpBounds.body_timeout_s,
        flag="body-timeout",
        help="Seconds from the end of a request's head to the end of its body (408).",
        minimum=0,
        exclusive=True,
    )
    keep_alive_s: float = knob(
        HttpBounds.keep_alive_s,
        flag="keep-alive-timeout",
        help="Seconds a client connection may stay open without starting a request.",
        minimum=0,
        exclusive=True,
    )
    send_timeout_s: float = knob(
        HttpBounds.send_timeout_s,
        flag="send-timeout",
        help="Seconds a client may take none of its answer's bytes (writes paused) before it is closed.",
        minimum=0,
        exclusive=True,
    )
    max_connections: int = knob(
        HttpBounds.max_connections,
        flag="max-connections",
        help="Client connections open at once; past it a new one gets 503 and is closed.",
        minimum=1,
    )
    reserved_connections: int = knob(
        HttpBounds.reserved_connections,
        flag="reserved-connections",
        help=(
            "Connections past --max-connections kept for GET and HEAD requests (/metrics, /health); "
            "past both a new one gets 503."
        ),
        minimum=0,
    )
    drain_timeout_s: float = knob(
        HttpBounds.drain_timeout_s,
        flag="drain-timeout",
        help="On SIGTERM, seconds requests in flight get to finish before they end with an error.",
        minimum=0,
    )
    passthrough: tuple[str, ...] = knob(
        (DEFAULT_ROUTES,),
        flag="passthrough",
        help=(
            "Paths forwarded to the engine (repeat; a /prefix/* pattern, '*' for all, 'none'); "
            f"'{DEFAULT_ROUTES}' is {' '.join(DEFAULT_FORWARDED)}. Others get 404."
        ),
    )

    record: str | None = knob(
        None,
        flag="record",
        help=(
            "Record the traffic to this directory: one JSON line per attempt (times, token counts, "
            "hashes; never text), a trace the replayer reads (docs/traces.md). Off unless given."
        ),
    )
    record_max_bytes: int = knob(
        1024 * 1024 * 1024,
        flag="record-max-bytes",
        help="The recording's files together at most this many bytes; the oldest are deleted.",
        minimum=1024 * 1024,
    )
    record_max_age_s: float = knob(
        8 * 86400.0,
        flag="record-max-age",
        help="The recording's files older than this many seconds are deleted.",
        minimum=0,
        exclusive=True,
    )

    def __post_init__(self) -> None:
        # Accept the flags' string values as well as the enums (frozen: set through object).
        for name, enum in (*_ENUMS.items(), ("key_without_id", KeyWithoutId)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                allowed = ", ".join(e.value for e in enum)
                raise SettingsError(f"--{name.replace('_', '-')} must be one of {allowed}") from None
        parts = urlsplit(self.upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SettingsError(
                f"--upstream must be an http(s) URL like http://127.0.0.1:8000, not {self.upstream!r}"
            )
        if ends_at_api_root(self.upstream):
            bare = without_api_root(self.upstream)
            raise SettingsError(
                f"--upstream is the engine's address without {OPENAI_API_ROOT} (the proxy forwards each "
                f"request's own /v1/... path): give {redact_url(bare)}, not {redact_url(self.upstream)}"
            )
        check_bounds(self, SettingsError)
        if self.answer_buffer_bytes < self.max_answer_bytes:
            raise SettingsError(
                "--answer-buffer-bytes must be at least --max-answer-bytes: an answer of the largest "
                "size must fit"
            )
        if not host_is_usable(self.host):
            raise SettingsError(f"--host: {EMPTY_HOST}")
        if self.deadline_auto and self.deadline_s is not None:
            raise SettingsError("--deadline is either a number of seconds or 'auto', not both")
        if self.deadline_check and self.deadline_s is None and not self.deadline_auto:
            raise SettingsError("--deadline-check needs --deadline S or --deadline auto")
        if self.admin_token is not None and not _visible_ascii(self.admin_token):
            # The token travels in an HTTP header (RFC 9110 field values are visible ASCII for
            # interoperability); another one could never be compared byte for byte with what a
            # client sends. The value is not echoed: it is a credential.
            raise SettingsError(
                "--admin-token must be one or more visible ASCII characters (no spaces, no control or "
                "non-ASCII characters): it is sent in an HTTP header"
            )
        if self.record is not None and not self.record.strip():
            raise SettingsError("--record must be a directory")
        if not self.call_id_header.strip():
            raise SettingsError("--call-id-header must be a header name")
        try:
            object.__setattr__(self, "passthrough", tuple(self.passthrough))
            self.forwarded_routes()
        except ValueError as exc:
            raise SettingsError(f"--passthrough: {exc}") from None
        self.policy_config()  # the policy validates its own knobs

    @classmethod
    def with_policy(cls, policy: PolicyConfig, **proxy: Any) -> ProxySettings:
        """Settings that run ``policy`` (every knob of it), with the proxy's own settings."""
        values = {f.name: getattr(policy, f.name) for f in fields(PolicyConfig)}
        return cls(**(values | proxy))

    def to_argv(self) -> list[str]:
        """The ``retrywatch proxy`` options that reproduce these settings (see ``foundation.knobs``)."""
        argv = to_argv(self)
        if self.deadline_auto:
            argv += ["--deadline", "auto"]
        elif self.deadline_s is not None:
            argv += ["--deadline", repr(float(self.deadline_s))]
        return argv

    def bounds(self) -> HttpBounds:
        """Where the proxy listens, and its server's client-side bounds."""
        return HttpBounds(**{f.name: getattr(self, f.name) for f in fields(HttpBounds)})

    @property
    def upstream_base(self) -> str:
        return self.upstream.rstrip("/")

    def forwarded_routes(self) -> ForwardedRoutes:
        """The paths passed through to the upstream (``--passthrough``)."""
        return ForwardedRoutes(self.passthrough)

    def policy_config(self) -> PolicyConfig:
        """The policy's own config from these settings.

        NOTE: the policy's config needs a deadline whenever the check is on. With --deadline
        auto there is none yet: the config gets a placeholder and the proxy clears it at once
        (``Policy.set_deadline(None)``) until a deadline has been learned; the check skips
        attempts while no deadline is known."""
        values = {f.name: getattr(self, f.name) for f in fields(PolicyConfig)}
        if self.deadline_auto and self.deadline_check:
            values["deadline_s"] = AUTO_DEADLINE_PLACEHOLDER_S
        return PolicyConfig(**values)
