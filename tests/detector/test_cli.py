"""``retrywatch detect`` as a real process: replay, serve, notify; episodes survive ``kill -9``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from detector.cli import detect
from detector.store import EpisodeStore
from detector.thresholds import ALERTS, PROMETHEUS_ALERTS
from foundation.processes import ManagedProcess, free_port
from foundation.timeseries import write_series
from tests.detector.conftest import TestServer, exposition, wait_until
from tests.detector.factories import snapshot
from tests.detector.minisim import MiniSim
from tests.exporter.support import endless_head


@pytest.mark.slow
def test_fired_episodes_survive_kill_9(tmp_path: Path, http_server: TestServer) -> None:
    series = tmp_path / "runs" / "diag__off__mini__r1" / "metrics.jsonl"
    series.parent.mkdir(parents=True)
    write_series(series, MiniSim(seed=3).run())
    db = f"sqlite:///{tmp_path / 'detector.db'}"
    port = free_port()
    env = {**os.environ, "RETRYWATCH_DB": db}
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--replay", str(series), "--port", str(port),
         "--webhook", http_server.url, "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.log").open("wb"),
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"

        def loop_episode() -> bool:
            eps = httpx.get(f"{base}/episodes", timeout=2).json()["episodes"]
            return any(e["alertname"] == "VLLMMetastableRetryLoop" for e in eps)

        wait_until(loop_episode, 90, "the detector to replay the run")
        wait_until(lambda: len(http_server.posts) >= 2, 20, "the webhook notifications")
        served = httpx.get(f"{base}/episodes", timeout=2).json()["episodes"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    store = EpisodeStore(db)
    kept = {(e.alertname, e.started_at, e.resolved_at) for e in store.episodes()}
    assert {(e["alertname"], e["started_at"], e["resolved_at"]) for e in served} <= kept
    loop = [e for e in store.episodes() if e.alertname == "VLLMMetastableRetryLoop"]
    assert len(loop) == 1 and loop[0].labels.instance == "diag__off__mini__r1"
    store.close()


def test_usage_errors_are_clear(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(detect, [])
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = runner.invoke(detect, ["--exporter", "http://a/metrics", "--prometheus", "http://p"])
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = runner.invoke(detect, ["--exporter", "a:8000"])
    assert res.exit_code == 2 and "http" in res.output
    res = runner.invoke(detect, ["--exporter", "http://a/metrics"], env={"RETRYWATCH_CAPACITY": "-1"})
    assert res.exit_code == 2 and "capacity" in res.output.lower()
    res = runner.invoke(detect, ["--exporter", "http://a/metrics", "--series-limit", "0"])
    assert res.exit_code == 2 and "'--series-limit': 0 is not in the range x>=1" in res.output, res.output


def test_an_openai_base_url_as_exporter_is_refused_at_start_naming_the_metrics_url(tmp_path: Path) -> None:
    """``--exporter http://HOST:PORT/v1`` scraped a 404 forever: refused before anything opens."""
    port = free_port()
    args = [sys.executable, "-m", "retrywatch", "detect", "--exporter", "http://127.0.0.1:8100/v1"]
    args += ["--db", f"sqlite:///{tmp_path / 'd.db'}", "--port", str(port)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: --exporter is a proxy's /metrics URL, not its /v1 API root: give "
        "http://127.0.0.1:8100/metrics, not http://127.0.0.1:8100/v1"
    )
    assert not (tmp_path / "d.db").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [("--interval", "nan"), ("--interval", "inf"), ("--time-scale", "nan"), ("--time-scale", "inf"),
     ("--capacity", "nan"), ("--deadline", "inf"), ("--replay-speed", "nan")],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_a_one_line_usage_error(
    tmp_path: Path, option: str, value: str
) -> None:
    # NaN passes every bound of click.FloatRange: --interval nan used to end in a traceback after
    # the database was opened, --capacity nan ran the detector against no capacity at all.
    args = [sys.executable, "-m", "retrywatch", "detect", "--exporter", "http://127.0.0.1:1/metrics"]
    args += ["--db", f"sqlite:///{tmp_path / 'd.db'}", "--port", str(free_port()), option, value]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: Invalid value for '{option}': {value} is not a finite number."
    )
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "d.db").exists()


