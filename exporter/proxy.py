"""The execution-aware proxy: the policy core driven in wall time, and its ASGI app for the rest.

Each generation attempt is validated, keyed (``exporter.callkey``) and decided by
``exporter.policy.Policy`` in ``Proxy.attempt``; this module carries out the policy's effects: a
dispatched execution sends one upstream request (``exporter.execution``, driven by the upstream
connection's callbacks), its bytes are fanned out to the execution's subscribers
(``exporter.relay``), a cancelled one has its upstream connection closed, and
deferred-cancellation timers are armed with ``loop.call_later``. The policy's clock is
``time.monotonic``.

A generation POST is normally served in callbacks on the server's connection
(``exporter.exchange``, taken over by ``foundation.server``): no ASGI cycle and no task. The ASGI
app (``Proxy.app``) serves the rest: the proxy's own routes (``/metrics``,
``/retrywatch/...``; 405 to other methods), any other path, passed through to the upstream
unchanged if ``--passthrough`` allows it (``exporter.routes``) or answered 404, and the
generation requests the callback path leaves to it (HTTP/1.0, ``Expect: 100-continue``, a
request pipelined behind another), answered by ``SubscriberResponse`` (a task per subscriber
waits for ``http.disconnect``). When a drained shutdown runs out of time (``foundation.server``),
``end_executions`` ends every live execution with an error its clients can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from exporter import sse
from exporter.admin import executions_listing
from exporter.callkey import (
    CallIdError,
    call_key,
    caller_scope,
    find_call_id,
    sdk_read_timeout,
    sdk_says_retry,
)
from exporter.execution import Execution
from exporter.metrics import ProxyMetrics
from exporter.policy import (
    Attempt,
    Cancel,
    Created,
    Decision,
    Dispatch,
    Drop,
    Effect,
    Policy,
    Shed,
    StartTimer,
)
from exporter.recorder import AttemptRecorder, open_recorder
from exporter.relay import READ_BYTES, Outcome, Relay, Subscription, UpstreamRequest
from exporter.settings import ProxySettings
from exporter.upstream import (
    UpstreamBroken,
    UpstreamClient,
    UpstreamError,
    UpstreamPool,
    forwardable_headers,
    relayed_headers,
)
from exporter.upstreamtext import scan_vllm_sliced
from exporter.validation import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    GENERATION_ROUTES,
    RequestError,
    check_forwarded_path,
    parse_body,
    validate,
)
from foundation.errors import error_body, error_type
from foundation.metricnames import ShedReason
from foundation.redact import redact_url
from foundation.server import ABORT_EXTENSION, PROXY_ERROR, SHUT_DOWN_UNANSWERED

log = logging.getLogger("retrywatch.proxy")

# The ASGI scope extension under which ``foundation.server`` gives the app a callable that closes the
# client's connection at once (its transport's ``abort``): a subscriber dropped for lagging has a
# paused send that only the connection's loss ends.

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

SAMPLE_INTERVAL_S = 1.0
# The methods of the requests passed through that --passthrough-read-timeout bounds: read-only ones.
READ_ONLY = frozenset({"GET", "HEAD"})
UPSTREAM_METRICS_MAX_AGE_S = 1.0
_JSON = b"application/json"
_SHUTTING_DOWN = (503, error_body("the proxy is shutting down", error_type(503), "proxy_shutting_down"))
# What a subscriber reads when its execution ended without an answer or an error of its own.
ENDED_WITHOUT_ANSWER = (
    503,
    error_body("the execution ended before it was answered", error_type(503), "execution_ended"),
)


class Ending(enum.Enum):
    """How one subscriber's attempt ends (:meth:`Proxy.settle`), for the code that writes it."""

    LEFT = "left"  # the client left first: nothing more to write
    STREAM_END = "stream_end"  # a whole stream: write its end unless the client is gone
    BODY = "body"  # a whole non-streaming answer: write it, then Proxy.body_written
    ERROR = "error"  # write the execution's error (an SSE error event mid-stream)


