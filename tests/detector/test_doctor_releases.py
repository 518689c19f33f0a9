"""``retrywatch doctor`` on every vLLM release family, end to end: the family's ``/metrics`` (built
from ``foundation.vllmreleases``: every series it serves, under its names, labels and buckets,
with requests finishing) served by a real HTTP server on loopback and read through the CLI
(``retrywatch doctor --vllm URL --capacity C --deadline S``). Its verdict line for each vLLM-tier alert is
checked twice: against the facts (whether the family serves what the alert's condition reads) and
against ``promtool`` evaluating the rendered rules over the same exposition (an alert can evaluate
where every record its condition reads is recorded: ``and`` for all of, ``or`` for any of).

No real older vLLM runs here: the expositions are the recorded facts, not a release's own output.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from detector.signals import PROMETHEUS_JOBS, SIGNALS_BY_NAME
from detector.thresholds import ALERTS, AnyOf, Cmp, Condition
from foundation import metricnames as mn
from foundation.vllmreleases import FAMILIES, WAITING_DEFERRED, WAITING_FOR_CAPACITY, ReleaseFamily
from retrywatch.cli import main
from rules import generate
from tests.detector.conftest import TestServer, need
from tests.detector.test_releases import CAPACITY, DEFERRED, MAX_MODEL_LEN, WAITING, supported

VLLM_ALERTS = [r for r in ALERTS if r.tier == "vllm"]
EVALUATES = ("ok", "approx", "partial")  # the doctor's words for an alert that can evaluate
STEP_S, STEPS = 5, 80
INSTANCE = "v"
DEADLINE_S = 120.0  # stated: the rules assume none
FINISHED = 10  # requests finished between two scrapes
OBSERVED = {  # seconds (or tokens) each finished request adds to a histogram
    mn.VLLM_QUEUE_TIME: 0.5,
    mn.VLLM_TTFT: 0.6,
    mn.VLLM_E2E_LATENCY: 3.0,
    mn.VLLM_PREFILL_TIME: 0.1,
    mn.VLLM_DECODE_TIME: 2.4,
    mn.VLLM_INTER_TOKEN_LATENCY: 0.05,
    mn.VLLM_REQUEST_PROMPT_TOKENS: 100,
    mn.VLLM_REQUEST_GENERATION_TOKENS: 50,
}


def exposition(family: ReleaseFamily) -> str:
    """One scrape of a vLLM of ``family`` that has finished ``FINISHED`` requests of 100 prompt
    tokens in 3 s each, with a queue of which some requests are deferred (0.20 on)."""
    registry = CollectorRegistry()
    series = [*((c, s) for c, s in family.series.items() if s is not None), *family.deprecated.items()]
    for canonical, s in series:
        values = {
            "engine": "0",
            "model_name": "m",
            "finished_reason": "stop",
            "reason": "max_num_queued_reqs",
        }
        if s.kind == "counter":
            per = {mn.VLLM_REQUEST_SUCCESS: 1, mn.VLLM_ADMISSION_REJECTIONS: 0}.get(canonical, 100)
            Counter(s.name, "help", s.labels, registry=registry).labels(*(values[lb] for lb in s.labels)).inc(
                per * FINISHED
            )
        elif canonical == mn.VLLM_NUM_WAITING_BY_REASON:
            gauge = Gauge(s.name, "help", s.labels, registry=registry)
            for reason, value in ((WAITING_FOR_CAPACITY, WAITING - DEFERRED), (WAITING_DEFERRED, DEFERRED)):
                gauge.labels(*({**values, "reason": reason}[lb] for lb in s.labels)).set(value)
        elif s.kind == "gauge":
            level = WAITING if canonical == mn.VLLM_NUM_WAITING else 2.0
            Gauge(s.name, "help", s.labels, registry=registry).labels(*(values[lb] for lb in s.labels)).set(
                level
            )
        else:
            h = Histogram(s.name, "help", s.labels, registry=registry, buckets=s.bounds(MAX_MODEL_LEN))
            for _ in range(FINISHED):
                h.labels(*(values[lb] for lb in s.labels)).observe(OBSERVED[canonical])
    return generate_latest(registry).decode()


def _input_series(text: str) -> list[dict[str, str]]:
    """The exposition as promtool input: each counter (and histogram sample) growing by its value
    every step, each gauge at its value; retrywatch's job and instance, Ĉ and the deadline stated."""
    job = PROMETHEUS_JOBS["vllm"]
    out = [
        {"series": f'up{{job="{job}",instance="{INSTANCE}"}}', "values": f"1x{STEPS}"},
        {"series": f'{mn.CAPACITY}{{job="{job}",instance="{INSTANCE}"}}', "values": f"{CAPACITY:g}x{STEPS}"},
        {
            "series": f'{mn.CLIENT_DEADLINE}{{job="{job}",instance="{INSTANCE}"}}',
            "values": f"{DEADLINE_S:g}x{STEPS}",
        },
    ]
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {**sample.labels, "job": job, "instance": INSTANCE}
            selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            grows = fam.type in ("counter", "histogram")
            values = f"0+{sample.value:g}x{STEPS}" if grows else f"{sample.value:g}x{STEPS}"
            out.append({"series": f"{sample.name}{{{selector}}}", "values": values})
    return out