SECRETS = ("DBSECRETpw", "SCRAPESECRET", "HOOKSECRET", "HOOKTOKEN", "QUERYTOKEN", "AMSECRET")


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("db_from", ["option", "environment"])
def test_no_credential_is_printed_logged_stored_or_sent(
    tmp_path: Path, http_server: TestServer, postgres_url: str, db_from: str
) -> None:
    http_server.body = exposition(snapshot(0.0, first=1.0).samples)
    http_server.fail_next = 1  # one failed notification: its error names the URL
    live = f"http://scrape:SCRAPESECRET@127.0.0.1:{http_server.port}/metrics"
    dead = f"http://scrape:SCRAPESECRET@127.0.0.1:{free_port()}/metrics"  # fires NoData
    db = postgres_url.replace("//rw@", "//rw:DBSECRETpw@")
    port = free_port()
    env = {**os.environ, "RETRYWATCH_DB": db} if db_from == "environment" else dict(os.environ)
    log = tmp_path / "detector.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--exporter", live, "--exporter", dead,
         "--webhook", f"http://hook:HOOKSECRET@127.0.0.1:{http_server.port}/hooks/HOOKTOKEN42?token=QUERYTOKEN",
         "--alertmanager", f"http://am:AMSECRET@127.0.0.1:{http_server.port}",
         *(["--db", db] if db_from == "option" else []),
         "--time-scale", "10", "--port", str(port), "--log-level", "info"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def notified() -> bool:
            kinds = {"webhook" if isinstance(p, dict) else "alertmanager" for p in http_server.posts}
            return kinds == {"webhook", "alertmanager"}

        wait_until(notified, 60, "the webhook and Alertmanager notifications")
        served = httpx.get(f"{base}/signals", timeout=5).text + httpx.get(f"{base}/episodes", timeout=5).text
        api_metrics = httpx.get(f"{base}/metrics", timeout=5).text
    finally:
        proc.terminate()
        proc.wait(20)
    output = log.read_text()
    assert "retrywatch detector on" in output and "rw:***@127.0.0.1" in output
    assert "HTTP Request: POST http://hook:***@127.0.0.1" in output  # httpx's own log line, masked
    assert "notify" in output and "/hooks/***?token=***" in output  # the failed delivery's error
    assert f"http://scrape:***@127.0.0.1:{http_server.port}/metrics" in served  # the engine's instance
    sent = json.dumps(http_server.posts)
    for secret in SECRETS:
        assert secret not in output, f"{secret} printed or logged"
        assert secret not in served + api_metrics, f"{secret} served by the API"
        assert secret not in sent, f"{secret} sent in a notification"


# case -> (--db, what the error says, given by the option or by RETRYWATCH_DB)
BAD_DATABASES = {
    "unknown scheme": ("nosuchdb://rw:DBSECRETpw@127.0.0.1/x", "unknown database scheme", "option"),
    "not a URL": ("rw:DBSECRETpw@127.0.0.1/x", "not a database URL", "environment"),
    "driver not installed": ("mysql://rw:DBSECRETpw@127.0.0.1/x", "'mysql' is not installed", "option"),
    "unreachable server": (
        "postgresql+psycopg://rw:DBSECRETpw@127.0.0.1:{free}/x",
        "Connection refused",
        "environment",
    ),
    "missing directory": ("sqlite:///{tmp}/no/such/d.db", "/no/such does not exist", "option"),
    "not a database": ("sqlite:///{tmp}/notes.txt", "file is not a database", "environment"),
}


