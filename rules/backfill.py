"""Load a run's metrics series into a real Prometheus and evaluate the rules over its past.

Prometheus evaluates rules only in real time, at the wall clock, never over history it was
handed afterwards. To evaluate ``rules/retrywatch.rules.yml`` over a recorded (or simulated) run
with Prometheus' own PromQL engine, this module:

1. renders the run as OpenMetrics with timestamps (``foundation.timeseries.to_openmetrics``) and
   turns it into TSDB blocks with ``promtool tsdb create-blocks-from openmetrics``;
2. starts a real ``prometheus`` on 127.0.0.1 over that data directory (``foundation.processes``),
   queried with ``prometheus-api-client``;
3. materialises the recording rules over the run's range with
   ``promtool tsdb create-blocks-from rules``, one dependency layer at a time (that tool cannot
   see the output of rules it is backfilling in the same pass), moving each layer's blocks into
   the data directory and restarting Prometheus so the next layer can read them;
4. evaluates each alert's expression with ``query_range`` at the rule group's evaluation step and
   applies the alerting state machine of Prometheus' ``rules/alerting.go`` (pending for ``for``,
   firing, kept firing for ``keep_firing_for``) in :func:`alert_episodes`.

Step 4 is the only part not done by Prometheus itself: it is the documented, ten-line state
machine, while every value it consumes comes from the real engine over the real TSDB.
:func:`evaluate_rules` also places the run's scrapes on the rule group's own evaluation grid
(Prometheus offsets it by a hash of the group), inside one TSDB block where promtool backfills
every evaluation of it (:func:`skipped_evaluations`), and emulates staleness markers with a lookback
under one interval, so that the evaluation at run time ``t`` sees exactly the scrape taken at
``t``, as the Python detector's replay does (rules/README.md explains the choices).
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException

from detector.evaluator import AlertStateMachine
from foundation.processes import ManagedProcess, ProcessStartError, free_port
from foundation.timeseries import Snapshot, to_openmetrics

# Prometheus' TSDB deletes blocks older than its retention on start; keep loaded runs recent.
_RETENTION = "30d"
_READY_TIMEOUT_S = 20.0


class BackfillError(RuntimeError):
    """A Prometheus tool failed; the message carries its output."""


def _run(cmd: Sequence[str], *, timeout: float) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise BackfillError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {proc.stderr or proc.stdout}")
    return proc.stdout


# Prometheus' TSDB block span (``tsdb.DefaultBlockDuration``): blocks are aligned to the epoch.
BLOCK_S = 2 * 3600.0
# How far in the past a loaded run ends: beyond the span of the head block, which would overlap it.
_PAST_S = 4 * 3600.0


def skipped_evaluations(start_unix_s: float, duration_s: float, step_s: float) -> list[float]:
    """The evaluation times of a grid over [start, start + duration] that
    ``promtool tsdb create-blocks-from rules`` never evaluates.

    NOTE: the tool queries block by block; it ends each block's query at the whole second before
    the next block begins (``endOfBlock / 1000``, truncated) and starts the next block's query at
    its first evaluation at or after that block's start, so an evaluation time in the last second
    before a block boundary is evaluated by neither, and every recorded series has a one-step hole
    there (in Prometheus 2.42; the tool has no flag for its block span)."""
    block_ms, step_ms, first_ms = round(BLOCK_S * 1000), round(step_s * 1000), round(start_unix_s * 1000)
    last_ms = first_ms + math.floor(duration_s / step_s + 1e-9) * step_ms
    skipped: list[float] = []
    for boundary in range((first_ms // block_ms + 1) * block_ms, last_ms + 1, block_ms):
        t = first_ms + (boundary - 1 - first_ms) // step_ms * step_ms  # the last one before it
        while t > boundary - 1000 and t >= first_ms:
            skipped.append(t / 1000.0)
            t -= step_ms
    return sorted(skipped)


def run_start(duration_s: float, step_s: float, offset_s: float, *, now: float | None = None) -> float | None:
    """Where to place a run whose rules evaluate on a grid offset by ``offset_s``: a Unix time on
    that grid, inside retention and in the past by more than the head block's span.

    The run starts where a TSDB block starts (plus the offset), so a run shorter than a block
    crosses no block boundary and every evaluation of it is backfilled. ``None`` when a longer
    run's grid has an evaluation :func:`skipped_evaluations` names; another grid offset (another
    rule file, :func:`place_run`) avoids it."""
    now = time.time() if now is None else now
    start = math.floor((now - duration_s - step_s - _PAST_S) / BLOCK_S) * BLOCK_S + offset_s
    return None if skipped_evaluations(start, duration_s, step_s) else start


def write_blocks(
    snapshots: Iterable[Snapshot],
    data_dir: Path,
    *,
    start_unix_s: float,
    extra_labels: Mapping[str, str] | None = None,
    promtool: str = "promtool",
    timeout: float = 60.0,
) -> None:
    """Turn a run's snapshots into TSDB blocks under ``data_dir`` (created if missing)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    text = to_openmetrics(snapshots, start_unix_s=start_unix_s, extra_labels=extra_labels)
    with tempfile.NamedTemporaryFile("w", suffix=".om", encoding="utf-8", delete=False) as fh:
        fh.write(text)
        om_path = Path(fh.name)
    try:
        _run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om_path), str(data_dir)],
            timeout=timeout,
        )
    finally:
        om_path.unlink(missing_ok=True)


