"""What ``foundation/server.py`` relies on inside uvicorn, pinned: ``BoundedProtocol`` subclasses
uvicorn's httptools protocol (its parser callbacks, its request cycle, attributes its ``__init__``
sets) and ``DrainingServer`` its server. None of that is uvicorn's public API, so
``pyproject.toml`` bounds uvicorn's version to the minor versions checked, and these tests fail
loudly, saying what changed, when an installed uvicorn no longer has what the subclasses use. The
behaviour itself is held by the black-box tests of ``test_server.py``."""

from __future__ import annotations

import asyncio
import inspect
import re
import tomllib
from importlib import metadata
from pathlib import Path

import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

ROOT = Path(__file__).resolve().parents[2]
VERSION = metadata.version("uvicorn")
WHAT_TO_DO = (
    f"uvicorn {VERSION}: {{}}. foundation/server.py (BoundedProtocol, DrainingServer) relies on it: "
    "check them against this uvicorn's protocols/http/httptools_impl.py and server.py, then move "
    "the bound on uvicorn in pyproject.toml"
)

# Methods of uvicorn's protocol the subclass overrides or calls, with their parameters.
PROTOCOL_METHODS = {
    "__init__": ["self", "config", "server_state", "app_state", "_loop"],
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_header": ["self", "name", "value"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
    "shutdown": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
    "_unset_keepalive_if_required": ["self"],
}
# Attributes its __init__ sets that the subclass reads (or copies into its per-server template).
PROTOCOL_ATTRIBUTES = [
    "config",
    "app",
    "loop",
    "logger",
    "access_logger",
    "access_log",
    "parser",
    "root_path",
    "asgi_version",
    "limit_concurrency",
    "app_state",
    "timeout_keep_alive_task",
    "timeout_keep_alive",
    "server_state",
    "connections",
    "tasks",
    "transport",
    "flow",
    "scheme",
    "pipeline",
    "scope",
    "headers",
    "expect_100_continue",
    "cycle",
]
# Set on a request cycle, read or replaced by the subclass (``send_500_response``) and the proxy.
CYCLE_ATTRIBUTES = [
    "scope",
    "transport",
    "flow",
    "message_event",
    "disconnected",
    "response_started",
    "response_complete",
    "keep_alive",
]
CYCLE_METHODS = {"send_500_response": ["self"], "send": ["self", "message"], "receive": ["self"]}
SERVER_METHODS = {
    "__init__": ["self", "config"],
    "startup": ["self", "sockets"],
    "shutdown": ["self", "sockets"],
    "capture_signals": ["self"],
    "handle_exit": ["self", "sig", "frame"],
    "run": ["self", "sockets"],
}
# Set by uvicorn's server (in __init__, or in startup for ``servers`` and ``lifespan``).
SERVER_ATTRIBUTES = ("server_state", "started", "should_exit", "force_exit")
SERVER_SET_LATER = ("servers", "lifespan")


def _params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_installed_uvicorn_is_within_the_verified_range() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [Requirement(d) for d in dependencies if Requirement(d).name == "uvicorn"]
    assert any(s.operator == "<" for s in pin.specifier), (
        "pyproject.toml must bound uvicorn from above: foundation/server.py subclasses its internals"
    )
    assert pin.specifier.contains(Version(VERSION)), WHAT_TO_DO.format(
        f"installed, outside the verified range {pin.specifier}"
    )


def test_the_protocol_methods_the_subclass_relies_on_keep_their_signatures() -> None:
    for name, params in PROTOCOL_METHODS.items():
        method = getattr(HttpToolsProtocol, name, None)
        assert method is not None, WHAT_TO_DO.format(f"HttpToolsProtocol.{name} is gone")
        assert _params(method) == params, WHAT_TO_DO.format(
            f"HttpToolsProtocol.{name} takes {_params(method)}, not {params}"
        )


def test_the_protocol_attributes_the_subclass_reads_are_set_by_its_init() -> None:
    config = uvicorn.Config(app=lambda scope, receive, send: None, http="httptools", log_config=None)
    loop = asyncio.new_event_loop()
    try:
        protocol = HttpToolsProtocol(config, ServerState(), {}, loop)
    finally:
        loop.close()
    missing = [a for a in PROTOCOL_ATTRIBUTES if not hasattr(protocol, a)]
    assert not missing, WHAT_TO_DO.format(f"HttpToolsProtocol() no longer sets {missing}")


def test_the_request_cycle_keeps_what_the_server_and_the_proxy_use() -> None:
    init = _params(RequestResponseCycle.__init__)
    cycle = RequestResponseCycle(**{p: None for p in init[1:]})  # type: ignore[arg-type]
    missing = [a for a in CYCLE_ATTRIBUTES if not hasattr(cycle, a)]
    assert not missing, WHAT_TO_DO.format(f"RequestResponseCycle() no longer sets {missing}")
    for name, params in CYCLE_METHODS.items():
        method = getattr(RequestResponseCycle, name, None)
        assert method is not None and _params(method) == params, WHAT_TO_DO.format(
            f"RequestResponseCycle.{name} changed"
        )
    # run_asgi sends its 500 through the attribute the server replaces with a JSON one.
    assert "self.send_500_response()" in inspect.getsource(RequestResponseCycle.run_asgi), WHAT_TO_DO.format(
        "RequestResponseCycle.run_asgi no longer answers a failed app with send_500_response"
    )
    # A disconnect wakes a receive() waiting on the cycle's event (the pass-through's watcher).
    assert "message_event" in inspect.getsource(RequestResponseCycle.receive), WHAT_TO_DO.format(
        "RequestResponseCycle.receive no longer waits on message_event"
    )


def test_the_server_keeps_what_the_drained_shutdown_uses() -> None:
    for name, params in SERVER_METHODS.items():
        method = getattr(uvicorn.Server, name, None)
        assert method is not None and _params(method) == params, WHAT_TO_DO.format(
            f"uvicorn.Server.{name} changed: {method and _params(method)}, not {params}"
        )
    server = uvicorn.Server(uvicorn.Config(app=lambda scope, receive, send: None, log_config=None))
    missing = [a for a in SERVER_ATTRIBUTES if not hasattr(server, a)]
    assert not missing, WHAT_TO_DO.format(f"uvicorn.Server() no longer sets {missing}")
    source = inspect.getsource(uvicorn.Server)
    for attribute in SERVER_SET_LATER:
        assert re.search(rf"self\.{attribute}\b[^=\n]*=", source), WHAT_TO_DO.format(
            f"uvicorn.Server no longer sets self.{attribute}"
        )
    assert {"connections", "tasks", "default_headers"} <= set(vars(ServerState())), WHAT_TO_DO.format(
        "ServerState changed"
    )


def test_the_helpers_the_subclass_imports_are_there() -> None:
    assert _params(flow_control.FlowControl) == ["transport"], WHAT_TO_DO.format("FlowControl changed")
    for method in ("drain", "pause_reading", "resume_reading"):
        assert hasattr(flow_control.FlowControl, method), WHAT_TO_DO.format(f"FlowControl.{method} is gone")
    assert "self.write_paused" in inspect.getsource(flow_control.FlowControl), WHAT_TO_DO.format(
        "FlowControl.write_paused is gone"
    )
    from uvicorn.protocols import utils

    for helper in ("get_local_addr", "get_remote_addr"):
        assert _params(getattr(utils, helper)) == ["transport"], WHAT_TO_DO.format(f"{helper} changed")
    assert httptools_impl.HttpToolsProtocol is HttpToolsProtocol
