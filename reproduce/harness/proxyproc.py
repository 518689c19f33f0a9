"""``retrywatch proxy`` started as a subprocess with a condition's flags, in front of an engine.

The settings are the condition's policy (``ProxyPolicy.config`` of the run's plan: durations in
the run's seconds) plus what the proxy needs to know about the run: Ĉ for its derived gauges
and the engine's vocabulary size for its token-ID guard (the clients' deadline is the policy's).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exporter.policy import Cancellation, PolicyConfig
from exporter.settings import ProxySettings
from reproduce.harness.childserver import ChildServer, retrywatch_argv

__all__ = ["NO_CONTROL", "ProxyProcess"]

#: The proxy a calibration measures Ĉ through: it counts, and controls nothing.
NO_CONTROL = PolicyConfig(coalesce=False, cancellation=Cancellation.OFF)


class ProxyProcess(ChildServer):
    """The proxy as a child process of this Python: ``start()`` returns its base URL.

    Its command line is ``ProxySettings.to_argv`` of the policy (every knob) with the run's own
    settings, so every knob of the policy reaches the process."""

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
        own: dict[str, object] = {"capacity": capacity, "vocab_size": vocab_size}
        if window_s is not None:
            own["window_s"] = window_s
        self.settings = ProxySettings.with_policy(policy, upstream=upstream, host=host, **own)

    def command(self, port: int) -> list[str]:
        return retrywatch_argv("proxy", *replace(self.settings, port=port).to_argv())

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