class Prometheus:
    """A real ``prometheus`` process on 127.0.0.1 over a given data directory, queried with
    ``prometheus-api-client``.

    Nothing is scraped (the configuration has no targets); rule files, if given, are loaded
    so that the server validates them, but they only evaluate at the wall clock. Its log is
    ``<data_dir>.prometheus.log`` beside the data directory, kept after it stops.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        rule_files: Sequence[Path] = (),
        lookback_delta_s: float = 30.0,
        binary: str = "prometheus",
    ) -> None:
        self.data_dir = data_dir
        self.rule_files = list(rule_files)
        self.lookback_delta_s = lookback_delta_s
        self.binary = binary
        self.port = 0
        self._process: ManagedProcess | None = None
        self._client: PrometheusConnect | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = self.data_dir.parent / f"{self.data_dir.name}.prometheus.yml"
        log = self.data_dir.parent / f"{self.data_dir.name}.prometheus.log"
        cfg: dict[str, Any] = {"global": {"evaluation_interval": "5s"}}
        if self.rule_files:
            cfg["rule_files"] = [str(p) for p in self.rule_files]
        config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        last_error = ""
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            argv = [
                self.binary,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self.data_dir}",
                f"--storage.tsdb.retention.time={_RETENTION}",
                f"--query.lookback-delta={int(self.lookback_delta_s)}s",
            ]
            self._process = ManagedProcess(argv, log_path=log, bound_s=None, name="prometheus").start()
            try:
                self._process.wait_ready(f"{self.url}/-/ready", timeout_s=_READY_TIMEOUT_S, poll_s=0.1)
            except ProcessStartError as exc:
                last_error = str(exc)
                self.stop()
                continue
            self._client = PrometheusConnect(url=self.url, disable_ssl=True, timeout=30)
            return
        raise BackfillError(f"prometheus did not become ready: {last_error[-2000:]}")

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop(grace_s=10.0)
            self._process = None
        self._client = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connection(self) -> PrometheusConnect:
        if self._client is None:
            raise BackfillError("prometheus is not running")
        return self._client

    def query(self, expr: str, at_unix_s: float) -> list[dict[str, Any]]:
        try:
            result = self._connection().custom_query(expr, params={"time": f"{at_unix_s:.3f}"})
        except PrometheusApiClientException as exc:
            raise BackfillError(f"query {expr!r}: {exc}") from exc
        return list(result)

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        # NOTE: custom_query_range rounds start and end to whole seconds; the evaluation grid is
        # offset by a fraction of a second (``evaluation_offset``), so the exact times are given
        # as the request's own parameters, which take precedence.
        exact = {"start": f"{start:.3f}", "end": f"{end:.3f}"}
        try:
            result = self._connection().custom_query_range(
                expr,
                start_time=datetime.fromtimestamp(start, UTC),
                end_time=datetime.fromtimestamp(end, UTC),
                step=f"{step_s:g}s",
                params=exact,
            )
        except PrometheusApiClientException as exc:
            raise BackfillError(f"query_range {expr!r}: {exc}") from exc
        return list(result)


# --- recording rules over history ----------------------------------------------------------

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def recording_layers(rules: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Split recording rules into layers: a rule sits one layer above the rules it reads."""
    records = {str(r["record"]) for r in rules}
    depth: dict[str, int] = {}
    by_name = {str(r["record"]): r for r in rules}

    def level(name: str, seen: frozenset[str]) -> int:
        if name in depth:
            return depth[name]
        if name in seen:
            raise BackfillError(f"recording rule {name} depends on itself")
        deps = set(_NAME_RE.findall(str(by_name[name]["expr"]))) & records
        deps.discard(name)
        d = 1 + max((level(dep, seen | {name}) for dep in deps), default=-1)
        depth[name] = d
        return d

    for name in by_name:
        level(name, frozenset())
    layers: list[list[Mapping[str, Any]]] = [[] for _ in range(1 + max(depth.values(), default=-1))]
    for r in rules:
        layers[depth[str(r["record"])]].append(r)
    return layers


