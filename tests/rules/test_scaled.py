"""The rules at a time scale (``rules/scaled.py``): every duration divided by K, and what
promtool makes of them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from detector.signals import DEFAULT_DEADLINE_S, VLLM_DEADLINE_LE
from foundation import metricnames as mn
from rules.backfill import parse_duration
from rules.generate import rule_documents
from rules.learned import DEADLINE_BUCKET
from rules.scaled import lookback_delta, main, scale_expr, scaled_documents, write_scaled

RANGES = re.compile(r"\[([0-9a-z]+)(?::[0-9a-z]*)?\]")
OFFSETS = re.compile(r"\boffset ([0-9a-z]+)")


def test_every_range_subquery_and_offset_is_divided() -> None:
    expr = 'rate(a[1m]) / max_over_time(b[5m:30s]) + c offset 1h + d[1h30m:] - e{le="10"}'
    assert scale_expr(expr, 10.0) == (
        'rate(a[6s]) / max_over_time(b[30s:3s]) + c offset 6m + d[9m:] - e{le="10"}'
    )
    assert scale_expr("rate(a[5s])", 10.0) == "rate(a[500ms])"
    assert scale_expr(expr, 1.0) == expr


def test_the_scaled_rules_keep_every_threshold_and_divide_every_duration() -> None:
    plain, scaled = rule_documents(), scaled_documents(10.0)
    assert len(plain["groups"]) == len(scaled["groups"]) > 1  # every tier's group
    for group, scaled_group in zip(plain["groups"], scaled["groups"], strict=True):
        assert parse_duration(scaled_group["interval"]) == pytest.approx(
            parse_duration(group["interval"]) / 10
        )
        assert len(group["rules"]) == len(scaled_group["rules"])
        for rule, other in zip(group["rules"], scaled_group["rules"], strict=True):
            for key in ("for", "keep_firing_for"):
                if key in rule:
                    assert parse_duration(other[key]) == pytest.approx(parse_duration(rule[key]) / 10)
            for durations in (RANGES, OFFSETS):
                old, new = durations.findall(rule["expr"]), durations.findall(other["expr"])
                assert [parse_duration(n) for n in new] == pytest.approx(
                    [parse_duration(o) / 10 for o in old]
                )

            # outside its durations, the expression is the same (the deadline is a series)
            def bare(expr: str) -> str:
                return OFFSETS.sub("offset", RANGES.sub("[]", expr))

            assert bare(rule["expr"]) == bare(other["expr"])
    assert lookback_delta(10.0) == "30s"


@pytest.mark.promtool
def test_promtool_loads_the_scaled_rules(promtool: str, tmp_path: Path) -> None:
    path = write_scaled(tmp_path / "scaled.rules.yml", 10.0)
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_command_writes_them_and_refuses_a_bad_scale(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["10", str(tmp_path / "r.yml")])
    assert result.exit_code == 0, result.output
    assert "--query.lookback-delta=30s" in result.output
    bad = CliRunner().invoke(main, ["--", "-1", str(tmp_path / "bad.yml")])
    assert bad.exit_code == 2 and "TIME_SCALE" in bad.output and "-1" in bad.output
    assert not (tmp_path / "bad.yml").exists()


def test_the_vllm_tier_reads_the_e2e_bucket_at_the_deadline_in_force_at_any_k() -> None:
    """The rules pick the e2e bucket from the deadline series (``rules.learned``) and assume no
    deadline: nothing in them names the default's bucket or value, at K as at 1."""
    fixed = f'{mn.VLLM_E2E_LATENCY}_bucket{{le="{VLLM_DEADLINE_LE}"}}'
    for k in (1.0, 10.0):
        scaled = [r["expr"] for g in scaled_documents(k)["groups"] for r in g["rules"]]
        assert not any(fixed in e or f"* 0 + {DEFAULT_DEADLINE_S / k:g}" in e for e in scaled)
        assert any(f"and on (instance, le) {DEADLINE_BUCKET}" in e for e in scaled)
