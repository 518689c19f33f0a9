"""``reproduce whatif`` through its command on the simulator: the composition block's ordering
on the pulse, a headroom search that resumes from the points already in DIR, a headroom against
the delivery objective checked by replaying its load and the load just above, the curve,
usage errors, and
a DIR that one sweep writes at a time, whose workers die with it, whose finished points are never
lost and whose points of other settings are refused."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from detector.signals import DELIVERY_OBJECTIVE
from foundation.groundtruth import Collapse, GroundTruth, JudgedSpan
from foundation.rundir import RunDirError, read_summary
from reproduce.cli import reproduce
from reproduce.planner.whatif import (
    CRITERIA,
    POLICIES,
    POLICY_SOURCES,
    RECOVERY_DEADLINES,
    STAMP,
    Objective,
    Point,
    WhatIfError,
    overload_end,
    parse_policies,
)
from reproduce.runner import usable_cores
from reproduce.workloads.plan import RecoveryRule
from tests.reproduce.test_runner import SMALL

# The small engine of the runner's tests, ten times faster than the study: a what-if of four
# policies runs in a few seconds. Seed 21 tunes nothing.
OPTIONS = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
BASE = ["whatif", "--time-scale", "10", "--seed", "21", "--no-progress", "--jobs", "2", *OPTIONS]
COMPOSITION = ("--policies", "none,budget,coalescing,lookup-first")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(reproduce, [*BASE, *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def composition(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whatif")
    result = invoke(*COMPOSITION, "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_the_pulse_reproduces_the_composition_blocks_ordering(composition: Path) -> None:
    body = json.loads((composition / "whatif.json").read_text())
    at = {p: body["policies"][p]["at_load"] for p in body["policies"]}
    pulse = {p: at[p]["pulse"] for p in at}
    # coalescing and lookup-first deliver (nearly) every pulse call, and never loop
    for p in ("coalescing", "lookup-first"):
        assert pulse[p]["failed"] <= 0.02 * pulse[p]["calls"], pulse[p]
        assert at[p]["recovered"] == 1 and at[p]["loops"] == 0
        assert at[p]["executions_per_call"] < 1.1
    # the budget restores service and leaves pulse calls undelivered
    assert at["budget"]["recovered"] == 1
    assert pulse["budget"]["failed"] > 0.3 * pulse["budget"]["calls"]
    assert at["budget"]["executions_per_call"] < 1.1
    # no control does not recover: the loop forms and holds, executions far above calls
    assert at["none"]["recovered"] == 0 and at["none"]["loops"] == 1
    assert at["none"]["executions_per_call"] > 2.0
    assert "VLLMMetastableRetryLoop" in at["none"]["alerts"]
    assert "VLLMMetastableRetryLoop" not in at["coalescing"].get("alerts", {})
    for p in at:  # every call is counted once
        assert at[p]["within_deadline"] + at[p]["late"] + at[p]["failed"] == at[p]["calls"] > 0
    report = (composition / "report.md").read_text()
    assert "| lookup-first |" in report and "<section>" in (composition / "report.html").read_text()


def test_headroom_brackets_the_loop_and_resumes_from_the_points_in_dir(composition: Path) -> None:
    before = {r["slug"] for r in read_summary(composition / "points")["runs"]}
    result = invoke(
        "--policies",
        "none",
        "--headroom",
        "--headroom-range",
        "1:2.7",
        "--precision",
        "0.5",
        "--unsafe-on",
        "metastable",
        "--out",
        str(composition),
    )  # fmt: skip  (the older spelling of --criterion, with its meaning: a loop is unsafe)
    assert result.exit_code == 0, result.output
    body = json.loads((composition / "whatif.json").read_text())
    head = body["policies"]["none"]["headroom"]
    assert head["criterion"] == body["criterion"]["name"] == "metastable"
    assert (
        "largest load safe by 'metastable' (no metastable collapse)"
        in (composition / "report.html").read_text()
    )
    tried = {t["load"]: t["safe"] for t in head["tried"]}
    # the pulse's own load (2.7, already run: reused) loops; the search brackets the headroom
    assert tried[2.7] is False and head["kind"] == "bracketed"
    assert head["precision_reached"] <= 0.5 and tried[head["headroom_load"]] is True
    assert all(safe == (load <= head["headroom_load"]) for load, safe in tried.items())
    after = [r["slug"] for r in read_summary(composition / "points")["runs"]]
    assert before <= set(after) and len(after) == len(set(after))
    assert len(after) - len(before) == len(tried) - 1  # 2.7 was not run again


def test_a_dir_of_other_settings_is_refused_and_bad_policies_named(composition: Path) -> None:
    result = CliRunner().invoke(
        reproduce, [*BASE[:-1], "--policies", "none", "--out", str(composition)], catch_exceptions=False
    )  # one backend option fewer: another engine
    assert result.exit_code == 2 and "differ in backend_options" in result.output
    with pytest.raises(WhatIfError, match="unknown policy 'nope'"):
        parse_policies("none,nope")
    assert parse_policies("none, budget,none") == ["none", "budget"]
    assert set(POLICIES) == set(POLICY_SOURCES)


def _point(collapses: int, loops: int, met: int) -> Point:
    return Point("none", 2.0, runs=1, calls=10, within_deadline=5, late=0, failed=5, executions=1.0,
                 collapses=collapses, loops=loops, loop_at_s=[None], loop_for_s=[0.0], met=met)  # fmt: skip


def test_the_headroom_criterion_says_what_makes_a_load_unsafe() -> None:
    """A sustained overload above Ĉ misses the objective and collapses without a loop: unsafe by
    the default criterion (the objective) and by "collapse", "safe" only by "metastable"; a loop
    broken in time that still meets the objective is safe by it alone."""
    assert CRITERIA[0] == "objective"  # the default
    overload, served = _point(collapses=1, loops=0, met=0), _point(0, 0, met=1)
    broken, loop = _point(collapses=1, loops=1, met=1), _point(collapses=1, loops=1, met=0)
    assert [overload.safe_under(c) for c in CRITERIA] == [False, False, True]
    assert [served.safe_under(c) for c in CRITERIA] == [True, True, True]
    assert [broken.safe_under(c) for c in CRITERIA] == [True, False, False]
    assert [loop.safe_under(c) for c in CRITERIA] == [False, False, False]
    assert (overload.state, served.state, broken.state) == ("overload", "meets", "loop")
    # the objective is the protocol's 98 % rule: one constant, the ground truth's and the detector's
    assert Objective().target == DELIVERY_OBJECTIVE == RecoveryRule().min_delivered
    assert Objective().recovery_deadlines == RECOVERY_DEADLINES
    for bad in (["--unsafe-on", "sometimes"], ["--criterion", "sometimes"], ["--objective", "1"],
                ["--recovery-deadlines", "0"], ["--curve", "1,x"], ["--curve", "0,1"]):  # fmt: skip
        result = CliRunner().invoke(reproduce, ["whatif", "--headroom", *bad, "--out", "unused"])
        assert result.exit_code == 2 and bad[0] in result.output and "Traceback" not in result.output, bad


def test_a_collapse_is_timed_from_when_arrivals_fall_back_below_capacity() -> None:
    """Without a pulse, arrivals fall back below Ĉ at the end of the last window-long stretch
    planned at Ĉ or more (2 calls/s to 100 s, then 0.5/s, at Ĉ = 1/s: the window starting at
    80 s is the last holding 60 calls); with a pulse, at its end; never before the collapse."""
    planned = sorted([i / 2 for i in range(200)] + [100 + 2 * i for i in range(250)])
    span = JudgedSpan(start_s=0, end_s=600, align_s=0, window_s=60, deadline_s=120, capacity=1.0)
    truth = GroundTruth(span, [], [])
    assert overload_end(Collapse(50, 400, ended=True), truth, planned) == pytest.approx(140, abs=1)
    assert overload_end(Collapse(500, 560, ended=True), truth, planned) == 500
    pulse = GroundTruth(JudgedSpan(0, 600, 100, 60, 120, 1.0, pulse_start_s=0, pulse_end_s=100), [], [])
    assert overload_end(Collapse(50, 400, ended=True), pulse, planned) == 100
    with pytest.raises(WhatIfError, match="between 0 and 1"):
        Objective(target=1.0)


def _delivered_share(points: Path) -> tuple[float, dict[str, Any]]:
    """From a what-if's one point, read straight from its call records: the share of its calls
    delivered within the deadline of their first attempt; and its summary entry."""
    (entry,) = read_summary(points)["runs"]
    calls = [json.loads(line) for line in (points / "runs" / entry["slug"] / "attempts.jsonl").open()]
    deadline = float(entry["deadline_s"])
    within = [c for c in calls if c["delivered_at"] is not None
              and c["delivered_at"] <= c["attempts"][0]["sent_at"] + deadline + 1e-9]  # fmt: skip
    return len(within) / len(calls), entry


def test_the_headroom_meets_the_objective_there_and_misses_it_just_above(tmp_path: Path) -> None:
    """The default criterion is the delivery objective: the search's answer, replayed alone (its
    load and the next load it tried, each in a DIR of its own), meets the objective there, as the
    call records themselves show, and misses it just above; every load run is on the curve."""
    search = tmp_path / "search"
    result = invoke(
        "--policies", "budget", "--load", "1", "--headroom", "--headroom-range", "1:3",
        "--precision", "0.2", "--curve", "2", "--out", str(search),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    body = json.loads((search / "whatif.json").read_text())
    policy = body["policies"]["budget"]
    head = policy["headroom"]
    assert head["criterion"] == body["criterion"]["name"] == "objective" and head["kind"] == "bracketed"
    assert body["objective"]["target"] == DELIVERY_OBJECTIVE
    safe, unsafe = head["headroom_load"], round(head["headroom_load"] + head["precision_reached"], 4)
    assert 1 < safe < unsafe <= 3 and head["precision_reached"] <= 0.2
    # the curve holds every load the search ran (and the fixed one), with its fates' shares
    tried = {t["load"] for t in head["tried"]}
    assert tried | {1.0, 2.0} <= {q["load"] for q in policy["curve"]}
    for q in policy["curve"]:
        assert abs(q["within_deadline_share"] + q["late_share"] + q["failed_share"] - 1) < 1e-3
        assert q["meets_objective"] == (q["load"] <= safe)
    assert policy["overload"]["load"] is None or policy["overload"]["load"] > safe
    for load, holds in ((safe, True), (unsafe, False)):
        alone = tmp_path / f"at{load:g}"
        result = invoke("--policies", "budget", "--load", f"{load:g}", "--out", str(alone))
        assert result.exit_code == 0, result.output
        point = json.loads((alone / "whatif.json").read_text())["policies"]["budget"]["at_load"]
        share, entry = _delivered_share(alone / "points")
        assert point["meets_objective"] is holds and point["within_deadline_share"] == round(share, 4)
        over = [c for c in entry["collapses"] if not c["ended"] or c["end_s"] - entry["pulse"]["end_s"]
                > RECOVERY_DEADLINES * entry["deadline_s"]]  # fmt: skip
        assert (share >= DELIVERY_OBJECTIVE and not over) is holds, (load, share, over)
    report = (search / "report.md").read_text()
    assert "## Headroom (criterion: objective)" in report and "| budget | 2 |" in report
    assert "metastable collapse ✗" not in report


# --- one sweep per DIR, workers that die with it, points that are never lost or mixed ---------

_BOUND_S = 60.0  # the longest a tiny sweep's step may take on a busy machine


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces
    return int(fields[1]), fields[0]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (_ppid_and_state(int(entry.name)) or (0, ""))[0] == pid:
            found.add(int(entry.name))
    return found


def _living(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped has exited)."""
    return {p for p in pids if (s := _ppid_and_state(p)) is not None and s[1] != "Z"}


