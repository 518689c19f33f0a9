"""A soak of a running proxy in front of the test upstream (``tests.exporter.upstream``).

Many concurrent calls, each with its own call id and caller credentials, of every kind the proxy
must survive: streams and non-streaming requests, clients that leave at random moments (while
sending the body, before the answer, mid-stream, during an upstream stall, at ``[DONE]``) and
retry the same call (attaching to the live execution or creating a new one), refusals in both of
vLLM's forms, upstreams that crash mid-stream or hang up after reading the request, interim
responses, and identical requests without a call id sent at once (and the same call id from two
callers); on new connections and on connections earlier attempts left open, as an SDK's pool
reuses them. Afterwards it checks what a client and an operator would see:

* every answer a client read whole is its own call's (the test upstream names each completion
  after the request it recorded, ``cmpl-<request_id>``, and every attempt carries its own
  ``x-test-tag``), complete (every token, in order) and ends with ``[DONE]``, or ends with an
  SSE error event: never a silently cut stream; every error is an OpenAI-style JSON error;
* the proxy's counter balance holds on ``/metrics`` (``exporter.policy``'s docstring), nothing
  is live, queued or subscribed once every call ended, the engine refusals and failures the
  proxy counts are those the clients got, and the attempts it counts delivered are those that
  got their answer whole (give or take those that left just as it ended);
* the upstream received exactly one request per execution the proxy counts as dispatched, and
  never one request twice (no tag recorded twice);
* the proxy's open file descriptors and resident memory, after a warm-up and after the soak.

``run_soak`` drives a proxy already running (the tests start it with their helpers); run with
bigger numbers by ``bench/soak_proxy.py``, which starts both processes and prints the figures.
Prompt text is never used: prompts are token IDs or a fixed word.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.exporter.upstream import MAX_RECORDS

# The proxy's settings for a soak: a short deferred cancellation (so some retries find their
# execution cancelled and create another), a short idle limit on upstream connections (so they
# churn), and a proxy cap below the soak's concurrency (so executions wait in the proxy queue and
# some are dropped there).
SOAK_PROXY_ARGS = ("--cancel-after", "0.3", "--upstream-max-idle", "0.5", "--max-outstanding", "48")
UPSTREAM_MAX_IDLE_S = 0.5  # as in SOAK_PROXY_ARGS
ATTEMPT_TIMEOUT_S = 60.0  # an attempt not answered in this long is reported as hung
SETTLE_TIMEOUT_S = 60.0  # how long the proxy may take to end every execution once the calls ended
PROBE_INDEX = 10**12  # call indexes of the settling probes start here (the phases' calls far below)
CALLERS = 64  # distinct caller credentials the calls are spread over
FATES = ("completed", "orphaned", "cancelled", "dropped", "refused", "failed")
KINDS = ("stream", "json", "retry", "refuse", "crash", "hang-up", "no-id", "shared-id")
WEIGHTS = (22, 10, 25, 8, 8, 6, 12, 9)
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")

# What a client expects an attempt to end with.
ANSWER = "answer"  # 200 and its own call's complete answer
REFUSED = "refused"  # 503 engine_refused
BROKEN = "broken"  # 502 upstream_broken, or (a stream) an SSE error event after a prefix of the answer
LEFT = "left"  # the client left before the end of its answer (what arrived is a prefix of its own)
BAD = "bad"  # anything else: a problem


@dataclass(frozen=True)
class Leave:
    """When a client closes its connection before its answer ends. ``in_body``: after part of
    the request body; otherwise after ``after_s`` seconds, or after ``events`` SSE events, or at
    ``[DONE]`` (before the end of the HTTP response, as the OpenAI SDK does), whichever first."""

    in_body: bool = False
    after_s: float | None = None
    events: int | None = None
    at_done: bool = False


@dataclass
class AttemptPlan:
    headers: dict[str, str]
    expect: str | None  # None: the client leaves before its answer (``leave``)
    leave: Leave | None = None
    backoff_s: float = 0.0  # wait before sending it
    reuse: bool = False  # on a connection an earlier attempt left open, if there is one


@dataclass
class Call:
    index: int
    kind: str
    route: str
    body: bytes
    stream: bool
    tokens: int
    attempts: list[AttemptPlan]


@dataclass
class Exchange:
    """What one attempt got back."""

    call: int
    attempt: int
    tag: str
    expect: str | None
    stream: bool
    status: int | None = None
    content_type: str = ""
    body: bytes = b""
    complete: bool = False  # the HTTP response ended properly
    left: bool = False  # the client closed before the end (as planned)
    sent: bool = False  # the whole request was written
    reused: bool = False  # sent on a kept-alive connection an earlier attempt left open
    error: str | None = None  # a transport error or a timeout


# --- calls ------------------------------------------------------------------------------------


def _tag(run: str, call: int, attempt: int) -> str:
    return f"{run}:{call}:{attempt}"


def _parse_tag(tag: str) -> tuple[str, int, int] | None:
    parts = tag.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def _body(rng: random.Random, route: str, tokens: int, stream: bool, unit: str) -> bytes:
    body: dict[str, Any] = {"model": "test-model", "max_tokens": tokens, "stream": stream}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "soak"}]
    else:
        body["prompt"] = [rng.randrange(50_000) for _ in range(rng.randint(1, 64))]
    body["temperature"] = 1.0
    body["user"] = unit  # distinct units never share a body
    return json.dumps(body).encode()


def _caller(rng: random.Random) -> dict[str, str]:
    who = rng.randrange(CALLERS)
    header = CREDENTIAL_HEADERS[who % len(CREDENTIAL_HEADERS)]
    secret = f"sk-soak-{who}"
    return {header: f"Bearer {secret}" if header == "authorization" else secret}


def plan_unit(rng: random.Random, run: str, first_index: int) -> list[Call]:
    """One unit of work: a call, or the calls of a group sent at once (identical requests
    without a call id; one call id from two callers). Call indexes start at ``first_index``."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    route = "/v1/chat/completions" if rng.random() < 0.3 else "/v1/completions"
    unit = f"{run}-{first_index}"
    if kind in ("no-id", "shared-id"):
        stream = rng.random() < 0.6
        tokens = rng.randint(3, 12)
        body = _body(rng, route, tokens, stream, unit)
        caller = _caller(rng)
        call_id = uuid.uuid4().hex
        members = rng.randint(2, 4) if kind == "no-id" else 2
        calls = []
        for m in range(members):
            index = first_index + m
            headers = {**(caller if kind == "no-id" else _caller_other(rng, caller, m))}
            if kind == "shared-id":
                headers["x-call-id"] = call_id
            # Held before their first token long enough to overlap at the proxy.
            headers["x-test-ttft"] = f"{rng.uniform(0.02, 0.05):.3f}"
            headers["x-test-tag"] = _tag(run, index, 0)
            calls.append(Call(index, kind, route, body, stream, tokens, [AttemptPlan(headers, ANSWER)]))
        return calls
    stream = rng.random() < (0.8 if kind in ("retry", "stream") else 0.5)
    if kind == "stream":
        stream = True
    if kind == "json":
        stream = False
    tokens = rng.randint(8, 20) if kind == "retry" else rng.randint(3, 16)
    body = _body(rng, route, tokens, stream, unit)
    base = {"x-call-id": uuid.uuid4().hex, **_caller(rng)}
    sdk = rng.random() < 0.5  # the client sends the OpenAI SDK's retry counter
    attempts: list[AttemptPlan] = []

    def add(
        headers: dict[str, str], expect: str | None, leave: Leave | None = None, backoff: float = 0
    ) -> None:
        a = len(attempts)
        h = {**base, **headers, "x-test-tag": _tag(run, first_index, a)}
        if sdk:
            h["x-stainless-retry-count"] = str(a)
        if rng.random() < 0.1:
            h["x-test-interim"] = "100,103"
        attempts.append(AttemptPlan(h, expect, leave, backoff, reuse=leave is None and rng.random() < 0.5))

    if kind in ("stream", "json"):
        headers = {"x-test-token-interval": f"{rng.uniform(0, 0.005):.4f}"}
        if stream and rng.random() < 0.3:
            headers["x-test-done-gap"] = "0.02"  # [DONE], then the end of the response later
        leave = Leave(at_done=True) if stream and rng.random() < 0.3 else None
        add(headers, ANSWER, leave)
    elif kind == "retry":
        interval = rng.uniform(0.01, 0.025)
        slow = {"x-test-token-interval": f"{interval:.4f}"}
        if rng.random() < 0.3:  # an upstream stall mid-answer, during which clients time out
            slow |= {
                "x-test-stall-after": str(rng.randint(2, 4)),
                "x-test-stall": f"{rng.uniform(0.2, 0.6):.2f}",
            }
        for _ in range(rng.choice((1, 1, 1, 2))):
            if rng.random() < 0.1:
                leave = Leave(in_body=True)
            elif stream and rng.random() < 0.5:
                leave = Leave(events=rng.randint(1, tokens - 1))
            else:
                leave = Leave(after_s=rng.uniform(0, tokens * interval))
            add(slow, None, leave, rng.uniform(0, 0.4) if attempts else 0.0)
        add(slow, ANSWER, None, rng.uniform(0, 0.4))
    else:
        if kind == "refuse":
            headers, expect = {"x-test-mode": rng.choice(("refuse-http", "refuse-stream"))}, REFUSED
        elif kind == "crash":
            headers = {"x-test-mode": "crash", "x-test-crash-after": str(rng.randint(1, tokens - 1))}
            headers["x-test-token-interval"] = f"{rng.uniform(0, 0.005):.4f}"
            expect = BROKEN
        else:  # hang-up: the upstream reads the request, then closes without a byte of answer
            headers = {"x-test-mode": "close", "x-test-ttft": f"{rng.uniform(0, 0.05):.3f}"}
            expect = BROKEN
        add(headers, expect)
        if rng.random() < 0.5:  # the client retries, and this time the engine answers
            add({}, ANSWER, None, rng.uniform(0, 0.2))
    return [Call(first_index, kind, route, body, stream, tokens, attempts)]


