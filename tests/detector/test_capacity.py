"""Ĉ predicted below saturation (``detector.capacity``): on the simulator's vLLM series, and on
hand-built counters for the formula's edge cases."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from detector.capacity import (
    CAPACITY_SOURCES,
    PREDICTOR_SERIES,
    StepCost,
    WindowTotals,
    fit_step_cost,
    predict_capacity,
    split_windows,
    window_totals,
)
from detector.service import Detector
from detector.signals import SignalConfig, SignalEngine
from detector.sources.replay import ReplaySource
from detector.store import EpisodeStore
from detector.thresholds import tier_rules
from foundation import metricnames as mn
from foundation.timeseries import Snapshot, write_series
from reproduce.conditions import block
from reproduce.engine.presets import STUDY_CAPACITY
from reproduce.sim import SimSpec, simulate

Samples = list[tuple[float, dict[str, float]]]

# Four simulated minutes at the study's base load (0.6 Ĉ), then the short tail a run needs.
LOW_LOAD = {"phases": ((240.0, 0.6), (30.0, 0.6), (30.0, 0.6)), "phase_names": ("base", "pulse", "hold")}


def _simulated(model: str, seed: int, workload: dict[str, object]) -> Samples:
    """vLLM's series of a simulated run without retries, summed over label sets."""
    cond = block("diagnostic").condition("retries-off-cancel-off")
    wanted = set(PREDICTOR_SERIES)
    out: Samples = []
    for snap in simulate(SimSpec(model=model, condition=cond, seed=seed, workload=workload)).snapshots:
        values: dict[str, float] = {}
        for name, _, value in snap.samples:
            if name in wanted:
                values[name] = values.get(name, 0.0) + value
        out.append((snap.t, values))
    return out


def _vllm_only(model: str, seed: int, workload: dict[str, object]) -> list[Snapshot]:
    """A simulated run's snapshots as a vLLM without the proxy serves them (no ``retrywatch_``
    series, so no stated Ĉ)."""
    cond = block("diagnostic").condition("retries-off-cancel-off")
    snaps = simulate(SimSpec(model=model, condition=cond, seed=seed, workload=workload)).snapshots
    return [Snapshot(t=s.t, samples=[x for x in s.samples if x[0].startswith("vllm:")]) for s in snaps]


def _predict(samples: Samples, until: float) -> float:
    upto = [s for s in samples if s[0] <= until]
    whole = window_totals(upto)
    assert whole is not None
    p = predict_capacity(whole, split_windows(upto))
    assert p is not None
    assert p.low <= p.capacity <= p.high
    return p.capacity


@pytest.mark.parametrize("model", sorted(STUDY_CAPACITY))
def test_four_minutes_below_saturation_predict_the_calibrated_capacity(model: str) -> None:
    samples = _simulated(model, seed=11, workload=LOW_LOAD)
    assert max(v.get(mn.VLLM_NUM_WAITING, 0.0) for _, v in samples) < 20  # never saturated
    predicted = _predict(samples, 240.0)
    assert predicted == pytest.approx(STUDY_CAPACITY[model], rel=0.2)


def test_shorter_prompts_predict_a_higher_capacity_on_the_simulator() -> None:
    """The mixed-prompts workload (half the prompts 3,000 tokens) costs less prefill per call."""
    study = _predict(_simulated("qwen2.5-7b-h100", 12, LOW_LOAD), 240.0)
    mixed = _predict(_simulated("qwen2.5-7b-h100", 12, {**LOW_LOAD, "mixed_prompts": True}), 240.0)
    assert mixed > 1.2 * study


# --- hand-built counters: an engine that follows the step cost exactly ---

COST = StepCost(step_s=0.008, prompt_token_s=25e-6, decode_token_s=2e-4)


def _engine(
    minutes: float,
    *,
    prompt: float = 10_000.0,
    output: float = 400.0,
    running: float = 10.0,
    kv_per_running: float = 0.01,
    busy_every: int = 1,
    seed: int = 0,
) -> Samples:
    """Scrapes every 5 s of an engine whose busy time is exactly ``COST``'s sum of its steps,
    with a load that varies from scrape to scrape; idle on all but every ``busy_every``-th."""
    rng = random.Random(seed)
    t, totals = 0.0, dict.fromkeys(PREDICTOR_SERIES, 0.0)
    out: Samples = [(t, dict(totals))]
    for i in range(int(minutes * 12)):
        t += 5.0
        busy = 5.0 if i % busy_every == 0 else 0.0
        if busy:
            calls = rng.uniform(0.5, 1.5)
            steps = rng.uniform(200, 400)
            tokens = calls * prompt
            decoded = (busy - COST.step_s * steps - COST.prompt_token_s * tokens) / COST.decode_token_s
            assert decoded > 0
            totals[mn.VLLM_PREFIX_CACHE_QUERIES] += tokens * 1.25
            totals[mn.VLLM_PREFIX_CACHE_HITS] += tokens * 0.25
            totals[f"{mn.VLLM_INTER_TOKEN_LATENCY}_count"] += decoded
            totals[f"{mn.VLLM_INTER_TOKEN_LATENCY}_sum"] += busy * decoded / steps
            for family, per_call in ((mn.VLLM_REQUEST_PROMPT_TOKENS, prompt * 1.25),
                                     (mn.VLLM_REQUEST_GENERATION_TOKENS, output)):  # fmt: skip
                totals[f"{family}_count"] += calls
                totals[f"{family}_sum"] += calls * per_call
        totals[mn.VLLM_NUM_RUNNING] = running if busy else 0.0
        totals[mn.VLLM_KV_CACHE_USAGE] = running * kv_per_running if busy else 0.0
        out.append((t, dict(totals)))
    return out


