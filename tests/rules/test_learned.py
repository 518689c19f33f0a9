"""The vLLM tier's Ĉ and deadline where nothing is stated (``rules.learned``), run by promtool.

Ĉ predicted by the rules against ``detector.capacity`` on the same simulated vLLM exposition (the
simulator's series become promtool's input series, scrape by scrape); the source in force; the
deadline taken from its series, its bucket chosen per instance, missing said plainly.
"""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from detector.capacity import PREDICTOR_SERIES, predict_capacity, split_windows, window_totals
from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from reproduce.conditions import block
from reproduce.sim import SimSpec, simulate
from rules import generate, learned

pytestmark = pytest.mark.promtool

INSTANCE = "sim:8000"
STEP_S = 5
# Five simulated minutes at 0.6 Ĉ (never saturated), then the short tail a run needs.
LOW_LOAD = {"phases": ((300.0, 0.6), (30.0, 0.6), (30.0, 0.6)), "phase_names": ("base", "pulse", "hold")}
#: How far the rules' prediction may stray from the detector's on the same series: at a 5-s
#: scrape interval both cut the same 5-s sub-windows wherever the window starts (1e-13 measured).
TOLERANCE = {300: 1e-9, 355: 1e-9}
WANTED = (*PREDICTOR_SERIES, mn.VLLM_NUM_WAITING, mn.VLLM_REQUEST_SUCCESS, f"{mn.VLLM_E2E_LATENCY}_count")


def _simulated(model: str, seed: int) -> list[Snapshot]:
    cond = block("diagnostic").condition("retries-off-cancel-off")
    snaps = simulate(SimSpec(model=model, condition=cond, seed=seed, workload=LOW_LOAD)).snapshots
    assert all(abs(s.t - i * STEP_S) < 1e-6 for i, s in enumerate(snaps))  # promtool's grid
    return [Snapshot(s.t, [x for x in s.samples if x[0] in WANTED]) for s in snaps]


def _python_prediction(snaps: Sequence[Snapshot], now: float) -> float:
    """``detector.capacity``'s prediction at ``now`` over its window, series summed per name."""
    samples = []
    for s in snaps:
        if now - 300.0 - 1e-9 <= s.t <= now + 1e-9:
            values: dict[str, float] = {}
            for name, _, v in s.samples:
                values[name] = values.get(name, 0.0) + v
            samples.append((s.t, values))
    whole = window_totals(samples)
    assert whole is not None
    p = predict_capacity(whole, split_windows(samples))
    assert p is not None
    return p.capacity


def _selector(name: str, labels: Mapping[str, str]) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in {**labels, "instance": INSTANCE, "job": "vllm"}.items())
    return f"{name}{{{body}}}"


def _input_series(snaps: Sequence[Snapshot], extra: Mapping[str, float] = {}) -> list[dict[str, str]]:
    """Every series of ``snaps`` as promtool input, one value per scrape (``_`` where absent)."""
    keys: dict[str, list[str]] = {}
    for i, s in enumerate(snaps):
        for name, labels, v in s.samples:
            key = _selector(name, labels)
            keys.setdefault(key, ["_"] * len(snaps))[i] = repr(float(v))
    out = [{"series": k, "values": " ".join(v)} for k, v in keys.items()]
    out.append({"series": f'up{{job="vllm",instance="{INSTANCE}"}}', "values": f"1+0x{len(snaps) - 1}"})
    for name, value in extra.items():
        out.append({"series": _selector(name, {}), "values": f"{value!r}+0x{len(snaps) - 1}"})
    return out


def _promtool(promtool: str, tmp: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp / "rules.yml").write_text(generate.render(), encoding="utf-8")
    doc = {"rule_files": ["rules.yml"], "evaluation_interval": f"{STEP_S}s", "tests": tests}
    (tmp / "learned.test.yml").write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return subprocess.run(
        [promtool, "test", "rules", "learned.test.yml"], capture_output=True, text=True, timeout=300, cwd=tmp
    )


def _expr_test(expr: str, at_s: int, labels: str | None, value: float = 1.0) -> dict[str, Any]:
    if labels is not None and re.fullmatch(r"[\w:]+", expr):  # a record read as it is keeps its name
        labels = "{" + f'__name__="{expr}",' + labels.removeprefix("{")
    samples = [] if labels is None else [{"labels": labels, "value": value}]
    return {"expr": expr, "eval_time": f"{at_s}s", "exp_samples": samples}


