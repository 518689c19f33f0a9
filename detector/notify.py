"""Notifiers (webhook, Alertmanager API v2) and the dispatcher that delivers each once.

The store queues one row per (episode, notifier, firing|resolved) in the transaction that
opens or resolves the episode; the :class:`Dispatcher` delivers them from a bounded queue per
notifier, each on a worker thread of its own (a receiver that hangs or fails delays only its own
deliveries), with a deadline on each whole delivery (:data:`DELIVERY_DEADLINE_S`) and retries
with exponential backoff, and marks each row sent. A restart picks up what was not sent
(``Dispatcher.requeue_unsent``); nothing sent is sent again. A delivery the database refuses to
mark sent is remembered and marked on the next round, and not sent again meanwhile.

Alertmanager resolves an alert by itself ``resolve_timeout`` after the last time it heard of
it, so :meth:`AlertmanagerNotifier.refresh` re-posts the firing alerts (Prometheus does the
same); Alertmanager deduplicates them, receivers are notified once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import httpx

from detector.episodes import AlertEpisode
from detector.runbook import DEFAULT_PATTERN, runbook_url
from detector.store import EpisodeStore, store_error
from foundation.redact import redact_text, redact_url

log = logging.getLogger("retrywatch.detector.notify")
#: Deliveries a dispatcher remembers having made, so that a stale read of the store cannot queue
#: one again (each episode's firing and resolution goes to each notifier once).
SENT_MEMORY = 10_000
#: Seconds one delivery may take in all: connect, send the request, read the whole answer. Past it
#: the delivery fails (logged, counted as an error) and is retried with the dispatcher's backoff.
DELIVERY_DEADLINE_S = 10.0
#: Bytes of a receiver's answer kept (for the error message of a refusal); the rest is read, not kept.
ANSWER_KEPT_BYTES = 4096


class NotifyError(RuntimeError):
    """A notifier could not deliver (network error, timeout, or a non-2xx answer)."""


class Notifier(Protocol):
    name: str

    def send(self, episode: AlertEpisode, kind: str) -> None: ...

    def close(self) -> None: ...


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat().replace("+00:00", "Z")


def _positive(deadline_s: float) -> float:
    if not deadline_s > 0 or deadline_s == float("inf"):
        raise ValueError(f"a delivery's deadline must be a positive number of seconds, got {deadline_s!r}")
    return deadline_s


def post_json(
    url: str, doc: object, *, timeout_s: float, deadline_s: float, what: str, tls: ssl.SSLContext
) -> tuple[int, str]:
    """POST ``doc`` as JSON to ``url``; the answer's status and the start of its body. Raises
    :class:`NotifyError` (``what`` names the receiver) on a network error, or when connecting,
    sending and reading the whole answer take more than ``deadline_s`` in all.

    NOTE: an HTTP client's timeout (``timeout_s`` here, httpx's) bounds each read, not the answer: a
    receiver that trickled its answer a byte every few seconds held its notifier's worker for as
    long as it trickled, and every notification behind it. The exchange runs on an event loop of
    its own under one ``asyncio.timeout``, which cancels it wherever it waits (connect, a write, a
    read of the head or the body) and closes its connection; each delivery opens one (``tls``, made
    once per notifier, keeps that cheap: httpx makes one for every client it creates otherwise)."""

    async def exchange() -> tuple[int, str]:
        async with (
            asyncio.timeout(deadline_s),
            httpx.AsyncClient(timeout=timeout_s, verify=tls) as client,
            client.stream("POST", url, json=doc) as resp,
        ):
            kept = bytearray()
            async for chunk in resp.aiter_bytes():
                kept += chunk[: max(0, ANSWER_KEPT_BYTES - len(kept))]
            return resp.status_code, kept.decode("utf-8", errors="replace")

    try:
        return asyncio.run(exchange())
    except TimeoutError as exc:
        raise NotifyError(f"{what}: no complete answer within {deadline_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise NotifyError(f"{what}: {redact_text(repr(exc), [url])}") from exc


class WebhookNotifier:
    """POSTs one JSON document per firing or resolution; ``timeout_s`` bounds each network
    operation, ``deadline_s`` the whole delivery (:func:`post_json`)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        deadline_s: float = DELIVERY_DEADLINE_S,
        name: str = "webhook",
        runbook_pattern: str = DEFAULT_PATTERN,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must be http(s)://..., got {redact_url(url)!r}")
        self.url = url
        self.runbook_pattern = runbook_pattern
        self.display_url = redact_url(url)  # its credentials masked, for messages
        self.name = name
        self.timeout_s = timeout_s
        self.deadline_s = _positive(deadline_s)
        self._tls = httpx.create_ssl_context()

    def payload(self, episode: AlertEpisode, kind: str) -> dict[str, object]:
        return {
            "version": 1,
            "status": kind,
            "alert": {
                **episode.as_dict(),
                "runbook_url": runbook_url(self.runbook_pattern, episode.alertname),
            },
        }

    def send(self, episode: AlertEpisode, kind: str) -> None:
        what = f"webhook {self.display_url}"
        status, _ = post_json(
            self.url,
            self.payload(episode, kind),
            timeout_s=self.timeout_s,
            deadline_s=self.deadline_s,
            what=what,
            tls=self._tls,
        )
        if status >= 300:
            raise NotifyError(f"{what}: HTTP {status}")

    def close(self) -> None:
        """Nothing to release: each delivery opens and closes its own connection."""


