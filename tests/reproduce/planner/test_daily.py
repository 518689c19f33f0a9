"""The daily what-if (``retrywatch reproduce plan-daily``) on a tiny synthetic recording, written
in the proxy's own recording layout: ``--once`` adds a run to the history and its series, the
window and its peak are the recording's, the server answers ``GET /metrics`` and ``POST /run``,
bad input is a usage error, and the ``VLLMHeadroomLow`` rule group is generated and passes its
promtool tests."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.registry import CollectorRegistry

from detector.signals import DELIVERY_OBJECTIVE
from exporter.recorder import format_record
from reproduce.cli import reproduce
from reproduce.planner import daily
from reproduce.planner.daily import (
    ALERT,
    MARGIN,
    PEAK_WINDOW_S,
    HeadroomCollector,
    History,
    Window,
    busiest_stretch,
    observe,
)
from reproduce.planner.whatif import headroom, marks
from reproduce.workloads.plan import RunClock
from tests.reproduce.test_runner import SMALL
from tests.systemtools import require

OPTIONS = [f"--backend-option={k}={json.dumps(v)}" for k, v in SMALL.items()]
# the small engine, ten times faster than the study; a coarse search keeps a run to seconds
BASE = ["plan-daily", "--time-scale", "10", "--headroom-range", "0.25:4", "--precision", "0.5", *OPTIONS]
CAPACITY = ["--capacity", str(SMALL["capacity"])]
T0 = 1_765_000_000.0  # the recording's first Unix second


def write_recording(
    folder: Path, seconds: float = 400.0, burst: tuple[float, float] = (200.0, 260.0)
) -> list[float]:
    """A recording of first attempts at 1 call/s, 3 calls/s in ``burst``, and a retry of every
    tenth call (skipped by the reader); returns the first attempts' arrivals (seconds from T0)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    arrivals: list[float] = []
    lines: list[str] = []
    t = 0.0
    while True:
        t += rng.expovariate(3.0 if burst[0] <= t < burst[1] else 1.0)
        if t >= seconds:
            break
        arrivals.append(t)
        n = len(arrivals)
        record = (
            T0 + t,
            T0 + t + 4,
            1200,
            20,
            True,
            64,
            f"call{n}",
            "client",
            0,
            "created",
            None,
            "delivered",
            False,
        )
        lines.append(format_record(record))
        if n % 10 == 0:
            retry = (T0 + t + 1, T0 + t + 5, 1200, 20, True, 64, f"call{n}", "client", 1, "attached", None,
                     "delivered", False)  # fmt: skip
            lines.append(format_record(retry))
    (folder / "attempts-20251206T054640.000000Z-000001.jsonl").write_text("".join(lines), encoding="utf-8")
    return arrivals


def peak_rate(arrivals: list[float]) -> float:
    return max(sum(a <= b < a + PEAK_WINDOW_S for b in arrivals) for a in arrivals) / PEAK_WINDOW_S


def invoke(*args: str) -> Any:
    return CliRunner().invoke(reproduce, [*BASE, *args], catch_exceptions=False)


def once(tmp_path: Path, *args: str) -> Any:
    """``--once`` on ``tmp_path``'s rec/ into state/, Ĉ stated."""
    return invoke(
        "--recording", str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--once", *CAPACITY, *args
    )


def series(history: History) -> dict[str, float | None]:
    registry = CollectorRegistry()
    registry.register(HeadroomCollector(history))
    get = registry.get_sample_value
    return {
        "none": get("retrywatch_headroom_load", {"policy": "none", "in_force": "false"}),
        "default": get("retrywatch_headroom_load", {"policy": "default", "in_force": "true"}),
        "peak": get("retrywatch_observed_peak_load"),
        "margin": get("retrywatch_headroom_margin"),
        "at": get("retrywatch_headroom_last_run_timestamp_seconds"),
    }