@pytest.mark.parametrize("case", list(BAD_DATABASES))
def test_a_bad_db_is_a_one_line_usage_error_with_the_password_masked(tmp_path: Path, case: str) -> None:
    template, reason, given_by = BAD_DATABASES[case]
    url = template.format(tmp=tmp_path, free=free_port())
    (tmp_path / "notes.txt").write_text("not a database, just notes\n" * 100)
    args = [sys.executable, "-m", "retrywatch", "detect", "--exporter", "http://127.0.0.1:9/metrics"]
    env = dict(os.environ)
    if given_by == "option":
        args += ["--db", url]
    else:
        env["RETRYWATCH_DB"] = url
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr  # like every bad option of this command
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("Error:")]
    assert line.startswith("Error: Invalid value for --db: cannot use the database ")
    assert reason in line and "Traceback" not in res.stderr and res.stdout == ""
    assert "DBSECRETpw" not in res.stderr + res.stdout
    if "DBSECRETpw" in url:
        assert "rw:***@" in line
    assert not (tmp_path / "no").exists()  # a mistyped path is refused, not created


def test_a_writer_lease_file_that_cannot_be_made_is_a_one_line_usage_error(tmp_path: Path) -> None:
    (tmp_path / "detector.db-writer").mkdir()  # where the lock file of detector.db goes
    db = f"sqlite:///{tmp_path / 'detector.db'}"
    args = [
        sys.executable,
        "-m",
        "retrywatch",
        "detect",
        "--exporter",
        "http://127.0.0.1:9/metrics",
        "--db",
        db,
    ]
    res = subprocess.run(args, env=_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("Error:")]
    lock = tmp_path / "detector.db-writer"
    assert line == f"Error: Invalid value for --db: the writer lease's file {lock}: Is a directory"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETRYWATCH_")}
    return env | {"XDG_STATE_HOME": str(tmp_path / "state")}


def test_the_default_database_is_in_the_state_directory_and_the_source_changes_are_logged_once(
    tmp_path: Path, http_server: TestServer
) -> None:
    http_server.body = exposition(snapshot(0.0, first=1.0).samples)
    port = free_port()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    log = tmp_path / "detector.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--exporter", http_server.url + "/metrics",
         "--interval", "0.2", "--port", str(port)],
        cwd=cwd, env=_env(tmp_path), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: "retrywatch detector on" in log.read_text(), 60, "the start line")
        wait_until(lambda: httpx.get(f"{base}/healthz", timeout=5).json()["source"]["up"], 30, "a scrape")
        http_server.status = 500
        wait_until(lambda: "is down" in log.read_text(), 30, "the source's down line")
        time.sleep(1.5)  # several more failed scrapes
        http_server.status = 200
        wait_until(lambda: "is back up" in log.read_text(), 30, "the source's up line")
        time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(20)
    db = tmp_path / "state" / "retrywatch" / "detector.db"
    assert db.exists() and list(cwd.iterdir()) == []  # nothing written where it was started
    lines = log.read_text().splitlines()
    assert lines[0] == (
        f"retrywatch detector on {base} (/alerts, /episodes, /runbook, /metrics) reading the proxies "
        f"{http_server.url}/metrics; episodes in sqlite:///{db}; runbook links {base}/runbook#{{alert}}; "
        "deadline: the proxy's per instance (stated to it or learned; logged once known), else missing"
    )
    # Quiet by default: the start line and one line per change of the source, nothing per scrape.
    assert [line.split(" ", 3)[2:] for line in lines[1:]] == [
        ["WARNING", f"retrywatch.detector: source exporter is down: {http_server.url}/metrics: HTTP 500"],
        ["WARNING", "retrywatch.detector: source exporter is back up"],
    ], lines


