"""The daily what-if through the real proxy on the emulated engine (``bench/bench_daily_proxy.py``),
sized for CI: a few short time-scaled days of a trace through one ``retrywatch proxy --record``
in front of ``retrywatch emulate``, the load growing 15 % a day, plan-daily after each day on
the recording, and a day held 30 % below the first missed: each day is recorded whole by the
real proxy, judged, searched, and warned of exactly where the rule says (the lead itself is
measured by the bench's longer run, docs/results.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reproduce.planner.daily import MARGIN

BENCH = Path(__file__).resolve().parents[2] / "bench"

pytestmark = pytest.mark.slow

# Two days at the edge of the shipped Mooncake slice's second half on qwen3-14b-h100, then one
# held 30 % below the first missed (docs/results.md: the full run warned first at 1.2x Ĉ).
ARGS = ["--days", "2", "--window", "120:240", "--first-load", "1.2", "--policies", "default",
        "--precision", "0.05", "--held", "--held-days", "1"]  # fmt: skip


def test_each_day_is_recorded_whole_and_warned_of_where_the_rule_says(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH / "bench_daily_proxy.py"), *ARGS, "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("growing {")
    ]
    held = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("held {")
    ]
    (summary,) = [
        json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("summary")
    ]
    assert [r["day"] for r in rows] == [0, 1] and [r["day"] for r in held] == [0]
    # each day's window is that day's calls, recorded by the real proxy: growing with the load
    assert all(r["calls"] > 20 for r in rows + held)
    assert rows[1]["calls"] == rows[0]["calls"]  # the same trace window each day, recorded whole
    recorded = sorted((tmp_path / "growing" / "rec").iterdir())
    assert recorded and sum(len(p.read_text().splitlines()) for p in recorded) >= sum(
        r["calls"] for r in rows
    )
    # The warning is the rule on what the real proxy recorded: it fires exactly where the policy in
    # force leaves less than the margin over the day's observed peak, and the peak follows the load.
    for r in rows + held:
        assert r["warn"] == (r["ratio"] < 1 + MARGIN), r
    assert rows[1]["peak"] > rows[0]["peak"] > held[0]["peak"], (rows, held)
    assert summary["missed"] is None or summary["missed"] in (0, 1)
    # NOTE: whether the warning leads the first missed day here is not asserted: the headroom of the
    # same traffic moves by about the margin from day to day at these loads (docs/results.md, "Through
    # the real proxy on the emulated engine", where the eight-day run reports the lead and the false
    # alarms); a test asserting it failed one run in three.
