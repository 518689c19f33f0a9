"""A test double of the detector: a detector-API-shaped HTTP server over data held in memory
(the shapes of docs/architecture.md).

It evaluates nothing: it serves the alerts, episodes and signal history it is given, so the
dashboard can be benchmarked at a chosen scale (``bench/bench_dashboard.py``: 6 h of 5-s history
for 8 engines) and its browser tests can switch an alert on and off at a moment they choose.
The real detector (``retrywatch detect``) serves the same shapes and keys engines the same way:
by ``instance`` (``/signals`` lists instances, ``engine=`` selects by instance), with vLLM's
``engine`` label ("0" on every vLLM) and the model kept as labels. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np

SIGNAL_UNITS: dict[str, str] = {
    "capacity": "calls/s",
    "deadline": "s",
    "vllm_waiting": "executions",
    "vllm_running": "executions",
    "proxy_queued": "executions",
    "backlog_seconds": "s",
}


class StaticDetectorAPI:
    """Serve ``/alerts``, ``/episodes``, ``/signals`` and ``/healthz`` from memory."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self._alerts: list[dict[str, Any]] = []
        self._episodes: list[dict[str, Any]] = []
        # instance -> signal name -> (n, 2) array of (Unix t, value)
        self._signals: dict[str, dict[str, np.ndarray]] = {}
        self._labels: dict[str, dict[str, str]] = {}  # instance -> {engine, model, instance}
        self._up = True
        self._last_scrape: float | None = None  # set by outage(); else the newest point
        self._evaluated_at: float | None = None  # set by outage(); else the last scrape
        self._inputs: list[dict[str, Any]] | None = None  # /inputs' engines; None: a 404, as before it
        self.requests: dict[str, int] = {}  # path -> requests answered (for tests)
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # --- state ------------------------------------------------------------------------
    def set_signals(
        self,
        instance: str,
        signals: Mapping[str, Sequence[Sequence[float]] | np.ndarray],
        *,
        engine: str = "0",
        model: str = "",
    ) -> None:
        """One engine's history, keyed by ``instance``; ``engine`` is vLLM's label ("0" on every
        vLLM, as in a real fleet)."""
        with self._lock:
            self._signals[instance] = {
                k: np.asarray(v, dtype=float).reshape(-1, 2) for k, v in signals.items()
            }
            self._labels[instance] = {"engine": engine, "model": model, "instance": instance}

    def set_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> None:
        with self._lock:
            self._alerts = [dict(a) for a in alerts]

    def set_episodes(self, episodes: Sequence[Mapping[str, Any]]) -> None:
        with self._lock:
            self._episodes = [dict(e) for e in episodes]

    def set_inputs(self, engines: Sequence[Mapping[str, Any]] | None) -> None:
        """``/inputs``' engines, as a real detector answers them (``detector.api``); None: no
        ``/inputs`` at all (a detector from before it)."""
        with self._lock:
            self._inputs = None if engines is None else [dict(e) for e in engines]

    def set_source_up(self, up: bool) -> None:
        with self._lock:
            self._up = up

    def outage(self, seconds: float, step_s: float = 5.0) -> None:
        """The source goes down for ``seconds``, as a real detector sees it: it goes on
        evaluating every ``step_s`` (its history gets points without a value, its alerts are as
        of its last evaluation) while its last scrape stays where it was."""
        with self._lock:
            self._up = False
            last = self._newest() or 0.0
            self._last_scrape = last
            times = last + np.arange(step_s, seconds + step_s / 2, step_s)
            gap = np.column_stack([times, np.full(times.size, np.nan)])
            for sig in self._signals.values():
                for name, arr in sig.items():
                    sig[name] = np.vstack([arr, gap])
            self._evaluated_at = last + seconds

    def _newest(self) -> float | None:
        return max(
            (float(a[-1, 0]) for sig in self._signals.values() for a in sig.values() if a.shape[0]),
            default=None,
        )

    def advance(self, dt: float) -> None:
        """Move every series, alert and episode ``dt`` seconds later, as the next scrape would."""
        with self._lock:
            for sig in self._signals.values():
                for arr in sig.values():
                    arr[:, 0] += dt
            for item in (*self._alerts, *self._episodes):
                item["started_at"] = float(item["started_at"]) + dt
                if item.get("resolved_at") is not None:
                    item["resolved_at"] = float(item["resolved_at"]) + dt

    # --- answers -----------------------------------------------------------------------
    def answer(self, path: str, query: Mapping[str, str]) -> tuple[int, Any]:
        with self._lock:
            self.requests[path] = self.requests.get(path, 0) + 1
            last = self._last_scrape if self._last_scrape is not None else self._newest()
            if path == "/alerts":
                evaluated = self._evaluated_at if self._evaluated_at is not None else last
                return 200, {"alerts": list(self._alerts), "evaluated_at": evaluated}
            if path == "/episodes":
                return 200, {"episodes": self._filter_episodes(query)}
            if path == "/signals":
                return self._signal_answer(query)
            if path == "/inputs" and self._inputs is not None:
                return 200, {"engines": list(self._inputs), "evaluated_at": last}
            if path == "/healthz":
                status = "ok" if self._up else "degraded"
                return 200, {"status": status, "source": {"up": self._up, "last_scrape_at": last}}
        return 404, {"detail": "Not Found"}

    def _filter_episodes(self, query: Mapping[str, str]) -> list[dict[str, Any]]:
        since = float(query["since"]) if query.get("since") else None
        until = float(query["until"]) if query.get("until") else None
        out = []
        for ep in self._episodes:
            end = ep.get("resolved_at")
            if since is not None and end is not None and float(end) < since:
                continue
            if until is not None and float(ep["started_at"]) > until:
                continue
            if query.get("alertname") and ep["alertname"] != query["alertname"]:
                continue
            if query.get("engine") and (ep.get("labels") or {}).get("instance") != query["engine"]:
                continue
            out.append(ep)
        return out

    def _signal_answer(self, query: Mapping[str, str]) -> tuple[int, Any]:
        name = query.get("name")
        if not name:
            names = sorted({n for sig in self._signals.values() for n in sig})
            return 200, {"signals": names, "engines": sorted(self._signals)}
        since = float(query["since"]) if query.get("since") else None
        series = []
        for instance, sig in sorted(self._signals.items()):
            if query.get("engine") and instance != query["engine"]:
                continue
            arr = sig.get(name)
            if arr is None:
                continue
            if since is not None:
                arr = arr[arr[:, 0] >= since]
            points = [[t, None if np.isnan(v) else v] for t, v in arr.tolist()]
            series.append({"labels": dict(self._labels[instance]), "points": points})
        return 200, {"name": name, "unit": SIGNAL_UNITS.get(name, "1/s"), "series": series}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
                try:
                    status, payload = api.answer(parsed.path, query)
                except (ValueError, KeyError) as exc:
                    status, payload = 422, {"detail": str(exc)}
                body = json.dumps(payload, separators=(",", ":")).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: tests and the benchmark read their own output

        return Handler

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> StaticDetectorAPI:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="static-detector-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> StaticDetectorAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def synthetic_history(
    *,
    end: float,
    duration_s: float = 21600.0,
    step_s: float = 5.0,
    capacity: float = 2.8,
    deadline_s: float = 120.0,
    collapse_from: float | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Signal history of one engine shaped like the study's runs: 0.6 Ĉ of first attempts;
    from ``collapse_from`` on, the retry loop with cancellation off (retries, creation above Ĉ,
    completions orphaned, the queue growing). For benchmarks and browser tests only."""
    rng = np.random.default_rng(seed)
    t = np.arange(end - duration_s, end + step_s / 2, step_s)
    n = t.size
    loop = np.zeros(n, dtype=bool) if collapse_from is None else t >= collapse_from
    noise = 1.0 + 0.05 * rng.standard_normal(n)
    first = 0.6 * capacity * noise
    retry = np.where(loop, 1.8 * capacity * noise, 0.02 * capacity)
    attempts = first + retry
    created = np.where(loop, attempts * 0.95, first)
    completed = np.where(loop, 0.05 * capacity, first * 0.99)
    orphaned = np.where(loop, 0.95 * capacity, 0.0)
    waiting = np.where(loop, np.cumsum(np.where(loop, (created - capacity) * step_s, 0.0)), 2.0 * noise)
    admitted = np.where(loop, capacity, first) * 12000.0
    counted = admitted * np.where(loop, 0.7, 1.0)

    def pts(values: np.ndarray | float) -> np.ndarray:
        return np.column_stack([t, np.broadcast_to(np.asarray(values, dtype=float), (n,))])

    zero = np.zeros(n)
    return {
        "attempt_rate_first": pts(first),
        "attempt_rate_retry": pts(retry),
        "attempt_rate": pts(attempts),
        "execution_creation_rate": pts(created),
        "capacity": pts(capacity),
        "deadline": pts(deadline_s),
        "vllm_waiting": pts(np.maximum(waiting, 0.0)),
        "vllm_running": pts(np.minimum(created * 10, 256)),
        "proxy_queued": pts(zero),
        "completion_rate_completed": pts(completed),
        "completion_rate_orphaned": pts(orphaned),
        "completion_rate_cancelled": pts(zero),
        "completion_rate_failed": pts(zero),
        "completion_rate_refused": pts(zero),
        "completion_rate_dropped": pts(zero),
        "shed_rate": pts(zero),
        "attached_rate": pts(zero),
        "delivered_rate_within_deadline": pts(completed),
        "delivered_rate_late": pts(zero),
        "prompt_tokens_counted_rate": pts(counted),
        "prompt_tokens_admitted_rate": pts(admitted),
        "prompt_token_gap": pts(1.0 - counted / admitted),
        "creation_capacity_ratio": pts(created / capacity),
        "waiting_littles_law_ratio": pts(np.maximum(waiting, 0.0) / (attempts * deadline_s)),
        "queue_littles_law_ratio": pts(np.maximum(waiting, 0.0) / (created * deadline_s)),
    }