def header_map(raw_headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """A request's header fields by name (lower-cased by the server); the first of repeated ones
    wins."""
    headers: dict[str, str] = {}
    for name, value in reversed(raw_headers):
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")
    return headers


@dataclass(frozen=True, slots=True)
class Answer:
    """What to answer an attempt at once: an OpenAI-style JSON error (bad input, a refusal)."""

    status: int
    body: bytes
    headers: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Joined:
    """An attempt that subscribed to an execution: its answer is read from the relay."""

    relay: Relay
    subscription: Subscription


def _json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _error_event(event: bytes) -> Mapping[str, Any] | None:
    """The error object if an SSE event is ``data: {"error": ...}`` (vLLM's in-stream error)."""
    payload = sse.event_payload(event)
    # Parsed only when it can be an error: the first event of every stream comes this way.
    if payload is None or not payload.startswith("{") or "error" not in payload[:64]:
        return None
    try:
        return sse.error_of(sse.event_json(payload))
    except (ValueError, RecursionError):  # nested past the interpreter's limit: no error object
        return None


class Proxy:
    """One proxy: its policy, its executions in flight and its ASGI app (``Proxy.app``)."""

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.policy = Policy(settings.policy_config())
        if settings.deadline_auto:
            self.policy.set_deadline(None)  # until learned (see ProxySettings.policy_config)
        self.metrics = ProxyMetrics(
            self.policy,
            settings.window_s,
            settings.capacity,
            settings.upstream_metrics_max_staleness_s,
            upstream_name=redact_url(settings.upstream_base),
            deadline_stated=settings.deadline_s is not None,
        )
        base, connect_s, idle_s = (
            settings.upstream_base,
            settings.upstream_connect_timeout_s,
            settings.upstream_max_idle_s,
        )
        fault = self.metrics.upstream_fault
        self.upstream = UpstreamClient(base, connect_s, on_fault=fault)
        self.pool = UpstreamPool(base, connect_s, max_idle_s=idle_s, on_fault=fault)
        self.relays: dict[int, Relay] = {}
        # --record DIR: every attempt's record, written off the loop (``exporter.recorder``)
        self.recorder: AttemptRecorder | None = None
        if settings.record is not None:
            self.recorder = open_recorder(
                settings.record, settings.record_max_bytes, settings.record_max_age_s
            )
            self.metrics.registry.register(self.recorder.collector())
        self.executions: dict[int, Execution] = {}  # the upstream requests in flight
        # Bytes of the non-streaming answers held at once (``exporter.execution``), bounded by
        # --answer-buffer-bytes; each relay gives its own back when done (``Relay._release``).
        self.answers_held = 0
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._refresh: asyncio.Task[None] | None = None  # the one upstream /metrics fetch in flight
        self._sampler: asyncio.Task[None] | None = None
        self.closing = False  # set when a drained shutdown ran out of time: new requests get 503
        self.forwarded = settings.forwarded_routes()
        # The proxy's own routes; another method on them is a 405. A path none of them matches
        # goes to ``unrouted``: passed through if --passthrough allows it, else a 404.
        routes = [
            Route(COMPLETIONS, self.generate, methods=["POST"]),
            Route(CHAT_COMPLETIONS, self.generate, methods=["POST"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/retrywatch/executions", self.admin_executions, methods=["GET"]),
        ]
        self.starlette = Starlette(
            routes=routes,
            lifespan=self._lifespan,
            # Exception: what Starlette's error middleware answers when a route fails (its own
            # answer is a plain-text 500); it still raises the error on, to the server's log.
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )
        self.starlette.router.default = self.unrouted
        # A path one slash away from a route of the proxy is not redirected to it (Starlette's
        # default, a 307 built from the Host header): like every other path, it is passed
        # through or answered 404.
        self.starlette.router.redirect_slashes = False
        self.app = self  # an ASGI 3 app (servers recognise it by its async __call__)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The proxy's ASGI app. Generation requests (the hot path) skip Starlette's middleware
        and router, whose wrappers would otherwise run on every chunk sent; the rest (other
        routes, lifespan) go through Starlette."""
        if scope["type"] == "http" and self.closing:
            message = "the proxy is shutting down"
            response = _json_response(503, error_body(message, error_type(503), "proxy_shutting_down"))
            await response(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_ROUTES:
            try:
                response = await self.generate_asgi(scope, receive)
            except Exception:  # a bug here must answer 500, like Starlette's error middleware
                log.exception("generation request failed in the proxy")
                response = _json_response(*PROXY_ERROR)
            await response(scope, receive, send)
            return
        await self.starlette(scope, receive, send)

    # --- lifecycle ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # NOTE: a full garbage collection walks every object the process holds; tens of
        # thousands come from imports and start-up alone, and walking them stalled every stream
        # for tens of milliseconds (the TTFT p99). Frozen, they are never walked again. The first
        # upstream refresh comes first (bounded), so that what it makes once is frozen too.
        first = self._refresh_upstream_metrics()
        if first is not None:
            await asyncio.wait({first}, timeout=self.settings.upstream_metrics_timeout_s)
        gc.collect()
        gc.freeze()
        self._sampler = asyncio.create_task(self._sample_forever())
        try:
            yield
        finally:
            self._sampler.cancel()
            if self._refresh is not None:
                self._refresh.cancel()
            for execution in list(self.executions.values()):
                execution.abort()
            for handle in self._timers.values():
                handle.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
            await self.upstream.aclose()
            self.pool.close()
            if self.recorder is not None:
                self.recorder.close()

    @staticmethod
    def now() -> float:
        # time.monotonic, not loop.time(): uvloop's loop clock has millisecond resolution.
        return time.monotonic()

    async def _sample_forever(self) -> None:
        while True:
            try:
                refresh = self._refresh_upstream_metrics()
                if refresh is not None:  # bounded: a slow upstream leaves the last good text
                    await asyncio.wait({refresh}, timeout=self.settings.upstream_metrics_timeout_s)
                self._sample()
            except Exception:  # a sampler bug must not take the proxy down
                log.exception("metrics sampler failed")
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def _sample(self) -> None:
        self.metrics.sample(self.now())
        if self.settings.deadline_s is None:  # none stated: the learned one, once there is one
            learned = self.metrics.deadlines.in_force()
            if learned is not None and learned.deadline_s != self.policy.deadline_s:
                self.policy.set_deadline(learned.deadline_s)

    def _refresh_upstream_metrics(self) -> asyncio.Task[None] | None:
        """Start a fetch of the upstream's /metrics unless the last one is under a second old or
        one is already in flight (never more than one); returns the fetch in flight, if any."""
        task = self._refresh
        if task is not None and not task.done():
            return task
        if self.now() - self.metrics.upstream_fetched_at < UPSTREAM_METRICS_MAX_AGE_S:
            return None
        self._refresh = asyncio.create_task(self._fetch_upstream_metrics())
        return self._refresh

    async def _fetch_upstream_metrics(self) -> None:
        # The fetch itself may take up to the staleness bound (a saturated vLLM answers /metrics
        # slowly); scrapes of the proxy wait for it only up to --metrics-timeout meanwhile.
        path = "/metrics" if self.settings.metrics_passthrough else "/health"
        settings = self.settings
        timeout = max(settings.upstream_metrics_timeout_s, settings.upstream_metrics_max_staleness_s)
        try:
            text = await self.pool.get_text(path, timeout)
        except (UpstreamError, OSError, TimeoutError, UnicodeDecodeError):
            self.metrics.upstream_failed(self.now())
            return
        now = self.now()
        if not self.settings.metrics_passthrough:
            self.metrics.upstream_fetched(now, "", {})
            return
        # In slices, the event loop running between them: a vLLM with many models or adapters
        # serves 100k series and more, and read at once they stalled every stream for seconds.
        vllm = await scan_vllm_sliced(text)
        self.metrics.upstream_fetched(now, text, vllm)

    # --- generation routes ----------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        too_large = self.body_too_large(request.headers.get("content-length"))
        if too_large is not None:
            raise too_large
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body is over the limit of {limit} bytes", "body_too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def _receive_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The request body straight from the ASGI messages (the hot path's ``_read_body``)."""
        limit = self.settings.max_body_bytes
        too_large = self.body_too_large(headers.get("content-length"))
        if too_large is not None:
            raise too_large
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise RequestError(
                        413, f"request body is over the limit of {limit} bytes", "body_too_large"
                    )
                parts.append(chunk)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def generate(self, request: Request) -> Response:
        """The Starlette endpoint of the generation routes (the ASGI entry point calls
        ``generate_asgi`` directly)."""
        return await self.generate_asgi(request.scope, request.receive)

    async def generate_asgi(self, scope: Scope, receive: Receive) -> Response:
        started = self.now()
        headers = header_map(scope["headers"])
        try:
            raw = await self._receive_body(headers, receive)
        except RequestError as exc:
            return _json_response(exc.status, exc.body())
        except ClientDisconnect:  # gone before the body arrived: nothing was decided
            return Response(status_code=400)
        outcome = self.attempt(scope["path"], headers, scope["headers"], raw, started)
        if isinstance(outcome, Answer):
            return _json_response(outcome.status, outcome.body, outcome.headers)
        return SubscriberResponse(self, outcome.relay, outcome.subscription, started)

    def body_too_large(self, declared: str | None) -> RequestError | None:
        """The 413 for a request whose declared Content-Length is over ``--max-body-bytes``."""
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return RequestError(413, f"request body is over the limit of {limit} bytes", "body_too_large")
        return None

    def attempt(
        self,
        route: str,
        headers: Mapping[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        raw: bytes,
        started: float,
    ) -> Answer | Joined:
        """One generation attempt whose body is in: validated, keyed and decided by the policy,
        its effects carried out. Either the answer to send now (bad input, a refusal) or the
        execution's relay the attempt now subscribes to. Called by the ASGI path
        (``generate_asgi``) and by the callback path (``exporter.exchange``) alike."""
        try:
            body = parse_body(raw)
            prompt_tokens = validate(route, body, self.settings.vocab_size)
            call_id = find_call_id(headers, self.settings.call_id_header)
        except RequestError as exc:
            return Answer(exc.status, exc.body())
        except CallIdError as exc:
            return Answer(400, error_body(str(exc), "invalid_request_error", "invalid_call_id"))
        key = call_key(call_id, route, body, self.settings.key_without_id, caller_scope(headers), raw)
        stream = bool(body.get("stream", False))
        attempt = Attempt(
            key,
            identified=call_id is not None,
            client_says_retry=sdk_says_retry(headers),
            prompt_tokens=prompt_tokens,
        )
        declared = sdk_read_timeout(headers)
        if declared is not None:
            self.metrics.deadlines.declare(declared)
        result = self.policy.on_attempt(started, attempt)
        decision = result.decision
        if isinstance(decision, Shed):
            self.metrics.observe_attempt("shed", self.now() - started)
            if self.recorder is not None:
                self._record_arrival(started, prompt_tokens, body, key, headers, result.decision, None)
            return self._shed_answer(decision)
        if isinstance(decision, Created):
            upstream_request = UpstreamRequest(route, raw, forwardable_headers(raw_headers))
            relay = Relay(
                decision.execution_id,
                upstream_request,
                stream,
                started,
                self.settings.replay_limit_bytes,
                on_overflow=self.policy.stop_attaching,
                on_release=None if stream else self._answer_released,
            )
            self.relays[decision.execution_id] = relay
        else:
            relay = self.relays[decision.execution_id]
        # The upstream request goes out first (a dispatch writes it at once on an idle pooled
        # connection): the subscription is set up while the engine works on it.
        self.apply(result.effects)
        if self.recorder is not None:
            self._record_arrival(started, prompt_tokens, body, key, headers, decision, relay)
        return Joined(relay, relay.subscribe(decision.subscriber_id))

    def _record_arrival(
        self,
        started: float,
        prompt_tokens: int,
        body: dict[str, Any],
        key: str | None,
        headers: Mapping[str, str],
        decision: Decision,
        relay: Relay | None,
    ) -> None:
        assert self.recorder is not None
        caller = caller_scope(headers)
        self.recorder.arrived(started, prompt_tokens, body, key, caller, decision, relay, self.now())

    def _answer_released(self, size: int) -> None:
        self.answers_held -= size

    def _shed_answer(self, shed: Shed) -> Answer:
        """A shed attempt's answer, with Retry-After: the estimated wait for a first token, which
        clients that honour it (the OpenAI SDK, up to 60 s) wait instead of their own backoff."""
        wait = shed.retry_after_s if shed.retry_after_s is not None else 1.0
        headers = {"retry-after": str(max(1, math.ceil(wait)))}
        if shed.reason is ShedReason.RETRY_BUDGET:
            message = "retry budget exhausted: retries exceed their share of first attempts; retry later"
            return Answer(429, error_body(message, error_type(429), shed.reason.value), headers)
        if shed.reason is ShedReason.DEADLINE:
            message = "the proxy estimates this attempt would miss the clients' deadline"
        else:
            message = "the proxy's queue is full"
        return Answer(503, error_body(message, error_type(503), shed.reason.value), headers)

    # --- effects ----------------------------------------------------------------------------

    def apply(self, effects: list[Effect]) -> None:
        """Carry out what the policy decided."""
        for effect in effects:
            eid = effect.execution_id
            if isinstance(effect, Dispatch):
                relay = self.relays.get(eid)
                if relay is not None:
                    if self.closing:  # nothing new reaches the engine once the drain ran out
                        relay.finish(Outcome.FAILED, _SHUTTING_DOWN)
                        self.relays.pop(eid, None)
                    else:
                        execution = self.executions[eid] = Execution(self, relay)
                        execution.start()
            elif isinstance(effect, Cancel):
                self._clear_timer(eid)
                relay = self.relays.pop(eid, None)
                if relay is not None:
                    relay.finish(Outcome.CANCELLED)
                running = self.executions.get(eid)
                if running is not None:
                    running.abort()  # closes the upstream response: the engine aborts it
            elif isinstance(effect, Drop):
                relay = self.relays.pop(eid, None)
                if relay is not None:
                    relay.finish(Outcome.DROPPED)
            elif isinstance(effect, StartTimer):
                self._clear_timer(eid)
                loop = asyncio.get_running_loop()
                delay = max(0.0, effect.at - self.now())
                self._timers[eid] = loop.call_later(delay, self._on_timer, eid)

    def _clear_timer(self, execution_id: int) -> None:
        handle = self._timers.pop(execution_id, None)
        if handle is not None:
            handle.cancel()

    def _on_timer(self, execution_id: int) -> None:
        self._timers.pop(execution_id, None)
        now = self.now()
        execution = self.policy.execution(execution_id)
        if execution is not None and execution.cancel_at is not None and now < execution.cancel_at:
            # The loop's timer clock is coarser than time.monotonic: it fired a hair early.
            loop = asyncio.get_running_loop()
            delay = execution.cancel_at - now + 0.001
            self._timers[execution_id] = loop.call_later(delay, self._on_timer, execution_id)
            return
        self.apply(self.policy.on_timer(now, execution_id))

    # --- one execution's upstream request: what ``exporter.execution`` calls -----------------

    def body_sink(self, relay: Relay) -> Callable[[bytes], None]:
        """The per-chunk path of an execution's response body from its first bytes on: append
        to the relay (which writes a stream's chunk to its subscribers); after the first, account
        the first token; in a stream, at ``data: [DONE]`` (any of ``sse.DONE_ENDINGS``) complete
        the execution at once.

        NOTE: the first token is accounted after it was written to the subscribers, not before:
        the accounting is off the time to first token.

        NOTE: the upstream ends its response (the chunked terminator) in a later write than
        ``[DONE]``, and most clients (the OpenAI SDK among them) close the connection as soon as
        ``[DONE]`` arrives. Completing only at the end of the upstream response let such a client
        be counted as gone first, and its execution as orphaned. The policy therefore hears of
        the completion in the same callback that appends ``[DONE]``, before any subscriber can
        read it."""
        append = relay.append
        stream = relay.stream
        ends, n = sse.DONE_ENDINGS, max(map(len, sse.DONE_ENDINGS))
        last = b""  # the stream's last bytes, enough to see a [DONE] split across chunks
        first = True

        def sink(data: bytes) -> None:
            nonlocal last, first
            append(data)
            if first:
                first = False
                self._first_token(relay)
            if not stream:
                return
            last = data if len(data) >= n else (last + data)[-n:]
            if last.endswith(ends) and relay.outcome is None:
                self.complete(relay)

        return sink if self.recorder is None else self.recorder.watch(relay, sink)

    def first_event_is_error(self, relay: Relay, event: bytes) -> bool:
        """Whether a stream's first SSE event is the engine's error (vLLM's in-stream refusal);
        if so, the execution has been ended with it."""
        error = _error_event(event)
        if error is None:
            return False
        code = sse.error_code(error)
        message = str(error.get("message") or "the engine reported an error")[:500]
        if code == 503:
            self.end_with_error(relay, Outcome.REFUSED, 503, message, "engine_refused")
        else:
            # NOTE: as the same error's HTTP form is answered (``exporter.execution``): the
            # engine's 4xx is the client's (vLLM checks a stream's input as it begins: a prompt
            # over the context is a 200 whose first event carries code 400), anything else a 502.
            # All answered 502, a client's own mistake read as a broken upstream, and retried.
            status = code if code is not None and 400 <= code < 500 else 502
            self.end_with_error(relay, Outcome.FAILED, status, message, "upstream_error")
        return True

    def _first_token(self, relay: Relay) -> None:
        now = self.now()
        self.policy.on_first_token(now, relay.execution_id)
        self.metrics.ttft.observe(now - relay.created_at)

    def complete(self, relay: Relay) -> None:
        """The execution's response ended whole: the policy hears of it, the relay finishes."""
        effects = self.policy.on_completed(self.now(), relay.execution_id)
        self._clear_timer(relay.execution_id)
        if self.recorder is not None:
            self.recorder.completed(relay)
        self.relays.pop(relay.execution_id, None)
        relay.finish(Outcome.COMPLETED)
        self.apply(effects)

    def end_with_error(self, relay: Relay, outcome: Outcome, status: int, message: str, code: str) -> None:
        """The execution ends refused or failed: the policy hears of it, and its subscribers read
        ``status`` with an OpenAI-style error body."""
        eid = relay.execution_id
        if outcome is Outcome.REFUSED:
            effects = self.policy.on_refused(self.now(), eid)
        else:
            effects = self.policy.on_failed(self.now(), eid)
        self._clear_timer(eid)
        self.relays.pop(eid, None)
        relay.finish(outcome, (status, error_body(message, error_type(status), code)))
        self.apply(effects)

    # --- a subscriber leaving or finishing ----------------------------------------------------

    def subscriber_left(self, subscription: Subscription, started: float) -> None:
        now = self.now()
        self.metrics.observe_attempt("disconnected", now - started)
        if self.recorder is not None:
            self.recorder.ended(subscription, "left", now)
        self.apply(self.policy.on_subscriber_left(now, subscription.subscriber_id))

    def log_overrun(self, relay: Relay, subscription: Subscription) -> None:
        """One line for a subscriber dropped for lagging (``Relay.overrun``); its attempt is then
        accounted as a client's that disconnected (``subscriber_left``)."""
        log.warning(
            "closed a client %d bytes behind the stream of execution %d (stored compressed, over "
            "--replay-limit-bytes, %d): it is not reading; counted as disconnected",
            relay.end - subscription.offset,
            relay.execution_id,
            relay.limit_bytes,
        )

    def subscriber_delivered(self, subscription: Subscription, started: float) -> None:
        now = self.now()
        self.metrics.observe_attempt("delivered", now - started)
        if self.recorder is not None:
            self.recorder.ended(subscription, "delivered", now)
        self.policy.on_subscriber_delivered(now, subscription.subscriber_id)

    def settle(self, relay: Relay, sub: Subscription, started: float, response_started: bool) -> Ending:
        """Account the end of one subscriber's attempt once its execution ended or it left, and
        say what is left to write; both servers' paths (``SubscriberResponse``,
        ``exporter.exchange``) end their attempts here. ``Ending.BODY`` is accounted by
        :meth:`body_written`, once the answer is written."""
        outcome = relay.outcome
        # A streaming client that closes at ``[DONE]`` (before the end of the HTTP response) was
        # sent the whole completion: it counts as delivered, not as gone.
        sent_all = (
            outcome is Outcome.COMPLETED and relay.stream and response_started and sub.offset >= relay.end
        )
        if sub.left and not sent_all:
            self.subscriber_left(sub, started)
            return Ending.LEFT
        if outcome is Outcome.COMPLETED:
            if not relay.stream:
                return Ending.BODY
            self.subscriber_delivered(sub, started)
            return Ending.STREAM_END
        now = self.now()
        if self.recorder is not None:
            self.recorder.ended(sub, "refused" if outcome is Outcome.REFUSED else "failed", now)
        if outcome is Outcome.REFUSED:
            self.metrics.observe_attempt("refused", now - started)
        else:
            self.metrics.observe_attempt("failed", now - started)
            if outcome in (Outcome.CANCELLED, Outcome.DROPPED):
                # Not expected (the policy cancels or drops only executions nobody waits for);
                # make sure the policy forgets this subscriber all the same.
                self.apply(self.policy.on_subscriber_left(now, sub.subscriber_id))
        return Ending.ERROR

    def body_written(self, sub: Subscription, started: float) -> None:
        """A whole non-streaming answer was written: delivered, unless its client went away while
        it was written."""
        if sub.left:
            self.subscriber_left(sub, started)
        else:
            self.subscriber_delivered(sub, started)

    # --- a drained shutdown out of time -------------------------------------------------------

    def end_executions(self) -> None:
        """The drain bound expired (``foundation.server``): refuse new requests, and end every
        execution with a 503 its subscribers read (a stream gets an SSE error event, then
        ``[DONE]``; any other attempt a JSON error). Closing its upstream request makes the engine
        abort it."""
        self.closing = True
        now = self.now()
        for eid, relay in list(self.relays.items()):
            self.policy.on_failed(now, eid)  # its effects are dropped: nothing new is dispatched
            relay.finish(Outcome.FAILED, _SHUTTING_DOWN)
        self.relays.clear()
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for execution in list(self.executions.values()):
            execution.abort()

    # --- other routes -----------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's HTTP errors (405 on the proxy's own routes) as OpenAI-style JSON."""
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        code = "method_not_allowed" if status == 405 else "http_error"
        message = (
            f"{request.method} is not allowed on {request.scope['path']}" if status == 405 else exc.detail
        )
        headers = dict(exc.headers) if exc.headers else None
        return _json_response(status, error_body(message, error_type(status), code), headers)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        """A route other than the generation routes failed: a 500, as an OpenAI-style error."""
        return _json_response(*PROXY_ERROR)

    async def unrouted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A path none of the proxy's routes matches: passed through, or a 404 (or a 400 for a
        path that cannot be forwarded)."""
        request = Request(scope, receive)
        path: str = scope["path"]
        try:
            check_forwarded_path(path)
        except RequestError as exc:
            response = _json_response(exc.status, exc.body())
        else:
            if self.forwarded.forwards(path):
                await self._pass_through(request, send)
                return
            message = (
                f"{request.method} {path[:200]} is not a route of the proxy and is not forwarded"
                " to the engine (see the proxy's --passthrough)"
            )
            response = _json_response(404, error_body(message, error_type(404), "route_not_found"))
        await response(scope, receive, send)

    async def metrics_endpoint(self, request: Request) -> Response:
        refresh = self._refresh_upstream_metrics()
        if refresh is not None:  # wait a bounded time; past it, serve the last good text
            await asyncio.wait({refresh}, timeout=self.settings.upstream_metrics_timeout_s)
        self._sample()
        if self.settings.metrics_passthrough:
            await self.metrics.digest_upstream_text()  # in slices (see exporter.upstreamtext)
        body = self.metrics.exposition(self.settings.metrics_passthrough, self.now())
        return Response(body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def admin_executions(self, request: Request) -> Response:
        token = self.settings.admin_token
        if token is not None:
            # The header's bytes as they came (Starlette decodes them as Latin-1); the token is
            # visible ASCII (``ProxySettings``), so the two compare byte for byte. The scheme's
            # name is case-insensitive (RFC 9110, 11.1).
            scheme, _, given = request.headers.get("authorization", "").encode("latin-1").partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given, token.encode("ascii"))):
                body = error_body("a valid bearer token is required", "authentication_error", "unauthorized")
                return _json_response(401, body, {"www-authenticate": "Bearer"})
        try:
            limit = int(request.query_params.get("limit", "1000"))
        except ValueError:
            limit = -1
        if not 1 <= limit <= 10_000:
            return _json_response(
                400,
                error_body(
                    "'limit' must be an integer in [1, 10000]", "invalid_request_error", "invalid_limit"
                ),
            )
        listing = executions_listing(self.policy, self.relays, self.now(), limit)
        return _json_response(200, json.dumps(listing).encode())

    async def _pass_through(self, request: Request, send: Send) -> None:
        """Forward a request and relay its answer for as long as its client stays.

        NOTE: a client that leaves ends its request to the upstream (its connection closed), as
        nginx does: a load balancer or kubelet probing a wedged engine every few seconds with a
        1-s timeout otherwise left one upstream connection and two descriptors behind each time,
        for as long as the engine stayed wedged. A drain that runs out of time (the server cancels
        what is left) answers a request still waiting a 503, and logs one line, not a traceback."""
        scope, receive = request.scope, request.receive
        try:
            body = await self._read_body(request)
        except RequestError as exc:
            await _send_json(send, exc.status, exc.body())
            return
        except ClientDisconnect:  # gone before its body arrived (the server answered a 408)
            await Response(status_code=400)(scope, receive, send)
            return
        started = False

        async def send_on(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        async def relay() -> None:
            response = await self.passthrough(request, body)
            try:
                await response(scope, receive, send_on)
            finally:  # cancelled too (its client left): the upstream's answer is closed now
                if response.background is not None:
                    await response.background()

        relaying = asyncio.ensure_future(relay())
        gone = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait((relaying, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            relaying.cancel()
            gone.cancel()
            await asyncio.wait((relaying, gone))
            if not self.closing:
                raise
            log.warning(
                "shutdown: %s %s, passed through, had no answer from the upstream by the end of the drain;"
                " %s",
                scope["method"],
                scope["path"][:200],
                "its client got 503" if not started else "its client's connection is closed",
            )
            if not started:
                await _send_json(send, *SHUT_DOWN_UNANSWERED)
            else:
                _abort(scope)
            return
        if not relaying.done():  # its client left: so does the request to the upstream
            relaying.cancel()
            await asyncio.wait((relaying,))
            return
        gone.cancel()
        relaying.result()  # a fault in the proxy is raised on (a 500, logged)

    async def passthrough(self, request: Request, body: bytes) -> Response:
        """The upstream's answer to a request passed through (its body read), or the error."""
        headers = forwardable_headers(request.scope["headers"])
        # NOTE: the path exactly as the client wrote it (percent-escapes kept), not rebuilt: a URL
        # rebuilt from the request takes its authority from the Host header, which older
        # Starlettes did not check (``Host: x/sleep?`` made the path /sleep), and decodes ``%2F``.
        scope = request.scope
        path = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else quote(scope["path"])
        # Read-only requests (health checks, model listings) are bounded by the read timeout; a
        # POST is engine work, bounded by its client's deadline as a generation request is.
        read_timeout = self.settings.passthrough_read_timeout_s if request.method in READ_ONLY else None
        try:
            response = await self.upstream.open(
                request.method, path, body, headers, request.scope.get("query_string", b""), read_timeout
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.metrics.upstream_up = False
            message = f"upstream unreachable ({type(exc).__name__})"
            return _json_response(502, error_body(message, error_type(502), "upstream_unreachable"))
        except UpstreamBroken as exc:  # its head over the bounds
            message = f"upstream broken: {exc}"
            return _json_response(502, error_body(message, error_type(502), "upstream_broken"))
        except httpx.TimeoutException:
            message = (
                f"the upstream did not answer {request.method} {request.scope['path'][:200]} within"
                f" {read_timeout:g} s (the proxy's --passthrough-read-timeout)"
            )
            return _json_response(504, error_body(message, error_type(504), "upstream_timeout"))
        except httpx.HTTPError as exc:
            message = f"the upstream broke the connection before the response ({type(exc).__name__})"
            return _json_response(502, error_body(message, error_type(502), "upstream_broken"))
        if response.status_code < 200:  # httpx skips the other interim responses; 101 is final to it
            await response.aclose()
            message = f"the upstream answered an interim HTTP {response.status_code} as its response"
            return _json_response(502, error_body(message, error_type(502), "upstream_broken"))
        relayed = StreamingResponse(
            _relayed(response, request),
            status_code=response.status_code,
            background=BackgroundTask(response.aclose),
        )
        relayed.raw_headers = relayed_headers(response.headers.raw)  # repeated fields stay lines
        return relayed


async def _client_gone(receive: Receive) -> None:
    """Return when the client of a request whose body was read has gone (or its answer ended)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _abort(scope: Scope) -> None:
    """Close the client's connection at once (an answer cut short must not look whole)."""
    abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
    if abort is not None:
        abort()


async def _relayed(response: httpx.Response, request: Request) -> AsyncIterator[bytes]:
    """The body of an answer passed through, as it arrives. If the upstream breaks off or falls
    silent past the read timeout mid-answer, the client's connection is closed (its answer cut
    short, as nginx does) and one line is logged: an upstream's fault is no traceback."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning(
            "%s %s, passed through, ended mid-answer (%s): its client's connection is closed",
            request.method,
            request.scope["path"][:200],
            type(exc).__name__,
        )
        _abort(request.scope)
        await asyncio.sleep(0)  # the server hears of the closed connection before the end is sent


class SubscriberResponse(Response):
    """Streams one subscriber's view of an execution: replay, live bytes, then the end."""

    def __init__(self, proxy: Proxy, relay: Relay, subscription: Subscription, started: float) -> None:
        self.proxy = proxy
        self.relay = relay
        self.subscription = subscription
        self.started = started
        self.background = None
        self._accounted = False  # the attempt's end was reported to the policy and the metrics
        self._abort: Callable[[], None] | None = None  # closes the client's connection at once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay, sub = self.relay, self.subscription
        self._abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
        sub.lagging = self._lagging  # from here it reads at once whatever it is woken for
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        headers_sent = False
        self._accounted = False
        try:
            while not sub.left:
                if relay.stream:
                    data = relay.read(sub, READ_BYTES)  # bounded: the rest waits in the relay
                    if data:
                        if not headers_sent:
                            await send(self._start(200, relay.content_type))
                            headers_sent = True
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                        continue
                if relay.outcome is not None:
                    break
                await relay.wait(sub)
            await self._finish(send, headers_sent)
        finally:
            sub.lagging = None
            self._abort = None
            watcher.cancel()
            relay.unsubscribe(sub.subscriber_id)
            if not self._accounted:  # e.g. the server's send raised: the client is gone
                self.proxy.subscriber_left(sub, self.started)

    def _lagging(self) -> None:
        """New bytes while the task is writing (its transport paused): a client that lags past
        the bound is dropped as one that went away. Closing its connection ends the paused send
        (the server hears the connection lost); the loop then sees ``left``."""
        relay, sub = self.relay, self.subscription
        if sub.left or not relay.overrun(sub):
            return
        self.proxy.log_overrun(relay, sub)
        sub.left = True
        sub.lagging = None
        if self._abort is not None:
            self._abort()

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.subscription.left = True
                self.subscription.wake()
                return

    @staticmethod
    def _start(status: int, content_type: bytes, length: int | None = None) -> Message:
        headers = [(b"content-type", content_type), (b"cache-control", b"no-cache")]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        return {"type": "http.response.start", "status": status, "headers": headers}

    async def _finish(self, send: Send, headers_sent: bool) -> None:
        relay, sub, proxy = self.relay, self.subscription, self.proxy
        ending = proxy.settle(relay, sub, self.started, headers_sent)
        self._accounted = ending is not Ending.BODY
        if ending is Ending.LEFT:
            return
        if ending is Ending.STREAM_END:
            if not headers_sent:
                await send(self._start(200, relay.content_type))
            if not sub.left:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if ending is Ending.BODY:
            body = relay.read(sub)
            await send(self._start(relay.status, relay.content_type, len(body)))
            await send({"type": "http.response.body", "body": body, "more_body": False})
            self._accounted = True
            proxy.body_written(sub, self.started)
            return
        status, body = relay.error or ENDED_WITHOUT_ANSWER
        if headers_sent:  # mid-stream: an SSE error event, then the end of the stream
            event = relay.error_end(body)
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            start = self._start(status, _JSON, len(body))
            extra = relay.error_headers()
            if extra is not None:
                start["headers"].extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(settings: ProxySettings) -> Proxy:
    """The proxy's ASGI app (``Proxy(settings).app``, the proxy itself)."""
    return Proxy(settings).app