def _parts(samples: Samples) -> list[WindowTotals]:
    """One sub-window per scrape: the hand-built engine's batch changes from scrape to scrape,
    and the fit's step count (busy time over mean inter-token latency) is exact within one."""
    return split_windows(samples, part_s=5.0)


def _exact(prompt: float, output: float, batch: float) -> float:
    return 1.0 / (prompt * COST.prompt_token_s + output * (COST.step_s / batch + COST.decode_token_s))


def test_the_fit_recovers_the_step_cost_and_the_formula_follows() -> None:
    samples = _engine(10)
    fitted = fit_step_cost(_parts(samples))
    assert fitted is not None
    for got, want in zip((fitted.step_s, fitted.prompt_token_s, fitted.decode_token_s),
                         (COST.step_s, COST.prompt_token_s, COST.decode_token_s), strict=True):  # fmt: skip
        assert got == pytest.approx(want, rel=1e-6)
    whole = window_totals(samples)
    assert whole is not None
    p = predict_capacity(whole, _parts(samples))
    assert p is not None
    assert p.saturated_batch == pytest.approx(100.0)  # 10 running fill 10 % of the KV cache
    assert p.uncached_prompt_tokens == pytest.approx(10_000.0)  # a fifth of the prompt was cached
    assert p.capacity == pytest.approx(_exact(10_000, 400, 100), rel=1e-6)
    assert p.low == pytest.approx(p.capacity, rel=1e-6) and p.high == pytest.approx(p.capacity, rel=1e-6)


def test_with_c_given_only_the_step_and_decode_costs_are_fitted() -> None:
    parts = _parts(_engine(10))
    given = fit_step_cost(parts, prompt_token_s=COST.prompt_token_s)
    assert given is not None and given.prompt_token_s == COST.prompt_token_s
    assert given.step_s == pytest.approx(COST.step_s, rel=1e-6)
    assert given.decode_token_s == pytest.approx(COST.decode_token_s, rel=1e-6)
    off = fit_step_cost(parts, prompt_token_s=COST.prompt_token_s * 1.5)  # a c too high: a, β absorb it
    assert off is not None and off.prompt_token_s == COST.prompt_token_s * 1.5
    assert (off.step_s, off.decode_token_s) != pytest.approx((COST.step_s, COST.decode_token_s), rel=1e-3)


def test_a_mix_change_moves_capacity_on_the_same_engine() -> None:
    """Longer outputs and shorter prompts on the same step cost: Ĉ follows the mix of the window."""
    long_prompts = _engine(10, prompt=10_000, output=400)
    short_prompts = _engine(10, prompt=2_000, output=800, seed=1)

    def predicted(samples: Samples) -> float:
        whole = window_totals(samples)
        assert whole is not None
        p = predict_capacity(whole, _parts(samples))
        assert p is not None
        return p.capacity

    assert predicted(long_prompts) == pytest.approx(_exact(10_000, 400, 100), rel=1e-6)
    assert predicted(short_prompts) == pytest.approx(_exact(2_000, 800, 100), rel=1e-6)
    assert predicted(short_prompts) > 1.3 * predicted(long_prompts)


def test_a_full_batch_is_capped_at_max_num_seqs() -> None:
    samples = _engine(10, running=4, kv_per_running=0.001)  # the KV cache would hold 1,000
    whole = window_totals(samples)
    assert whole is not None
    p = predict_capacity(whole, _parts(samples), max_num_seqs=256)
    assert p is not None and p.saturated_batch == 256.0
    assert p.capacity == pytest.approx(_exact(10_000, 400, 256), rel=1e-6)


def test_idle_scrapes_are_not_counted_as_busy_time() -> None:
    """An engine idle every other scrape: its busy share halves the time the fit spreads."""
    samples = _engine(20, busy_every=2)
    whole = window_totals(samples)
    assert whole is not None and whole.busy == pytest.approx(0.5)
    p = predict_capacity(whole, _parts(samples))
    assert p is not None
    assert p.capacity == pytest.approx(_exact(10_000, 400, 100), rel=0.02)


def test_no_traffic_predicts_nothing() -> None:
    quiet = [(5.0 * i, dict.fromkeys(PREDICTOR_SERIES, 0.0)) for i in range(121)]
    whole = window_totals(quiet)
    assert whole is not None
    assert predict_capacity(whole, _parts(quiet)) is None
    assert fit_step_cost(_parts(quiet)) is None