class AlertmanagerNotifier:
    """Posts alerts to Alertmanager's API v2 (``POST /api/v2/alerts``); ``timeout_s`` bounds each
    network operation, ``deadline_s`` each whole post (:func:`post_json`)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        deadline_s: float = DELIVERY_DEADLINE_S,
        generator_url: str = "",
        name: str = "alertmanager",
        runbook_pattern: str = DEFAULT_PATTERN,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Alertmanager URL must be http(s)://..., got {redact_url(url)!r}")
        self.runbook_pattern = runbook_pattern
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.display_url = redact_url(self.url)  # its credentials masked, for messages
        self.name = name
        self.generator_url = generator_url
        self.timeout_s = timeout_s
        self.deadline_s = _positive(deadline_s)
        self._tls = httpx.create_ssl_context()

    def alert(self, episode: AlertEpisode, kind: str) -> dict[str, object]:
        labels = {"alertname": episode.alertname, "severity": episode.severity, "source": "retrywatch"}
        labels.update({k: v for k, v in episode.labels.as_dict().items() if v})
        doc: dict[str, object] = {
            "labels": labels,
            "annotations": {
                "summary": episode.summary,
                "description": episode.description,
                "runbook_url": runbook_url(self.runbook_pattern, episode.alertname),
            },
            "startsAt": _iso(episode.started_at),
        }
        if kind == "resolved" and episode.resolved_at is not None:
            doc["endsAt"] = _iso(max(episode.resolved_at, episode.started_at))
        if self.generator_url:
            doc["generatorURL"] = self.generator_url
        return doc

    def _post(self, alerts: list[dict[str, object]]) -> None:
        what = f"Alertmanager {self.display_url}"
        status, text = post_json(
            self.url, alerts, timeout_s=self.timeout_s, deadline_s=self.deadline_s, what=what, tls=self._tls
        )
        if status >= 300:
            raise NotifyError(f"{what}: HTTP {status} {text[:200]}")

    def send(self, episode: AlertEpisode, kind: str) -> None:
        self._post([self.alert(episode, kind)])

    def refresh(self, firing: Sequence[AlertEpisode]) -> None:
        """Re-post the alerts still firing so Alertmanager does not time them out."""
        if firing:
            self._post([self.alert(ep, "firing") for ep in firing])

    def close(self) -> None:
        """Nothing to release: each post opens and closes its own connection."""


@dataclass(frozen=True)
class _Refresh:
    """A worker's job: re-post the alerts still firing to one Alertmanager."""

    target: AlertmanagerNotifier
    firing: list[AlertEpisode]


# What a notifier's worker takes: one delivery (episode, notifier, kind), a refresh, or None to stop.
_Job = tuple[AlertEpisode, str, str] | _Refresh | None


