"""Real servers for the detector's tests: an HTTP server that serves counters or records
webhooks, Prometheus, Alertmanager and PostgreSQL, each on a free loopback port, each stopped
by its PID. A missing tool skips the test, naming what installs it, and fails it under CI=true
(``tests/systemtools.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from detector.lease import LeaseState
from foundation.processes import ManagedProcess, free_port
from tests.systemtools import require


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


@contextlib.contextmanager
def trickling_server(body: bytes, *, every_s: float = 0.2, for_s: float = 20.0) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 that answers every request with ``body`` (JSON, 200) a byte
    every ``every_s`` seconds (each read well within a client's read timeout), for at most
    ``for_s``; yields its base URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                conn.sendall(head % len(body))
                started = time.monotonic()
                for i in range(len(body)):
                    if stop.wait(every_s) or time.monotonic() - started > for_s:
                        break
                    try:
                        conn.sendall(body[i : i + 1])
                    except OSError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(5)


def need(binary: str) -> str:
    """A system tool's path; a missing one skips the test (fails it under CI=true)."""
    return require(binary)


class TestServer:
    """A threaded HTTP server on 127.0.0.1: serves ``body`` (or ``body_fn()``) on GET, records
    POSTs, and answers the next ``fail_next`` POSTs with HTTP 500."""

    __test__ = False

    def __init__(self) -> None:
        self.body = ""
        self.body_fn: Callable[[], str] | None = None
        self.status = 200
        self.posts: list[object] = []
        self.fail_next = 0
        self.delay_s = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = (outer.body_fn() if outer.body_fn else outer.body).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(n)
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                if outer.fail_next > 0:
                    outer.fail_next -= 1
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.posts.append(json.loads(raw))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server() -> Iterator[TestServer]:
    server = TestServer()
    yield server
    server.close()


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = need("prometheus-alertmanager")
    port = free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text("route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n")
    argv = [binary, f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
            f"--storage.path={tmp_path / 'am'}", f"--config.file={cfg}"]  # fmt: skip
    with ManagedProcess(argv, log_path=tmp_path / "am.log", bound_s=120, name="Alertmanager") as proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/-/ready", timeout_s=20, poll_s=0.1)
        yield url


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[str | Path], str]]:
    """Start a real Prometheus scraping every second, as job retrywatch, ``target`` (host:port)
    or the targets a file-based service discovery file lists (a Path; rewrite it to move them)."""
    binary = need("prometheus")
    procs: list[ManagedProcess] = []

    def start(target: str | Path) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        targets = (
            f"    file_sd_configs:\n      - files: ['{target}']\n        refresh_interval: 1s\n"
            if isinstance(target, Path)
            else f"    static_configs:\n      - targets: ['{target}']\n"
        )
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: retrywatch\n{targets}"
        )
        argv = [binary, f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--config.file={cfg}"]  # fmt: skip
        proc = ManagedProcess(argv, log_path=tmp_path / "prometheus.log", bound_s=120, name="Prometheus")
        procs.append(proc.start())
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/-/ready", timeout_s=20, poll_s=0.1)
        return url

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL 15 server in a temp dir, run as the ``postgres`` user when we are root."""
    initdb, postgres = need("initdb"), need("postgres")
    # PostgreSQL refuses to run as root: as root, run it as the ``postgres`` user in a directory
    # that user owns (pytest's own temp dirs are private to root).
    base = Path(tempfile.mkdtemp(prefix="retrywatch-pg-"))
    data, sock = base / "data", base / "sock"
    sock.mkdir()
    prefix: list[str] = []
    if os.geteuid() == 0:
        for path in (base, sock):
            shutil.chown(path, "postgres")
            path.chmod(0o700)
        prefix = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*prefix, initdb, "-D", str(data), "-U", "rw", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    port = free_port()
    argv = [*prefix, postgres, "-D", str(data), "-c", "listen_addresses=127.0.0.1",
            "-p", str(port), "-k", str(sock), "-c", "fsync=off"]  # fmt: skip
    proc = ManagedProcess(argv, log_path=base / "postgres.log", bound_s=120, name="PostgreSQL").start()

    def ready() -> bool:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user=rw dbname=postgres", connect_timeout=1):
            return True

    try:
        wait_until(lambda: _pg_ready(ready), 30, "PostgreSQL")
        yield f"postgresql+psycopg://rw@127.0.0.1:{port}/postgres"
    finally:
        proc.stop()
        shutil.rmtree(base, ignore_errors=True)


def _pg_ready(check: Callable[[], bool]) -> bool:
    import psycopg

    try:
        return check()
    except psycopg.OperationalError:
        return False


def exposition(snapshot_samples: list[tuple[str, dict[str, str], float]]) -> str:
    """Plain-text exposition of samples, as the proxy serves them."""
    from foundation.timeseries import format_sample

    return "\n".join(format_sample(n, lb, v) for n, lb, v in snapshot_samples) + "\n"


class ScriptedLease:
    """A lease whose states the test sets: the detector's side of the lease, without a second
    process. ``ACQUIRED`` turns into ``HELD`` once read, as a real lease's does."""

    description = "a scripted lease"

    def __init__(self, state: LeaseState = LeaseState.TAKEN) -> None:
        self.state = state

    def hold(self) -> LeaseState:
        state = self.state
        if state is LeaseState.ACQUIRED:
            self.state = LeaseState.HELD
        return state

    def release(self) -> None:
        return None