def test_observe_takes_the_last_window_and_its_busiest_minute(tmp_path: Path) -> None:
    arrivals = write_recording(tmp_path / "rec")
    whole = observe(tmp_path / "rec", window_s=1e9)
    rel = [a - arrivals[0] for a in arrivals]  # the reader counts from the first call
    assert whole.calls == len(arrivals) and whole.end_s == pytest.approx(rel[-1], abs=1e-5)
    assert whole.peak_rate == pytest.approx(peak_rate(rel), rel=1e-9)
    assert whole.mean_rate == pytest.approx((len(rel) - 1) / (rel[-1] - rel[0]), rel=1e-6)
    # the last 100 s ends after the burst: its peak is the quiet rate's, not the burst's
    tail = observe(tmp_path / "rec", window_s=100.0)
    inside = [a for a in rel if a >= rel[-1] - 100.0]
    assert tail.calls == len(inside) and tail.peak_rate == pytest.approx(peak_rate(inside), rel=1e-9)
    assert tail.peak_rate < whole.peak_rate
    # a window ending before the burst's end, as a day of a longer recording
    early = observe(tmp_path / "rec", window_s=100.0, end_s=150.0)
    assert early.calls == sum(50.0 <= a <= 150.0 for a in rel)
    # each minute's calls, from the window's first call on
    assert sum(whole.bins) == whole.calls and max(whole.bins) <= whole.peak_rate * PEAK_WINDOW_S
    assert list(whole.bins) == [sum(k * 60 <= a < (k + 1) * 60 for a in rel) for k in range(len(whole.bins))]


def test_a_window_of_more_calls_than_a_replay_holds_is_cut_to_its_busiest_stretch(tmp_path: Path) -> None:
    arrivals = write_recording(tmp_path / "rec")
    rel = [a - arrivals[0] for a in arrivals]
    whole = observe(tmp_path / "rec", window_s=1e9)
    assert whole.cut_from is None and whole.calls > 150
    cut = observe(tmp_path / "rec", window_s=1e9, most=150)
    assert cut.cut_from == (whole.start_s, whole.end_s, whole.calls)
    assert cut.calls <= 150 and cut.calls == sum(cut.start_s <= a <= cut.end_s for a in rel)
    assert cut.start_s <= 200.0 < 260.0 <= cut.end_s + 60.0  # the burst's minutes are in it
    assert cut.mean_rate > whole.mean_rate
    # whole minutes: the longest run whose busiest placement fits, and that placement
    first, d = busiest_stretch(whole.bins, 150)
    runs = [sum(whole.bins[j : j + d]) for j in range(len(whole.bins) - d + 1)]
    assert sum(whole.bins[first : first + d]) == max(runs) <= 150
    assert max(sum(whole.bins[j : j + d + 1]) for j in range(len(whole.bins) - d)) > 150
    assert cut.end_s - cut.start_s == pytest.approx(d * PEAK_WINDOW_S, abs=1e-5)
    with pytest.raises(daily.DailyError, match="holds more than 100 calls"):
        busiest_stretch([5, 200, 5], 100)
    # what the day says and keeps of it
    day = daily.Day(T0, cut, 2.0, "given", "default", MARGIN, {"default": 1.0}, {"default": "bracketed"})
    assert f"the busiest stretch of {whole.calls} calls" in day.says()
    kept = {"start_s": whole.start_s, "end_s": whole.end_s, "calls": whole.calls}
    assert day.to_dict()["window"]["cut_from"] == kept


def test_the_onset_is_where_the_busiest_minutes_holding_the_share_reach_capacity() -> None:
    mean = 1100 / 6000  # 98 minutes of 10 calls and 2 of 60, over 100 minutes
    window = Window(0.0, 6000.0, 1100, mean, 1.0, (10,) * 49 + (60,) + (10,) * 49 + (60,))
    # 2 % of the calls (22) lie in the busiest minute alone: Ĉ there is 60 calls a minute
    assert window.onset_load(0.02) == pytest.approx(mean * PEAK_WINDOW_S / 60)
    # 20 % (220): both busy minutes (120) and ten quiet ones: the share is reached at 10 a minute
    assert window.onset_load(0.2) == pytest.approx(mean * PEAK_WINDOW_S / 10)
    assert Window(0.0, 10.0, 5, 0.5, 2.0).onset_load(0.02) == 0.25  # no bins: where the peak reaches Ĉ


