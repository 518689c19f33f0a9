"""The proxy's configuration: one dataclass holding every flag of ``retrywatch proxy``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from exporter.callkey import DEFAULT_CALL_ID_HEADER, KeyWithoutId
from exporter.policy import BudgetOrder, Cancellation, PolicyConfig, QueueOrder
from exporter.routes import DEFAULT_ROUTES, ForwardedRoutes
from exporter.upstream import DEFAULT_MAX_IDLE_S


class SettingsError(ValueError):
    """A proxy setting is unusable; the message names the flag and what it accepts."""


DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
AUTO_DEADLINE_PLACEHOLDER_S = 1e9
# The server's client-side bounds (exporter.server): request heads, slow or idle clients, connections.
DEFAULT_MAX_HEAD_BYTES = 64 * 1024  # request line and headers
DEFAULT_MAX_HEADERS = 100  # header fields in one request
DEFAULT_HEAD_TIMEOUT_S = 10.0  # from a request's first byte to the end of its head
DEFAULT_BODY_TIMEOUT_S = 30.0  # from the end of the head to the end of the body
# Idle keep-alive connections: longer than the idle timeout of the usual load balancers (60 s),
# so that they, not the proxy, close a kept-alive connection (no request races a close).
DEFAULT_KEEP_ALIVE_S = 75.0
DEFAULT_MAX_CONNECTIONS = 10_000  # client connections open at once (as many as --max-queued)
# On SIGTERM, requests in flight get this long to finish; inside Kubernetes' default 30-s grace.
DEFAULT_DRAIN_TIMEOUT_S = 25.0


@dataclass(frozen=True)
class ProxySettings:
    upstream: str
    host: str = "127.0.0.1"
    port: int = 8100
    # policy
    cancellation: Cancellation = Cancellation.DEFERRED
    cancel_after_s: float = 10.0
    coalesce: bool = True
    call_id_header: str = DEFAULT_CALL_ID_HEADER
    key_without_id: KeyWithoutId = KeyWithoutId.BODY
    retry_budget: float | None = None
    budget_window_s: float = 60.0
    budget_order: BudgetOrder = BudgetOrder.LOOKUP_FIRST
    max_outstanding: int | None = None
    max_queued: int = 10_000
    queue_order: QueueOrder = QueueOrder.FIFO
    lifo_threshold: int = 50
    deadline_check: bool = False
    deadline_s: float | None = None  # fixed client deadline
    deadline_auto: bool = False  # infer the deadline from attempts that ended in a disconnect
    max_live_executions: int = 20_000
    # the proxy itself
    capacity: float | None = None  # Ĉ in calls/s
    vocab_size: int | None = None
    admin_token: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    replay_limit_bytes: int = 4 * 1024 * 1024  # stored (compressed) replay per execution
    window_s: float = 60.0  # sliding window of the derived gauges
    metrics_passthrough: bool = True
    upstream_metrics_timeout_s: float = 2.0  # longest a scrape of the proxy waits for the upstream's
    upstream_metrics_max_staleness_s: float = 15.0  # last good upstream scrape served this long
    upstream_connect_timeout_s: float = 5.0
    # a kept-alive upstream connection idle longer than this is not reused (both upstream clients)
    upstream_max_idle_s: float = DEFAULT_MAX_IDLE_S
    # the server (exporter.server) and the routes it forwards (exporter.routes)
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    passthrough: tuple[str, ...] = (DEFAULT_ROUTES,)

    def __post_init__(self) -> None:
        # Accept the flags' string values as well as the enums (frozen: set through object).
        for name, enum in (
            ("cancellation", Cancellation),
            ("budget_order", BudgetOrder),
            ("queue_order", QueueOrder),
            ("key_without_id", KeyWithoutId),
        ):
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
        if not (0 <= self.port < 65536):
            raise SettingsError("--port must be in [0, 65535]")
        if self.capacity is not None and not (0 < self.capacity < math.inf):
            raise SettingsError("--capacity must be a positive number of calls per second")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise SettingsError("--vocab-size must be >= 1")
        if self.max_body_bytes < 1024:
            raise SettingsError("--max-body-bytes must be >= 1024")
        if self.replay_limit_bytes < 1024:
            raise SettingsError("--replay-limit-bytes must be >= 1024")
        if self.window_s <= 0:
            raise SettingsError("--window must be > 0 seconds")
        if not (0 < self.upstream_metrics_timeout_s < math.inf):
            raise SettingsError("--metrics-timeout must be a positive number of seconds")
        if not (0 < self.upstream_metrics_max_staleness_s < math.inf):
            raise SettingsError("--metrics-max-staleness must be a positive number of seconds")
        if not (0 < self.upstream_max_idle_s < math.inf):
            raise SettingsError("--upstream-max-idle must be a positive number of seconds")
        if self.deadline_auto and self.deadline_s is not None:
            raise SettingsError("--deadline is either a number of seconds or 'auto', not both")
        if self.deadline_check and self.deadline_s is None and not self.deadline_auto:
            raise SettingsError("--deadline-check needs --deadline S or --deadline auto")
        if not self.call_id_header.strip():
            raise SettingsError("--call-id-header must be a header name")
        if self.max_head_bytes < 1024:
            raise SettingsError("--max-head-bytes must be >= 1024")
        if self.max_headers < 8:
            raise SettingsError("--max-headers must be >= 8")
        for flag, seconds in (
            ("--head-timeout", self.head_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--keep-alive-timeout", self.keep_alive_s),
        ):
            if not (0 < seconds < math.inf):
                raise SettingsError(f"{flag} must be a positive number of seconds")
        if self.max_connections < 1:
            raise SettingsError("--max-connections must be >= 1")
        if not (0 <= self.drain_timeout_s < math.inf):
            raise SettingsError("--drain-timeout must be a number of seconds >= 0")
        try:
            object.__setattr__(self, "passthrough", tuple(self.passthrough))
            self.forwarded_routes()
        except ValueError as exc:
            raise SettingsError(f"--passthrough: {exc}") from None
        self.policy_config()  # the policy validates its own knobs

    @property
    def upstream_base(self) -> str:
        return self.upstream.rstrip("/")

    def forwarded_routes(self) -> ForwardedRoutes:
        """The paths passed through to the upstream (``--passthrough``)."""
        return ForwardedRoutes(self.passthrough)

    def policy_config(self) -> PolicyConfig:
        # NOTE: the policy's config needs a deadline whenever the check is on. With --deadline
        # auto there is none yet: the config gets a placeholder and the proxy clears it at once
        # (``Policy.set_deadline(None)``) until a deadline has been inferred; the check skips
        # attempts while no deadline is known.
        deadline = self.deadline_s
        if self.deadline_auto and self.deadline_check:
            deadline = AUTO_DEADLINE_PLACEHOLDER_S
        return PolicyConfig(
            coalesce=self.coalesce,
            cancellation=self.cancellation,
            cancel_after_s=self.cancel_after_s,
            retry_budget=self.retry_budget,
            budget_window_s=self.budget_window_s,
            budget_order=self.budget_order,
            max_outstanding=self.max_outstanding,
            max_queued=self.max_queued,
            queue_order=self.queue_order,
            lifo_threshold=self.lifo_threshold,
            deadline_check=self.deadline_check,
            deadline_s=deadline,
            max_live_executions=self.max_live_executions,
        )
