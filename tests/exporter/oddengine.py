"""Engines that misbehave the ways the pass-through and ``/metrics`` tests need, on real loopback
sockets:

* ``HungEngine`` (a thread of the test process): accepts every connection, reads what it is sent
  and never answers, as a wedged engine does (or answers the beginning of an answer, ``reply``,
  and falls silent mid-answer); it counts the connections its peers still hold open,
  so a test sees whether the proxy let go of them.
* ``heavy`` (a process: ``python -m tests.exporter.oddengine --port P --series N``): an engine
  whose ``/metrics`` carries ``N`` series, as a vLLM serving many LoRA adapters or models does
  (``big_exposition``: every one of a family the proxy's window reads, the worst case; about 100
  bytes a series), optionally with ``retrywatch_`` families of its own (``--own-families``: a
  proxy in front of a proxy); ``/health`` answers 200, and ``POST /v1/completions`` (and chat)
  streams ``--tokens`` SSE events, the first at once, then one every ``--token-interval`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import selectors
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from foundation.processes import ManagedProcess, free_port

#: What ``big_exposition`` sums to per series, for each family (a test checks the scan against it).
WAITING_PER_SERIES = 3.0
PROMPT_TOKENS_PER_SERIES = 100.0

OWN_FAMILIES = (
    "# HELP retrywatch_attempts_total Attempts received, by kind.\n"
    "# TYPE retrywatch_attempts_total counter\n"
    'retrywatch_attempts_total{kind="first"} 7.0\n'
    'retrywatch_attempts_total{kind="retry"} 1.0\n'
    "# HELP retrywatch_executions_live Executions in the engine.\n"
    "# TYPE retrywatch_executions_live gauge\n"
    "retrywatch_executions_live 2.0\n"
)


def big_exposition(series: int, own_families: bool = False) -> str:
    """A vLLM-shaped exposition of ``series`` series, half of ``vllm:num_requests_waiting`` and
    half of ``vllm:prompt_tokens_total``, one per adapter (``WAITING_PER_SERIES`` and
    ``PROMPT_TOKENS_PER_SERIES`` each), a label value holding a brace and an escaped quote among
    them; with ``own_families``, ``OWN_FAMILIES`` in the middle."""
    half = series // 2
    parts = [
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n",
        "# TYPE vllm:num_requests_waiting gauge\n",
    ]
    model = "Qwen/Qwen2.5-7B-Instruct-lora"
    parts += [
        f'vllm:num_requests_waiting{{engine="0",model_name="{model}-{i:07d}"}} {WAITING_PER_SERIES}\n'
        for i in range(half)
    ]
    parts.append('vllm:num_requests_waiting{engine="1",model_name="odd} \\"name\\""} 0.0\n')
    if own_families:
        parts.append(OWN_FAMILIES)
    parts += [
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n",
        "# TYPE vllm:prompt_tokens_total counter\n",
    ]
    tokens = PROMPT_TOKENS_PER_SERIES
    parts += [
        f'vllm:prompt_tokens_total{{engine="0",model_name="{model}-{i:07d}"}} {tokens}\n'
        for i in range(series - half)
    ]
    return "".join(parts)


class HungEngine:
    """A socket server that accepts and never answers (see the module), in a thread."""

    def __init__(self, reply: bytes = b"") -> None:
        self.reply = reply  # written once, when a connection's first bytes arrive; then nothing more
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._open: set[socket.socket] = set()
        self._replied: set[socket.socket] = set()
        self.accepted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="hung engine")

    def open_connections(self) -> int:
        """Connections accepted that their peer has not closed yet."""
        with self._lock:
            return len(self._open)

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self._listener.accept()
                        conn.setblocking(False)
                        selector.register(conn, selectors.EVENT_READ)
                        with self._lock:
                            self._open.add(conn)
                            self.accepted += 1
                    continue
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data and self.reply and sock not in self._replied:
                    self._replied.add(sock)
                    sock.sendall(self.reply)
                if not data:  # the peer closed its end
                    selector.unregister(sock)
                    sock.close()
                    with self._lock:
                        self._open.discard(sock)
        for conn in list(self._open):
            conn.close()
        selector.close()

    def __enter__(self) -> HungEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()


@contextlib.contextmanager
def hung_engine() -> Iterator[HungEngine]:
    with HungEngine() as engine:
        yield engine


# --- the heavy engine, a process -----------------------------------------------------------------


class _Heavy:
    def __init__(self, metrics: bytes, tokens: int, token_interval_s: float) -> None:
        self.metrics = metrics
        self.tokens = tokens
        self.token_interval_s = token_interval_s

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
                length = int({k.strip().lower(): v for k, v in fields.items()}.get("content-length", "0"))
                if length:
                    await reader.readexactly(length)
                path = path.partition("?")[0]
                if method == "GET" and path == "/metrics":
                    writer.write(_head(200, "text/plain; version=0.0.4; charset=utf-8", len(self.metrics)))
                    writer.write(self.metrics)
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    await self._stream(writer)
                elif path == "/health":
                    writer.write(_head(200, "text/plain", 0))
                else:
                    writer.write(_head(404, "text/plain", 0))
                await writer.drain()
        writer.close()

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.token_interval_s)
            event = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
            writer.write(_chunk(b"data: %b\n\n" % json.dumps(event).encode()))
            await writer.drain()
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _head(status: int, content_type: str, length: int) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n" % (
        status,
        content_type.encode(),
        length,
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _main(args: argparse.Namespace) -> None:
    heavy = _Heavy(big_exposition(args.series, args.own_families).encode(), args.tokens, args.token_interval)
    server = await asyncio.start_server(heavy.serve, "127.0.0.1", args.port, limit=1 << 20)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="an engine with a heavy /metrics (see the module)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--series", type=int, default=150_000)
    parser.add_argument("--own-families", action="store_true")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-interval", type=float, default=0.02)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()


@contextlib.contextmanager
def heavy_engine(log_dir: Path, series: int, own_families: bool = False, tokens: int = 8) -> Iterator[str]:
    """The heavy engine as a process on a free loopback port; its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.exporter.oddengine", "--port", str(port), "--series", str(series)]
    cmd += ["--tokens", str(tokens)] + (["--own-families"] if own_families else [])
    proc = ManagedProcess(
        cmd, log_path=log_dir / "heavy-engine.log", bound_s=None, cwd=ROOT, name="heavy engine"
    )
    with proc:
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{url}/health", timeout_s=30, poll_s=0.05)
        yield url


ROOT = Path(__file__).resolve().parents[2]  # the repository: ``python -m tests...`` runs from it
