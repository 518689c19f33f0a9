"""``retrywatch proxy`` started as a subprocess with a condition's flags, in front of an engine.

The flags come from the condition's policy (``Condition.policy_config``, durations already
divided by the time scale) plus what the proxy needs to know about the run: Ĉ for its derived
gauges, the clients' deadline, and the engine's vocabulary size for its token-ID guard.
"""

from __future__ import annotations

from pathlib import Path

from exporter.policy import PolicyConfig
from reproduce.httpdriver.childserver import ChildServer, retrywatch_argv

__all__ = ["ProxyProcess", "proxy_args"]


def proxy_args(
    policy: PolicyConfig,
    *,
    upstream: str,
    port: int,
    host: str = "127.0.0.1",
    capacity: float | None = None,
    vocab_size: int | None = None,
    window_s: float | None = None,
) -> list[str]:
    """The ``retrywatch proxy`` arguments that reproduce ``policy`` in front of ``upstream``."""
    args = [
        "--upstream",
        upstream,
        "--host",
        host,
        "--port",
        str(port),
        "--cancellation",
        policy.cancellation.value,
        "--cancel-after",
        f"{policy.cancel_after_s:g}",
        "--coalesce" if policy.coalesce else "--no-coalesce",
        "--budget-window",
        f"{policy.budget_window_s:g}",
        "--budget-order",
        policy.budget_order.value,
        "--queue-order",
        policy.queue_order.value,
        "--lifo-threshold",
        str(policy.lifo_threshold),
        "--max-queued",
        str(policy.max_queued),
    ]
    if policy.retry_budget is not None:
        args += ["--retry-budget", f"{policy.retry_budget:g}"]
    if policy.max_outstanding is not None:
        args += ["--max-outstanding", str(policy.max_outstanding)]
    if policy.deadline_s is not None:
        args += ["--deadline", f"{policy.deadline_s:g}"]
    if policy.deadline_check:
        args.append("--deadline-check")
    if capacity is not None:
        args += ["--capacity", f"{capacity:g}"]
    if vocab_size is not None:
        args += ["--vocab-size", str(vocab_size)]
    if window_s is not None:
        args += ["--window", f"{window_s:g}"]
    return args


class ProxyProcess(ChildServer):
    """The proxy as a child process of this Python: ``start()`` returns its base URL."""

    name = "proxy"
    ready_path = "/metrics"

    def __init__(
        self,
        policy: PolicyConfig,
        *,
        upstream: str,
        workdir: Path,
        capacity: float | None = None,
        vocab_size: int | None = None,
        window_s: float | None = None,
        host: str = "127.0.0.1",
        bound_s: float = 3_600.0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(workdir=workdir, host=host, bound_s=bound_s, startup_timeout_s=startup_timeout_s)
        self.policy = policy
        self.upstream = upstream
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.window_s = window_s

    def command(self, port: int) -> list[str]:
        args = proxy_args(
            self.policy,
            upstream=self.upstream,
            port=port,
            host=self.host,
            capacity=self.capacity,
            vocab_size=self.vocab_size,
            window_s=self.window_s,
        )
        return retrywatch_argv("proxy", *args)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