def test_once_runs_the_window_under_each_policy_and_keeps_the_history(tmp_path: Path) -> None:
    arrivals = write_recording(tmp_path / "rec")
    state = tmp_path / "state"
    args = ["--recording", str(tmp_path / "rec"), "--out", str(state), "--once", "--policies", "none,default"]
    result = invoke(*args, "--capacity", str(SMALL["capacity"]))
    assert result.exit_code == 0, result.output
    history = History(f"sqlite:///{state / daily.HISTORY_FILE}")
    (day,) = history.days()
    rel = [a - arrivals[0] for a in arrivals]
    assert day.window.calls == len(arrivals) and day.policy_in_force == "default" and day.margin == MARGIN
    assert day.capacity == SMALL["capacity"] and day.capacity_source == "given"
    assert day.observed_peak_load == pytest.approx(peak_rate(rel) / SMALL["capacity"], rel=1e-9)
    # each headroom is the search's safe mean load, as a peak of this traffic's shape
    found = json.loads((next((state / "runs").iterdir()) / "whatif.json").read_text())["headroom"]
    for p in ("none", "default"):
        safe = found[p]["headroom_load"] or 0.0
        assert day.headroom[p] == pytest.approx(safe * day.window.peak_rate / day.window.mean_rate, abs=1e-4)
        assert found[p]["tried"], p
    assert day.low == (day.ratio("default") < 1 + MARGIN)
    assert "default leaves" in result.output and "wrote" in result.output
    assert result.output.count("where its busiest minutes reach Ĉ") == 2 and "warm start" not in result.output
    got = series(history)
    want = {"none": day.headroom["none"], "default": day.headroom["default"]}
    assert got == {**want, "peak": pytest.approx(day.observed_peak_load), "margin": MARGIN, "at": day.run_at}
    # a second run with a stated Ĉ and margin: a second row, and the series follow the latest
    result = invoke(*args, "--capacity", "2", "--margin", "0.5", "--policy-in-force", "none")
    assert result.exit_code == 0, result.output
    assert result.output.count("warm start at") == 2  # from the first run's answers
    newest, oldest = history.days()
    assert oldest.run_at == day.run_at and newest.run_at >= day.run_at and newest.capacity == 2.0
    assert newest.headroom == day.headroom  # the same points: the same answer, Ĉ only rescales the peak
    got = series(history)
    assert got["peak"] == pytest.approx(peak_rate(rel) / 2.0) and got["margin"] == 0.5
    assert newest.low == (newest.ratio("none") < 1.5)
    latest = json.loads((state / daily.LATEST).read_text())
    assert latest["policy_in_force"] == "none" and latest["low"] == newest.low
    history.close()


def test_the_answer_names_the_policy_that_leaves_the_most_and_by_how_much(tmp_path: Path) -> None:
    """Clients that give an attempt up at 40 s (under the 120-s deadline) retry within it: with no
    control each retry is one more execution and the burst's queue feeds itself, while the default
    recipe attaches it to the live one; the budget sheds the retries (calls failed). The simulator
    finds less headroom for no control and the budget than for the default recipe."""
    write_recording(tmp_path / "rec")
    result = once(tmp_path, "--policies", "none,default,budget", "--policy-in-force", "none",
                  "--client", "deadline=40", "--precision", "0.1")  # fmt: skip
    assert result.exit_code == 0, result.output
    history = History(f"sqlite:///{tmp_path / 'state' / daily.HISTORY_FILE}")
    (day,) = history.days()
    head = day.headroom
    assert head["default"] > head["none"] and head["default"] > head["budget"], head
    assert day.best() == "default" and day.gain() == pytest.approx(head["default"] / head["none"])
    more = head["default"] - head["none"]
    assert (
        f"default leaves the most: {day.ratio('default'):.3g}x (+{more:.3g}x Ĉ, {day.gain():.3g}x none's)"
        in result.output
    )
    registry = CollectorRegistry()
    registry.register(HeadroomCollector(history))
    assert (
        registry.get_sample_value("retrywatch_headroom_best_load", {"policy": "default"}) == head["default"]
    )
    assert registry.get_sample_value("retrywatch_headroom_best_load", {"policy": "none"}) is None
    history.close()


