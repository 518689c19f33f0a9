"""Which paths the proxy passes through to the engine (``--passthrough``).

The proxy answers its own routes itself (the two generation routes, ``/metrics`` and everything
under ``/retrywatch/``) and forwards only the paths allowed here; any other path gets a 404 from
the proxy and never reaches the engine. By default it forwards what an OpenAI client or a health
checker needs, and none of vLLM's admin and control routes (cache resets, sleep and wake-up,
``/collective_rpc``, profiling, LoRA loading, elastic scaling, pause and weight updates, ...):
those change the engine's state for every client, and a proxy that sits in front of an engine
must not hand them to whoever can reach it.

A pattern is a path (``/v1/models``), a path prefix (``/v1/responses/*`` matches every path
under ``/v1/responses/``), ``default`` (the set below), ``*`` (every path the proxy does not
own: forward everything, as a plain reverse proxy would) or ``none`` (forward nothing).
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_ROUTES = "default"
EVERY_ROUTE = "*"
NO_ROUTE = "none"
OWNED_PREFIX = "/retrywatch/"  # the proxy's own namespace: never forwarded

# vLLM 0.32's routes that are forwarded by default.
DEFAULT_FORWARDED = (
    # read-only: what a health checker, a load balancer or a client's start-up check asks
    "/health",
    "/ping",
    "/version",
    "/load",
    "/v1/models",
    "/v1/models/*",
    # the rest of the OpenAI-compatible API (the proxy handles the two generation routes)
    "/v1/embeddings",
    "/v1/responses",
    "/v1/responses/*",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    # stateless token helpers
    "/tokenize",
    "/detokenize",
)


class ForwardedRoutes:
    """A set of forwarding patterns, checked once; ``forwards(path)`` answers per request."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.prefixes: list[str] = []
        self.everything = False
        given = list(patterns)
        if NO_ROUTE in given and len(given) > 1:
            raise ValueError(f"'{NO_ROUTE}' forwards nothing and cannot be combined with other patterns")
        for pattern in given:
            if pattern == NO_ROUTE:
                continue
            if pattern == DEFAULT_ROUTES:
                for default in DEFAULT_FORWARDED:
                    self._add(default)
            elif pattern == EVERY_ROUTE:
                self.everything = True
            else:
                self._add(pattern)

    def _add(self, pattern: str) -> None:
        if not pattern.startswith("/") or not pattern.isprintable() or " " in pattern:
            raise ValueError(
                f"{pattern!r} is not a path like /v1/models, a prefix like /v1/responses/*, "
                f"'{DEFAULT_ROUTES}', '{EVERY_ROUTE}' or '{NO_ROUTE}'"
            )
        segments = pattern.split("/")
        if "*" in pattern[:-1] or (pattern.endswith("*") and not pattern.endswith("/*")):
            raise ValueError(f"{pattern!r}: '*' stands only for a last path segment, as in /v1/responses/*")
        if any(s in (".", "..") for s in segments):
            raise ValueError(f"{pattern!r}: a pattern has no '.' or '..' segments")
        if pattern.endswith("/*"):
            self.prefixes.append(pattern[:-1])
        else:
            self.exact.add(pattern)

    def forwards(self, path: str) -> bool:
        """Whether a request for ``path`` (decoded, as the server gives it) goes to the upstream."""
        if path.startswith(OWNED_PREFIX):
            return False
        if self.everything or path in self.exact:
            return True
        return any(path.startswith(p) and len(path) > len(p) for p in self.prefixes)