@pytest.mark.parametrize(
    "series",
    [f"{mn.VLLM_INTER_TOKEN_LATENCY}_count", f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum", mn.VLLM_KV_CACHE_USAGE],
)
def test_a_series_vllm_did_not_export_predicts_nothing(series: str) -> None:
    samples = [(t, {k: v for k, v in values.items() if k != series}) for t, values in _engine(10)]
    whole = window_totals(samples)
    assert whole is not None
    assert predict_capacity(whole, _parts(samples)) is None


def test_too_short_a_window_predicts_nothing() -> None:
    samples = _engine(0.25)  # three scrapes: fewer sub-windows than the fit needs
    whole = window_totals(samples)
    assert whole is not None
    assert predict_capacity(whole, _parts(samples)) is None
    assert window_totals(samples[:1]) is None


def test_a_counter_reset_counts_as_an_increase_from_zero() -> None:
    name = mn.VLLM_PREFIX_CACHE_QUERIES
    w = window_totals(
        [(0.0, {name: 100.0}), (5.0, {name: 150.0}), (10.0, {name: 20.0}), (15.0, {name: 30.0})]
    )
    assert isinstance(w, WindowTotals)
    assert w.increase[name] == 50.0 + 20.0 + 10.0
    assert not math.isnan(w.busy)


# --- in the detector: stated > saturated measurement > prediction ---


def _source(values: dict[str, float | None], key: str) -> str:
    code = values[key]
    assert code is not None
    return CAPACITY_SOURCES[int(code)]


def test_the_vllm_tier_knows_capacity_before_any_saturation() -> None:
    engine = SignalEngine()
    for snap in _vllm_only("qwen3-14b-h100", 13, LOW_LOAD):
        engine.add(snap, "vllm-a")
        if snap.t == 240.0:
            break
    frame = engine.compute(240.0)[0]
    assert "capacity" not in frame.missing_for("vllm")
    assert _source(frame.values, "vllm_capacity_source") == "predicted"
    assert frame.values["vllm_capacity"] == frame.values["capacity_predicted"]
    assert frame.values["vllm_capacity"] == pytest.approx(STUDY_CAPACITY["qwen3-14b-h100"], rel=0.2)

    stated = SignalEngine(SignalConfig(capacity=1.5))
    for snap in _vllm_only("qwen3-14b-h100", 13, LOW_LOAD):
        stated.add(snap, "vllm-a")
        if snap.t == 240.0:
            break
    frame = stated.compute(240.0)[0]
    assert frame.values["vllm_capacity"] == 1.5
    assert _source(frame.values, "vllm_capacity_source") == "stated"
    assert frame.values["capacity_predicted"] == pytest.approx(STUDY_CAPACITY["qwen3-14b-h100"], rel=0.2)


def test_a_saturated_measurement_takes_over_from_the_prediction() -> None:
    """Four minutes at 0.6 Ĉ, then 1.5 Ĉ until vLLM's queue has not emptied for five minutes."""
    workload = {
        "phases": ((240.0, 0.6), (420.0, 1.5), (30.0, 0.01)),
        "phase_names": ("base", "pulse", "hold"),
    }
    engine = SignalEngine()
    sources: dict[float, str] = {}
    for snap in _vllm_only("qwen2.5-7b-h100", 14, workload):
        engine.add(snap, "vllm-a")
        if snap.t in (235.0, 650.0):
            frame = engine.compute(snap.t)[0]
            sources[snap.t] = _source(frame.values, "vllm_capacity_source")
            if snap.t == 650.0:
                measured = frame.values["vllm_capacity"]
    assert sources == {235.0: "predicted", 650.0: "saturated"}
    assert measured == pytest.approx(STUDY_CAPACITY["qwen2.5-7b-h100"], rel=0.1)


def test_the_detector_publishes_capacity_with_its_source(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_series(path, _vllm_only("llama3.1-8b-h100", 15, LOW_LOAD))
    source = ReplaySource(path, instance="vllm-a")
    det = Detector(source, EpisodeStore(f"sqlite:///{tmp_path / 'd.db'}"), rules=tier_rules("vllm"))
    try:
        for t in [s.t for s in source.snapshots if s.t <= 240.0]:
            det.tick(t)
    finally:
        det.stop()
    registry = det.metrics.registry
    labels = {"instance": "vllm-a", "tier": "vllm", "source": "predicted"}
    published = registry.get_sample_value("retrywatch_detector_capacity_calls_per_second", labels)
    assert published == pytest.approx(STUDY_CAPACITY["llama3.1-8b-h100"], rel=0.2)
    predicted = registry.get_sample_value(
        "retrywatch_detector_capacity_predicted_calls_per_second", {"instance": "vllm-a"}
    )
    assert predicted == published
    stated = {**labels, "source": "stated"}
    assert registry.get_sample_value("retrywatch_detector_capacity_calls_per_second", stated) is None
