"""The callback path's guards (``exporter.exchange``, ``exporter.execution``): a fault in the proxy
on a generation request answers an OpenAI-style error (or ends the stream), is logged, and leaves
the proxy serving and its counters balanced. The faults are injected into a real proxy served in
a thread (there is no input that makes the proxy fail: these are its bugs' paths)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from exporter.relay import Relay
from tests.exporter.support import RunningProxy, balance

StartProxy = Callable[..., RunningProxy]
BODY = {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 3}


def post(p: RunningProxy, **extra: Any) -> httpx.Response:
    body = {**BODY, **extra}
    return httpx.post(
        f"{p.url}/v1/completions", json=body, headers={"x-call-id": uuid.uuid4().hex}, timeout=10
    )


def settled(p: RunningProxy) -> None:
    deadline = time.monotonic() + 5
    while p.metrics()[("retrywatch_subscribers", ())] != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    balance(p.metrics())


def test_a_fault_deciding_an_attempt_answers_a_json_500_and_is_logged(
    start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    p = start_proxy()
    attempt = p.proxy.attempt

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    p.proxy.attempt = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="retrywatch.exchange"):
        r = post(p)
    assert r.status_code == 500 and r.json()["error"]["code"] == "proxy_error"
    assert any("generation request failed" in rec.message for rec in caplog.records)
    p.proxy.attempt = attempt  # type: ignore[method-assign]
    assert post(p).status_code == 200  # the proxy goes on serving
    settled(p)


@pytest.mark.parametrize("stream", [False, True])
def test_a_fault_relaying_an_execution_fails_it_with_a_502_its_client_reads(
    start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    p = start_proxy()
    # The first step of relaying that runs before anything reaches the client: a stream's first
    # event inspected for the engine's refusal, a body's first chunk accounted.
    step = "first_event_is_error" if stream else "_first_token"
    original = getattr(p.proxy, step)

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    setattr(p.proxy, step, broken)
    with caplog.at_level(logging.ERROR, logger="retrywatch.proxy"):
        r = post(p, stream=stream)
    assert r.status_code == 502 and r.json()["error"]["code"] == "proxy_error"
    assert any("failed in the proxy" in rec.message for rec in caplog.records)
    setattr(p.proxy, step, original)
    assert post(p, stream=stream).status_code == 200
    settled(p)


def test_a_fault_after_a_streams_first_token_was_written_ends_it_with_an_error_event(
    start_proxy: StartProxy, caplog: pytest.LogCaptureFixture
) -> None:
    # The first token is written to the client before it is accounted (off the time to first
    # token): a fault in the accounting ends the stream already begun with an SSE error event.
    p = start_proxy()
    first_token = p.proxy._first_token

    def broken(relay: Relay) -> None:
        raise RuntimeError("injected")

    p.proxy._first_token = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="retrywatch.proxy"):
        r = post(p, stream=True)
    assert r.status_code == 200
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith("{") and '"error"' not in events[0]  # the first token got through
    assert '"proxy_error"' in events[-2] and events[-1] == "[DONE]"
    assert any("failed in the proxy" in rec.message for rec in caplog.records)
    p.proxy._first_token = first_token  # type: ignore[method-assign]
    assert post(p, stream=True).status_code == 200
    settled(p)