def test_a_taken_port_ends_it_before_it_prints_scrapes_or_creates_anything(
    tmp_path: Path, http_server: TestServer
) -> None:
    scrapes: list[float] = []
    http_server.body_fn = lambda: (scrapes.append(time.time()), "")[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "retrywatch", "detect", "--exporter", http_server.url,
             "--port", str(port)],
            env=_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port} (Address already in use): pick another with --port"
    ]
    assert scrapes == [] and not (tmp_path / "state").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_runbook_links_follow_the_option_and_the_detector_serves_its_runbook_and_an_index(
    tmp_path: Path,
) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}/metrics"  # fires VLLMRetrywatchNoData
    log = tmp_path / "detector.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--exporter", dead, "--time-scale", "10",
         "--interval", "0.5", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'd.db'}",
         "--runbook-url", "https://wiki.example/rw#{alert}"],
        env=_env(tmp_path), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def firing() -> list[dict[str, str]]:
            with contextlib.suppress(httpx.HTTPError):
                return list(httpx.get(f"{base}/alerts", timeout=5).json()["alerts"])
            return []

        def stored() -> list[dict[str, str]]:
            with contextlib.suppress(httpx.HTTPError):
                return list(httpx.get(f"{base}/episodes", timeout=5).json()["episodes"])
            return []

        # The episode is written by the database's worker after the alert fires: wait for both.
        wait_until(lambda: bool(firing()) and bool(stored()), 60, "the NoData alert and its episode")
        alerts, episodes = firing(), stored()
        index = httpx.get(f"{base}/", timeout=5)
        runbook = httpx.get(f"{base}/runbook", timeout=5)
    finally:
        proc.terminate()
        proc.wait(20)
    expected = "https://wiki.example/rw#VLLMRetrywatchNoData"
    assert [a["runbook_url"] for a in alerts] == [expected]
    assert episodes and {e["runbook_url"] for e in episodes} == {expected}
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    for path in ("/alerts", "/episodes", "/runbook", "/metrics"):
        assert f'href="{path}"' in index.text
    assert runbook.status_code == 200 and runbook.headers["content-type"].startswith("text/html")
    for name in [rule.name for rule in ALERTS] + [alert.name for alert in PROMETHEUS_ALERTS]:
        assert f'<h2 id="{name}">{name}</h2>' in runbook.text  # the rules' links land on it
    assert "runbook links https://wiki.example/rw#{alert}" in log.read_text()


@pytest.mark.parametrize(
    "pattern", ["docs/runbook.md#{alert}", "https://wiki.example/rw", "https://wiki.example/{alert}/{x}"]
)
def test_a_runbook_pattern_that_gives_no_absolute_link_per_alert_is_refused(pattern: str) -> None:
    result = CliRunner().invoke(detect, ["--replay", __file__, "--runbook-url", pattern])
    assert result.exit_code == 2 and "--runbook-url" in result.output, result.output


def test_the_api_bounds_its_clients_and_sigterm_ends_it_cleanly(tmp_path: Path) -> None:
    """The API ran on stock uvicorn, which bounds no request head: one client sending an endless
    header grew the detector by 250 MB in 30 s, and half-sent requests were held forever."""
    series = tmp_path / "runs" / "diag__off__mini__r1" / "metrics.jsonl"
    series.parent.mkdir(parents=True)
    write_series(series, MiniSim(seed=3).run())
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrywatch", "detect", "--replay", str(series), "--port", str(port),
         "--db", f"sqlite:///{tmp_path / 'detector.db'}", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.log").open("wb"),
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{base}/healthz"), 60, "the detector's API")
        answer = endless_head(port, "/alerts")
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b"head_too_large" in answer
        assert httpx.get(f"{base}/alerts", timeout=5).status_code == 200  # and it goes on serving
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, (tmp_path / "stderr.log").read_text()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_ipv6_listener_announces_a_url_that_reaches_it(tmp_path: Path) -> None:
    """On an IPv6 address the start line said ``http://::1:PORT``, which no client parses."""
    port = free_port()
    args = [sys.executable, "-m", "retrywatch", "detect", "--exporter", "http://127.0.0.1:9/metrics"]
    args += ["--db", f"sqlite:///{tmp_path / 'd.db'}", "--host", "::1", "--port", str(port)]
    log = tmp_path / "detector.log"
    with ManagedProcess(args, log_path=log, bound_s=None, name="detector") as proc:
        proc.wait_ready(f"http://[::1]:{port}/healthz", timeout_s=30, poll_s=0.1)
    announced = log.read_text().split("retrywatch detector on ", 1)[1].split(" ", 1)[0]
    assert announced == f"http://[::1]:{port}"