def _caller_other(rng: random.Random, caller: dict[str, str], member: int) -> dict[str, str]:
    """Another caller than ``caller`` for every member after the first."""
    if member == 0:
        return caller
    while (other := _caller(rng)) == caller:
        pass
    return other


# --- the client -------------------------------------------------------------------------------


class _ResponseParser:
    """httptools callbacks collecting one response (interim ones skipped)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status: int | None = None
        self.interim = False
        self.content_type = ""
        self.body = bytearray()
        self.complete = False
        self.keep_alive = False
        self._headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.interim = status < 200
        if not self.interim:
            self.status = status
            self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it at the end
            for name, value in self._headers:
                if name == b"content-type":
                    self.content_type = value.decode("latin-1")
        self._headers = []

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        else:
            self.complete = True


def _request_bytes(host: str, route: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [
        f"POST {route} HTTP/1.1",
        f"host: {host}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Client:
    """Where attempts connect: a new connection each, or, for an attempt planned to ``reuse``
    one, a connection an earlier attempt read to its end and left open (as an SDK's pool does:
    at most ``max_idle`` wait, the others are closed)."""

    def __init__(self, host: str, port: int, max_idle: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Connection] = []
        self.max_idle = max_idle

    async def connect(self, reuse: bool) -> tuple[Connection, bool]:
        if reuse and self.idle:
            return self.idle.pop(), True
        return await asyncio.open_connection(self.host, self.port), False

    def release(self, connection: Connection) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append(connection)
        else:
            connection[1].close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop()[1].close()


async def _attempt(client: _Client, call: Call, a: int, run: str) -> Exchange:
    plan = call.attempts[a]
    ex = Exchange(call.index, a, _tag(run, call.index, a), plan.expect, call.stream)
    request = _request_bytes(f"{client.host}:{client.port}", call.route, call.body, plan.headers)
    leave = plan.leave or Leave()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ATTEMPT_TIMEOUT_S
    writer: asyncio.StreamWriter | None = None
    keep = False
    try:
        (reader, writer), ex.reused = await client.connect(plan.reuse)
        if leave.in_body:
            writer.write(request[: len(request) - len(call.body) // 2 - 1])
            await writer.drain()
            ex.left = True
            return ex
        writer.write(request)
        ex.sent = True
        leave_at = loop.time() + leave.after_s if leave.after_s is not None else None
        response = _ResponseParser()
        while not response.complete:
            now = loop.time()
            until = deadline if leave_at is None else min(deadline, leave_at)
            try:
                data = await asyncio.wait_for(reader.read(65536), max(0.0, until - now))
            except TimeoutError:
                if leave_at is not None and loop.time() >= leave_at:
                    ex.left = True
                    break
                ex.error = f"no answer within {ATTEMPT_TIMEOUT_S:g} s"
                break
            if not data:
                break
            response.parser.feed_data(data)
            if response.status is not None and call.stream:
                events = response.body.count(b"\n\n")
                if leave.events is not None and events >= leave.events:
                    ex.left = True
                    break
                if leave.at_done and response.body.endswith(b"data: [DONE]\n\n"):
                    ex.left = not response.complete
                    break
        ex.status, ex.content_type = response.status, response.content_type
        ex.body, ex.complete = bytes(response.body), response.complete
        keep = response.complete and response.keep_alive and not ex.left
    except (OSError, httptools.HttpParserError) as exc:
        ex.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None and keep:
            client.release((reader, writer))
        elif writer is not None:
            writer.close()
    return ex


async def _run_call(client: _Client, call: Call, run: str) -> list[Exchange]:
    out = []
    for a, plan in enumerate(call.attempts):
        if plan.backoff_s:
            await asyncio.sleep(plan.backoff_s)
        out.append(await _attempt(client, call, a, run))
    return out


async def drive(
    proxy_url: str, run: str, calls: int, concurrency: int, rng: random.Random, first_index: int = 0
) -> tuple[list[Call], list[Exchange]]:
    """Send at least ``calls`` calls (a group's calls count one by one), ``concurrency`` units at
    a time; return the calls planned and every attempt's exchange."""
    parts = urlsplit(proxy_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    units: list[list[Call]] = []
    index = first_index
    while index < first_index + calls:
        unit = plan_unit(rng, run, index)
        units.append(unit)
        index += len(unit)
    queue = list(reversed(units))
    exchanges: list[Exchange] = []
    client = _Client(host, port, max_idle=concurrency // 2)

    async def worker() -> None:
        while queue:
            unit = queue.pop()
            results = await asyncio.gather(*(_run_call(client, c, run) for c in unit))
            for r in results:
                exchanges.extend(r)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        client.close()  # the phase's figures are taken with no client connection left open
    return [c for u in units for c in u], exchanges


# --- checks -----------------------------------------------------------------------------------


def _events(body: bytes) -> list[bytes]:
    """The whole SSE events of a body (a last one cut short is left out)."""
    events = body.split(b"\n\n")
    return [e.strip() for e in events[:-1] if e.strip()]


def _error_object(raw: bytes) -> dict[str, Any] | None:
    """The ``error`` object of an OpenAI-style error body, or None if it is not one."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "code"} <= set(error):
        return None
    return error


def _stream_content(body: bytes, chat: bool) -> tuple[str, set[str], dict[str, Any] | None, bool]:
    """A stream's text, the completion ids its events carry, its error event if it ended with
    one, and whether ``[DONE]`` ended it. Raises ValueError, KeyError, ... if an event is not an
    OpenAI-style chunk."""
    events = _events(body)
    done = bool(events) and events[-1] == b"data: [DONE]"
    if done:
        events = events[:-1]
    error = None
    if events and events[-1].startswith(b'data: {"error"'):
        error = _error_object(events.pop()[6:])
    texts: list[str] = []
    ids: set[str] = set()
    for e in events:
        if not e.startswith(b"data: "):
            raise ValueError(f"not an SSE data event: {e[:80]!r}")
        obj = json.loads(e[6:])
        ids.add(str(obj["id"]))
        choice = obj["choices"][0]
        texts.append(str(choice["delta"].get("content", "")) if chat else str(choice["text"]))
    return "".join(texts), ids, error, done


def _json_content(body: bytes, chat: bool) -> tuple[str, set[str]]:
    obj = json.loads(body)
    choice = obj["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"]), {str(obj["id"])}


def check_exchange(ex: Exchange, call: Call, owner: dict[str, int]) -> tuple[str, list[str]]:
    """What one attempt got (``ANSWER``, ``REFUSED``, ``BROKEN``, ``LEFT`` or ``BAD``) and what
    is wrong with it (nothing: an empty list). ``owner`` maps an answer id
    (``cmpl-<request_id>``) to the call whose attempt the upstream recorded it for."""
    where = f"call {call.index} ({call.kind}) attempt {ex.attempt}"
    got, problems = _classify(ex, call, owner, where)
    # A client planning to leave may get its whole answer first; otherwise what it expected.
    wanted = (LEFT, ANSWER) if ex.expect is None else (ex.expect,)
    if got != BAD and got not in wanted:
        problems.append(f"{where}: expected {' or '.join(wanted)}, got {got}")
    return got, problems


def _classify(ex: Exchange, call: Call, owner: dict[str, int], where: str) -> tuple[str, list[str]]:
    if ex.error is not None:
        return BAD, [f"{where}: {ex.error}"]
    if ex.status is None:
        if ex.left:
            return LEFT, []
        return BAD, [f"{where}: the connection closed without an answer"]
    chat = call.route.endswith("/chat/completions")
    expected = "".join(f" t{i}" for i in range(call.tokens))
    if ex.status != 200:
        error = _error_object(ex.body)
        if error is None:
            if ex.left and not ex.complete:
                return LEFT, []
            return BAD, [
                f"{where}: HTTP {ex.status} whose body is not an OpenAI-style error: {ex.body[:200]!r}"
            ]
        got = {(503, "engine_refused"): REFUSED, (502, "upstream_broken"): BROKEN}.get(
            (ex.status, error["code"])
        )
        if got is None:
            return BAD, [f"{where}: HTTP {ex.status} {error['code']}: {error['message'][:200]}"]
        return got, []
    try:
        if ex.stream:
            text, ids, error, done = _stream_content(ex.body, chat)
        elif ex.complete:
            (text, ids), error, done = _json_content(ex.body, chat), None, True
        else:
            text, ids, error, done = "", set(), None, False
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return BAD, [f"{where}: an answer that does not parse ({type(exc).__name__}): {ex.body[:200]!r}"]
    problems = []
    if len(ids) > 1:
        problems.append(f"{where}: one answer made of several completions {sorted(ids)}")
    for answer_id in ids:
        if owner.get(answer_id) != call.index:
            problems.append(f"{where}: got {answer_id}, the answer of call {owner.get(answer_id)}")
    if not expected.startswith(text):
        problems.append(f"{where}: tokens that are not its answer's, in order: {text[:80]!r}")
    if problems:
        return BAD, problems
    if error is not None:  # a stream ended by an error event: it must then end, with [DONE]
        if error.get("code") != "upstream_broken" or not (done or ex.left):
            return BAD, [f"{where}: a stream ended by error event {error.get('code')}, [DONE] {done}"]
        return BROKEN, []
    if text == expected and done:
        if not ex.complete and not ex.left:
            return BAD, [f"{where}: the HTTP response was cut after a whole answer"]
        return ANSWER, []
    if ex.left:
        return LEFT, []
    return BAD, [
        f"{where}: a stream cut short silently ({len(text)} of {len(expected)} characters, [DONE] {done})"
    ]


# --- the proxy and the upstream, seen from outside -----------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(proxy_url: str) -> Samples:
    text = httpx.get(f"{proxy_url}/metrics", timeout=30).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(m: Samples, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def balance_problems(m: Samples) -> list[str]:
    """The counter balance of ``exporter.policy`` on one scrape: what does not hold."""
    attempts = _v(m, "retrywatch_attempts_total", kind="first") + _v(
        m, "retrywatch_attempts_total", kind="retry"
    )
    shed = sum(
        _v(m, "retrywatch_attempts_shed_total", reason=r) for r in ("retry_budget", "proxy_queue", "deadline")
    )
    created = _v(m, "retrywatch_executions_created_total")
    dispatched = _v(m, "retrywatch_executions_dispatched_total")
    fate = {f: _v(m, "retrywatch_executions_finished_total", fate=f) for f in FATES}
    queued = _v(m, "retrywatch_executions_queued")
    live = _v(m, "retrywatch_executions_live")
    problems = []
    if attempts != _v(m, "retrywatch_attempts_attached_total") + shed + created:
        problems.append(f"attempts {attempts} != attached + shed + created")
    if created != dispatched + fate["dropped"] + queued:
        problems.append(
            f"created {created} != dispatched {dispatched} + dropped {fate['dropped']} + queued {queued}"
        )
    ended = sum(fate[f] for f in FATES if f != "dropped")
    if dispatched != ended + live:
        problems.append(f"dispatched {dispatched} != finished (not dropped) {ended} + live {live}")
    return problems


_BUSY = ("retrywatch_executions_live", "retrywatch_executions_queued", "retrywatch_subscribers")


def _idle(m: Samples) -> bool:
    return all(_v(m, g) == 0 for g in _BUSY)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/PID/status")


def upstream_records(upstream_url: str, run: str) -> list[dict[str, Any]]:
    rows = httpx.get(f"{upstream_url}/test/requests", params={"tag_prefix": f"{run}:"}, timeout=60).json()
    return list(rows["requests"])


# --- a soak -----------------------------------------------------------------------------------


@dataclass
class Resources:
    fds: int
    rss_kib: int


@dataclass
class Phase:
    """One phase's calls and what the proxy counted meanwhile."""

    calls: list[Call]
    exchanges: list[Exchange]
    duration_s: float
    counters: dict[str, float]  # deltas over the phase
    resources: Resources  # after the phase, once the proxy settled
    outcomes: dict[str, int] = field(default_factory=dict)  # what the attempts got, by outcome


@dataclass
class SoakReport:
    warmup: Phase
    soak: Phase
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        f = self.figures
        w, s = self.warmup.resources, self.soak.resources
        return [
            f"calls: {f['calls']} ({f['calls_per_s']:.0f}/s over {self.soak.duration_s:.1f} s, "
            f"concurrency {f['concurrency']}); warm-up {len(self.warmup.calls)} calls",
            "calls by kind: " + ", ".join(f"{k} {n}" for k, n in f["kinds"].items()),
            f"attempts: {f['attempts']} ({f['reused']} on a kept-alive connection); what they got: "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.soak.outcomes.items())),
            f"the proxy counted attempts first {f['first']:.0f}, retry {f['retry']:.0f}, "
            f"attached {f['attached']:.0f}",
            f"retries answered: {f['retries_attached']} by an earlier attempt's execution, "
            f"{f['retries_created']} by a new one",
            "executions: created {:.0f}, dispatched {:.0f}; by fate: ".format(f["created"], f["dispatched"])
            + ", ".join(f"{k} {v:.0f}" for k, v in f["fates"].items()),
            f"upstream requests recorded: {f['upstream_requests']}",
            f"open fds: {w.fds} after the warm-up, {s.fds} after the soak ({s.fds - w.fds:+d})",
            f"RSS: {w.rss_kib / 1024:.1f} MiB after the warm-up, {s.rss_kib / 1024:.1f} MiB after the soak "
            f"({(s.rss_kib - w.rss_kib) / 1024:+.2f} MiB, {f['rss_bytes_per_call']:+.0f} B per call)",
            f"problems: {len(self.problems)}",
            *(f"  {p}" for p in self.problems[:50]),
        ]


_COUNTERS = {
    "first": ("retrywatch_attempts_total", {"kind": "first"}),
    "retry": ("retrywatch_attempts_total", {"kind": "retry"}),
    "attached": ("retrywatch_attempts_attached_total", {}),
    "created": ("retrywatch_executions_created_total", {}),
    "dispatched": ("retrywatch_executions_dispatched_total", {}),
    **{f: ("retrywatch_executions_finished_total", {"fate": f}) for f in FATES},
    "refused_attempts": ("retrywatch_attempt_duration_seconds_count", {"outcome": "refused"}),
    "failed_attempts": ("retrywatch_attempt_duration_seconds_count", {"outcome": "failed"}),
    "delivered_attempts": ("retrywatch_attempt_duration_seconds_count", {"outcome": "delivered"}),
}


def _counters(m: Samples) -> dict[str, float]:
    return {k: _v(m, name, **labels) for k, (name, labels) in _COUNTERS.items()}


async def _settle(proxy_url: str, run: str, probe_index: int, problems: list[str]) -> Samples:
    """Wait until the proxy holds no execution, queued work or subscriber, then let its idle
    upstream connections expire and send one call (which closes the expired ones), so that the
    descriptors it holds are its resting set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while not _idle(m := await asyncio.to_thread(scrape, proxy_url)):
        if loop.time() > deadline:
            busy = ", ".join(f"{g.removeprefix('retrywatch_')} {_v(m, g):.0f}" for g in _BUSY)
            problems.append(f"still busy {SETTLE_TIMEOUT_S:g} s after the calls ended: {busy}")
            return m
        await asyncio.sleep(0.1)
    await asyncio.sleep(UPSTREAM_MAX_IDLE_S + 0.3)
    body = json.dumps({"model": "test-model", "prompt": [1], "max_tokens": 1}).encode()
    headers = {"x-call-id": uuid.uuid4().hex, "x-test-tag": _tag(run, probe_index, 0)}
    probe = Call(probe_index, "probe", "/v1/completions", body, False, 1, [AttemptPlan(headers, ANSWER)])
    parts = urlsplit(proxy_url)
    client = _Client(parts.hostname or "127.0.0.1", parts.port or 80, max_idle=0)
    ex = await _attempt(client, probe, 0, run)
    client.close()
    if ex.status != 200:
        problems.append(f"the settling probe got {ex.status} {ex.error or ex.body[:200]!r}")
    await asyncio.sleep(0.3)
    return await asyncio.to_thread(scrape, proxy_url)


async def _phase(
    proxy_url: str,
    pid: int,
    run: str,
    calls: int,
    concurrency: int,
    rng: random.Random,
    first: int,
    problems: list[str],
) -> Phase:
    before = _counters(await asyncio.to_thread(scrape, proxy_url))
    began = time.monotonic()
    planned, exchanges = await drive(proxy_url, run, calls, concurrency, rng, first)
    duration = time.monotonic() - began
    m = await _settle(proxy_url, run, PROBE_INDEX + first, problems)
    after = _counters(m)
    problems.extend(balance_problems(m))
    counters = {k: after[k] - before[k] for k in after}
    return Phase(planned, exchanges, duration, counters, Resources(fds(pid), rss_kib(pid)))


def _verify(phases: Iterable[Phase], records: list[dict[str, Any]], run: str, m: Samples) -> list[str]:
    problems: list[str] = []
    owner: dict[str, int] = {}
    tags = Counter(r["tag"] for r in records)
    for tag, n in tags.items():
        if n > 1:
            problems.append(f"the upstream received the request of attempt {tag} {n} times")
    for r in records:
        parsed = _parse_tag(r["tag"] or "")
        if parsed is None or parsed[0] != run:
            problems.append(f"the upstream received a request nobody sent: tag {r['tag']!r}")
            continue
        owner[f"cmpl-{r['request_id']}"] = parsed[1]
    dispatched = _v(m, "retrywatch_executions_dispatched_total")
    if dispatched > MAX_RECORDS:
        problems.append(f"the test upstream keeps only its last {MAX_RECORDS} records: soak with fewer calls")
    elif len(records) != dispatched:
        problems.append(
            f"the upstream received {len(records)} requests; the proxy dispatched {dispatched:.0f}"
        )
    for phase in phases:
        calls = {c.index: c for c in phase.calls}
        got: Counter[str] = Counter()
        for ex in phase.exchanges:
            outcome, wrong = check_exchange(ex, calls[ex.call], owner)
            got[outcome] += 1
            problems.extend(wrong)
        phase.outcomes = dict(got)
        c = phase.counters
        if not c["refused"] == c["refused_attempts"] == got[REFUSED]:
            problems.append(
                f"the clients got {got[REFUSED]} refusals; the proxy counted {c['refused']:.0f} executions "
                f"and {c['refused_attempts']:.0f} attempts refused"
            )
        if not c["failed"] == c["failed_attempts"] == got[BROKEN]:
            problems.append(
                f"the clients got {got[BROKEN]} broken answers; the proxy counted {c['failed']:.0f} "
                f"executions and {c['failed_attempts']:.0f} attempts failed"
            )
        # The settling probe is one more answer. A client that left may have been sent all of
        # its answer before the proxy saw it go: the proxy counts it delivered.
        answers = got[ANSWER] + 1
        if not answers <= c["delivered_attempts"] <= answers + got[LEFT]:
            problems.append(
                f"the clients got {answers} answers whole and left {got[LEFT]} times; the proxy "
                f"counted {c['delivered_attempts']:.0f} attempts delivered"
            )
    return problems


def run_soak(
    proxy_url: str,
    proxy_pid: int,
    upstream_url: str,
    calls: int,
    warmup_calls: int,
    concurrency: int,
    seed: int = 0,
) -> SoakReport:
    """A warm-up of ``warmup_calls`` calls, then the soak of ``calls``, against a proxy already
    running (process ``proxy_pid``, started with ``SOAK_PROXY_ARGS``, nothing else sent to it)
    in front of the test upstream; the report holds every problem seen and the figures."""
    return asyncio.run(_run_soak(proxy_url, proxy_pid, upstream_url, calls, warmup_calls, concurrency, seed))


async def _run_soak(
    proxy_url: str, pid: int, upstream_url: str, calls: int, warmup_calls: int, concurrency: int, seed: int
) -> SoakReport:
    rng = random.Random(seed)
    run = f"soak-{uuid.uuid4().hex[:12]}"
    problems: list[str] = []
    warmup = await _phase(proxy_url, pid, run, warmup_calls, concurrency, rng, 0, problems)
    first = 1 + max((c.index for c in warmup.calls), default=0)
    soak = await _phase(proxy_url, pid, run, calls, concurrency, rng, first, problems)
    m = await asyncio.to_thread(scrape, proxy_url)
    records = await asyncio.to_thread(upstream_records, upstream_url, run)
    problems.extend(_verify((warmup, soak), records, run, m))
    report = SoakReport(warmup, soak, problems)
    report.figures = _figures(warmup, soak, concurrency, records)
    return report


def _figures(warmup: Phase, s: Phase, concurrency: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    attempt_of = {f"cmpl-{r['request_id']}": (_parse_tag(r["tag"]) or ("", -1, -1))[2] for r in records}
    attached = created = 0
    for ex in s.exchanges:
        if ex.attempt == 0 or ex.expect != ANSWER or ex.status != 200 or not ex.body:
            continue
        try:
            first = _events(ex.body)[0][6:] if ex.stream else ex.body
            answer = str(json.loads(first)["id"])
        except (ValueError, KeyError, IndexError):
            continue
        if attempt_of.get(answer, -1) < ex.attempt:
            attached += 1
        else:
            created += 1
    c = s.counters
    return {
        "calls": len(s.calls),
        "calls_per_s": len(s.calls) / max(s.duration_s, 1e-9),
        "concurrency": concurrency,
        "kinds": dict(sorted(Counter(call.kind for call in s.calls).items())),
        "attempts": len(s.exchanges),
        "reused": sum(1 for ex in s.exchanges if ex.reused),
        "first": c["first"],
        "retry": c["retry"],
        "attached": c["attached"],
        "retries_attached": attached,
        "retries_created": created,
        "created": c["created"],
        "dispatched": c["dispatched"],
        "fates": {f: c[f] for f in FATES},
        "upstream_requests": len(records),
        "rss_bytes_per_call": (s.resources.rss_kib - warmup.resources.rss_kib) * 1024 / max(1, len(s.calls)),
        "fds_per_call": (s.resources.fds - warmup.resources.fds) / max(1, len(s.calls)),
    }
