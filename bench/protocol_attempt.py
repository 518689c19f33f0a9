"""The protocol floor plus the proxy's per-attempt work, all in callbacks: an estimate of what the
proxy's generation path would cost on asyncio protocols.

``bench/bench_floor.py`` measures it beside the pure floor (``bench/protocol_floor.py``), so the
difference is what the proxy's own work costs there. The work is the proxy's own code, imported
read-only:

* per attempt (a POST to a generation route): ``exporter.validation`` (``parse_body``,
  ``validate``), ``exporter.callkey`` (call id, caller scope, key, the SDK's retry counter), the
  decision of ``exporter.policy.Policy`` under the proxy's default settings
  (``exporter.settings.ProxySettings``), an ``exporter.relay.Relay`` per execution and a
  subscription per attempt, and the metrics the proxy keeps on the way
  (``exporter.metrics.ProxyMetrics``: time to first token, attempt durations);
* per chunk, in the upstream parser's callback: ``Relay.append``, then every subscriber's new
  bytes written to its own transport (the fan-out, without a task or a future per chunk); at
  ``data: [DONE]`` the execution completes and every subscriber is delivered;
* what is on the way to the first token goes first: the upstream request is written as soon as
  the policy has decided (the subscription is set up after it), and the first chunk is written to
  the subscribers before it is accounted (``Policy.on_first_token``, the TTFT histogram), with
  the time taken on its arrival (about 0.05 ms less added TTFT at p50 than the other order);
* a client that leaves: ``Policy.on_subscriber_left``, whose effects are carried out (a
  deferred-cancellation timer on ``loop.call_later``, a cancel that closes the upstream
  connection so the engine aborts).

A subscriber whose transport asks to stop writing (``pause_writing``: the client reads slower
than the engine writes) is skipped by the fan-out and lags in the relay's compressed buffer; it
catches up from there on ``resume_writing``. Other paths are forwarded as the floor does.

A prototype, not the proxy: no /metrics, admin or drain, no per-second sampling, no bounds on
heads or timeouts, and an upstream answer other than a 200 fails the execution with a 502 (the
proxy relays 4xx statuses and reads vLLM's refusals).

Run: ``python bench/protocol_attempt.py --upstream http://127.0.0.1:8000 --port 8103``
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvloop
from protocol_floor import ClientConnection, UpstreamConnection, UpstreamPool, response_head, serve

from exporter.callkey import CallIdError, call_key, caller_scope, find_call_id, sdk_says_retry
from exporter.metrics import ProxyMetrics
from exporter.policy import Attempt, Cancel, Created, Dispatch, Drop, Effect, Policy, Shed, StartTimer
from exporter.relay import Outcome, Relay, Subscription
from exporter.settings import ProxySettings
from exporter.validation import GENERATION_ROUTES, RequestError, parse_body, validate
from foundation.errors import error_body, error_type
from foundation.metricnames import ShedReason

DONE_EVENT = b"data: [DONE]\n\n"
ERROR_BODY_LIMIT = 64 * 1024


class Core:
    """The policy, the metrics and the executions in flight of one prototype proxy."""

    def __init__(self, settings: ProxySettings, pool: UpstreamPool) -> None:
        self.settings = settings
        self.pool = pool
        self.policy = Policy(settings.policy_config())
        self.metrics = ProxyMetrics(
            self.policy, settings.window_s, settings.capacity, settings.upstream_metrics_max_staleness_s
        )
        self.flights: dict[int, Flight] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}

    @staticmethod
    def now() -> float:
        return time.monotonic()

    def attempt(self, conn: AttemptConnection, route: str, raw: bytes) -> None:
        """Validate, key and decide one attempt; subscribe its connection to the execution."""
        started = self.now()
        headers: dict[str, str] = {}
        for name, value in reversed(conn.headers):
            headers[name.decode("latin-1")] = value.decode("latin-1")
        settings = self.settings
        try:
            if len(raw) > settings.max_body_bytes:
                raise RequestError(413, "request body is over the limit", "body_too_large")
            body = parse_body(raw)
            prompt_tokens = validate(route, body, settings.vocab_size)
            call_id = find_call_id(headers, settings.call_id_header)
        except RequestError as exc:
            conn.respond(exc.status, exc.body())
            return
        except CallIdError as exc:
            conn.respond(400, error_body(str(exc), "invalid_request_error", "invalid_call_id"))
            return
        key = call_key(call_id, route, body, settings.key_without_id, caller_scope(headers), raw)
        attempt = Attempt(
            key,
            identified=call_id is not None,
            client_says_retry=sdk_says_retry(headers),
            prompt_tokens=prompt_tokens,
        )
        result = self.policy.on_attempt(started, attempt)
        decision = result.decision
        if isinstance(decision, Shed):
            self.metrics.observe_attempt("shed", self.now() - started)
            conn.respond(*shed_response(decision))
            return
        if isinstance(decision, Created):
            relay = Relay(
                decision.execution_id,
                None,
                bool(body.get("stream", False)),
                started,
                settings.replay_limit_bytes,
                on_overflow=self.policy.stop_attaching,
            )
            request = self.pool.request_bytes(b"POST", route.encode(), conn.headers, raw)
            flight = self.flights[decision.execution_id] = Flight(self, relay, request)
        else:
            flight = self.flights[decision.execution_id]
        self.apply(result.effects)  # first: the upstream request is written before the bookkeeping
        flight.subscribe(conn, flight.relay.subscribe(decision.subscriber_id), started)

    def apply(self, effects: list[Effect]) -> None:
        """Carry out what the policy decided."""
        for effect in effects:
            eid = effect.execution_id
            if isinstance(effect, Dispatch):
                flight = self.flights.get(eid)
                if flight is not None:
                    flight.dispatch()
            elif isinstance(effect, Cancel):
                self.clear_timer(eid)
                flight = self.flights.pop(eid, None)
                if flight is not None:
                    flight.cancel()
            elif isinstance(effect, Drop):
                flight = self.flights.pop(eid, None)
                if flight is not None:
                    flight.relay.finish(Outcome.DROPPED)
            elif isinstance(effect, StartTimer):
                self.clear_timer(eid)
                delay = max(0.0, effect.at - self.now())
                self.timers[eid] = asyncio.get_running_loop().call_later(delay, self.on_timer, eid)

    def clear_timer(self, execution_id: int) -> None:
        handle = self.timers.pop(execution_id, None)
        if handle is not None:
            handle.cancel()

    def on_timer(self, execution_id: int) -> None:
        self.timers.pop(execution_id, None)
        now = self.now()
        execution = self.policy.execution(execution_id)
        if execution is not None and execution.cancel_at is not None and now < execution.cancel_at:
            delay = execution.cancel_at - now + 0.001  # the loop's clock is coarser than monotonic
            self.timers[execution_id] = asyncio.get_running_loop().call_later(
                delay, self.on_timer, execution_id
            )
            return
        self.apply(self.policy.on_timer(now, execution_id))


def shed_response(shed: Shed) -> tuple[int, bytes]:
    if shed.reason is ShedReason.RETRY_BUDGET:
        message = "retry budget exhausted: retries exceed their share of first attempts; retry later"
        return 429, error_body(message, error_type(429), shed.reason.value)
    return 503, error_body("the proxy shed the attempt", error_type(503), shed.reason.value)


def first_event_error(data: bytes) -> dict[str, object] | None:
    """The error object if the stream's first event is ``data: {"error": ...}`` (vLLM's
    in-stream refusal), else None."""
    if not data.startswith(b"data: {") or b"error" not in data[:64]:
        return None
    try:
        parsed = orjson.loads(data.split(b"\n\n", 1)[0][5:])
    except orjson.JSONDecodeError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return error if isinstance(error, dict) else None


class Flight:
    """One execution's upstream exchange (an ``Exchange`` of the pool) and its subscribers."""

    def __init__(self, core: Core, relay: Relay, request: bytes) -> None:
        self.core = core
        self.relay = relay
        self.request: bytes | None = request  # held until dispatched
        self.upstream: UpstreamConnection | None = None
        self.subscribers: dict[int, tuple[AttemptConnection, Subscription]] = {}
        self.status = 0
        self.error_parts: list[bytes] = []
        self.first = True
        self.last = b""  # the stream's last bytes, to see a [DONE] split across chunks

    @property
    def abandoned(self) -> bool:
        """Nobody waits for the upstream answer any more (the execution ended meanwhile)."""
        return self.relay.outcome is not None

    def subscribe(self, conn: AttemptConnection, sub: Subscription, started: float) -> None:
        self.subscribers[sub.subscriber_id] = (conn, sub)
        conn.flight, conn.sub, conn.attempt_started = self, sub, started
        if self.relay.stream:
            replay = self.relay.read(sub)  # an attached retry first gets what was streamed so far
            if replay:
                conn.write_chunk(replay)

    def dispatch(self) -> None:
        request, self.request = self.request, None
        if request is not None:
            self.core.pool.send(self, request)

    def cancel(self) -> None:
        self.relay.finish(Outcome.CANCELLED)
        if self.upstream is not None:
            self.upstream.abort()  # the engine sees the disconnect and aborts

    # Exchange
    def bind_upstream(self, conn: UpstreamConnection) -> None:
        self.upstream = conn

    def upstream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        for name, value in headers:
            if name == b"content-type":
                self.relay.content_type = value
        self.relay.status = status

    def upstream_body(self, data: bytes) -> None:
        relay = self.relay
        if self.status != 200:
            if sum(map(len, self.error_parts)) < ERROR_BODY_LIMIT:
                self.error_parts.append(data)
            return
        if relay.outcome is not None:
            return
        core = self.core
        first_token_at = None
        if self.first:
            self.first = False
            if relay.stream and (error := first_event_error(data)) is not None:
                code = error.get("code")
                self.end_with_error(Outcome.REFUSED if code in (503, "503") else Outcome.FAILED)
                return
            first_token_at = core.now()
        relay.append(data)
        if relay.stream:
            read = relay.read
            for conn, sub in self.subscribers.values():
                if conn.paused:  # a slow reader lags in the relay's buffer, not in its transport's
                    continue
                chunk = read(sub)
                if chunk:
                    conn.write_chunk(chunk)
        if first_token_at is not None:  # accounted after the writes, off the time to first token
            core.policy.on_first_token(first_token_at, relay.execution_id)
            core.metrics.ttft.observe(first_token_at - relay.created_at)
        if relay.stream:
            n = len(DONE_EVENT)
            self.last = data if len(data) >= n else (self.last + data)[-n:]
            if self.last.endswith(DONE_EVENT):
                self.complete()

    def upstream_end(self) -> None:
        self.upstream = None
        if self.status != 200:
            self.end_with_error(Outcome.REFUSED if self.status == 503 else Outcome.FAILED)
        else:
            self.complete()

    def upstream_failed(self, reason: str) -> None:
        self.upstream = None
        self.end_with_error(Outcome.FAILED)

    # the end of the execution
    def complete(self) -> None:
        relay, core = self.relay, self.core
        if relay.outcome is not None:
            return
        now = core.now()
        effects = core.policy.on_completed(now, relay.execution_id)
        core.clear_timer(relay.execution_id)
        core.flights.pop(relay.execution_id, None)
        relay.finish(Outcome.COMPLETED)
        subscribers, self.subscribers = self.subscribers, {}
        for conn, _ in subscribers.values():
            conn.deliver(now)
        core.apply(effects)

    def end_with_error(self, outcome: Outcome) -> None:
        relay, core = self.relay, self.core
        if relay.outcome is not None:
            return
        now = core.now()
        eid = relay.execution_id
        if outcome is Outcome.REFUSED:
            effects = core.policy.on_refused(now, eid)
            status, code = 503, "engine_refused"
        else:
            effects = core.policy.on_failed(now, eid)
            status, code = 502, "upstream_error"
        body = error_body("the upstream did not answer the request", error_type(status), code)
        core.clear_timer(eid)
        core.flights.pop(eid, None)
        relay.finish(outcome, (status, body))
        subscribers, self.subscribers = self.subscribers, {}
        for conn, _ in subscribers.values():
            conn.fail(now, outcome, status, body)
        core.apply(effects)