def _start_sweep(out: Path) -> tuple[subprocess.Popen[bytes], set[int]]:
    """A what-if of the composition's settings as a process of its own, once its first point is
    in DIR and its workers run the others; returns it and its workers."""
    command = [sys.executable, "-m", "retrywatch", "reproduce", *BASE, *COMPOSITION, "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + _BOUND_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if read_summary(out / "points")["runs"]:
                break
        except RunDirError:  # not written yet, or between its writes
            pass
        time.sleep(0.05)
    workers = _children(process.pid)
    if process.poll() is not None or not workers:
        process.kill()
        pytest.fail(f"the sweep ended or ran no workers: {process.communicate()[1].decode()[-2000:]}")
    return process, workers


def _gone(pids: set[int]) -> set[int]:
    """Waits (bounded) for ``pids`` to exit; returns those that did not."""
    deadline = time.monotonic() + 10.0
    while _living(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _living(pids)


needs_workers = pytest.mark.skipif(
    usable_cores() < 2 or not Path("/proc/self/stat").exists(),
    reason="needs two cores (jobs are capped to them) and /proc",
)


@needs_workers
def test_a_killed_sweep_holds_dir_till_it_dies_leaves_no_worker_and_resumes_to_the_same_result(
    composition: Path, tmp_path: Path
) -> None:
    out = tmp_path / "w"
    process, workers = _start_sweep(out)
    try:
        # A second sweep into DIR is refused at once, naming the first; nothing of it is written.
        # (Both kept on running, each rewriting the summary from what it read first: runs lost.)
        second = invoke("--policies", "none", "--out", str(out))
        assert second.exit_code == 2 and f"pid {process.pid}" in second.output, second.output
        assert "being written by another sweep" in second.output
        finished = {r["slug"]: r for r in read_summary(out / "points")["runs"]}
        assert _living(workers) and process.poll() is None  # killed mid-sweep
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=_BOUND_S)
    finally:
        process.kill()
    # Its workers were left blocked, their parent 1, forever.
    assert not _gone(workers), "workers outlived their sweep"
    resumed = invoke(*COMPOSITION, "--out", str(out))  # the kernel released the lock
    assert resumed.exit_code == 0, resumed.output
    after = {r["slug"]: r for r in read_summary(out / "points")["runs"]}
    assert all(after[slug] == entry for slug, entry in finished.items())  # kept, not run again
    # the same runs and verdicts as the uninterrupted sweep's (the headroom test may have run more)
    whole = {r["slug"]: r for r in read_summary(composition / "points")["runs"]}
    assert {s: _timeless(r) for s, r in after.items()} == {s: _timeless(whole[s]) for s in after}
    body, full = (json.loads((d / "whatif.json").read_text())["policies"] for d in (out, composition))
    assert full and all(body[p]["at_load"] == full[p]["at_load"] for p in full)


def _timeless(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("wall_s", "cpu_s")}


@needs_workers
def test_sigterm_stops_a_sweep_and_its_workers_promptly_keeping_finished_points(tmp_path: Path) -> None:
    out = tmp_path / "w"
    process, workers = _start_sweep(out)
    try:
        assert _living(workers) and process.poll() is None  # stopped mid-sweep
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=10.0)
    finally:
        process.kill()
    assert code == 128 + signal.SIGTERM
    assert not _gone(workers), "workers outlived their sweep"
    kept = read_summary(out / "points")["runs"]
    assert kept and all(STAMP in r for r in kept)
    assert not list((out / "points").glob(".summary.*"))  # no summary left half-written


