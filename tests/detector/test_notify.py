"""Notifiers against real servers: a webhook receiver and a real Alertmanager; each firing and
each resolution delivered once, retried with backoff, and not lost or repeated by a restart."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from detector.evaluator import Transition
from detector.notify import AlertmanagerNotifier, Dispatcher, NotifyError, WebhookNotifier
from detector.signals import EngineLabels
from detector.store import EpisodeStore
from tests.detector.conftest import TestServer, wait_until

LABELS = EngineLabels("0", "qwen", "proxy-a")

WIKI_PATTERN = "https://wiki.example/rw#{alert}"


def _tr(kind: str, at: float) -> Transition:
    return Transition(kind=kind, alertname="VLLMMetastableRetryLoop", severity="critical", labels=LABELS,  # type: ignore[arg-type]
                      at=at, started_at=1000.0, value=2.0, summary="loop", description="desc")  # fmt: skip


def test_webhook_retries_with_backoff_and_delivers_each_transition_once(
    tmp_path: Path, http_server: TestServer
) -> None:
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    sleeps: list[float] = []
    hook = WebhookNotifier(
        http_server.url + "/hook", timeout_s=2.0, name="webhook0", runbook_pattern=WIKI_PATTERN
    )
    disp = Dispatcher(
        store, [hook], retries=3, backoff_s=0.05, sleep=lambda s: (sleeps.append(s), time.sleep(s))[1]
    )
    disp.start()
    http_server.fail_next = 2
    ep = store.record(_tr("firing", 1000.0), disp.names)
    assert ep is not None
    disp.submit(ep, "webhook0", "firing")
    disp.submit(ep, "webhook0", "firing")  # a duplicate submission is ignored while in flight
    assert disp.wait_idle(10)
    assert sleeps == [0.05, 0.1]  # two failures, exponential backoff
    assert [p["status"] for p in http_server.posts] == ["firing"]  # type: ignore[index]
    body = http_server.posts[0]
    assert body["alert"]["alertname"] == "VLLMMetastableRetryLoop"  # type: ignore[index]
    assert body["alert"]["runbook_url"] == "https://wiki.example/rw#VLLMMetastableRetryLoop"  # type: ignore[index]
    assert store.unsent() == []
    assert disp.requeue_unsent() == 0  # nothing left to send: nothing is sent twice
    done = store.record(_tr("resolved", 1300.0), disp.names)
    assert done is not None
    disp.submit(done, "webhook0", "resolved")
    assert disp.wait_idle(10)
    assert [p["status"] for p in http_server.posts] == ["firing", "resolved"]  # type: ignore[index]
    disp.close()
    store.close()


def test_undelivered_notifications_survive_a_restart_and_are_sent_once(
    tmp_path: Path, http_server: TestServer
) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}"
    store = EpisodeStore(url)
    http_server.fail_next = 100
    disp = Dispatcher(store, [WebhookNotifier(http_server.url, name="webhook0")], retries=1, backoff_s=0.01)
    disp.start()
    ep = store.record(_tr("firing", 1000.0), disp.names)
    disp.submit(ep, "webhook0", "firing")  # type: ignore[arg-type]
    assert disp.wait_idle(10)
    disp.close()
    store.close()
    assert http_server.posts == []
    # the receiver is back; a new detector process picks up what was not sent
    http_server.fail_next = 0
    store2 = EpisodeStore(url)
    disp2 = Dispatcher(store2, [WebhookNotifier(http_server.url, name="webhook0")])
    disp2.start()
    assert disp2.requeue_unsent() == 1
    assert disp2.wait_idle(10)
    assert disp2.requeue_unsent() == 0
    assert [p["status"] for p in http_server.posts] == ["firing"]  # type: ignore[index]
    disp2.close()
    store2.close()


def test_a_row_read_as_unsent_just_before_its_delivery_was_marked_is_not_sent_again(
    tmp_path: Path, http_server: TestServer
) -> None:
    """``requeue_unsent`` reads the unsent rows, then queues each: a delivery that finished and was
    marked sent in between was queued again, since nothing was in flight for it any more, and the
    receiver was told twice."""
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    disp = Dispatcher(store, [WebhookNotifier(http_server.url, name="webhook0")])
    disp.start()
    ep = store.record(_tr("firing", 1000.0), disp.names)
    assert ep is not None
    stale = store.unsent()  # read while the delivery is still to come
    disp.submit(ep, "webhook0", "firing")
    assert disp.wait_idle(10) and store.unsent() == []
    for episode, notifier, kind in stale:  # what requeue_unsent then does with its stale read
        disp.submit(episode, notifier, kind)
    assert disp.wait_idle(10)
    assert [p["status"] for p in http_server.posts] == ["firing"]  # type: ignore[index]
    disp.close()
    store.close()


def test_webhook_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="http"):
        WebhookNotifier("ftp://x")
    hook = WebhookNotifier("http://127.0.0.1:9/none", timeout_s=0.5)
    from detector.episodes import AlertEpisode

    ep = AlertEpisode("A", "warning", LABELS, 1.0, None, "s", "d", None, id=1)
    with pytest.raises(NotifyError, match="webhook"):
        hook.send(ep, "firing")
    hook.close()


def test_bounded_queue_drops_and_keeps_the_row_unsent(tmp_path: Path) -> None:
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    disp = Dispatcher(store, [WebhookNotifier("http://127.0.0.1:9/x", name="webhook0")], max_queue=1)
    eps = [store.record(_tr("firing", 1000.0 + i), disp.names) for i in range(1)]
    other = Transition(
        kind="firing", alertname="VLLMBacklogBeyondDeadline", severity="warning", labels=LABELS,
        at=1.0, started_at=1.0, value=1.0, summary="s", description="d",
    )  # fmt: skip
    eps.append(store.record(other, disp.names))
    assert disp.submit(eps[0], "webhook0", "firing")  # type: ignore[arg-type]
    assert not disp.submit(eps[1], "webhook0", "firing")  # type: ignore[arg-type]
    assert disp.dropped == 1 and len(store.unsent()) == 2
    disp.close()
    store.close()


def test_alertmanager_receives_firing_then_resolved(tmp_path: Path, alertmanager: str) -> None:
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    am = AlertmanagerNotifier(alertmanager)
    disp = Dispatcher(store, [am])
    disp.start()
    now = time.time()
    ep = store.record(_tr("firing", now), disp.names)
    assert ep is not None
    ep.started_at = now
    disp.submit(ep, "alertmanager", "firing")
    assert disp.wait_idle(10) and store.unsent() == []

    def active() -> list[dict[str, object]]:
        resp = httpx.get(
            f"{alertmanager}/api/v2/alerts", params={"filter": "alertname=VLLMMetastableRetryLoop"}
        )
        resp.raise_for_status()
        return [a for a in resp.json() if a["status"]["state"] == "active"]

    wait_until(lambda: len(active()) == 1, 10, "the alert in Alertmanager")
    alert = active()[0]
    assert alert["labels"] == {  # type: ignore[comparison-overlap]
        "alertname": "VLLMMetastableRetryLoop", "severity": "critical", "source": "retrywatch",
        "engine": "0", "model": "qwen", "instance": "proxy-a",
    }  # fmt: skip
    # By default the link opens the detector's own runbook page, at its default address.
    assert alert["annotations"]["runbook_url"] == (  # type: ignore[index]
        "http://127.0.0.1:8200/runbook#VLLMMetastableRetryLoop"
    )
    am.refresh([ep])  # a refresh is accepted and does not create a second alert
    assert len(active()) == 1
    resolved = Transition(
        kind="resolved", alertname=ep.alertname, severity="critical", labels=LABELS,
        at=time.time(), started_at=now, value=1.0, summary="s", description="d",
    )  # fmt: skip
    done = store.record(resolved, disp.names)
    disp.submit(done, "alertmanager", "resolved")  # type: ignore[arg-type]
    assert disp.wait_idle(10) and store.unsent() == []
    wait_until(lambda: active() == [], 10, "the alert to resolve in Alertmanager")
    disp.close()
    store.close()


def test_a_webhook_that_hangs_does_not_hold_back_the_other_notifiers(
    tmp_path: Path, http_server: TestServer
) -> None:
    # A receiver that takes the connection and never answers: each delivery to it waits out its
    # timeout on every try. The other notifiers (the pager behind Alertmanager) must not wait
    # behind it, alert after alert.
    import socket

    hung = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog, unanswered
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    hooks = [
        WebhookNotifier(f"http://127.0.0.1:{hung.getsockname()[1]}/x", timeout_s=1.0, name="webhook0"),
        WebhookNotifier(http_server.url, name="webhook1"),
    ]
    disp = Dispatcher(store, hooks, retries=2, backoff_s=0.05)
    disp.start()
    try:
        for i in range(3):  # as the detector submits them: each episode to every notifier in turn
            tr = Transition(kind="firing", alertname=f"Alert{i}", severity="warning", labels=LABELS,
                            at=1.0, started_at=1.0, value=1.0, summary="s", description="d")  # fmt: skip
            ep = store.record(tr, disp.names)
            assert ep is not None
            for name in disp.names:
                disp.submit(ep, name, "firing")
        wait_until(lambda: len(http_server.posts) == 3, 3.0, "webhook1's three deliveries")
    finally:
        disp.close(timeout_s=0.1)
        hung.close()
        store.close()


class TricklingReceiver:
    """A webhook receiver on a real loopback socket, a thread per connection: the first
    ``trickle_first`` requests are answered a byte every ``every_s`` seconds (the status line, then
    an endless header: each read well within the client's read timeout, the answer never
    complete), the others at once with 200. Records every request's JSON document."""

    def __init__(self, *, trickle_first: int, every_s: float = 0.2) -> None:
        self.trickle_first = trickle_first
        self.every_s = every_s
        self.requests: list[dict[str, object]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # accept() looks at the stop flag this often
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    @staticmethod
    def _read_request(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            body += chunk
        return body

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            body = self._read_request(conn)
            with self._lock:
                self.requests.append(json.loads(body))
                trickle = len(self.requests) <= self.trickle_first
            if not trickle:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            answer = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100_000
            for i in range(len(answer)):
                if self._stop.wait(self.every_s):
                    return
                try:
                    conn.sendall(answer[i : i + 1])
                except OSError:  # the client gave up and closed
                    return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(5)


def test_a_receiver_that_trickles_its_answer_fails_the_delivery_at_its_deadline_and_it_is_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that answered a byte every few seconds never tripped the per-read timeout: the
    delivery hung for as long as it trickled, nothing logged or counted, and every later
    notification to it waited behind. Each delivery now has a deadline on the whole exchange."""
    receiver = TricklingReceiver(trickle_first=1)
    store = EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}")
    results: list[tuple[str, str]] = []
    hook = WebhookNotifier(receiver.url, timeout_s=2.0, deadline_s=1.0, name="webhook0")
    disp = Dispatcher(store, [hook], retries=2, backoff_s=0.05, on_result=lambda n, r: results.append((n, r)))
    disp.start()
    try:
        first = store.record(_tr("firing", 1000.0), disp.names)
        other = Transition(
            kind="firing", alertname="VLLMBacklogBeyondDeadline", severity="warning", labels=LABELS,
            at=1.0, started_at=1.0, value=1.0, summary="s", description="d",
        )  # fmt: skip
        later = store.record(other, disp.names)
        assert first is not None and later is not None
        started = time.monotonic()
        disp.submit(first, "webhook0", "firing")
        disp.submit(later, "webhook0", "firing")  # queued behind the trickled delivery
        # Within the deadline and a margin, not the trickle's many seconds (or forever).
        assert disp.wait_idle(6.0), "the trickled delivery still holds the notifier"
        elapsed = time.monotonic() - started
        assert elapsed >= 1.0  # the first try waited out its deadline
        # The trickled try failed and was counted, the retry and the later notification got through.
        assert results == [("webhook0", "error"), ("webhook0", "sent"), ("webhook0", "sent")]
        names = [r["alert"]["alertname"] for r in receiver.requests]  # type: ignore[index]
        assert names == ["VLLMMetastableRetryLoop", "VLLMMetastableRetryLoop", "VLLMBacklogBeyondDeadline"]
        assert store.unsent() == []
        assert any("no complete answer within 1 s" in r.getMessage() for r in caplog.records)
    finally:
        disp.close(timeout_s=0.1)
        receiver.close()
        store.close()


@pytest.mark.parametrize("kind", ["webhook", "alertmanager"])
def test_every_kind_of_notification_has_a_deadline_on_the_whole_exchange(kind: str) -> None:
    from detector.episodes import AlertEpisode

    receiver = TricklingReceiver(trickle_first=2)
    notifier: WebhookNotifier | AlertmanagerNotifier
    if kind == "webhook":
        notifier = WebhookNotifier(receiver.url, timeout_s=2.0, deadline_s=0.5)
    else:
        notifier = AlertmanagerNotifier(receiver.url, timeout_s=2.0, deadline_s=0.5)
    ep = AlertEpisode("A", "warning", LABELS, 1.0, None, "s", "d", None, id=1)
    try:
        started = time.monotonic()
        with pytest.raises(NotifyError, match=r"no complete answer within 0\.5 s"):
            notifier.send(ep, "firing")
        if isinstance(notifier, AlertmanagerNotifier):  # its refresh of the firing alerts too
            with pytest.raises(NotifyError, match=r"no complete answer within 0\.5 s"):
                notifier.refresh([ep])
        else:
            with pytest.raises(NotifyError, match=r"no complete answer within 0\.5 s"):
                notifier.send(ep, "resolved")
        assert time.monotonic() - started < 4.0  # two deadlines, not the trickle
        notifier.send(ep, "firing")  # a receiver that answers is delivered to
        assert len(receiver.requests) == 3
    finally:
        notifier.close()
        receiver.close()
    with pytest.raises(ValueError, match="deadline"):
        WebhookNotifier(receiver.url, deadline_s=0.0)