def _vllm_alone(case_name: str, time_scale: float) -> Callable[[], str]:
    """vLLM's own /metrics (no retrywatch series at all) along a vLLM-tier promtool scenario,
    played ``time_scale`` times faster than written, from the first scrape: a clock started
    with the test let a detector slow to start on a busy machine miss the whole scenario."""
    from rules import unittests

    case = next(c for s in unittests.VLLM_SCENARIOS for c in s.cases if c.name == case_name)
    snaps = unittests.case_snapshots(case, tier="vllm")
    started: list[float] = []

    def body() -> str:
        if not started:
            started.append(time.monotonic())
        t = (time.monotonic() - started[0]) * time_scale
        snap = snaps[min(len(snaps) - 1, int(t // unittests.STEP_S))]
        # the counters scaled with the clock: a run K times faster finishes K times more per second
        samples = [
            (n, lb, v * time_scale if n.endswith(("_total", "_sum", "_count", "_bucket")) else v)
            for n, lb, v in snap.samples
            if not n.startswith("retrywatch_")
        ]
        return exposition(samples)

    return body


def test_on_vllm_alone_it_evaluates_the_vllm_tier_and_says_nothing_of_the_proxy(
    tmp_path: Path, http_server: TestServer
) -> None:
    """``detect --exporter http://VLLM/metrics --tier vllm``: the queue beyond the deadline fires
    from vLLM's series and the stated Ĉ and deadline alone; the proxy tier's NoData does not (with
    ``--tier proxy`` it does); vLLM's scrape failing raises the vLLM tier's NoData."""
    k = 50.0  # the 1000-s scenario in 20 s, the queue's 300 s in 6; Ĉ = 2/s written, so 100/s
    http_server.body_fn = _vllm_alone("the waiting queue holds 1.25 deadlines of work while vLLM admits", k)
    port = free_port()
    log = tmp_path / "detector.log"
    args = [sys.executable, "-m", "retrywatch", "detect", "--exporter", http_server.url + "/metrics",
            "--tier", "vllm", "--capacity", str(2 * k), "--deadline", str(120 / k), "--time-scale", str(k),
            "--interval", "0.1",
            "--db", f"sqlite:///{tmp_path / 'd.db'}", "--port", str(port)]  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def names() -> set[str]:
        return {e["alertname"] for e in httpx.get(f"{base}/episodes", timeout=2).json()["episodes"]}

    with ManagedProcess(args, log_path=log, bound_s=None, name="detector"):
        wait_until(lambda: "VLLMQueueBeyondDeadline" in names(), 30, "the vLLM tier's warning")
        assert "reading vLLM's own metrics at " in log.read_text()
        # 2.4 s lies between vLLM's 2- and 2.5-s buckets: the start line says which one counts
        assert "deadline: stated 2.4 s (WARNING: the deadline 2.4 s falls between" in log.read_text()
        firing = {a["alertname"] for a in httpx.get(f"{base}/alerts", timeout=2).json()["alerts"]}
        assert firing <= {"VLLMQueueBeyondDeadline"}
        http_server.status = 500  # vLLM's /metrics fails
        wait_until(lambda: "VLLMTierNoData" in names(), 30, "the vLLM tier's NoData")
        assert names() == {"VLLMQueueBeyondDeadline", "VLLMTierNoData"}
    # the same vLLM read as a proxy: the proxy tier's NoData fires for the series it lacks
    http_server.status = 200
    args[args.index("vllm")] = "proxy"
    args[args.index(str(port))] = str(port2 := free_port())
    args[args.index(f"sqlite:///{tmp_path / 'd.db'}")] = f"sqlite:///{tmp_path / 'p.db'}"
    base = f"http://127.0.0.1:{port2}"
    with ManagedProcess(args, log_path=tmp_path / "proxy.log", bound_s=None, name="detector"):
        wait_until(lambda: "VLLMRetrywatchNoData" in names(), 30, "the proxy tier's NoData")