def _backfill(
    prom: Prometheus,
    rules: Sequence[Mapping[str, Any]],
    *,
    rule_file: Path,
    group_name: str,
    start_unix_s: float,
    end_unix_s: float,
    step_s: float,
    out_dir: Path,
    promtool: str,
    timeout: float,
) -> None:
    group = {"name": group_name, "interval": format_duration(step_s), "rules": [dict(r) for r in rules]}
    rule_file.write_text(yaml.safe_dump({"groups": [group]}, sort_keys=False), encoding="utf-8")
    _run(
        [
            promtool,
            "tsdb",
            "create-blocks-from",
            "rules",
            "-q",
            f"--url={prom.url}",
            f"--start={int(start_unix_s)}",
            f"--end={math.ceil(end_unix_s)}",
            f"--eval-interval={format_duration(step_s)}",
            f"--output-dir={out_dir}",
            str(rule_file),
        ],
        timeout=timeout,
    )


def evaluation_offset(
    prom: Prometheus,
    *,
    rule_file: Path,
    group_name: str,
    step_s: float,
    promtool: str = "promtool",
    timeout: float = 60.0,
) -> float:
    """The offset in [0, step) of the evaluation grid of ``group_name`` in ``rule_file``.

    Prometheus offsets a group's evaluation timestamps by a hash of the group's name and file
    (``Group.EvalTimestamp``); ``create-blocks-from rules`` does the same. A probe rule is
    backfilled into a scratch directory and the timestamp of its first sample read back with
    ``promtool tsdb dump``."""
    now = time.time() - 3 * 3600.0
    with tempfile.TemporaryDirectory(prefix="rw-probe-") as tmp:
        out = Path(tmp) / "blocks"
        probe = [{"record": "retrywatch_backfill:probe", "expr": "vector(1)"}]
        _backfill(
            prom,
            probe,
            rule_file=rule_file,
            group_name=group_name,
            start_unix_s=now,
            end_unix_s=now + 4 * step_s,
            step_s=step_s,
            out_dir=out,
            promtool=promtool,
            timeout=timeout,
        )
        (out / "wal").mkdir(parents=True, exist_ok=True)  # `tsdb dump` opens the directory as a DB
        dump = _run([promtool, "tsdb", "dump", str(out)], timeout=timeout)
    stamps = [
        int(line.rsplit(" ", 1)[1]) for line in dump.splitlines() if "retrywatch_backfill:probe" in line
    ]
    if not stamps:
        raise BackfillError(f"the probe rule left no sample: {dump[:500]}")
    return (min(stamps) / 1000.0) % step_s


