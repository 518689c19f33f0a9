"""``bench/bench_policy_memory.py`` runs, small, and prints a figure for each scenario."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_policy_memory.py"


def test_policy_memory_benchmark_prints_what_each_bound_keeps() -> None:
    argv = [sys.executable, str(BENCH), "--calls", "300", "--keys", "100", "--departures", "40"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["calls", "awaiting", "departures", "everything"]
    assert "kept        300" in lines[0]
    assert "300 calls awaiting, kept        300" in lines[1]
    # 40 offered a key, 32 kept a key (the bound per key)
    assert "offered      4,000 departures (100 keys x 40), kept      3,200" in lines[2]
    assert "kept      3,800" in lines[3]  # every structure at once