class Dispatcher:
    """Delivers queued notifications: per notifier a bounded queue and a worker thread of its
    own (so one receiver's timeouts and retries never hold back another's), retries, backoff."""

    def __init__(
        self,
        store: EpisodeStore,
        notifiers: Sequence[Notifier],
        *,
        max_queue: int = 1000,
        retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        on_result: Callable[[str, str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.notifiers = {n.name: n for n in notifiers}
        if len(self.notifiers) != len(notifiers):
            raise ValueError("notifier names must be unique")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.on_result = on_result
        self._sleep = sleep
        self._queues: dict[str, queue.Queue[_Job]] = {
            name: queue.Queue(maxsize=max_queue) for name in self.notifiers
        }
        self._inflight: set[tuple[int, str, str]] = set()
        self._unmarked: set[tuple[int, str, str]] = set()  # delivered; the store refused to mark it
        # Delivered by this dispatcher, newest last (at most SENT_MEMORY): a row of one that
        # :meth:`requeue_unsent` read just before it was marked sent is not queued again.
        self._sent: dict[tuple[int, str, str], None] = {}
        self._refreshing: set[str] = set()  # Alertmanagers with a refresh queued or in progress
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.dropped = 0

    @property
    def names(self) -> list[str]:
        return list(self.notifiers)

    def start(self) -> None:
        if not self._threads:
            for name, q in self._queues.items():
                thread = threading.Thread(
                    target=self._run, args=(q,), name=f"retrywatch-notify-{name}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def submit(self, episode: AlertEpisode, notifier: str, kind: str) -> bool:
        """Queue one delivery; False when the queue is full (it stays unsent in the store and is
        picked up again by :meth:`requeue_unsent`)."""
        key = (episode.id or 0, notifier, kind)
        q = self._queues.get(notifier)
        if q is None:
            raise ValueError(f"no notifier named {notifier!r}")
        with self._lock:
            if key in self._inflight or key in self._unmarked or key in self._sent:
                return True
            try:
                q.put_nowait((episode, notifier, kind))
            except queue.Full:
                self.dropped += 1
                return False
            self._inflight.add(key)
        return True

    def requeue_unsent(self) -> int:
        """Queue every delivery the store holds as unsent (after a restart, or a full queue),
        after marking sent those delivered while the store refused the mark."""
        with self._lock:
            unmarked = sorted(self._unmarked)
        for key in unmarked:
            self.store.mark_sent(*key)
            with self._lock:
                self._unmarked.discard(key)
        n = 0
        for episode, notifier, kind in self.store.unsent():
            if notifier in self.notifiers and self.submit(episode, notifier, kind):
                n += 1
        return n

    def idle(self) -> bool:
        with self._lock:
            return not self._inflight

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.02)
        return self.idle()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for q in self._queues.values():
            with contextlib.suppress(queue.Full):
                q.put_nowait(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = []
        for n in self.notifiers.values():
            n.close()

    def refresh(self, firing: Sequence[AlertEpisode]) -> None:
        """Re-post the alerts still firing to every Alertmanager, each on its own worker (one
        that hangs delays nothing else); skipped for one whose last refresh is still queued."""
        for name, target in self.notifiers.items():
            if not isinstance(target, AlertmanagerNotifier) or not firing:
                continue
            with self._lock:
                if name in self._refreshing:
                    continue
                try:
                    self._queues[name].put_nowait(_Refresh(target, list(firing)))
                except queue.Full:
                    continue
                self._refreshing.add(name)

    def _run(self, q: queue.Queue[_Job]) -> None:
        while not self._stop.is_set():
            item = q.get()
            if item is None:
                return
            if isinstance(item, _Refresh):
                try:
                    item.target.refresh(item.firing)
                except Exception as exc:  # the next refresh tries again
                    log.warning("alertmanager refresh failed: %s", exc)
                finally:
                    with self._lock:
                        self._refreshing.discard(item.target.name)
                continue
            episode, notifier, kind = item
            try:
                self._deliver(episode, notifier, kind)
            except Exception:  # the worker must outlive any one delivery; it stays unsent
                log.exception("notify %s %s %s failed", notifier, kind, episode.alertname)
            finally:
                with self._lock:
                    self._inflight.discard((episode.id or 0, notifier, kind))

    def _deliver(self, episode: AlertEpisode, notifier: str, kind: str) -> None:
        target = self.notifiers[notifier]
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                target.send(episode, kind)
            except NotifyError as exc:
                log.warning("notify %s %s %s failed (attempt %d): %s", notifier, kind, episode.alertname,
                            attempt + 1, exc)  # fmt: skip
                self._record_failure(episode.id or 0, notifier, kind, str(exc))
                if self.on_result:
                    self.on_result(notifier, "error")
                if attempt == self.retries or self._stop.is_set():
                    return  # stays unsent; requeue_unsent retries it later
                self._sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            key = (episode.id or 0, notifier, kind)
            self._mark_sent(key)
            with self._lock:
                self._sent[key] = None
                if len(self._sent) > SENT_MEMORY:
                    del self._sent[next(iter(self._sent))]
            if self.on_result:
                self.on_result(notifier, "sent")
            return

    def _mark_sent(self, key: tuple[int, str, str]) -> None:
        try:
            self.store.mark_sent(*key)
        except Exception as exc:  # delivered: never send it again; mark it on the next round
            log.warning(
                "notify %s %s of episode %d delivered, but the store refused to mark it sent "
                "(marked on the next round): %s",
                key[1], key[2], key[0], store_error(exc),
            )  # fmt: skip
            with self._lock:
                self._unmarked.add(key)

    def _record_failure(self, episode_id: int, notifier: str, kind: str, error: str) -> None:
        try:
            self.store.mark_failed(episode_id, notifier, kind, error)
        except Exception as exc:  # only bookkeeping: the row stays unsent either way
            log.debug("recording a failed notification failed: %s", store_error(exc))
