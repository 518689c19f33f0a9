"""The proxy's candidates side by side with nginx: added time to first token, its tail, and CPU per
relayed chunk, in one run against one upstream. Prints figures, asserts nothing.

Run: ``python bench/bench_floor.py`` (about five minutes with the defaults; ``--paths`` picks a
subset, ``--rounds`` and ``--window`` the length). The scenario is the one the proxy's latency
targets are stated in:

* 100 background streams in flight (40 chunks each, one every 50 ms), from a separate load
  process, each on a new connection, started again as soon as it ends;
* a probe every 20 ms, on a new connection, timing the first body byte (time to first token),
  and, 10 ms later, the same probe straight to the upstream: the probe's own baseline, taken in
  the same seconds, under the same load;
* the paths take turns (a phase each, several rounds, the order rotating), all against the same
  upstream (``tests/exporter/upstream.py``); during a path's phase the background streams and the
  probes go through it, and the CPU time of its processes (from /proc, the process and its
  children) over the phase's measured window is divided by the chunks relayed through it in that
  window (SSE events counted by the clients);
* with ``--pin``, each path runs on a core of its own (the last one), the clients and the upstream
  on the others: the proxy as it runs beside a GPU engine, on a machine with cores to spare,
  instead of taking turns on one core with the processes it serves (on a 2-core machine a
  socket write's wake-up puts the woken process behind the writer on its CPU). nginx is pinned
  the same way.

Paths (``--paths``, comma-separated):

* ``direct``: the upstream itself (its row is the baseline; its CPU per chunk is the upstream's);
* ``nginx``: Debian's nginx (skipped if it is not installed), its own config (``-p``/``-c``,
  ``daemon off;``, one worker, loopback, ``proxy_buffering off``, kept-alive upstream
  connections);
* ``proxy``: ``retrywatch proxy`` on its defaults;
* ``proxy-record``: ``retrywatch proxy`` recording its traffic (``--record DIR``, in the path's
  work directory), to measure the recorder beside ``proxy``;
* ``asgi-uvicorn``: the forwarding floor under uvicorn (``bench/asgi_floor.py``);
* ``asgi-granian``, ``rsgi-granian``: the same floor under granian (``bench/granian_floor.py``),
  one worker, one runtime thread, uvloop (skipped if granian, from PyPI, is not installed);
* ``protocol-floor``: forwarding in asyncio protocol callbacks on uvloop + httptools
  (``bench/protocol_floor.py``);
* ``uvicorn-bypass``: the same forwarding in callbacks inside uvicorn's own protocol, the ASGI
  cycle bypassed for generation POSTs only (``bench/uvicorn_bypass.py``);
* ``protocol-attempt``: ``protocol-floor`` plus the proxy's per-attempt work in callbacks
  (``bench/protocol_attempt.py``);
* ``proxy-baseline``: ``retrywatch proxy`` run from another checkout's sources (``--baseline``,
  e.g. a ``git worktree`` of the last commit), to measure a change beside what it changes;
* ``proxy-python``: ``retrywatch proxy`` run by another Python interpreter (``--python``: a
  virtual environment's, with this checkout installed), to measure an interpreter beside this one;
* diagnostics, not in the default set: ``proxy-probe`` (the proxy with the event-loop stall probe
  of ``bench/loop_stalls.py``; its summary is printed at the end), ``proxy-steps`` (the proxy with
  the steps of a request's path timed, wall and CPU, by ``bench/step_times.py``; its summary is
  printed at the end, its latency figures are not the proxy's), ``proxy-nogc`` (the garbage
  collector disabled after start-up), ``proxy-gc10k`` (its youngest generation collected every
  10,000 allocations instead of 700), ``proxy-nosampler`` (no per-second sampling or upstream
  ``/metrics`` refresh), ``proxy-quiet`` (both), ``proxy-census`` (the cyclic garbage kept and
  counted by type, printed at the end; its latency figures are not the proxy's).

Added TTFT is a path's probe percentile minus the same percentile of the direct probes taken in
its phases. The ratios are the issue's targets: added p50 / max(nginx's added p50, 0.25 ms),
added p99 / max(nginx's, 1 ms), CPU per chunk / nginx's (each ≤ 2 to meet them). The machine's
cores, load average, and the CPU used by processes outside the benchmark during the windows are
printed: on a shared machine compare figures from one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import uvloop

from foundation.processes import ManagedProcess, free_port

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = pathlib.Path(BENCH).parent  # the repository: ``python -m tests...`` runs from it
CLK_TCK = os.sysconf("SC_CLK_TCK")
STREAMS = 100
STREAM_CHUNKS = 40
CHUNK_INTERVAL_S = 0.05
PROBE_INTERVAL_S = 0.020
PROBE_TOKENS = 2
DEFAULT_PATHS = (
    "direct",
    "nginx",
    "proxy",
    "asgi-uvicorn",
    "asgi-granian",
    "rsgi-granian",
    "protocol-floor",
    "uvicorn-bypass",
    "protocol-attempt",
)
# the paths that keep executions and replays
REPLAY_PATHS = ("proxy", "proxy-baseline", "proxy-python", "protocol-attempt")
DIAGNOSTIC_PATHS = (
    "proxy-probe",
    "proxy-steps",
    "proxy-nogc",
    "proxy-gc10k",
    "proxy-nosampler",
    "proxy-quiet",
    "proxy-census",
)
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 10240; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream engine {{
        server 127.0.0.1:{upstream};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


# --- processes, CPU and memory from /proc -----------------------------------------------------


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    """Until something answers HTTP at ``url`` (any status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def rss_mb(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / CLK_TCK


def split_cores() -> tuple[set[int], set[int]]:
    """``--pin``: the cores for everything else (the clients, the upstream), and the core of the
    path under test (the last one this process may use)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs at least two cores")
    return set(cores[:-1]), {cores[-1]}


def pin(pids: list[int], cores: set[int]) -> None:
    """Every thread of these processes on ``cores``."""
    for pid in pids:
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(int(tid), cores)


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
        )


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# --- the paths --------------------------------------------------------------------------------


@dataclass
class Path:
    name: str
    port: int
    proc: ManagedProcess | None = None
    workdir: str | None = None
    root_pid: int = 0  # the process whose tree serves the path (the upstream's for direct)
    pids: list[int] = field(default_factory=list)

    def refresh_pids(self) -> None:
        self.pids = tree(self.root_pid)


def _command(
    name: str, port: int, upstream: str, workdir: str, python: str | None
) -> tuple[list[str], dict[str, str]]:
    py = sys.executable
    env = dict(os.environ)
    proxy_args = ["--upstream", upstream, "--port", str(port)]
    stalls = [py, os.path.join(BENCH, "loop_stalls.py")]
    granian = [
        os.path.join(os.path.dirname(py), "granian"),
        "--factory",
        "--working-dir",
        BENCH,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--no-ws",
        "--workers",
        "1",
        "--runtime-threads",
        "1",
        "--log-level",
        "warning",
    ]
    env["FLOOR_UPSTREAM"] = upstream
    commands: dict[str, list[str]] = {
        "nginx": ["nginx", "-p", workdir, "-c", os.path.join(workdir, "nginx.conf"), "-e", "stderr"],
        "proxy": [py, "-m", "retrywatch", "proxy", *proxy_args],
        "proxy-record": [
            py,
            "-m",
            "retrywatch",
            "proxy",
            *proxy_args,
            "--record",
            os.path.join(workdir, "rec"),
        ],
        "proxy-probe": [
            *stalls,
            "--probe",
            "--report",
            os.path.join(workdir, "stalls.json"),
            "--",
            *proxy_args,
        ],
        "proxy-steps": [
            py,
            os.path.join(BENCH, "step_times.py"),
            "--report",
            os.path.join(workdir, "steps.json"),
            "--",
            *proxy_args,
        ],
        "proxy-nogc": [*stalls, "--no-gc", "--", *proxy_args],
        "proxy-gc10k": [*stalls, "--gc-threshold", "10000", "--", *proxy_args],
        "proxy-nosampler": [*stalls, "--no-sampler", "--", *proxy_args],
        "proxy-quiet": [*stalls, "--no-gc", "--no-sampler", "--", *proxy_args],
        "proxy-census": [
            *stalls,
            "--census",
            "--report",
            os.path.join(workdir, "census.json"),
            "--",
            *proxy_args,
        ],
        "asgi-uvicorn": [py, os.path.join(BENCH, "asgi_floor.py"), *proxy_args],
        "asgi-granian": [*granian, "--interface", "asgi", "granian_floor:asgi"],
        "rsgi-granian": [*granian, "--interface", "rsgi", "granian_floor:rsgi"],
        "protocol-floor": [py, os.path.join(BENCH, "protocol_floor.py"), *proxy_args],
        "uvicorn-bypass": [py, os.path.join(BENCH, "uvicorn_bypass.py"), *proxy_args],
        "protocol-attempt": [py, os.path.join(BENCH, "protocol_attempt.py"), *proxy_args],
    }
    commands["proxy-baseline"] = commands["proxy"]  # run from the --baseline checkout (start_path)
    if python is not None:
        commands["proxy-python"] = [python, *commands["proxy"][1:]]
    elif name == "proxy-python":
        raise SystemExit("the path proxy-python needs --python INTERPRETER")
    if name not in commands:
        raise SystemExit(f"unknown path {name!r}; known: direct, {', '.join(commands)}")
    return commands[name], env


def start_path(
    name: str, upstream_port: int, upstream_pid: int, root: str, baseline: str | None, python: str | None
) -> Path | None:
    """Start a path's process; None (and a line saying why) if its server is not installed.
    ``proxy-baseline`` runs from the checkout ``baseline`` (its modules shadow this one's)."""
    if name == "direct":
        return Path(name, upstream_port, root_pid=upstream_pid)
    port = free_port()
    workdir = os.path.join(root, name)
    os.makedirs(workdir)
    upstream = f"http://127.0.0.1:{upstream_port}"
    command, env = _command(name, port, upstream, workdir, python)
    if shutil.which(command[0]) is None:
        print(f"{name}: skipped, {os.path.basename(command[0])} is not installed", flush=True)
        return None
    if name == "nginx":
        with open(os.path.join(workdir, "nginx.conf"), "w") as f:
            f.write(NGINX_CONF.format(d=workdir, upstream=upstream_port, port=port))
    log = pathlib.Path(workdir) / "output.log"
    cwd = ROOT
    if name == "proxy-baseline":
        if baseline is None:
            raise SystemExit("the path proxy-baseline needs --baseline CHECKOUT")
        cwd = pathlib.Path(baseline).resolve()
    proc = ManagedProcess(command, log_path=log, bound_s=None, env=env, cwd=cwd, name=name).start()
    assert proc.pid is not None
    return Path(name, port, proc, workdir, proc.pid)


# --- the clients ------------------------------------------------------------------------------


def request_bytes(port: int, max_tokens: int, headers: dict[str, str]) -> bytes:
    body = b'{"model": "test-model", "prompt": [1, 2, 3, 4], "max_tokens": %d, "stream": true}' % max_tokens
    lines = [
        "POST /v1/completions HTTP/1.1",
        f"host: 127.0.0.1:{port}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        f"x-call-id: {uuid.uuid4().hex}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Exchange(asyncio.Protocol):
    """One streaming request on a new connection: when its first body byte came, how many SSE
    events it carried, whether the answer was a 200. Ends when the server closes (the request
    says ``connection: close``)."""

    def __init__(self, request: bytes, on_events: Callable[[int], None] | None = None) -> None:
        self.request = request
        self.on_events = on_events
        self.head = b""
        self.in_body = False
        self.ok = False
        self.first_byte_at: float | None = None
        self.events = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            self.ok = self.head.startswith(b"HTTP/1.1 200")
            data, self.in_body = self.head[end + 4 :], True
        if data:
            if self.first_byte_at is None:
                self.first_byte_at = time.perf_counter()
            n = data.count(b"data: ")
            self.events += n
            if self.on_events is not None:
                self.on_events(n)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def exchange(
    port: int, request: bytes, on_events: Callable[[int], None] | None = None
) -> tuple[float | None, Exchange]:
    """Run one exchange; the time from the start of the connection to the first body byte."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    try:
        _, ex = await loop.create_connection(lambda: Exchange(request, on_events), "127.0.0.1", port)
    except OSError:
        return None, Exchange(request)
    await ex.done
    ttft = ex.first_byte_at - t0 if ex.first_byte_at is not None else None
    return ttft, ex


async def load_worker(streams: int) -> None:
    """The background streams, as a separate process driven on stdin: ``target PORT`` (new
    streams go there), ``count`` (prints the events received per port and the failed streams),
    ``stop``."""
    target = 0
    events: Counter[int] = Counter()
    failed: Counter[int] = Counter()
    stopping = False
    headers = {"x-test-token-interval": str(CHUNK_INTERVAL_S)}

    async def client(delay: float) -> None:
        await asyncio.sleep(delay)
        while not stopping:
            port = target
            if not port:
                await asyncio.sleep(0.05)
                continue

            def count(n: int, port: int = port) -> None:
                events[port] += n

            _, ex = await exchange(port, request_bytes(port, STREAM_CHUNKS, headers), count)
            if not (ex.ok and ex.events == STREAM_CHUNKS + 1):
                failed[port] += 1
                await asyncio.sleep(0.05)

    stream_s = STREAM_CHUNKS * CHUNK_INTERVAL_S
    tasks = [asyncio.create_task(client(stream_s * i / streams)) for i in range(streams)]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        command, _, arg = line.partition(" ")
        if command == "target":
            target = int(arg)
        elif command == "count":
            print(" ".join(f"{p}:{events[p]}:{failed[p]}" for p in events) or "-", flush=True)
        elif command == "stop":
            break
    stopping = True
    await asyncio.wait(tasks, timeout=stream_s + 2)


class LoadProcess:
    def __init__(self, streams: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--load-worker", "--streams", str(streams)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def counts(self) -> dict[int, tuple[int, int]]:
        self.send("count")
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        out: dict[int, tuple[int, int]] = {}
        for item in line.split():
            if item != "-":
                port, events, failed = (int(x) for x in item.split(":"))
                out[port] = (events, failed)
        return out

    def stop(self) -> None:
        self.send("stop")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Holder(asyncio.Protocol):
    """A client that sends its request and reads nothing back (a reader slower than the engine)."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]
        transport.pause_reading()  # type: ignore[attr-defined]


async def held_rss(path: Path, upstream_port: int, executions: int) -> tuple[float, float]:
    """The path's RSS before, and while holding ``executions`` live executions each with 400 tokens
    streamed into its replay buffer (the upstream stalls after 400 tokens; the clients read
    nothing)."""
    before = rss_mb(path.pids)
    tag = uuid.uuid4().hex
    headers = {"x-test-stall-after": "400", "x-test-stall": "60", "x-test-tag": tag}
    loop = asyncio.get_running_loop()
    holders: list[Holder] = []
    for _ in range(executions):
        _, holder = await loop.create_connection(
            functools.partial(Holder, request_bytes(path.port, 401, headers)), "127.0.0.1", path.port
        )
        holders.append(holder)
    try:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                url = f"http://127.0.0.1:{upstream_port}/test/requests"
                rows = (await client.get(url, params={"tag": tag}, timeout=30)).json()["requests"]
                if len(rows) >= executions and all(r["tokens_sent"] >= 400 for r in rows):
                    break
                await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # let the path read what the upstream wrote
        return before, rss_mb(path.pids)
    finally:
        for holder in holders:
            if holder.transport is not None:
                holder.transport.close()


# --- the measurement --------------------------------------------------------------------------


@dataclass
class PathFigures:
    ttft: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    probe_failures: int = 0
    cpu_s: float = 0.0
    chunks: int = 0
    stream_failures: int = 0
    windows: list[tuple[float, float]] = field(default_factory=list)
    by_round: list[tuple[float, float, float]] = field(default_factory=list)  # added p50, p99; others
    others_cores: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def probe_window(
    port: int, direct_port: int, seconds: float
) -> tuple[list[float], list[float], int, int]:
    """A probe to ``port`` every 20 ms and one to the upstream 10 ms after each; their TTFTs, the
    failed probes to ``port`` and the events they received through it."""
    loop = asyncio.get_running_loop()
    request_path = request_bytes(port, PROBE_TOKENS, {})
    request_direct = request_bytes(direct_port, PROBE_TOKENS, {})
    tasks_path: list[asyncio.Task[tuple[float | None, Exchange]]] = []
    tasks_direct: list[asyncio.Task[tuple[float | None, Exchange]]] = []
    start = loop.time()
    k = 0
    while (at := start + k * PROBE_INTERVAL_S) < start + seconds:
        await asyncio.sleep(max(0.0, at - loop.time()))
        tasks_path.append(asyncio.create_task(exchange(port, request_path)))
        await asyncio.sleep(max(0.0, at + PROBE_INTERVAL_S / 2 - loop.time()))
        tasks_direct.append(asyncio.create_task(exchange(direct_port, request_direct)))
        k += 1
    path_results = await asyncio.gather(*tasks_path)
    direct_results = await asyncio.gather(*tasks_direct)
    ttft = [t for t, ex in path_results if t is not None and ex.ok]
    direct = [t for t, ex in direct_results if t is not None and ex.ok]
    failures = len(path_results) - len(ttft)
    events = sum(ex.events for _, ex in path_results)
    return ttft, direct, failures, events


def measure(
    paths: list[Path], load: LoadProcess, rounds: int, window_s: float, own_pids: list[int]
) -> dict[str, PathFigures]:
    figures = {p.name: PathFigures() for p in paths}
    settle_s = STREAM_CHUNKS * CHUNK_INTERVAL_S + 0.3  # every background stream has moved over
    direct_port = next(p.port for p in paths if p.name == "direct")
    for r in range(rounds):
        order = paths[r % len(paths) :] + paths[: r % len(paths)]
        for path in order:
            load.send(f"target {path.port}")
            time.sleep(settle_s)
            path.refresh_pids()
            all_pids = sorted(set(own_pids).union(pid for p in paths for pid in p.pids))
            counts0 = load.counts().get(path.port, (0, 0))
            cpu0, ours0, busy0 = cpu_seconds(path.pids), cpu_seconds(all_pids), machine_busy_s()
            t0 = time.perf_counter()
            ttft, direct, failures, probe_events = uvloop.run(probe_window(path.port, direct_port, window_s))
            t1 = time.perf_counter()
            counts1 = load.counts().get(path.port, (0, 0))
            cpu1, ours1, busy1 = cpu_seconds(path.pids), cpu_seconds(all_pids), machine_busy_s()
            f = figures[path.name]
            f.ttft += ttft
            f.direct += direct
            f.probe_failures += failures
            f.cpu_s += cpu1 - cpu0
            f.chunks += counts1[0] - counts0[0] + probe_events
            f.stream_failures += counts1[1] - counts0[1]
            f.windows.append((t0, t1))
            others = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)
            f.others_cores.append(others)
            f.by_round.append(
                (pct(ttft, 0.5) - pct(direct, 0.5), pct(ttft, 0.99) - pct(direct, 0.99), others)
            )
        print(f"  round {r + 1}/{rounds} done (load average {load_average()})", flush=True)
    return figures


def report(paths: list[Path], figures: dict[str, PathFigures]) -> None:
    def added(name: str, q: float) -> float:
        f = figures[name]
        return pct(f.ttft, q) - pct(f.direct, q)

    def per_chunk_us(name: str) -> float:
        f = figures[name]
        return f.cpu_s / f.chunks * 1e6 if f.chunks else float("nan")

    ref = "nginx" if "nginx" in figures else None
    if ref is not None:
        ref50 = max(added(ref, 0.5), 0.00025)
        ref99 = max(added(ref, 0.99), 0.001)
        ref_cpu = per_chunk_us(ref)
    print()
    print(
        f"{'path':<17} {'probes':>6} {'TTFT p50':>8} {'p99':>7} {'direct p50':>10} {'p99':>7}"
        f" {'added p50':>9} {'p99':>7} {'CPU s':>6} {'chunks':>7} {'us/chunk':>8}"
        f" {'RSS MB':>6}" + ("   ratios to nginx: p50  p99  CPU" if ref else "")
    )
    for path in paths:
        f = figures[path.name]
        line = (
            f"{path.name:<17} {len(f.ttft):>6} {pct(f.ttft, 0.5) * 1e3:>8.2f} {pct(f.ttft, 0.99) * 1e3:>7.2f}"
            f" {pct(f.direct, 0.5) * 1e3:>10.2f} {pct(f.direct, 0.99) * 1e3:>7.2f}"
            f" {added(path.name, 0.5) * 1e3:>9.2f} {added(path.name, 0.99) * 1e3:>7.2f}"
            f" {f.cpu_s:>6.2f} {f.chunks:>7} {per_chunk_us(path.name):>8.1f} {rss_mb(path.pids):>6.1f}"
        )
        if ref is not None and path.name not in ("direct", ref):
            line += (
                f"   {added(path.name, 0.5) / ref50:>20.1f} {added(path.name, 0.99) / ref99:>4.1f}"
                f" {per_chunk_us(path.name) / ref_cpu:>4.1f}"
            )
        print(line)
        if f.probe_failures or f.stream_failures:
            print(
                f"  {path.name}: {f.probe_failures} probes and {f.stream_failures} background streams failed"
            )
    print("\nper round: added p50 / added p99 (ms) [cores used outside the benchmark in the window]")
    for path in paths:
        rounds = "  ".join(
            f"{a50 * 1e3:5.2f} / {a99 * 1e3:6.2f} [{o:.2f}]" for a50, a99, o in figures[path.name].by_round
        )
        print(f"  {path.name:<17} {rounds}")
    others = [x for f in figures.values() for x in f.others_cores]
    print(
        f"\ntimes in ms; CPU per chunk in us. Outside the benchmark, the machine used"
        f" {statistics.median(others):.2f} cores (median over windows; max {max(others):.2f})."
    )
    if ref is not None:
        print(
            "targets: added p50 <= 2 x max(nginx's, 0.25 ms); added p99 <= 2 x max(nginx's, 1 ms);"
            " CPU per chunk <= 2 x nginx's (the ratio columns, each <= 2)."
        )


def print_diagnostics(paths: list[Path], figures: dict[str, PathFigures]) -> None:
    """The reports of the diagnostic paths, written by their processes at exit."""
    from loop_stalls import summarize

    for path in paths:
        if path.workdir is None:
            continue
        stalls = os.path.join(path.workdir, "stalls.json")
        if path.name == "proxy-probe" and os.path.exists(stalls):
            with open(stalls) as f:
                print("\nevent-loop stalls of the proxy (proxy-probe), in its measured windows:")
                print(summarize(json.load(f), figures[path.name].windows))
        steps = os.path.join(path.workdir, "steps.json")
        if path.name == "proxy-steps" and os.path.exists(steps):
            from step_times import summarize as summarize_steps

            with open(steps) as f:
                print("\nthe steps of a request's path in the proxy (proxy-steps), over its run:")
                print(summarize_steps(json.load(f)))
        census = os.path.join(path.workdir, "census.json")
        if path.name == "proxy-census" and os.path.exists(census):
            with open(census) as f:
                report = json.load(f)
            print(f"\ncyclic garbage of the proxy (proxy-census), {report['census_seconds']:.0f} s, by type:")
            for name, n in report["garbage_census"]:
                print(f"  {n:>9}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"comma-separated (see the module doc); diagnostics: {', '.join(DIAGNOSTIC_PATHS)}",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--window", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--streams", type=int, default=STREAMS, help="background streams in flight")
    parser.add_argument(
        "--memory",
        type=int,
        default=1000,
        help="live executions held when measuring the RSS of the paths that keep replays (0: skip)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the paths' logs and reports, and say where")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the path under test on a core of its own, the clients and the upstream on the others",
    )
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="another checkout of this repository: adds the path proxy-baseline, its proxy",
    )
    parser.add_argument(
        "--python",
        metavar="INTERPRETER",
        help="another Python with this checkout installed: adds the path proxy-python, the proxy under it",
    )
    parser.add_argument("--load-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_worker:
        uvloop.run(load_worker(args.streams))
        return
    names = [n.strip() for n in args.paths.split(",") if n.strip()]
    if args.baseline and "proxy-baseline" not in names:
        names.append("proxy-baseline")
    if args.python and "proxy-python" not in names:
        names.append("proxy-python")
    if "direct" not in names:
        names.insert(0, "direct")
    others, own_core = split_cores() if args.pin else (set(), set())
    if args.pin:
        os.sched_setaffinity(0, others)  # the upstream and the load process inherit it
    root = tempfile.mkdtemp(prefix="bench-floor-")
    upstream_port = free_port()
    upstream = ManagedProcess(
        [sys.executable, "-m", "tests.exporter.upstream", "--port", str(upstream_port)],
        log_path=pathlib.Path(root) / "upstream.log",
        bound_s=None,
        cwd=ROOT,
        name="test upstream",
    ).start()
    assert upstream.pid is not None
    paths: list[Path] = []
    load: LoadProcess | None = None
    try:
        wait_http(f"http://127.0.0.1:{upstream_port}/health")
        started = (
            start_path(name, upstream_port, upstream.pid, root, args.baseline, args.python) for name in names
        )
        paths = [p for p in started if p is not None]
        for path in paths:
            wait_http(f"http://127.0.0.1:{path.port}/health")
        load = LoadProcess(args.streams)
        own = [os.getpid(), upstream.pid, load.proc.pid]
        for path in paths:
            path.refresh_pids()
            if args.pin and path.name != "direct":
                pin(path.pids, own_core)
        phase_s = args.window + STREAM_CHUNKS * CHUNK_INTERVAL_S + 0.3
        print(
            f"machine: {os.cpu_count()} cores; load average {load_average()} at the start;"
            f" {len(paths)} paths x {args.rounds} rounds x {phase_s:.1f} s;"
            f" {args.streams} background streams ({STREAM_CHUNKS} chunks at {CHUNK_INTERVAL_S * 1e3:g} ms),"
            f" a probe every {PROBE_INTERVAL_S * 1e3:g} ms"
            + (
                f"; each path on core {min(own_core)}, the clients and the upstream on"
                f" {', '.join(map(str, sorted(others)))}"
                if args.pin
                else ""
            ),
            flush=True,
        )
        figures = measure(paths, load, args.rounds, args.window, own)
        print(f"load average {load_average()} at the end")
        report(paths, figures)
        if args.memory:
            load.stop()
            load = None
            raise_fd_limit(args.memory * 2 + 256)
            for path in paths:
                if path.name in REPLAY_PATHS:
                    before, held = uvloop.run(held_rss(path, upstream_port, args.memory))
                    print(
                        f"{path.name}: RSS {before:.1f} MB before, {held:.1f} MB holding {args.memory}"
                        " live executions with 400-token replays (target <= 100 MB;"
                        f" load average {load_average()})"
                    )
    finally:
        if load is not None:
            load.stop()
        for path in paths:
            if path.proc is not None:
                path.proc.stop(grace_s=15.0)
        upstream.stop(grace_s=15.0)
    print_diagnostics(paths, figures)
    if args.keep:
        print(f"\nlogs and reports kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