@pytest.mark.parametrize(("model", "seed"), [("qwen2.5-7b-h100", 11), ("qwen3-14b-h100", 12)])
def test_the_rules_predict_the_detectors_capacity_on_a_simulated_run(
    promtool: str, tmp_path: Path, model: str, seed: int
) -> None:
    snaps = _simulated(model, seed)
    at = 300
    inst = f'{{instance="{INSTANCE}"}}'
    agree = []
    for t, tolerance in TOLERANCE.items():
        python = _python_prediction(snaps, t)
        assert math.isfinite(python) and python > 0
        within = f"abs({learned.CAPACITY_PREDICTED} / {python!r} - 1) < bool {tolerance}"
        agree.append(_expr_test(within, t, inst))
    tests = [
        {
            "interval": f"{STEP_S}s",
            "input_series": _input_series(snaps),
            "promql_expr_test": [
                *agree,
                # nothing stated, never saturated: the Ĉ in force is the prediction
                _expr_test(
                    f"max by (instance) ({learned.CAPACITY_RECORD})"
                    f" - on (instance) {learned.CAPACITY_PREDICTED}",
                    at,
                    inst,
                    0.0,
                ),
                _expr_test(learned.CAPACITY_SOURCE, at, _source_labels(snaps, "predicted")),
            ],
        }
    ]
    proc = _promtool(promtool, tmp_path, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("scrape_s", [10, 15])
def test_a_longer_scrape_interval_gives_the_detectors_capacity_on_the_same_scrapes(
    promtool: str, tmp_path: Path, scrape_s: int
) -> None:
    """Prometheus scraping vLLM less often than the fit's sub-windows (15 s is its default): each
    scrape interval is one sub-window, for the rules as for the detector, whose rates are over the
    scrapes' own spacing (dividing by the sub-window's length made them 3x at 15 s, and Ĉ 2.6x)."""
    snaps = _simulated("qwen2.5-7b-h100", 11)
    every = scrape_s // STEP_S
    kept = [s if i % every == 0 else Snapshot(s.t, []) for i, s in enumerate(snaps)]
    python = _python_prediction(snaps[::every], 300)
    within = f"abs({learned.CAPACITY_PREDICTED} / {python!r} - 1) < bool 1e-4"
    tests = [
        {
            "interval": f"{STEP_S}s",
            "input_series": _input_series(kept),
            "promql_expr_test": [_expr_test(within, 300, f'{{instance="{INSTANCE}"}}')],
        }
    ]
    proc = _promtool(promtool, tmp_path, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _source_labels(snaps: Sequence[Snapshot], source: str) -> str:
    model = next(lb["model_name"] for name, lb, _ in snaps[-1].samples if name == mn.VLLM_NUM_WAITING)
    return f'{{instance="{INSTANCE}",model="{model}",source="{source}"}}'


def test_a_stated_capacity_wins_over_the_prediction(promtool: str, tmp_path: Path) -> None:
    snaps = _simulated("qwen2.5-7b-h100", 11)
    tests = [
        {
            "interval": f"{STEP_S}s",
            "input_series": _input_series(snaps, {mn.CAPACITY: 7.5}),
            "promql_expr_test": [
                _expr_test(
                    f"max by (instance) ({learned.CAPACITY_RECORD})", 300, f'{{instance="{INSTANCE}"}}', 7.5
                ),
                _expr_test(learned.CAPACITY_SOURCE, 300, _source_labels(snaps, "stated")),
            ],
        }
    ]
    proc = _promtool(promtool, tmp_path, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _steady(deadline_s: float | None) -> list[dict[str, str]]:
    """vLLM finishing 2 requests/s, one of them within 60 s and both within 120 s; the clients'
    deadline stated as a series, or none."""
    lb = f'instance="{INSTANCE}",job="vllm",engine="0",model_name="m"'
    series = [
        {"series": f'up{{job="vllm",instance="{INSTANCE}"}}', "values": "1+0x100"},
        {"series": f"{mn.VLLM_NUM_WAITING}{{{lb}}}", "values": "0+0x100"},
        {"series": f"{mn.VLLM_NUM_RUNNING}{{{lb}}}", "values": "4+0x100"},
        {"series": f'{mn.VLLM_REQUEST_SUCCESS}{{finished_reason="stop",{lb}}}', "values": "0+10x100"},
        {"series": f'{mn.VLLM_E2E_LATENCY}_bucket{{le="60.0",{lb}}}', "values": "0+5x100"},
        {"series": f'{mn.VLLM_E2E_LATENCY}_bucket{{le="120.0",{lb}}}', "values": "0+10x100"},
        {"series": f"{mn.VLLM_E2E_LATENCY}_count{{{lb}}}", "values": "0+10x100"},
        {"series": f"{mn.CAPACITY}{{{lb}}}", "values": "4+0x100"},
    ]
    if deadline_s is not None:
        series.append({"series": f"{mn.CLIENT_DEADLINE}{{{lb}}}", "values": f"{deadline_s!r}+0x100"})
    return series


_LABELS = f'instance="{INSTANCE}",engine="0",model="m"'


@pytest.mark.parametrize(
    ("deadline_s", "le", "late_share"),
    [(120.0, "120.0", 0.0), (90.0, "60.0", 0.5)],
)
def test_the_in_time_bucket_follows_the_deadline_in_force(
    promtool: str, tmp_path: Path, deadline_s: float, le: str, late_share: float
) -> None:
    """A 90-s deadline counts finishes within vLLM's 60-s bound as in time (never rounded up to
    120 s) and says so; a deadline on a bound says nothing."""
    late = learned.DEADLINE_RECORD.replace("client_deadline:seconds", "late_fraction:ratio1m")
    beyond = deadline_s - float(le)
    tests = [
        {
            "interval": f"{STEP_S}s",
            "input_series": _steady(deadline_s),
            "promql_expr_test": [
                _expr_test(learned.DEADLINE_BUCKET, 300, f'{{instance="{INSTANCE}",le="{le}"}}', beyond),
                _expr_test(late, 300, "{" + _LABELS + "}", late_share),
                _expr_test(learned.DEADLINE_RECORD, 300, "{" + _LABELS + "}", deadline_s),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "300s",
                    "alertname": "VLLMDeadlineBetweenBuckets",
                    "exp_alerts": []
                    if beyond == 0
                    else [
                        {
                            "exp_labels": {"severity": "info", "le": le, **_labels()},
                            "exp_annotations": _annotations("VLLMDeadlineBetweenBuckets", {"le": le}, beyond),
                        }
                    ],
                },
                {"eval_time": "300s", "alertname": "VLLMDeadlineMissing", "exp_alerts": []},
            ],
        }
    ]
    proc = _promtool(promtool, tmp_path, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _labels() -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', _LABELS))


def _annotations(name: str, labels: Mapping[str, str], value: float) -> dict[str, str]:
    """The alert's annotations as Prometheus expands them for these labels and value."""
    alert = next(a for a in learned.EXTRA_ALERTS if a.name == name)
    text = alert.description
    full = {**_labels(), **labels}
    text = re.sub(
        r"\{\{ if or \$labels.engine \$labels.model \}\}.*?\)\{\{ end \}\}",
        f" (engine {full['engine']}, model {full['model']})",
        text,
    )
    for key, v in full.items():
        text = text.replace(f"{{{{ $labels.{key} }}}}", v)
    text = text.replace('{{ $value | printf "%.3g" }}', f"{value:.3g}")
    from detector.runbook import DEFAULT_PATTERN, runbook_url

    return {"summary": alert.summary, "description": text, "runbook_url": runbook_url(DEFAULT_PATTERN, name)}


def test_no_deadline_stated_nor_learned_is_said_plainly(promtool: str, tmp_path: Path) -> None:
    """No deadline series: no default either; the deadline alerts' records are absent, NoData and
    VLLMDeadlineMissing fire."""
    queue = learned.DEADLINE_RECORD.replace("client_deadline:seconds", "queue_deadline:ratio1m")
    missing = learned.DEADLINE_RECORD.replace("client_deadline:seconds", "data_missing:bool")
    tests = [
        {
            "interval": f"{STEP_S}s",
            "input_series": _steady(None),
            "promql_expr_test": [
                _expr_test(learned.DEADLINE_RECORD, 300, None),
                _expr_test(queue, 300, None),
                # the tier's NoData reads it (its alert's own generated test checks the alert)
                _expr_test(missing, 300, f'{{instance="{INSTANCE}"}}', 1.0),
            ],
            "alert_rule_test": [
                {
                    "eval_time": "300s",
                    "alertname": "VLLMDeadlineMissing",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", **_labels()},
                            "exp_annotations": _annotations("VLLMDeadlineMissing", {}, 1.0),
                        }
                    ],
                },
            ],
        }
    ]
    proc = _promtool(promtool, tmp_path, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr
