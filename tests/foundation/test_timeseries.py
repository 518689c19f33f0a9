"""The metrics series format: which histograms a scrape keeps, and how a line stores them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.timeseries import Sample, Snapshot, parse_exposition, read_series, write_series
from foundation.vllmbuckets import SERIES_HISTOGRAMS

E2E = "vllm:e2e_request_latency_seconds"
EXPOSITION = f"""# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} 3.0
# HELP {E2E} Histogram of e2e request latency in seconds.
# TYPE {E2E} histogram
{E2E}_bucket{{engine="0",le="0.3",model_name="m"}} 1.0
{E2E}_bucket{{engine="0",le="+Inf",model_name="m"}} 2.0
{E2E}_count{{engine="0",model_name="m"}} 2.0
{E2E}_sum{{engine="0",model_name="m"}} 9.5
{E2E}_created{{engine="0",model_name="m"}} 1.7e9
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{{engine="0",le="1.0",model_name="m"}} 5.0
vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} 5.0
vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} 5.0
vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} 5.0
"""


def histogram(family: str, labels: dict[str, str], cumulative: list[float], total: float) -> list[Sample]:
    les = [f"{0.5 * (i + 1)}" for i in range(len(cumulative) - 1)] + ["+Inf"]
    out: list[Sample] = [
        (family + "_bucket", {**labels, "le": le}, v) for le, v in zip(les, cumulative, strict=True)
    ]
    return [*out, (family + "_count", dict(labels), cumulative[-1]), (family + "_sum", dict(labels), total)]


def test_a_scrape_keeps_only_the_named_histograms() -> None:
    names = {n for n, _, _ in parse_exposition(EXPOSITION)}
    assert names == {"vllm:num_requests_waiting"}
    kept = parse_exposition(EXPOSITION, keep_histograms=SERIES_HISTOGRAMS)
    assert {n for n, _, _ in kept} == {
        "vllm:num_requests_waiting",
        E2E + "_bucket",
        E2E + "_count",
        E2E + "_sum",
    }
    assert (E2E + "_bucket", {"engine": "0", "le": "+Inf", "model_name": "m"}, 2.0) in kept
    every = {n for n, _, _ in parse_exposition(EXPOSITION, keep_histograms=True)}
    assert "vllm:iteration_tokens_total_bucket" in every
    assert not any(n.endswith("_created") for n in every)


def test_a_line_stores_a_histogram_compactly_and_reads_back_the_same_samples(tmp_path: Path) -> None:
    labels = {"engine": "0", "model_name": "m"}
    flat: list[Sample] = [("vllm:num_requests_waiting", labels, 3.0)]
    hist = histogram(E2E, labels, [0.0, 1.0, 1.0, 4.0], 31.5)
    snap = Snapshot(5.0, [*flat, *hist])
    line = snap.to_json()
    obj = json.loads(line)
    assert obj["samples"] == [["vllm:num_requests_waiting", labels, 3.0]]
    assert obj["histograms"] == [
        [E2E, labels, ["0.5", "1.0", "1.5", "+Inf"], [0.0, 1.0, 1.0, 4.0], 4.0, 31.5]
    ]
    as_samples = json.dumps(
        {"t": 5.0, "samples": [[n, lb, v] for n, lb, v in snap.samples]}, separators=(",", ":")
    )
    assert len(line) * 2 < len(as_samples)
    write_series(tmp_path / "m.jsonl", [snap])
    (back,) = read_series(tmp_path / "m.jsonl")
    assert back == snap
    assert back.value(E2E + "_bucket", le="+Inf") == 4.0


def test_an_incomplete_histogram_stays_as_samples() -> None:
    labels = {"engine": "0"}
    partial = [(E2E + "_bucket", {**labels, "le": "+Inf"}, 2.0), (E2E + "_count", labels, 2.0)]
    twice = [
        *histogram("vllm:request_queue_time_seconds", labels, [1.0, 2.0], 3.0),
        ("vllm:request_queue_time_seconds_sum", labels, 3.0),
    ]
    nan_sum = histogram("vllm:time_to_first_token_seconds", labels, [1.0, 1.0], float("nan"))
    snap = Snapshot(1.0, [*partial, *twice, *nan_sum])
    obj = json.loads(snap.to_json())
    assert [h[0] for h in obj["histograms"]] == ["vllm:time_to_first_token_seconds"]
    back = Snapshot.from_json(snap.to_json())
    assert back.samples[: len(partial) + len(twice)] == [*partial, *twice]
    assert back.value("vllm:time_to_first_token_seconds_count") == 1.0


def test_a_malformed_histogram_entry_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = Snapshot(0.0, histogram(E2E, {}, [1.0, 2.0], 3.0)).to_json()
    bad = json.loads(good)
    bad["histograms"][0][3] = [1.0]  # one count for two le values
    path.write_text(good + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a metrics snapshot"):
        list(read_series(path))


@pytest.mark.parametrize("where", ["samples", "histograms"])
def test_labels_that_are_not_an_object_are_a_clear_error(tmp_path: Path, where: str) -> None:
    path = tmp_path / "bad.jsonl"
    line = json.loads(Snapshot(0.0, [("up", {}, 1.0), *histogram(E2E, {}, [1.0, 2.0], 3.0)]).to_json())
    line[where][0][1] = ["engine", "0"]  # labels as a list
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a metrics snapshot"):
        list(read_series(path))


def test_a_value_too_large_for_a_float_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "samples": [["up", {}, 1' + "0" * 400 + "]]}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a metrics snapshot"):
        list(read_series(path))
