"""The connections past ``--max-connections`` (the reserve, for GET and HEAD requests) under
clients that misuse them, black-box: real ``retrywatch proxy`` processes and the test upstream.

``test_proxy_overload.py`` has the reserve serving a scrape and a probe at the cap; here the
reserve must neither serve more than GET and HEAD, nor be held longer than the docs say, nor
take places below the cap from the requests the cap is for.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from tests.exporter.support import Upstream, balance, proxy_process, scrape

WAIT_S = 15.0  # how long a test waits for an answer: far above anything here takes
BODY = b'{"model": "test-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": false}'
POST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
GET = b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n"


def _args(head_timeout_s: float) -> tuple[str, ...]:
    """A cap of two and a reserve of two; a connection below the cap idles for 600 s, one of the
    reserve for ``head_timeout_s``."""
    return (
        "--max-connections", "2", "--reserved-connections", "2", "--keep-alive-timeout", "600",
        "--head-timeout", str(head_timeout_s), "--drain-timeout", "0",
    )  # fmt: skip


class Client:
    """One client connection: requests written raw, answers read one at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.buffer = b""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def answer(self) -> tuple[int, bytes]:
        """The next whole answer (its status and body: every answer here has a length)."""
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length:"))
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(lines[0].split()[1]), body

    def ask(self, request: bytes) -> tuple[int, bytes]:
        self.sock.sendall(request)
        return self.answer()

    def closed_by_server(self) -> bool:
        """Whether the server closes the connection (with nothing more to read) within WAIT_S."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"the server closed the connection; unread: {self.buffer!r}"
        self.buffer += chunk


@contextlib.contextmanager
def _clients(port: int, n: int) -> Iterator[list[Client]]:
    """``n`` connections, each past one request (so the server has taken them, in order)."""
    clients: list[Client] = []
    try:
        for _ in range(n):
            clients.append(Client(port))
            assert clients[-1].ask(GET)[0] == 200
        yield clients
    finally:
        for c in clients:
            c.close()


def test_a_connection_of_the_reserve_serves_a_pipelined_get_then_refuses_the_post(
    upstream: Upstream,
) -> None:
    with proxy_process(upstream.url, *_args(600)) as p, _clients(p.port, 2), Client(p.port) as reserved:
        reserved.sock.sendall(GET + POST)
        assert reserved.answer()[0] == 200
        status, body = reserved.answer()
        assert status == 503 and b'"too_many_connections"' in body
        assert reserved.closed_by_server()
        balance(scrape(p.url))


def test_a_connection_of_the_reserve_idles_no_longer_than_a_head_may_take(upstream: Upstream) -> None:
    # After a served GET too: it goes back to idle for the head timeout (1 s), not the keep-alive
    # timeout (600 s), which still holds for a connection below the cap.
    with (
        proxy_process(upstream.url, *_args(1)) as p,
        _clients(p.port, 2) as below,
        Client(p.port) as reserved,
    ):
        assert reserved.ask(GET)[0] == 200
        assert reserved.closed_by_server()
        below[0].sock.settimeout(2.0)  # twice the head timeout
        assert not below[0].closed_by_server()


def test_connections_of_the_reserve_take_no_place_below_the_cap(upstream: Upstream) -> None:
    # The cap is for every request: a connection of the reserve still open once those below the
    # cap had closed left the connections opened next past the cap, their POSTs refused with
    # places free below it.
    with proxy_process(upstream.url, *_args(600)) as p:
        with contextlib.ExitStack() as stack:
            with _clients(p.port, 2):
                reserved = stack.enter_context(Client(p.port))
                assert reserved.ask(GET)[0] == 200
            with _clients(p.port, 2) as below:
                for c in below:
                    assert c.ask(POST)[0] == 200
        balance(scrape(p.url))


def test_a_connection_of_the_reserve_takes_a_place_below_the_cap_once_one_is_free(
    upstream: Upstream,
) -> None:
    # A client's pool that opened a connection at the cap sends its next POST on it.
    with proxy_process(upstream.url, *_args(600)) as p, _clients(p.port, 1) as (staying,):
        with _clients(p.port, 1):
            reserved = Client(p.port)
            assert reserved.ask(GET)[0] == 200
        with reserved:
            assert staying.ask(GET)[0] == 200  # the server has seen the other one close
            assert reserved.ask(POST)[0] == 200
            assert reserved.ask(POST)[0] == 200
        balance(scrape(p.url))
