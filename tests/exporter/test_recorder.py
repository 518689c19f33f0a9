"""The proxy's recording (``exporter.recorder``, ``retrywatch proxy --record DIR``): the writer's
rotation, bounds and queue; a real proxy's recording read back as a trace; a ``kill -9``."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from exporter.cli import proxy
from exporter.recorder import RecordWriter, format_record, recording_files, usage_of
from reproduce.workloads.tracecapacity import CACHE_ENV
from reproduce.workloads.traces import read_trace
from reproduce.workloads.traces.stats import main as stats_main
from tests.exporter.support import Upstream, free_port, proxy_process, scrape, start_upstream, until

SECRET_PROMPT = "zebra-quokka-7731 the secret prompt"
SECRET_KEY = "sk-recorder-secret-0042"


def _record(i: float, attempt: int = 0) -> tuple:  # type: ignore[type-arg]
    return (
        1.7e9 + i,
        1.7e9 + i + 0.5,
        10,
        20,
        True,
        None,
        f"c{i}",
        None,
        attempt,
        "created",
        None,
        "delivered",
        False,
    )


def _lines(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in recording_files(directory) for line in f.read_text().splitlines()]


# --- the writer -------------------------------------------------------------------------------


def test_rotates_and_keeps_the_newest_files_within_the_size_bound(tmp_path: Path) -> None:
    line = len(format_record(_record(0)))
    writer = RecordWriter(tmp_path, max_bytes=6 * line, max_age_s=3600, rotate_bytes=2 * line, flush_s=0.01)
    for i in range(40):
        writer.offer(_record(i))
        time.sleep(0.002)  # the writer keeps up: nothing dropped
    writer.close()
    files = recording_files(tmp_path)
    assert len(files) >= 3
    total = sum(f.stat().st_size for f in files)
    assert total <= 6 * line + 2 * line + line  # the bound, plus the file being written
    arrivals = [r["arrival_s"] for r in _lines(tmp_path)]
    assert arrivals == sorted(arrivals) and arrivals[-1] == 1.7e9 + 39  # the oldest went first
    assert writer.written == 40 and writer.dropped == 0


def test_deletes_files_past_the_age_bound_and_nothing_of_anyone_else(tmp_path: Path) -> None:
    old = tmp_path / "attempts-20000101T000000.000000Z.jsonl"
    old.write_text(format_record(_record(0)))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    other = tmp_path / "notes.jsonl"
    other.write_text("mine\n")
    os.utime(other, (time.time() - 7200, time.time() - 7200))
    writer = RecordWriter(tmp_path, max_bytes=1 << 20, max_age_s=3600, flush_s=0.01)
    writer.offer(_record(1))
    writer.close()
    assert not old.exists() and other.read_text() == "mine\n"
    assert [r["call"] for r in _lines(tmp_path)] == ["c1"]


def test_an_idle_writer_still_deletes_files_past_the_age_bound(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path, max_bytes=1 << 20, max_age_s=3600, rotate_s=0.05, flush_s=0.01)
    try:
        old = tmp_path / "attempts-20000101T000000.000000Z-000001.jsonl"
        old.write_text(format_record(_record(0)))
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        assert until(lambda: not old.exists(), timeout_s=5)  # no record offered meanwhile
    finally:
        writer.close()


def test_a_full_queue_drops_and_counts_and_never_blocks(tmp_path: Path) -> None:
    stalled = threading.Event()
    go_on = threading.Event()

    def clock() -> float:  # the writer thread stalls on its clock: a disk that does not keep up
        if threading.current_thread().name == "retrywatch-recorder":
            stalled.set()
            go_on.wait(10)
        return time.time()

    writer = RecordWriter(tmp_path, max_bytes=1 << 20, max_age_s=3600, queue_records=5, clock=clock)
    assert stalled.wait(5)
    started = time.monotonic()
    for i in range(100):
        writer.offer(_record(i))
    assert time.monotonic() - started < 0.1
    assert writer.dropped == 95
    go_on.set()
    writer.close()
    assert writer.written == 5 and len(_lines(tmp_path)) == 5


def test_flushes_within_a_second_while_running(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path, max_bytes=1 << 20, max_age_s=3600)
    try:
        writer.offer(_record(0))
        assert until(lambda: len(_lines(tmp_path)) == 1, timeout_s=1.5)
    finally:
        writer.close()


def test_usage_is_read_from_an_answers_last_bytes() -> None:
    body = b'{"choices":[{"text":"x"}],"usage":{"prompt_tokens":7,"completion_tokens":31,"total_tokens":38}}'
    assert usage_of(body) == (7, 31)
    stream = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    assert usage_of(stream) == (3, 4)
    assert usage_of(b'data: {"choices":[{"text":"usage"}]}\n\ndata: [DONE]\n\n') is None


# --- the reader ---------------------------------------------------------------------------------


def test_a_recording_reads_as_calls_from_first_attempts_in_arrival_order(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        # written at their ends: the second arrived first
        {"arrival_s": 105.0, "end_s": 106.0, "prompt_tokens": 5, "output_tokens": 9, "attempt": 0},
        {"arrival_s": 100.0, "end_s": 107.0, "prompt_tokens": 4, "output_tokens": None, "attempt": 0},
        {"arrival_s": 108.0, "end_s": 109.0, "prompt_tokens": 4, "output_tokens": 8, "attempt": 1},
        {"arrival_s": 110.0, "end_s": 111.0, "prompt_tokens": 6, "output_tokens": None, "attempt": 0},
        # a first attempt whose client left; its retry was given 42 tokens: the call's length
        {
            "arrival_s": 111.0,
            "end_s": 111.5,
            "prompt_tokens": 7,
            "output_tokens": None,
            "attempt": 0,
            "call": "x",
        },
        {
            "arrival_s": 111.6,
            "end_s": 113.0,
            "prompt_tokens": 7,
            "output_tokens": 42,
            "attempt": 1,
            "call": "x",
        },
    ]
    common: dict[str, Any] = {"fate": "created", "ended": "delivered", "client": "ab12"}
    rows[1]["max_tokens"] = 12
    lines = [json.dumps(common | r) for r in rows]
    (tmp_path / "attempts-1.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (tmp_path / "attempts-2.jsonl").write_text("\n".join(lines[2:]) + '\n{"arrival_s": 112, "pro')
    notes: list[str] = []
    records = list(read_trace(tmp_path, notes=notes))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in records] == [
        (0.0, 4, 12),
        (5.0, 5, 9),
        (11.0, 7, 42),
    ]
    assert records[0].tenant == "ab12"
    text = " ".join(notes)
    assert "torn last line" in text and "2 retries" in text and "1 call(s) of no known output" in text
    result = CliRunner().invoke(stats_main, [str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert '"calls": 3' in result.output and "note:" in result.output and "2 retries" in result.output


# --- a real proxy -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Upstream]:
    with start_upstream(tmp_path_factory.mktemp("upstream")) as up:
        yield up


def _body(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"model": "m", "prompt": SECRET_PROMPT, "max_tokens": max_tokens, "stream": stream}


def _headers(call_id: str) -> dict[str, str]:
    return {"x-call-id": call_id, "authorization": f"Bearer {SECRET_KEY}"}


def test_a_proxy_records_its_calls_and_retries_and_no_text(upstream: Upstream, tmp_path: Path) -> None:
    record = tmp_path / "rec"
    with proxy_process(upstream.url, "--record", str(record)) as proxy, httpx.Client(timeout=30) as client:
        url = f"{proxy.url}/v1/completions"
        for call_id, max_tokens in (("a", 3), ("b", 5), ("b", 5), ("c", 7)):  # b's second: a retry
            r = client.post(url, json=_body(max_tokens), headers=_headers(call_id))
            assert r.status_code == 200, r.text
            time.sleep(0.01)
        with client.stream("POST", url, json=_body(4, stream=True), headers=_headers("d")) as r:
            assert r.status_code == 200
            r.read()
        slow = _headers("e") | {"x-test-ttft": "2.0"}
        with pytest.raises(httpx.ReadTimeout):  # its client leaves before the answer ...
            client.post(url, json=_body(6), headers=slow, timeout=0.3)
        r = client.post(url, json=_body(6), headers=slow)  # ... and retries: given 6 tokens
        assert r.status_code == 200, r.text

        def written() -> float:
            return scrape(proxy.url).get(("retrywatch_recorder_records_written_total", ()), 0.0)

        assert until(lambda: written() == 7, timeout_s=5)
        assert scrape(proxy.url)[("retrywatch_recorder_records_dropped_total", ())] == 0
    raw = _lines(record)
    assert [(r["attempt"], r["fate"], r["ended"]) for r in raw] == [
        (0, "created", "delivered"),
        (0, "created", "delivered"),
        (1, "created", "delivered"),
        (0, "created", "delivered"),
        (0, "created", "delivered"),
        (0, "created", "left"),
        (1, "attached", "delivered"),
    ]
    assert raw[1]["call"] == raw[2]["call"] != raw[0]["call"]
    assert len({r["client"] for r in raw}) == 1 and raw[0]["client"]
    assert raw[0]["usage"] is True and raw[4]["usage"] is False  # the test upstream's streams carry none
    notes: list[str] = []
    calls = list(read_trace(record, notes=notes))
    # a, b, c from the engine's usage; d's stream had none: its max_tokens; e's from its retry
    assert [c.output_tokens for c in calls] == [3, 5, 7, 4, 6]
    assert calls[0].arrival_s == 0.0 and all(a.arrival_s < b.arrival_s for a, b in itertools.pairwise(calls))
    assert any("2 retries" in n for n in notes)
    out = tmp_path / "replay"
    args = [
        sys.executable, "-m", "retrywatch", "reproduce", "run", "--trace", str(record),
        "--backend-option", "capacity=4", "--runs", "1", "--seed", "1", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs and all(run["calls"]["offered"] == 5 for run in runs)  # the calls, not the attempts
    for f in record.iterdir():
        data = f.read_bytes()
        assert b"zebra" not in data and SECRET_KEY.encode() not in data and b"Bearer" not in data


def test_a_recording_survives_kill_9_losing_at_most_the_last_second(
    upstream: Upstream, tmp_path: Path
) -> None:
    record = tmp_path / "rec"
    ended: list[float] = []  # wall-clock ends of the answers the client got whole
    stop = threading.Event()
    with proxy_process(upstream.url, "--record", str(record)) as proxy:
        url = f"{proxy.url}/v1/completions"

        def traffic() -> None:
            with httpx.Client(timeout=10) as client:
                n = 0
                while not stop.is_set():
                    n += 1
                    try:
                        r = client.post(url, json=_body(2), headers=_headers(f"k{n}"))
                    except httpx.HTTPError:
                        return
                    if r.status_code == 200:
                        ended.append(time.time())

        sender = threading.Thread(target=traffic)
        sender.start()
        time.sleep(2.5)
        killed_at = time.time()
        os.kill(proxy.proc.pid or 0, signal.SIGKILL)
        stop.set()
        sender.join(15)
    assert len(ended) > 10
    calls = list(read_trace(record))
    before = sum(1 for t in ended if t < killed_at - 1.0)
    # every answer given more than a second before the kill is recorded (one being read when
    # the proxy died may be recorded and not received)
    assert before <= len(calls) <= len(ended) + 1


def test_a_record_directory_that_cannot_be_made_is_one_usage_line(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    runner = CliRunner()
    args = ["--upstream", "http://127.0.0.1:1", "--port", str(free_port()), "--record", str(taken)]
    result = runner.invoke(proxy, args)
    assert result.exit_code == 2 and "--record" in result.output and "Traceback" not in result.output
    result = runner.invoke(proxy, ["--upstream", "http://127.0.0.1:1", "--record-max-bytes", "10"])
    assert result.exit_code == 2 and "--record-max-bytes" in result.output
    assert list(taken.parent.iterdir()) == [taken]  # nothing written


def test_a_shed_attempt_and_an_engine_refusal_are_recorded_with_their_fates(
    upstream: Upstream, tmp_path: Path
) -> None:
    record = tmp_path / "rec"
    args = ("--record", str(record), "--max-outstanding", "1", "--max-queued", "0")
    with proxy_process(upstream.url, *args) as proxy, httpx.Client(timeout=30) as client:
        url = f"{proxy.url}/v1/completions"
        slow = threading.Thread(
            target=lambda: client.post(url, json=_body(2), headers=_headers("s1") | {"x-test-ttft": "1.0"})
        )
        slow.start()
        assert until(lambda: len(upstream.requests(call_id="s1")) == 1)
        shed = client.post(url, json=_body(2), headers=_headers("s2"))  # the engine's one place is taken
        assert shed.status_code == 503
        slow.join(10)
        refused = client.post(url, json=_body(2), headers=_headers("r1") | {"x-test-mode": "refuse-http"})
        assert refused.status_code == 503

        def written() -> float:
            return scrape(proxy.url).get(("retrywatch_recorder_records_written_total", ()), 0.0)

        assert until(lambda: written() == 3, timeout_s=5)
    ended = {(r["fate"], r["shed_reason"], r["ended"]) for r in _lines(record)}
    assert ended == {
        ("shed", "proxy_queue", "shed"),
        ("created", None, "delivered"),
        ("created", None, "refused"),
    }