_RULE_FILE_TRIES = 8


def place_run(
    prom: Prometheus,
    *,
    rule_dir: Path,
    group_name: str,
    duration_s: float,
    step_s: float,
    promtool: str = "promtool",
    timeout: float = 60.0,
) -> tuple[Path, float]:
    """A rule file under ``rule_dir`` for :func:`backfill_recording_rules` and the Unix time to
    place a run at, such that every evaluation of the run's grid is backfilled
    (:func:`run_start`). The grid's offset is a hash of the group's name and file, so a run longer
    than a block whose grid would fall in a gap tries the next file name."""
    for attempt in range(_RULE_FILE_TRIES):
        rule_file = rule_dir / f"retrywatch-{attempt}.rules.yml"
        offset = evaluation_offset(
            prom,
            rule_file=rule_file,
            group_name=group_name,
            step_s=step_s,
            promtool=promtool,
            timeout=timeout,
        )
        start = run_start(duration_s, step_s, offset)
        if start is not None:
            return rule_file, start
    raise BackfillError(
        f"no evaluation grid of {step_s:g} s found whose {duration_s:g}-s run promtool backfills "
        f"without a gap at a {BLOCK_S:g}-s block boundary ({_RULE_FILE_TRIES} rule file names tried)"
    )


def backfill_recording_rules(
    prom: Prometheus,
    rules: Sequence[Mapping[str, Any]],
    *,
    rule_file: Path,
    group_name: str,
    start_unix_s: float,
    end_unix_s: float,
    step_s: float,
    promtool: str = "promtool",
    timeout: float = 60.0,
) -> None:
    """Evaluate recording rules over [start, end] with ``promtool tsdb create-blocks-from rules``
    against ``prom``, layer by layer, moving each layer's blocks into ``prom.data_dir`` and
    restarting Prometheus so the next layer reads them.

    NOTE: every layer is written to the same ``rule_file`` under the same ``group_name``, so all
    layers share one evaluation grid (see :func:`evaluation_offset`) and each reads the previous
    layer's samples at the very timestamp it evaluates, as the rules of one group do live."""
    for layer in recording_layers(rules):
        with tempfile.TemporaryDirectory(prefix="rw-layer-") as tmp:
            out = Path(tmp) / "blocks"
            _backfill(
                prom,
                layer,
                rule_file=rule_file,
                group_name=group_name,
                start_unix_s=start_unix_s,
                end_unix_s=end_unix_s,
                step_s=step_s,
                out_dir=out,
                promtool=promtool,
                timeout=timeout,
            )
            for block in out.iterdir():
                if block.is_dir():
                    shutil.move(str(block), str(prom.data_dir / block.name))
        prom.restart()


# --- the alerting state machine ------------------------------------------------------------


@dataclass(frozen=True)
class Episode:
    """One firing episode of an alert for one label set; times in Unix seconds."""

    labels: tuple[tuple[str, str], ...]
    fired_at: float
    resolved_at: float | None


def alert_episodes(
    active: Mapping[tuple[tuple[str, str], ...], Sequence[float]],
    eval_times: Sequence[float],
    *,
    for_s: float,
    keep_firing_for_s: float = 0.0,
) -> list[Episode]:
    """Prometheus' alerting state machine (rules/alerting.go; the detector's own,
    ``detector.evaluator.AlertStateMachine``) over evaluation timestamps.

    ``active[labels]`` lists the evaluation times at which the alert expression returned a
    sample for ``labels``. An alert becomes pending at the first such time ``t0`` and fires at
    the first evaluation ``t`` with ``t - t0 >= for``; pending alerts vanish the first time the
    expression is empty. A firing alert resolves at the first evaluation at which the expression
    has been empty for at least ``keep_firing_for``, measured from the first empty evaluation
    (``KeepFiringSince`` in alerting.go); with ``keep_firing_for`` 0, at the first empty one.
    """
    episodes: list[Episode] = []
    for labels, times in active.items():
        hits = set(times)
        machine = AlertStateMachine(for_s, keep_firing_for_s)
        for t in eval_times:
            if machine.step(t, t in hits) == "resolved":
                assert machine.fired_at is not None
                episodes.append(Episode(labels, machine.fired_at, t))
        if machine.state == "firing":
            assert machine.fired_at is not None
            episodes.append(Episode(labels, machine.fired_at, None))
    return sorted(episodes, key=lambda e: (e.fired_at, e.labels))


