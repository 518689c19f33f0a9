"""The proxy against a misbehaving upstream (``tests.exporter.badupstream``, a real process), each
test against a real ``retrywatch proxy`` process: answers framed past their end, response heads
and trailers without end, too many whole answers held at once, repeated response fields.

Every answer is checked against the request it belongs to: the misbehaving upstream names each
answer after its request's call id (``cmpl-first-CALL``; the answer nobody asked for
``cmpl-second-CALL``)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exporter.upstream import UpstreamPool
from tests.exporter.badupstream import completion, events
from tests.exporter.support import (
    BadUpstream,
    ProxyProcess,
    Samples,
    balance,
    errors_logged,
    proxy_process,
    scrape,
    start_bad_upstream,
    until,
)

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BadUpstream]:
    with start_bad_upstream(tmp_path_factory.mktemp("bad")) as running:
        yield running


@pytest.fixture
def proxy(bad: BadUpstream, tmp_path: Path) -> Iterator[Callable[..., ProxyProcess]]:
    """Start ``retrywatch proxy`` processes in front of the misbehaving upstream (at most a few);
    none may log a traceback."""
    logs: list[Path] = []
    stack: list[Any] = []

    def start(*args: str, upstream: BadUpstream | None = None) -> ProxyProcess:
        log = tmp_path / f"proxy-{len(logs)}.log"
        logs.append(log)
        cm = proxy_process((upstream or bad).url, *args, log=log)
        stack.append(cm)
        return cm.__enter__()

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
    for log in logs:
        assert not errors_logged(log), log.read_text()[-3000:]


def _body(stream: bool = False) -> dict[str, Any]:
    return {"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream}


def _post(p: ProxyProcess, mode: str, stream: bool = False, **headers: str) -> tuple[str, httpx.Response]:
    call = uuid.uuid4().hex
    sent = {"x-call-id": call, "x-bad": mode, **{k.replace("_", "-"): v for k, v in headers.items()}}
    r = httpx.post(f"{p.url}/v1/completions", json=_body(stream), headers=sent, timeout=30)
    return call, r


def _fate(m: Samples, fate: str) -> float:
    return m[("retrywatch_executions_finished_total", (("fate", fate),))]


def _faults(m: Samples, kind: str) -> float:
    return m[("retrywatch_upstream_faults_total", (("kind", kind),))]


def _own_answers_follow(p: ProxyProcess, rounds: int = 2) -> int:
    """Later well-behaved calls, streaming and not, each get their own answer (a connection that
    carried stray bytes was not reused). Returns how many were made."""
    for _ in range(rounds):
        for stream in (False, True):
            call, r = _post(p, "normal", stream)
            assert r.status_code == 200, r.text
            expected = events(f"first-{call}") if stream else completion(f"first-{call}")
            assert r.content == expected
    return 2 * rounds


# --- framing: nothing past the end of an answer reaches its client ---------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("mode", ["two-responses", "two-responses-later"], ids=["same-read", "later"])
def test_bytes_past_the_end_of_an_answer_never_reach_its_client(
    proxy: Callable[..., ProxyProcess], mode: str, stream: bool
) -> None:
    """An upstream that wrote a second response right after the first, in the same write, had
    the second body handed to the first's execution: a non-streaming client got
    ``{..}{..}`` (not JSON), a streaming one the other response's events after ``[DONE]``, and
    the execution counted completed. Now a complete answer takes nothing more from the read; the
    stray bytes close the connection (as nginx's "upstream sent more data than specified") and
    are counted."""
    p = proxy()
    call, r = _post(p, mode, stream)
    assert r.status_code == 200, r.text
    assert r.content == (events(f"first-{call}") if stream else completion(f"first-{call}"))
    assert until(lambda: _faults(scrape(p.url), "stray_bytes") == 1)
    time.sleep(0.2)  # the stray answer of the later mode has come (50 ms) before the next calls
    n = _own_answers_follow(p)
    m = scrape(p.url)
    balance(m)
    assert _fate(m, "completed") == 1 + n and _fate(m, "failed") == 0
    assert _faults(m, "stray_bytes") == 1


def test_a_second_response_on_a_passed_through_route_is_not_relayed(
    proxy: Callable[..., ProxyProcess],
) -> None:
    p = proxy()
    for _ in range(2):
        call = uuid.uuid4().hex
        r = httpx.get(f"{p.url}/v1/models", headers={"x-call-id": call, "x-bad": "two-responses"}, timeout=10)
        assert r.status_code == 200 and r.content == completion(f"first-{call}")
    balance(scrape(p.url))


# --- response heads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("mode", "size"),
    [("huge-head", 32 * MIB), ("endless-header-line", 32 * MIB), ("many-fields", 1000)],
)
def test_a_response_head_over_the_bound_is_a_502_and_its_connection_is_closed(
    proxy: Callable[..., ProxyProcess], bad: BadUpstream, mode: str, size: int, stream: bool
) -> None:
    """A response head was read however large: 400 MB of header lines took the proxy from 44 to
    432 MiB of RSS for one execution. Past 64 KiB or 100 fields (nginx answers "upstream sent too
    big header" past a few KiB) the execution fails with a 502 its client can read, the
    connection is closed, and the counters stay balanced."""
    p = proxy()
    _own_answers_follow(p, rounds=1)
    rss_before = p.peak_rss_kib()
    call, r = _post(p, mode, stream, x_bad_size=str(size))
    assert r.status_code == 502 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_broken" and "head" in error["message"], error
    if size > MIB:  # far more than the sockets' buffers hold: the proxy stopped reading
        assert until(lambda: [rec["cut_short"] for rec in bad.log() if rec["call_id"] == call] == [True])
    assert p.peak_rss_kib() - rss_before < 8 * 1024
    n = _own_answers_follow(p, rounds=1)
    m = scrape(p.url)
    balance(m)
    assert _fate(m, "failed") == 1 and _fate(m, "completed") == 2 + n
    assert _faults(m, "head_too_large") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_trailer_fields_without_end_are_bounded_as_a_head(
    proxy: Callable[..., ProxyProcess], bad: BadUpstream, stream: bool
) -> None:
    """The trailer fields of a chunked answer were read however many: a whole answer waited for
    them and the proxy's memory grew. Past the head's bound the connection is closed; a stream
    already whole at ``[DONE]`` stays delivered, a JSON answer (whole only at its end) fails."""
    p = proxy()
    call, r = _post(p, "huge-trailer", stream, x_bad_size=str(32 * MIB))
    if stream:
        assert r.status_code == 200 and r.content == events(f"first-{call}")
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken", r.text
    assert until(lambda: [rec["cut_short"] for rec in bad.log() if rec["call_id"] == call] == [True])
    m = scrape(p.url)
    balance(m)
    assert _fate(m, "completed" if stream else "failed") == 1
    assert _faults(m, "head_too_large") == 1


@pytest.mark.parametrize(("mode", "size"), [("many-fields", 1000), ("huge-head", 32 * MIB)])
def test_a_passed_through_answer_with_a_head_over_the_bound_is_a_502(
    proxy: Callable[..., ProxyProcess], mode: str, size: int
) -> None:
    p = proxy()
    headers = {"x-bad": mode, "x-bad-size": str(size)}
    r = httpx.get(f"{p.url}/v1/models", headers=headers, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_broken", r.text[:300]
    assert "head" in r.json()["error"]["message"]
    assert httpx.get(f"{p.url}/v1/models", timeout=10).status_code == 200
    assert _faults(scrape(p.url), "head_too_large") == 1


def test_an_upstream_metrics_answer_with_a_head_over_the_bound_is_a_failed_fetch(
    proxy: Callable[..., ProxyProcess], tmp_path: Path
) -> None:
    """The proxy's own fetch of the upstream's /metrics bounded only the body (16 MiB)."""
    with start_bad_upstream(tmp_path, "/metrics=huge-head") as up:
        p = proxy(upstream=up)
        assert until(lambda: any(rec["cut_short"] for rec in up.log("/metrics")))
        text = httpx.get(f"{p.url}/metrics", timeout=30).text
        assert "retrywatch_upstream_up 0.0" in text and "vllm:" not in text


# --- whole answers held at once ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["callbacks", "asgi"])
def test_whole_answers_held_at_once_are_bounded_together(
    proxy: Callable[..., ProxyProcess], path: str
) -> None:
    """Each non-streaming answer was bounded (--max-answer-bytes) but not all of them together:
    four of 200 MB peaked at 1.36 GiB of RSS. An answer that would take the bytes held past
    --answer-buffer-bytes fails with a 503 (``answer_buffer_full``); the others, and later
    answers once the held ones are gone, are served. (``Expect: 100-continue`` takes a generation
    request off the callback path, to the ASGI one.)"""
    p = proxy("--max-answer-bytes", str(8 * MIB), "--answer-buffer-bytes", str(10 * MIB))
    extra = {"expect": "100-continue"} if path == "asgi" else {}
    got: dict[str, httpx.Response] = {}

    def held(name: str) -> None:
        _, got[name] = _post(p, "held-answer", x_bad_size=str(6 * MIB), x_bad_hold="1.5", **extra)

    threads = [threading.Thread(target=held, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    time.sleep(0.7)  # one holds most of its answer now; the other failed on its way past the bound
    call, small = _post(p, "normal", **extra)
    assert small.status_code == 200 and small.content == completion(f"first-{call}")
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in got.values())
    assert statuses == [200, 503], {k: r.text[:200] for k, r in got.items()}
    refused = next(r for r in got.values() if r.status_code == 503)
    error = refused.json()["error"]
    assert error["code"] == "answer_buffer_full" and "--answer-buffer-bytes" in error["message"]
    whole = next(r for r in got.values() if r.status_code == 200)
    assert len(whole.content) == 6 * MIB and whole.json()["id"].startswith("cmpl-first-")
    # 8 MiB more fit only if what both held was given back (the failed one held over 4 MiB)
    _, later = _post(p, "held-answer", x_bad_size=str(8 * MIB), x_bad_hold="0", **extra)
    assert later.status_code == 200, later.text[:200]
    m = scrape(p.url)
    balance(m)
    assert _fate(m, "failed") == 1 and _fate(m, "completed") == 3


# --- repeated fields ----------------------------------------------------------------------------


def test_repeated_fields_of_a_passed_through_answer_stay_separate_lines(
    proxy: Callable[..., ProxyProcess],
) -> None:
    """``Set-Cookie`` may not be folded into one line (RFC 6265, 3); the pass-through merged
    every repeated field into one, comma-joined."""
    p = proxy()
    r = httpx.get(f"{p.url}/v1/models", headers={"x-bad": "repeated-fields"}, timeout=10)
    assert r.status_code == 200
    assert r.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert r.headers.get_list("x-multi") == ["one", "two"]


def test_the_pools_responses_keep_repeated_fields(bad: BadUpstream) -> None:
    async def scenario() -> httpx.Headers:
        pool = UpstreamPool(bad.url)
        try:
            response = await pool.open("GET", "/v1/models", b"", [(b"x-bad", b"repeated-fields")])
            async for _ in response.aiter_raw():
                pass
            await response.aclose()
            return response.headers
        finally:
            pool.close()

    headers = asyncio.run(scenario())
    assert headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert headers["content-type"] == "application/json"
