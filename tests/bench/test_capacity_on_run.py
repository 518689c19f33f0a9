"""``bench/capacity_on_run.py`` prints, for a kept run, the prediction ``detector.capacity`` makes
of its series, and what the engine did; bad input is one usage line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from detector.capacity import predict_capacity, split_windows, window_totals
from foundation.timeseries import Snapshot, write_series
from reproduce.conditions import block
from reproduce.engine.presets import STUDY_CAPACITY, preset
from reproduce.sim import SimSpec, simulate

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "capacity_on_run.py"
MODEL = "qwen2.5-7b-h100"
LOW_LOAD = {"phases": ((240.0, 0.6), (30.0, 0.6), (30.0, 0.6)), "phase_names": ("base", "pulse", "hold")}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_it_prints_the_detectors_prediction_over_the_stretch(tmp_path: Path) -> None:
    cond = block("diagnostic").condition("retries-off-cancel-off")
    snaps = simulate(SimSpec(model=MODEL, condition=cond, seed=11, workload=LOW_LOAD)).snapshots
    vllm = [Snapshot(t=s.t, samples=[x for x in s.samples if x[0].startswith("vllm:")]) for s in snaps]
    write_series(tmp_path / "metrics.jsonl", vllm)
    true = STUDY_CAPACITY[MODEL]
    done = _run(str(tmp_path), "--true", str(true), "--to", "240", "--window", "300", "--parts", "15")
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("sub-window  15.0 s, window 240.0 s"))
    printed = float(re.search(r":\s+([\d.]+)x", line).group(1))  # type: ignore[union-attr]

    upto = [(s.t, _summed(s)) for s in vllm if s.t <= 240.0]
    whole = window_totals(upto)
    assert whole is not None
    expected = predict_capacity(whole, split_windows(upto, 15.0))
    assert expected is not None
    assert printed == round(expected.capacity / true, 2)
    assert 0.8 <= printed <= 1.2
    # the variant with c measured from vLLM's prefill histogram: a request's prefill time holds
    # whole steps (its chunks, the others' decodes), so c measured is never below the engine's
    at = done.stdout.splitlines().index(line)
    for label, variant in zip(
        ("admitted", "finished"), done.stdout.splitlines()[at + 1 : at + 3], strict=True
    ):
        found = re.search(r"prefill measured over (\w+) tokens:\s+([\d.]+)x c=([\d.e+-]+)", variant)
        assert found is not None, variant
        assert found.group(1) == label
        assert 0.8 <= float(found.group(2)) <= 1.2
        assert float(found.group(3)) >= preset(MODEL).step_time.per_prompt_token_s
    # the engine table: calls finished in every stretch of the base
    rows = [x.split() for x in done.stdout.splitlines() if re.match(r"\s*\d+\s+\d+\s+[\d.]+", x)]
    assert rows and all(float(r[2]) > 0 for r in rows if float(r[1]) <= 240)


def _summed(snap: Snapshot) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, _, value in snap.samples:
        out[name] = out.get(name, 0.0) + value
    return out


def test_bad_input_is_one_usage_line(tmp_path: Path) -> None:
    missing = _run(str(tmp_path), "--true", "3")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].endswith("metrics.jsonl: no such file")
    assert "Traceback" not in missing.stderr
    zero = _run(str(tmp_path), "--true", "3", "--window", "0")
    assert zero.returncode == 2
    assert "must be above 0" in zero.stderr and "Traceback" not in zero.stderr