def active_times(result: Iterable[Mapping[str, Any]]) -> dict[tuple[tuple[str, str], ...], list[float]]:
    """Map a ``query_range`` matrix to {label set (without __name__): [timestamps with a sample]}."""
    out: dict[tuple[tuple[str, str], ...], list[float]] = {}
    for series in result:
        labels = tuple(sorted((k, v) for k, v in series["metric"].items() if k != "__name__"))
        out.setdefault(labels, []).extend(float(ts) for ts, _ in series["values"])
    return out


@dataclass(frozen=True)
class RunEpisode:
    """An alert episode of Prometheus' verdict, in seconds from the run's start."""

    alertname: str
    labels: tuple[tuple[str, str], ...]
    fired_at_s: float
    resolved_at_s: float | None


_DURATION_RE = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "y": 31536000.0}


def format_duration(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``5s``; ``500ms`` for a run at a time scale: rule
    files and promtool take whole units only)."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def parse_duration(text: str) -> float:
    """A Prometheus duration (``1m30s``, ``500ms``) in seconds."""
    parts = _DURATION_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


def _split_rules(doc: Mapping[str, Any]) -> tuple[str, float, list[dict[str, Any]], list[dict[str, Any]]]:
    groups = doc.get("groups") or []
    if len(groups) != 1:
        raise BackfillError(
            "expected exactly one rule group (its rules are evaluated in order at one timestamp)"
        )
    group = groups[0]
    interval = parse_duration(str(group.get("interval", "1m")))
    rules = list(group["rules"])
    return (
        str(group["name"]),
        interval,
        [r for r in rules if "record" in r],
        [r for r in rules if "alert" in r],
    )


def evaluate_rules(
    runs: Mapping[str, Sequence[Snapshot]],
    rules_doc: Mapping[str, Any],
    *,
    job: str | Callable[[str], str] = "retrywatch",
    lookback_delta_s: float | None = None,
    promtool: str = "promtool",
    prometheus: str = "prometheus",
) -> dict[str, list[RunEpisode]]:
    """Prometheus' verdict on runs: ``{instance: alert episodes}`` of every group of ``rules_doc``
    (a parsed rule file) over each run's snapshots, in seconds from the run's start. ``job``: the
    scrapes' job label, or a function of the group's name that gives it (each group's NoData
    reads its own job's ``up``).

    Groups read nothing of each other's records (``rules/generate.py``), so each is evaluated in
    a Prometheus of its own, on its own evaluation grid (:func:`evaluate_group`)."""
    out: dict[str, list[RunEpisode]] = {}
    for group in rules_doc.get("groups") or []:
        group_job = job(str(group["name"])) if callable(job) else job
        verdict = evaluate_group(
            runs,
            {"groups": [group]},
            job=group_job,
            lookback_delta_s=lookback_delta_s,
            promtool=promtool,
            prometheus=prometheus,
        )
        for instance, episodes in verdict.items():
            out.setdefault(instance, []).extend(episodes)
    return {k: sorted(v, key=lambda e: (e.fired_at_s, e.alertname)) for k, v in out.items()}


