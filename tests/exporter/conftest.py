"""Fixtures for the proxy's tests: a real test upstream process on loopback, and proxies served by
the proxy's own server (``foundation.server``) on free loopback ports in a thread of the test
process. Tests of the server itself (``test_server.py``) run ``retrywatch proxy`` processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from exporter.exchange import ProxyTakeOver
from exporter.proxy import Proxy
from exporter.settings import ProxySettings
from foundation.processes import free_port
from foundation.server import DrainingServer, ServerConfig
from tests.exporter.support import RunningProxy, Upstream, start_upstream


@pytest.fixture(scope="session")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    with start_upstream(tmp_path_factory.mktemp("upstream")) as running:
        yield running


@pytest.fixture
def start_proxy(upstream: Upstream) -> Iterator[Callable[..., RunningProxy]]:
    """Start a proxy (in a thread, on a free port) with the given settings."""
    servers: list[tuple[DrainingServer, threading.Thread]] = []

    def start(upstream_url: str | None = None, **kwargs: Any) -> RunningProxy:
        port = free_port()
        kwargs.setdefault("drain_timeout_s", 0.5)  # at teardown, streams left open end at once
        settings = ProxySettings(upstream=upstream_url or upstream.url, port=port, **kwargs)
        proxy = Proxy(settings)
        config = ServerConfig(
            proxy.app,
            settings.bounds(),
            proxy.end_executions,
            takeover=ProxyTakeOver(proxy),
            log_level="warning",
            loop="asyncio",
        )
        server = DrainingServer(config)  # in a thread, it leaves signals alone
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("proxy did not start")
            time.sleep(0.01)
        servers.append((server, thread))
        return RunningProxy(f"http://127.0.0.1:{port}", proxy)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