class AttemptConnection(ClientConnection):
    """A client connection whose generation requests are attempts (``Core.attempt``)."""

    def __init__(self, pool: UpstreamPool, core: Core) -> None:
        super().__init__(pool)
        self.core = core
        self.flight: Flight | None = None
        self.sub: Subscription | None = None
        self.attempt_started = 0.0

    def handle(self, method: bytes, body: bytes) -> None:
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        if method == b"POST" and path in GENERATION_ROUTES:
            self.core.attempt(self, path, body)
        else:
            super().handle(method, body)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        flight, sub = self.flight, self.sub
        if flight is not None and sub is not None:
            self.flight = self.sub = None
            flight.subscribers.pop(sub.subscriber_id, None)
            flight.relay.unsubscribe(sub.subscriber_id)
            core = self.core
            now = core.now()
            core.metrics.observe_attempt("disconnected", now - self.attempt_started)
            core.apply(core.policy.on_subscriber_left(now, sub.subscriber_id))

    def pause_writing(self) -> None:
        if self.flight is None:
            super().pause_writing()
        else:
            self.paused = True

    def resume_writing(self) -> None:
        flight, sub = self.flight, self.sub
        if flight is None or sub is None:
            super().resume_writing()
            return
        self.paused = False
        if flight.relay.stream:
            chunk = flight.relay.read(sub)  # catch up from the relay's buffer
            if chunk:
                self.write_chunk(chunk)

    def _leave(self) -> Subscription:
        flight, sub = self.flight, self.sub
        assert flight is not None and sub is not None
        self.flight = self.sub = None
        flight.relay.unsubscribe(sub.subscriber_id)
        return sub

    def deliver(self, now: float) -> None:
        """The execution completed: end the stream (or send the whole body)."""
        relay = self.flight.relay if self.flight is not None else None
        sub = self._leave()
        assert relay is not None
        if relay.stream:
            rest = relay.read(sub)  # what a paused subscriber has not been sent yet
            if rest:
                self.write_chunk(rest)
            elif not self.started and self.head is None:
                self.head = self.stream_head(relay.content_type)
            self.end_chunks()
        else:
            body = relay.read(sub)
            headers = [(b"content-type", relay.content_type), (b"content-length", str(len(body)).encode())]
            self.write_transport().write(response_head(relay.status, headers, chunked=False) + body)
            self.finish()
        core = self.core
        core.metrics.observe_attempt("delivered", now - self.attempt_started)
        core.policy.on_subscriber_delivered(now, sub.subscriber_id)

    def fail(self, now: float, outcome: Outcome, status: int, body: bytes) -> None:
        self._leave()
        outcome_label = "refused" if outcome is Outcome.REFUSED else "failed"
        self.core.metrics.observe_attempt(outcome_label, now - self.attempt_started)
        if self.started:  # mid-stream: an SSE error event, then the end of the stream
            self.write_chunk(b"data: " + body + b"\n\n" + DONE_EVENT)
            self.end_chunks()
        else:
            self.respond(status, body)

    @staticmethod
    def stream_head(content_type: bytes) -> bytes:
        headers = [(b"content-type", content_type), (b"cache-control", b"no-cache")]
        return response_head(200, headers, chunked=True)

    def write_chunk(self, data: bytes) -> None:
        if not self.started and self.head is None:  # an attempt's answer: the head is the proxy's
            content_type = self.flight.relay.content_type if self.flight is not None else b"text/event-stream"
            self.head = self.stream_head(content_type)
        super().write_chunk(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream", required=True, help="base URL of the upstream, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8103)
    args = parser.parse_args()
    settings = ProxySettings(upstream=args.upstream, host=args.host, port=args.port)
    pool = UpstreamPool(settings.upstream_base)
    core = Core(settings, pool)

    class Connection(AttemptConnection):
        def __init__(self, pool: UpstreamPool) -> None:
            super().__init__(pool, core)

    uvloop.run(serve(args.port, args.host, pool, Connection))


if __name__ == "__main__":
    main()