def _move_point(source: Path, into: Path, slug: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Copy ``source``'s point ``slug`` (its entry, changed by ``change``, and its run folder) into
    ``into``'s points, in place of the one there."""
    entry = next(r for r in read_summary(source / "points")["runs"] if r["slug"] == slug)
    change(entry)
    summary = read_summary(into / "points")
    summary["runs"] = [entry if r["slug"] == slug else r for r in summary["runs"]]
    (into / "points" / "summary.json").write_text(json.dumps(summary))
    shutil.rmtree(into / "points" / "runs" / slug)
    shutil.copytree(source / "points" / "runs" / slug, into / "points" / "runs" / slug)


def test_a_point_of_other_settings_in_dir_is_refused_not_mixed_in(composition: Path, tmp_path: Path) -> None:
    # A point run with --client none, copied in, moved none's headroom from 1.15x to 2.7x Ĉ: only
    # DIR's own settings were checked, not each point's.
    other = tmp_path / "other"
    result = CliRunner().invoke(
        reproduce, [*BASE, "--jobs", "256", "--client", "none", "--policies", "none", "--out", str(other)],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"--jobs 256 capped to {usable_cores()}" in result.stderr  # and it ran
    dir_ = tmp_path / "dir"
    shutil.copytree(composition, dir_)
    slug = next(r["slug"] for r in read_summary(other / "points")["runs"])
    _move_point(other, dir_, slug, lambda entry: None)
    before = (dir_ / "points" / "summary.json").read_text()
    again = invoke("--policies", "none", "--headroom", "--out", str(dir_))
    assert again.exit_code == 2 and f"point {slug!r}" in again.output, again.output
    assert "differs in client" in again.output
    assert (dir_ / "points" / "summary.json").read_text() == before  # nothing run, nothing lost
    # A run of `reproduce run` (it records no what-if's settings) is refused too, whatever it says.
    _move_point(composition, dir_, slug, lambda entry: entry.pop(STAMP))
    again = invoke("--policies", "none", "--out", str(dir_))
    assert again.exit_code == 2 and f"records no {STAMP}" in again.output, again.output