def test_the_server_publishes_the_series_and_runs_on_demand(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from reproduce.planner.dailycli import Runner, make_app
    from reproduce.planner.whatif import WhatIf
    from reproduce.registry import get_backend
    from reproduce.workloads.clients import parse_client

    write_recording(tmp_path / "rec", seconds=200.0, burst=(100.0, 130.0))
    engine = get_backend("sim", **SMALL)
    spec = parse_client("study")
    from reproduce.conditions import MODELS, ClientProfile, PulseWorkload

    profile = ClientProfile(name=spec.name, base=spec.config)
    setup = WhatIf(
        engine, "sim", SMALL, MODELS[0], profile, PulseWorkload(), clock=RunClock(10.0), progress=False
    )
    job = daily.DailyJob(
        tmp_path / "rec", tmp_path / "state", setup, ["none", "default"], capacity=SMALL["capacity"],
        precision=0.5, lo=0.25, hi=4.0,
    )  # fmt: skip
    (tmp_path / "state").mkdir()
    history = History(job.url)
    with TestClient(make_app(history, Runner(job))) as client:
        assert "retrywatch_headroom_load" not in client.get("/metrics").text  # no run yet
        assert client.post("/run").status_code == 202
        assert client.post("/run").status_code == 409  # one at a time
        assert client.get("/run").status_code == 405
        deadline = time.monotonic() + 60
        while not history.days() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = client.get("/metrics").text
    assert 'retrywatch_headroom_load{in_force="true",policy="default"}' in text
    assert "retrywatch_observed_peak_load " in text
    history.close()


def _job(tmp_path: Path, policies: list[str], **settings: Any) -> daily.DailyJob:
    from reproduce.conditions import MODELS, ClientProfile, PulseWorkload
    from reproduce.planner.whatif import WhatIf
    from reproduce.registry import get_backend
    from reproduce.workloads.clients import parse_client

    spec = parse_client("study")
    profile = ClientProfile(name=spec.name, base=spec.config)
    setup = WhatIf(get_backend("sim", **SMALL), "sim", SMALL, MODELS[0], profile, PulseWorkload(),
                   clock=RunClock(10.0), progress=False)  # fmt: skip
    return daily.DailyJob(tmp_path / "rec", tmp_path / "state", setup, policies, capacity=SMALL["capacity"],
                          **settings)  # fmt: skip


def _run(job: daily.DailyJob, day: int) -> dict[str, Any]:
    done = daily.run_day(job, now=T0 + day * 86_400.0)
    assert done.out is not None
    body: dict[str, Any] = json.loads((done.out / "whatif.json").read_text())
    return body


def test_the_first_day_starts_at_the_onset_and_the_next_from_the_last_answer_both_on_the_cold_answer(
    tmp_path: Path,
) -> None:
    """The first day searches from the mean load at which the window's busiest minutes reach Ĉ,
    the next day from the last answer; each policy's headroom is what a cold search of the same window
    finds (here delivery is monotone in load, as the cold search's own verdicts show), the warm
    one in two loads; a policy the history has no answer for starts at that onset; whatif.json says
    which start each search took, and holds its curves and their marks."""
    write_recording(tmp_path / "rec")
    settings = {"precision": 0.1, "lo": 0.25, "hi": 4.0}
    job = _job(tmp_path, ["none", "default"], **settings)
    first = _run(job, 1)
    assert first["warm_start"] is None
    window = observe(job.recording, job.window_s)
    cold = headroom(daily.replayed(job, window), ["none", "default"], tmp_path / "cold", **settings)
    warm = _run(_job(tmp_path, ["none", "default", "budget"], **settings), 2)
    previous = History(f"sqlite:///{tmp_path / 'state' / daily.HISTORY_FILE}").days()[-1]
    assert warm["warm_start"]["run_at"] == previous.run_at
    onset = window.onset_load(1 - DELIVERY_OBJECTIVE)
    assert window.mean_rate / window.peak_rate <= onset  # the busiest minutes: at most the peak
    for p in ("none", "default"):
        truth, before, after = cold[p], first["headroom"][p], warm["headroom"][p]
        tried = sorted((t["load"], t["safe"]) for t in truth["tried"])
        assert [safe for _, safe in tried] == sorted((safe for _, safe in tried), reverse=True), tried
        assert truth["start"] == {"kind": "cold"} and truth["kind"] == "bracketed"
        assert before["start"]["kind"] == "onset" and before["start"]["from"] == pytest.approx(onset)
        assert after["start"]["kind"] == "warm" and after["start"]["load"] == before["headroom_load"]
        assert after["start"]["from"] == pytest.approx(before["headroom_load"], abs=1e-3)
        for key in ("headroom_load", "kind", "precision_reached"):
            assert before[key] == truth[key] == after[key], (p, key)
        assert len(after["tried"]) == 2 < len(truth["tried"]) == 2 + 6  # the bisection's depth: 6
        assert len(before["tried"]) < len(truth["tried"]), before["tried"]
        assert warm["daily"]["headroom_load"][p] == first["daily"]["headroom_load"][p]
    assert warm["headroom"]["budget"]["start"]["kind"] == "onset" and "budget" not in warm["warm_start"]
    # the curves: every load run, with the marks the planner finds on them
    for p, drawn in warm["curves"].items():
        assert [q["load"] for q in drawn["curve"]] == sorted(t["load"] for t in warm["headroom"][p]["tried"])
        assert drawn["loop_onset"] == marks(drawn["curve"])["loop_onset"]
    assert warm["objective"]["target"] == DELIVERY_OBJECTIVE and warm["criterion"]["name"] == "objective"


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--at", "25:00"], "--at"),
        (["--policies", "none,nosuch"], "--policies"),
        (["--policies", "none,budget"], "--policy-in-force"),
        (["--margin", "-1"], "--margin"),
        (["--headroom-range", "3:1"], "--headroom-range"),
        (["--model", "nosuch"], "--model"),
    ],
)
def test_bad_input_is_one_usage_line(tmp_path: Path, args: list[str], hint: str) -> None:
    write_recording(tmp_path / "rec", seconds=20.0, burst=(0.0, 0.0))
    result = once(tmp_path, *args)
    assert result.exit_code == 2 and hint in result.output and "Traceback" not in result.output


