"""The client-side bounds of retrywatch's HTTP servers (``foundation.server``): where a server
listens, and how large a request head, how slow a client (sending, or taking its answer), how many
connections (and how many more for GET and HEAD requests only) and how long a drained shutdown it
allows.

``retrywatch proxy`` makes each bound a flag (``exporter.settings``, whose defaults are these);
the detector's API, the emulated engine and the dashboard serve with the defaults (each with a
connection cap of its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

#: Why an empty ``--host`` is refused by every serving command.
EMPTY_HOST = "an empty host would listen on every interface: give an address (0.0.0.0 for every one)"


def host_is_usable(host: str) -> bool:
    """Whether ``host`` names where to listen: an empty one listens on every interface, and
    makes the URLs a server announces unusable."""
    return bool(host.strip())


#: The OpenAI API's root path: a client's base URL ends in it, a server's address does not.
OPENAI_API_ROOT = "/v1"


def ends_at_api_root(url: str) -> bool:
    """Whether ``url`` is an OpenAI client's base URL (``http://HOST:PORT/v1``): the habit of
    every OpenAI SDK, and a trap where retrywatch wants the server's address, since the
    requests' own paths (``/v1/chat/completions``, ``/metrics``) would be appended to it."""
    return urlsplit(url).path.rstrip("/").endswith(OPENAI_API_ROOT)


def without_api_root(url: str) -> str:
    """The server's address in ``url``, a base URL that ``ends_at_api_root``: its path without
    the API root, and without a query or fragment (what a refusal tells to give instead)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/").removesuffix(OPENAI_API_ROOT)
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def base_url(host: str, port: int) -> str:
    """The URL of a server listening on ``host``:``port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class HttpBounds:
    """Where to listen and the bounds, each with its default."""

    host: str = "127.0.0.1"
    port: int
    max_head_bytes: int = 64 * 1024  # request line and header fields (431)
    max_headers: int = 100  # header fields (431)
    head_timeout_s: float = 10.0  # from a request's first byte to the end of its head (408)
    body_timeout_s: float = 30.0  # from the end of a request's head to the end of its body (408)
    # NOTE: longer than the idle timeout of the usual load balancers (60 s), so that they, not
    # the server, close a kept-alive connection (no request races a close).
    keep_alive_s: float = 75.0
    # A connection whose writes stay paused this long (the client takes none of its answer's
    # bytes) is closed, as nginx's send_timeout does (its default, 60 s).
    send_timeout_s: float = 60.0
    max_connections: int = 10_000  # past it a new one gets 503 (as many as the proxy's --max-queued)
    # NOTE: connections past ``max_connections`` kept for GET and HEAD requests (a scrape of
    # /metrics, a readiness probe of /health): at the cap, in the very overload the metrics exist
    # to show, they went missing and the pod went unready. Fixed and small; past it a new
    # connection gets 503.
    reserved_connections: int = 32
    drain_timeout_s: float = 25.0  # inside Kubernetes' default 30-s grace period

    @property
    def connection_limit(self) -> int:
        """Every connection a server holds at once: the cap and the reserve above it."""
        return self.max_connections + self.reserved_connections


# Largest /metrics answer read (the proxy's ``UpstreamPool.get_text``), as the detector reads one: a real
# engine's is a few hundred KiB; past it the fetch fails as an unreachable endpoint's would.
MAX_METRICS_BYTES = 16 * 1024 * 1024
