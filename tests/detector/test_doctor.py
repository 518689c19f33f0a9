"""``retrywatch doctor`` against expositions built from what vLLM releases serve
(``foundation.vllmreleases``), served over loopback HTTP, and a real proxy's ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from detector.capacity import PREDICTOR_SERIES
from detector.doctor import PREDICTING_SINCE
from detector.doctorread import ReadError, read_metrics
from detector.needs import alert_series, signal_needs
from detector.signals import RAW, UP
from detector.thresholds import ALERTS, ALERTS_BY_NAME
from exporter.metrics import ProxyMetrics
from exporter.policy import Policy, PolicyConfig
from foundation import metricnames as mn
from foundation.processes import ManagedProcess, free_port
from foundation.vllmreleases import ReleaseFamily, covering
from retrywatch.cli import main
from rules import stated
from tests.detector.conftest import TestServer, need, wait_until

MAX_MODEL_LEN = 2048
VLLM_PAGES = [r.name for r in ALERTS if r.tier == "vllm" and r.severity == "critical"]


def family(version: str, engine: str = "V1") -> ReleaseFamily:
    return next(f for f in covering(version) if f.engine == engine or len(covering(version)) == 1)


def vllm_text(fam: ReleaseFamily) -> str:
    """What a release of ``fam`` serves once it has finished a request, as its /metrics text."""
    registry = CollectorRegistry()
    for s in fam.served():
        values = ["0"] * len(s.labels)
        if s.kind == "counter":
            Counter(s.name, "help", s.labels, registry=registry).labels(*values).inc()
        elif s.kind == "gauge":
            Gauge(s.name, "help", s.labels, registry=registry).labels(*values).set(1.0)
        else:
            h = Histogram(s.name, "help", s.labels, registry=registry, buckets=s.bounds(MAX_MODEL_LEN))
            h.labels(*values).observe(1.0)
    return generate_latest(registry).decode()


@pytest.fixture
def server() -> Iterator[TestServer]:
    s = TestServer()
    yield s
    s.close()


def doctor(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["doctor", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, res.output


def line(output: str, name: str) -> str:
    (found,) = [ln for ln in output.splitlines() if f" {name} (" in ln]
    return found


# --- what each alert needs, from its declaration ---------------------------------------------


def test_every_alert_needs_only_series_the_detector_reads_and_the_vllm_tier_nothing_of_the_proxy() -> None:
    raw_names = {name for name, _ in RAW.values()}
    for rule in ALERTS:
        assert set(alert_series(rule)) <= raw_names, rule.name
        if rule.tier == "vllm":  # Ĉ's and the deadline's series are the stated numbers, not the proxy's
            stated = {mn.CAPACITY, mn.CLIENT_DEADLINE}
            assert {n for n in alert_series(rule) if n.startswith("retrywatch_")} <= stated
    assert alert_series(ALERTS_BY_NAME["VLLMRequestsNotAnsweredInTime"]) == (
        mn.CLIENT_DEADLINE,
        f"{mn.VLLM_E2E_LATENCY}_bucket",
        f"{mn.VLLM_E2E_LATENCY}_count",
        mn.VLLM_NUM_WAITING,
    )


def test_or_gives_alternatives_and_unless_guarded_ones_are_not_counted_on() -> None:
    # Ĉ: stated (its series), learned (the rules' hourly estimate) or predicted (the series the
    # fit reads: the detector's, followed through the record only the rules define)
    assert signal_needs("vllm_capacity") == {
        frozenset({mn.CAPACITY, mn.VLLM_NUM_WAITING}),
        frozenset({"instance:retrywatch_vllmtier_capacity_estimate:avg1h", mn.VLLM_NUM_WAITING}),
        frozenset({*PREDICTOR_SERIES, mn.VLLM_NUM_WAITING}),
    }
    # no tier assumes a deadline: stated or exported
    assert signal_needs("vllm_deadline") == {frozenset({mn.CLIENT_DEADLINE, mn.VLLM_NUM_WAITING})}
    assert signal_needs("deadline") == {frozenset({mn.CLIENT_DEADLINE, mn.VLLM_NUM_WAITING})}
    # the delivery error's "nothing finished" branch holds only while nothing finishes; its
    # in-time finishes are the e2e bucket the deadline's record picks
    (need,) = signal_needs("vllm_delivery_error_ratio_short")
    assert {f"{mn.VLLM_E2E_LATENCY}_bucket", mn.CLIENT_DEADLINE} <= need
    assert signal_needs("vllm_data_missing") == {frozenset({UP})}


# --- verdicts over real HTTP ------------------------------------------------------------------


def test_vllm_0_6_cannot_page_and_says_why(server: TestServer) -> None:
    server.body = vllm_text(family("0.6.0"))
    code, out = doctor("--vllm", server.url, "--capacity", "2", "--deadline", "120")
    assert code == 1
    assert "release     vLLM 0.6.0-0.6.3 (V0)" in out
    assert "missing vllm:prefix_cache_queries_total (this release does not serve it)" in out
    buckets = "vLLM's e2e latency buckets end at 60 s: they cannot tell a 120-s deadline"
    assert line(out, "VLLMRequestsNotAnsweredInTime").startswith("  CANNOT") and buckets in out
    for page in VLLM_PAGES:
        if page != "VLLMRetryLoopAtQueueCap":
            assert line(out, page).startswith("  CANNOT")
    # no refusals counted, and no queue cap to refuse with: that page does not apply, blocks nothing
    no_cap = "this vLLM has no engine queue cap (--max-num-queued-reqs): no such loop can form"
    assert line(out, "VLLMRetryLoopAtQueueCap").startswith("  n/a") and no_cap in out
    assert "VLLMTierNoData (warning)" in line(out, "VLLMTierNoData") and "  ok" in line(out, "VLLMTierNoData")
    assert out.rstrip().endswith("3 of 3 pages cannot fire")
    # a deadline its buckets tell: the symptom page can fire (read at le=60)
    code, out = doctor("--vllm", server.url, "--capacity", "2", "--deadline", "60")
    assert line(out, "VLLMRequestsNotAnsweredInTime").startswith("  ok")


def test_vllm_0_32_with_c_and_deadline_stated_can_page(server: TestServer) -> None:
    server.body = vllm_text(family("0.32.0"))
    code, out = doctor("--vllm", server.url, "--capacity", "2.78", "--deadline", "120")
    assert code == 0, out
    assert "release     vLLM 0.32.0-0.34.0 (V1)" in out
    assert "13 of 13 vLLM series the alerts read are present" in out
    assert "Ĉ           2.78 calls/s (stated)" in out
    assert "proxy tier  not judged: no proxy (--proxy URL)" in out
    assert all(line(out, r.name).startswith("  ok") for r in ALERTS if r.tier == "vllm")
    assert out.rstrip().endswith("every page (4) can fire")


def test_without_c_it_is_predicted_from_vllms_counters_where_vllm_serves_them(server: TestServer) -> None:
    assert PREDICTING_SINCE == "0.10.2"  # vllm:inter_token_latency_seconds, and the new names
    server.body = vllm_text(family("0.32.0"))
    code, out = doctor("--vllm", server.url, "--deadline", "120")
    assert code == 0, out
    predicted = "Ĉ           predicted from vLLM's counters over its first minutes of decoding"
    assert predicted + " (vLLM 0.10.2 on), before any saturation" in out
    assert all(line(out, r.name).startswith("  ok") for r in ALERTS if r.tier == "vllm")
    report = json.loads(doctor("--vllm", server.url, "--format", "json")[1])
    assert report["capacity"]["source"] == "predicted"


def test_without_c_on_an_older_vllm_the_pages_that_need_it_wait_for_saturation(server: TestServer) -> None:
    # 0.9.1 serves time per output token, not the inter-token latency the rules' fit reads
    server.body = vllm_text(family("0.9.1"))
    code, out = doctor("--vllm", server.url, "--deadline", "120")
    assert code == 1
    waits = "Ĉ           not stated: the alerts that need it cannot evaluate until it is (--capacity C)"
    assert waits + " or learned online once vLLM's queue has stayed non-empty for 5 minutes" in out
    lacking = "no prediction from vLLM's counters (vLLM 0.10.2 on): missing vllm:inter_token_latency_seconds"
    assert lacking + " (this release serves it as vllm:time_per_output_token_seconds)" in out
    assert "no Ĉ stated (--capacity), predicted or learned yet" in line(out, "VLLMRetryLoopSuspected")
    assert line(out, "VLLMRequestsNotAnsweredInTime").startswith("  ok")  # needs no Ĉ


def test_without_a_deadline_none_is_assumed_and_the_alerts_reading_it_cannot_evaluate(
    server: TestServer,
) -> None:
    server.body = vllm_text(family("0.32.0"))
    code, out = doctor("--vllm", server.url, "--capacity", "2")
    assert code == 1
    assert "deadline    missing: not stated (--deadline S) nor exported by a proxy" in out
    assert "VLLMTierNoData and VLLMDeadlineMissing fire" in out and "120" not in out
    no_deadline = "no deadline: not stated (--deadline) nor exported by the proxy"
    assert line(out, "VLLMRequestsNotAnsweredInTime").startswith("  CANNOT") and no_deadline in out
    assert line(out, "VLLMTierNoData").startswith("  ok")  # it fires: the deadline is missing
    report = json.loads(doctor("--vllm", server.url, "--capacity", "2", "--format", "json")[1])
    assert report["deadline"] == {"value": None, "source": "missing", "lacking": []}


def test_a_deadline_between_buckets_is_read_at_the_bound_below_and_said(server: TestServer) -> None:
    server.body = vllm_text(family("0.32.0"))
    code, out = doctor("--vllm", server.url, "--capacity", "2", "--deadline", "90")
    assert code == 0
    note = "a 90-s deadline falls between vLLM's e2e latency buckets: read at 60 s"
    assert line(out, "VLLMRequestsNotAnsweredInTime").startswith("  approx") and note in out
    assert line(out, "VLLMAbandonedWorkSustained").startswith("  ok")  # reads no bucket


def test_a_renamed_series_is_read_under_the_name_the_release_serves(server: TestServer) -> None:
    # 0.9.1 serves the prefix-cache queries only as vllm:gpu_prefix_cache_queries_total: the rules
    # and the detector read that name where the new one is absent
    server.body = vllm_text(family("0.9.1"))
    code, out = doctor("--vllm", server.url, "--capacity", "2", "--deadline", "120")
    assert code == 0, out
    assert "missing vllm:prefix_cache_queries_total" not in out
    assert line(out, "VLLMRetryLoopSuspected").startswith("  ok")
    assert line(out, "VLLMAbandonedWorkSustained").startswith("  ok")
    # before 0.32 vLLM has no queue cap and counts no refusals: the queue-cap page does not apply
    assert line(out, "VLLMRetryLoopAtQueueCap").startswith("  n/a")


def test_behind_a_real_proxys_metrics_both_tiers_are_judged(server: TestServer) -> None:
    server.body = vllm_text(family("0.32.0"))
    proxy = TestServer()
    try:
        metrics = ProxyMetrics(Policy(PolicyConfig(deadline_s=120.0)), window_s=60.0, capacity=2.0)
        proxy.body = metrics.exposition(False, 0.0).decode()
        code, out = doctor("--vllm", server.url, "--proxy", proxy.url)
        assert code == 0, out
        assert "Ĉ           2 calls/s (exported)" in out and "deadline    120 s (exported)" in out
        assert "alerts (proxy tier)" in out
        assert all(line(out, r.name).startswith("  ok") for r in ALERTS)
        # a proxy that does not know the deadline: its symptom page cannot evaluate
        metrics = ProxyMetrics(Policy(PolicyConfig()), window_s=60.0, capacity=2.0)
        proxy.body = metrics.exposition(False, 0.0).decode()
        code, out = doctor("--vllm", server.url, "--proxy", proxy.url)
        assert code == 1
        assert "no deadline: not stated (--deadline) nor exported by the proxy" in line(
            out, "VLLMMetastableRetryLoop"
        )
        # a proxy given that does not answer: its tier is judged, and cannot page
        proxy.status = 502
        code, out = doctor("--vllm", server.url, "--proxy", proxy.url, "--capacity", "2", "--deadline", "120")
        assert code == 1 and "proxy       " in out and "did not answer: HTTP 502" in out
        assert line(out, "VLLMMetastableRetryLoop").endswith("the proxy did not answer")
        assert line(out, "VLLMRetryLoopSuspected").startswith("  ok")
    finally:
        proxy.close()


def test_json_credentials_and_an_engine_that_does_not_answer(server: TestServer) -> None:
    server.body = vllm_text(family("0.32.0"))
    url = server.url.replace("http://", "http://user:s3cretpw@") + "/v1"
    code, out = doctor("--vllm", url, "--capacity", "2", "--deadline", "120", "--format", "json")
    assert "s3cretpw" not in out
    report = json.loads(out)
    assert code == report["exit_code"] == 0
    assert report["release"] == "0.32.0-0.34.0 (V1)"
    assert report["endpoints"][0]["url"].endswith("/metrics") and "***" in report["endpoints"][0]["url"]
    assert {a["name"]: a["status"] for a in report["alerts"]}["VLLMRetryLoopSuspected"] == "ok"
    server.status = 503
    code, out = doctor("--vllm", server.url)
    assert code == 1 and "did not answer: HTTP 503" in out and "Traceback" not in out
    assert "release     unknown: no vLLM series read" in out
    assert line(out, "VLLMRequestsNotAnsweredInTime").endswith("no endpoint serving vLLM's series answered")
    assert line(out, "VLLMTierNoData").startswith("  ok")  # it fires on a target that does not answer


def test_usage_errors_are_one_line() -> None:
    code, out = doctor()
    assert code == 2 and "give --vllm URL" in out
    code, out = doctor("--vllm", "127.0.0.1:8000")
    assert code == 2 and "http(s)://" in out
    code, out = doctor("--vllm", "http://127.0.0.1:1", "--deadline", "nan")
    assert code == 2 and "not a finite number" in out
    code, out = doctor("--prometheus", "http://127.0.0.1:1", "--selector", "}")
    assert code == 2 and "label matchers" in out


def test_a_metrics_answer_is_read_within_its_size_bound() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"x" * 1000))
    with httpx.Client(transport=transport) as client, pytest.raises(ReadError, match="exceeds 100 bytes"):
        read_metrics(client, "http://vllm/metrics", max_bytes=100, timeout_s=5.0)


@pytest.mark.promtool  # needs Debian's prometheus package
def test_through_a_real_prometheus_without_the_rules_no_page_can_fire(
    server: TestServer, prometheus_factory: Callable[[str | Path], str]
) -> None:
    server.body = vllm_text(family("0.32.0"))
    prom = prometheus_factory(f"127.0.0.1:{server.port}")  # scraped as job retrywatch
    args = ("--prometheus", prom, "--vllm-job", "retrywatch", "--capacity", "2", "--deadline", "120")
    wait_until(lambda: "13 of 13" in doctor(*args)[1], 30, "vLLM's series in Prometheus")
    code, out = doctor(*args)
    assert code == 1
    assert "release     vLLM 0.32.0-0.34.0 (V1)" in out
    assert "rules       0 of 6 retrywatch alerts loaded, 0 evaluating" in out
    for page in VLLM_PAGES:
        assert line(out, page).endswith("not loaded in Prometheus' rules (retrywatch mixin)")
    # scraped as OpenMetrics, vLLM's colons become _: the doctor says so rather than "missing"
    server.body = server.body.replace("vllm:", "vllm_")
    wait_until(lambda: "keep the colons" in doctor(*args)[1], 30, "the colons lost in Prometheus")
    code, out = doctor(*args)
    assert code == 1 and "release     unknown" in out
    assert "Prometheus holds vLLM's series with each colon written as _ (vllm_" in line(
        out, "VLLMRetryLoopSuspected"
    )


@pytest.mark.promtool  # needs Debian's prometheus package
def test_through_a_real_prometheus_with_the_stated_rules_every_page_can_fire(
    server: TestServer, tmp_path: Path
) -> None:
    """The rules as ``retrywatch mixin --tier vllm`` renders them, Ĉ and the deadline stated in
    them: loaded and evaluating, and Ĉ read from the series they record."""
    server.body = vllm_text(family("0.32.0"))
    rules = tmp_path / "rules.yml"
    rules.write_text(stated.render(vllm_job="vllm", deadline_s=120.0, capacity=2.5, proxy_tier=False))
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    argv = [need("prometheus"), f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--config.file={cfg}"]  # fmt: skip
    with ManagedProcess(argv, log_path=tmp_path / "prometheus.log", bound_s=120, name="Prometheus") as proc:
        prom = f"http://127.0.0.1:{port}"
        proc.wait_ready(f"{prom}/-/ready", timeout_s=20, poll_s=0.1)
        wait_until(lambda: doctor("--prometheus", prom)[0] == 0, 30, "every page able to fire")
        code, out = doctor("--prometheus", prom, "--vllm", server.url)
    assert code == 0, out
    assert "rules       6 of 6 retrywatch alerts loaded, 6 evaluating" in out
    assert "Ĉ           2.5 calls/s (exported)" in out and "deadline    120 s (exported)" in out
    assert "release     vLLM 0.32.0-0.34.0 (V1)" in out and "Prometheus lacks" not in out
    assert out.rstrip().endswith("every page (4) can fire")