def test_a_recording_too_short_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "rec").mkdir()
    result = invoke(
        "--recording", str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--once", *CAPACITY
    )
    assert result.exit_code == 1 and "without trace files" in result.output
    one = (T0, T0 + 4, 1200, 20, True, 64, "call1", "client", 0, "created", None, "delivered", False)
    (tmp_path / "rec" / "attempts-20251206T054640.000000Z-000001.jsonl").write_text(format_record(one))
    result = invoke(
        "--recording", str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--once", *CAPACITY
    )
    assert result.exit_code == 1 and "needs at least two" in result.output
    assert "Traceback" not in result.output


def test_the_rule_group_is_generated_from_the_planner() -> None:
    assert daily.RULES_PATH.read_text(encoding="utf-8") == daily.render_rules()
    assert f"alert: {ALERT}" in daily.render_rules() and f"default {MARGIN:g}" in daily.render_rules()


@pytest.mark.promtool
def test_the_warning_passes_its_promtool_tests() -> None:
    promtool = require("promtool")
    for args in (("check", "rules", daily.RULES_PATH.name), ("test", "rules", "vllmheadroomlow.test.yml")):
        proc = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120,
                              cwd=daily.RULES_DIR, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SUCCESS" in proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_command_serves_the_schedule_and_a_run_on_demand_then_stops_on_sigterm(tmp_path: Path) -> None:
    """The real command, serving: no series before a run, ``POST /run`` starts one, the series
    appear, SIGTERM ends it."""
    import signal
    import sys
    import urllib.error
    import urllib.request

    write_recording(tmp_path / "rec", seconds=200.0, burst=(100.0, 130.0))
    port = _free_port()
    command = [sys.executable, "-m", "retrywatch", "reproduce", *BASE, "--recording",
               str(tmp_path / "rec"), "--out", str(tmp_path / "state"), "--policies", "none,default",
               "--port", str(port), *CAPACITY]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def get(path: str, data: bytes | None = None) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, data=data), timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, text = get("/metrics")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server never answered"
                time.sleep(0.2)
        assert status == 200 and "retrywatch_headroom_load" not in text
        assert get("/run", b"")[0] == 202
        while "retrywatch_headroom_load" not in text and time.monotonic() < deadline + 60:
            time.sleep(0.5)
            text = get("/metrics")[1]
        assert 'retrywatch_headroom_load{in_force="true",policy="default"}' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "each day at 04:00 UTC" in out