def evaluate_group(
    runs: Mapping[str, Sequence[Snapshot]],
    rules_doc: Mapping[str, Any],
    *,
    job: str = "retrywatch",
    lookback_delta_s: float | None = None,
    promtool: str = "promtool",
    prometheus: str = "prometheus",
) -> dict[str, list[RunEpisode]]:
    """Prometheus' verdict on runs: ``{instance: alert episodes}`` of ``rules_doc`` (a parsed rule
    file with one group) over each run's snapshots, in seconds from the run's start.

    Every run is loaded as its own ``instance`` into one TSDB, all starting at the same moment
    (the rules aggregate ``by (instance)``, so runs do not mix), and evaluated in one pass. The
    runs are placed on the rule group's own evaluation grid (:func:`place_run`, where promtool
    backfills every evaluation), so Prometheus evaluates at exactly the snapshots' times: the
    evaluation at run time ``t`` sees the scrape taken at ``t``, as the Python detector's replay
    does. Each scrape also records ``up{job, instance} = 1``.

    NOTE: a live Prometheus writes a staleness marker for every series a scrape no longer
    returns, so the series vanishes at once; backfilled blocks carry no such markers. The lookback
    delta defaults to just under one interval, which on this grid has the same effect: a series
    missing from the scrape at ``t`` is absent from the evaluation at ``t``.
    """
    runs = {instance: snaps for instance, snaps in runs.items() if snaps}
    if not runs:
        return {}
    group_name, step_s, records, alerts = _split_rules(rules_doc)
    if lookback_delta_s is None:
        lookback_delta_s = max(1.0, step_s - 1.0)
    duration = max(snaps[-1].t for snaps in runs.values())
    with tempfile.TemporaryDirectory(prefix="rw-prom-") as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        with Prometheus(data, lookback_delta_s=lookback_delta_s, binary=prometheus) as prom:
            rule_file, start = place_run(
                prom,
                rule_dir=Path(tmp),
                group_name=group_name,
                duration_s=duration,
                step_s=step_s,
                promtool=promtool,
            )
            prom.stop()
            # One OpenMetrics file for every run: each sample carries its run's instance label.
            scraped = [
                Snapshot(
                    s.t, [(n, {**lb, "instance": instance}, v) for n, lb, v in [*s.samples, ("up", {}, 1.0)]]
                )
                for instance, snaps in runs.items()
                for s in snaps
            ]
            write_blocks(scraped, data, start_unix_s=start, extra_labels={"job": job}, promtool=promtool)
            prom.start()
            backfill_recording_rules(
                prom,
                records,
                rule_file=rule_file,
                group_name=group_name,
                start_unix_s=start,
                end_unix_s=start + duration,
                step_s=step_s,
                promtool=promtool,
            )
            eval_times = [round(start + i * step_s, 3) for i in range(round(duration / step_s) + 1)]
            out: dict[str, list[RunEpisode]] = {instance: [] for instance in runs}
            for alert in alerts:
                result = prom.query_range(str(alert["expr"]), eval_times[0], eval_times[-1], step_s)
                by_instance: dict[str, dict[tuple[tuple[str, str], ...], list[float]]] = {}
                for labels, ts in active_times(result).items():
                    instance = dict(labels).get("instance", "")
                    if instance not in out:
                        raise BackfillError(f"{alert['alert']} is active for unknown instance {instance!r}")
                    by_instance.setdefault(instance, {})[labels] = [round(t, 3) for t in ts]
                for instance, active in by_instance.items():
                    # Each run is judged over its own length, like its replay.
                    run_end = start + runs[instance][-1].t + 1e-6
                    episodes = alert_episodes(
                        active,
                        [t for t in eval_times if t <= run_end],
                        for_s=parse_duration(str(alert.get("for", "0s"))),
                        keep_firing_for_s=parse_duration(str(alert.get("keep_firing_for", "0s"))),
                    )
                    for ep in episodes:
                        resolved = None if ep.resolved_at is None else round(ep.resolved_at - start, 3)
                        out[instance].append(
                            RunEpisode(
                                str(alert["alert"]), ep.labels, round(ep.fired_at - start, 3), resolved
                            )
                        )
    return {k: sorted(v, key=lambda e: (e.fired_at_s, e.alertname)) for k, v in out.items()}