def _evaluable(cond: Condition) -> str:
    """PromQL present (per instance) exactly where every record ``cond`` reads is recorded."""
    if isinstance(cond, Cmp):
        return f"group by (instance) ({SIGNALS_BY_NAME[cond.signal].record})"
    word = " or " if isinstance(cond, AnyOf) else " and on (instance) "
    return "(" + word.join(_evaluable(term) for term in cond.terms) + ")"


def _facts_evaluable(cond: Condition, family: ReleaseFamily) -> bool:
    if isinstance(cond, Cmp):
        return supported(cond.signal, family)
    hold = [_facts_evaluable(term, family) for term in cond.terms]
    return any(hold) if isinstance(cond, AnyOf) else all(hold)


@pytest.fixture
def server() -> Iterator[TestServer]:
    s = TestServer()
    yield s
    s.close()


def _verdicts(url: str) -> dict[str, str]:
    """The doctor's first word for each vLLM-tier alert, run through the CLI over HTTP."""
    args = ["--vllm", url, "--capacity", f"{CAPACITY:g}", "--deadline", f"{DEADLINE_S:g}"]
    res = CliRunner().invoke(main, ["doctor", *args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert res.exit_code in (0, 1), res.output
    out: dict[str, str] = {}
    for rule in VLLM_ALERTS:
        (found,) = [ln for ln in res.output.splitlines() if f" {rule.name} (" in ln]
        out[rule.name] = found.split()[0]
    return out


@pytest.mark.promtool
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_the_doctor_over_http_says_what_the_facts_and_promtool_say(
    family: ReleaseFamily, server: TestServer, tmp_path: Path
) -> None:
    promtool = need("promtool")
    server.body = exposition(family)
    verdicts = _verdicts(server.url)
    # the facts: an alert the doctor lets evaluate reads only what the family serves
    for rule in VLLM_ALERTS:
        assert (verdicts[rule.name] in EVALUATES) == _facts_evaluable(rule.condition, family), (
            rule.name,
            verdicts[rule.name],
        )
    # promtool, over the same exposition: the rendered rules record what each condition reads
    # exactly where the doctor says the alert can evaluate
    at = f"{(STEPS - 2) * STEP_S}s"
    tests = [
        {
            "expr": _evaluable(rule.condition),
            "eval_time": at,
            "exp_samples": [{"labels": f'{{instance="{INSTANCE}"}}', "value": 1}]
            if verdicts[rule.name] in EVALUATES
            else [],
        }
        for rule in VLLM_ALERTS
    ]
    doc = {
        "rule_files": [str(generate.RULES_PATH)],
        "evaluation_interval": f"{STEP_S}s",
        "tests": [
            {
                "interval": f"{STEP_S}s",
                "input_series": _input_series(server.body),
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "doctor.test.yml"
    path.write_text(json.dumps(doc), encoding="utf-8")  # JSON is YAML
    proc = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, (verdicts, proc.stdout[-3000:] + proc.stderr[-3000:])
