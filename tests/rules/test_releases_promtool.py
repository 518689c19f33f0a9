"""Every vLLM release family through the rendered rules (``promtool test rules``): a steady state
exported as the family serves it records every vLLM-tier signal its series support (older names
read), the admitted prompt tokens once where a release serves the old name beside the new one,
and the waiting requests without those vLLM defers where it tells them apart."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from detector.signals import PROMETHEUS_JOBS, tier_signals
from foundation import metricnames as mn
from foundation.vllmbuckets import le_label
from foundation.vllmreleases import FAMILIES, WAITING_DEFERRED, WAITING_FOR_CAPACITY, ReleaseFamily
from rules import generate
from tests.detector.test_releases import CAPACITY, DEFERRED, MAX_MODEL_LEN, WAITING, supported

pytestmark = pytest.mark.promtool

STEP_S = 5
STEPS = 80
PER_STEP = 10  # requests finished per step: 2/s
PROMPT = 100
E2E_S = 3.0
INSTANCE = "v"


def _input_series(family: ReleaseFamily) -> list[dict[str, str]]:
    job = PROMETHEUS_JOBS["vllm"]
    out = [
        {"series": f'up{{job="{job}",instance="{INSTANCE}"}}', "values": f"1x{STEPS}"},
        {"series": f'{mn.CAPACITY}{{job="{job}",instance="{INSTANCE}"}}', "values": f"{CAPACITY:g}x{STEPS}"},
        # the deadline as an operator states it (the rules assume none)
        {"series": f'{mn.CLIENT_DEADLINE}{{job="{job}",instance="{INSTANCE}"}}', "values": f"120x{STEPS}"},
    ]
    values = {"engine": "0", "model_name": "m", "finished_reason": "stop", "reason": "max_num_queued_reqs"}
    series = [*((c, s) for c, s in family.series.items() if s is not None), *family.deprecated.items()]
    for canonical, s in series:
        labels = f'job="{job}",instance="{INSTANCE}",' + ",".join(f'{lb}="{values[lb]}"' for lb in s.labels)
        if canonical == mn.VLLM_NUM_WAITING_BY_REASON:  # the two parts of the whole queue
            for reason, value in ((WAITING_FOR_CAPACITY, WAITING - DEFERRED), (WAITING_DEFERRED, DEFERRED)):
                by_reason = labels.replace('reason="max_num_queued_reqs"', f'reason="{reason}"')
                out.append({"series": f"{s.name}{{{by_reason}}}", "values": f"{value:g}x{STEPS}"})
        elif canonical == mn.VLLM_NUM_WAITING:
            out.append({"series": f"{s.name}{{{labels}}}", "values": f"{WAITING:g}x{STEPS}"})
        elif s.kind == "gauge":
            out.append({"series": f"{s.name}{{{labels}}}", "values": f"2x{STEPS}"})
        elif s.kind == "counter":
            step = 0 if canonical == mn.VLLM_ADMISSION_REJECTIONS else PER_STEP * PROMPT
            if canonical == mn.VLLM_REQUEST_SUCCESS:
                step = PER_STEP
            out.append({"series": f"{s.name}{{{labels}}}", "values": f"0+{step}x{STEPS}"})
        else:
            for le in (*s.bounds(MAX_MODEL_LEN), float("inf")):
                step = PER_STEP if le >= E2E_S else 0
                le_text = "+Inf" if le == float("inf") else le_label(le)
                bucket = f'{s.name}_bucket{{{labels},le="{le_text}"}}'
                out.append({"series": bucket, "values": f"0+{step}x{STEPS}"})
            out.append({"series": f"{s.name}_count{{{labels}}}", "values": f"0+{PER_STEP}x{STEPS}"})
            out.append({"series": f"{s.name}_sum{{{labels}}}", "values": f"0+{PER_STEP * PROMPT}x{STEPS}"})
    return out


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_records_the_vllm_tier_signals_its_series_support(
    family: ReleaseFamily, promtool: str, tmp_path: Path
) -> None:
    at = f"{(STEPS - 2) * STEP_S}s"
    tests = [
        {
            "expr": f"count by (instance) ({spec.record})",
            "eval_time": at,
            "exp_samples": [{"labels": f'{{instance="{INSTANCE}"}}', "value": 1}]
            if supported(spec.name, family)
            else [],
        }
        for spec in tier_signals("vllm")
    ]
    if supported("vllm_admitted_tokens_rate", family):
        tests.append(
            {
                "expr": "sum by (instance) (instance:retrywatch_vllmtier_prompt_tokens_admitted:rate1m)",
                "eval_time": at,
                "exp_samples": [
                    {"labels": f'{{instance="{INSTANCE}"}}', "value": PER_STEP * PROMPT / STEP_S}
                ],
            }
        )
    waiting = WAITING if family.series[mn.VLLM_NUM_WAITING_BY_REASON] is None else WAITING - DEFERRED
    tests.append(
        {
            "expr": "sum by (instance) (instance:retrywatch_vllmtier_requests_waiting:sum)",
            "eval_time": at,
            "exp_samples": [{"labels": f'{{instance="{INSTANCE}"}}', "value": waiting}],
        }
    )
    doc = {
        "rule_files": [str(generate.RULES_PATH)],
        "evaluation_interval": f"{STEP_S}s",
        "tests": [
            {"interval": f"{STEP_S}s", "input_series": _input_series(family), "promql_expr_test": tests}
        ],
    }
    path = tmp_path / "family.test.yml"
    path.write_text(json.dumps(doc), encoding="utf-8")  # JSON is YAML
    proc = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
