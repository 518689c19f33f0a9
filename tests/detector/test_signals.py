"""Signals from raw counters: rates like Prometheus' rate(), gauges, derived ratios, NoData."""

from __future__ import annotations

import math

import pytest

from detector.signals import (
    ALL_ENGINES,
    RAW_KEYS,
    SignalConfig,
    SignalEngine,
    deadline_bucket,
    split_snapshot,
)
from foundation import metricnames as mn
from foundation.timeseries import Snapshot
from tests.detector.factories import snapshot, steady


def _frame(engine: SignalEngine, now: float):  # type: ignore[no-untyped-def]
    frames = engine.compute(now)
    assert len(frames) == 1
    return frames[0]


def test_rates_gauges_and_ratios_from_steady_counters() -> None:
    eng = SignalEngine()
    for snap in steady(
        120, first=1.0, retry=3.0, completed=0.5, orphaned=1.5, within=0.5, waiting=480, queued=20,
        capacity=2.0, deadline=120.0, queries=1000.0, prompt=600.0,
    ):  # fmt: skip
        eng.add(snap, "proxy-a")
    f = _frame(eng, 120.0)
    v = f.values
    assert f.labels.as_dict() == {"engine": "0", "model": "m", "instance": "proxy-a"}
    assert v["attempt_rate_first"] == pytest.approx(1.0)
    assert v["attempt_rate"] == pytest.approx(4.0)
    assert v["execution_creation_rate"] == pytest.approx(4.0)
    assert v["executions_per_first_attempt"] == pytest.approx(4.0)
    assert v["creation_capacity_ratio"] == pytest.approx(2.0)
    assert v["completion_capacity_ratio"] == pytest.approx(1.0)
    assert v["orphaned_fraction"] == pytest.approx(0.75)
    assert v["goodput_ratio"] == pytest.approx(0.5)
    assert v["backlog_seconds"] == pytest.approx(250.0)
    assert v["backlog_deadline_ratio"] == pytest.approx(250.0 / 120.0)
    assert v["waiting_littles_law_ratio"] == pytest.approx(480 / (4.0 * 120))
    assert v["queue_littles_law_ratio"] == pytest.approx((480 + 20) / (4.0 * 120))
    assert v["cancelled_fraction"] == pytest.approx(0.0)
    assert v["prompt_token_gap"] == pytest.approx(0.4)
    assert v["queue_growth_rate"] == pytest.approx(0.0)
    assert v["data_missing"] == 0.0 and f.missing == ()


def test_rate_window_counter_reset_and_queue_growth() -> None:
    eng = SignalEngine()
    # 2/s for 100 s, then the proxy restarts (counter back to 0) and counts 2/s again
    for t in range(0, 101, 5):
        eng.add(snapshot(float(t), first=2.0 * t, waiting=float(t)), "x")
    for t in range(105, 161, 5):
        eng.add(snapshot(float(t), first=2.0 * (t - 105), waiting=float(t)), "x")
    v = _frame(eng, 160.0).values
    assert v["attempt_rate_first"] == pytest.approx(2.0 * 55 / 60, rel=1e-6)  # one 5-s step lost to the reset
    assert v["queue_growth_rate"] == pytest.approx(1.0)
    # Only the window [now-60, now] counts: the rate 5 s after a jump sees it whole.
    eng2 = SignalEngine()
    for t in range(0, 61, 5):
        eng2.add(snapshot(float(t), first=0.0 if t < 60 else 60.0), "x")
    assert _frame(eng2, 60.0).values["attempt_rate_first"] == pytest.approx(1.0)


def test_configured_capacity_and_deadline_win_over_the_proxy_gauges() -> None:
    eng = SignalEngine(SignalConfig(capacity=4.0, deadline=60.0))
    for snap in steady(60, first=2.0, waiting=240.0, capacity=2.0, deadline=120.0):
        eng.add(snap, "x")
    v = _frame(eng, 60.0).values
    assert v["capacity"] == 4.0 and v["deadline"] == 60.0
    assert v["backlog_deadline_ratio"] == pytest.approx(1.0)


def test_capacity_estimated_online_while_the_queue_is_non_empty() -> None:
    eng = SignalEngine()
    for t in range(0, 601, 5):
        eng.add(snapshot(float(t), first=3.0 * t, completed=2.5 * t, waiting=10.0 + t, capacity=None), "x")
        frame = _frame(eng, float(t))
    assert frame.values["capacity"] == pytest.approx(2.5)
    assert "capacity" not in frame.missing
    # an idle engine (empty queue) gives no estimate: no verdict rather than a wrong one
    idle = SignalEngine()
    for snap in steady(600, first=1.0, completed=1.0, waiting=0.0, capacity=None):
        idle.add(snap, "x")
    f = _frame(idle, 600.0)
    assert f.values["capacity"] is None and "capacity" in f.missing and f.values["data_missing"] == 1.0


def test_missing_series_and_source_down_are_reported_not_taken_as_healthy() -> None:
    eng = SignalEngine()
    for snap in steady(60, first=1.0):
        snap.samples = [s for s in snap.samples if s[0] != "vllm:num_requests_waiting"]
        eng.add(snap, "x")
    f = _frame(eng, 60.0)
    assert f.values["data_missing"] == 1.0 and "vllm:num_requests_waiting" in f.missing
    eng.mark_down("x", 65.0)
    assert "source" in _frame(eng, 65.0).missing
    # data older than the lookback counts as missing too
    assert _frame(eng, 60.0 + 400.0).values["data_missing"] == 1.0


def test_engines_are_grouped_by_instance_and_bounded() -> None:
    eng = SignalEngine(max_instances=2)
    eng.add(snapshot(0.0, instance="a", model="m1"))
    eng.add(snapshot(0.0, instance="b", model="m2"))
    assert sorted(f.labels.model for f in eng.compute(0.0)) == ["m1", "m2"]
    # past the bound a new instance is left out, and counted, not an error for the others
    both = snapshot(5.0, instance="a")
    both.samples += snapshot(5.0, instance="c").samples
    assert eng.add(both) == 1 and not eng.mark_down("d", 5.0) and eng.mark_down("b", 5.0)
    assert sorted(f.labels.instance for f in eng.compute(5.0)) == ["a", "b"]


def test_an_instance_the_source_stops_naming_is_forgotten_unless_the_source_went_silent() -> None:
    lookback = SignalConfig().windows.gauge_lookback_s
    eng = SignalEngine(max_instances=2)
    named: dict[float, set[str]] = {}
    left_out: dict[float, int] = {}
    for t in range(0, 1000, 5):  # a replica replaced at 300 s: "a" leaves, "c" comes
        fleet = snapshot(float(t), instance="b", first=t * 1.0)
        fleet.samples += snapshot(float(t), instance="a" if t < 300 else "c", first=t * 1.0).samples
        left_out[t] = eng.add(fleet)
        named[t] = {f.labels.instance for f in eng.compute(float(t))}
    # "a" keeps its place (its data going stale) for the lookback, then is forgotten ...
    assert named[295 + lookback] == {"a", "b"} and left_out[295 + lookback] == 1
    assert named[300 + lookback] == {"b"}
    # ... and the place it held goes to "c": the bound is not used up by engines that left
    assert named[305 + lookback] == {"b", "c"} and left_out[305 + lookback] == 0
    assert eng.instances == ["b", "c"]
    # a source that names nobody (a wrong job, every series gone) is silent, not an empty fleet
    silent = {f.labels.instance: f for f in eng.compute(995.0 + 2 * lookback)}
    assert sorted(silent) == ["b", "c"] and all(f.values["data_missing"] == 1.0 for f in silent.values())


def test_history_is_trimmed_to_the_retention() -> None:
    eng = SignalEngine(retention_s=100.0)
    for snap in steady(3000, first=1.0):
        eng.add(snap, "x")
    hist = eng._engines["x"]
    assert len(hist.times) <= 100 / 5 + 66


def test_a_series_absent_from_the_latest_scrape_is_stale_like_in_prometheus() -> None:
    eng = SignalEngine()
    for snap in steady(60, first=1.0, waiting=10.0, queued=4.0):
        eng.add(snap, "x")
    eng.add(snapshot(65.0, first=65.0, waiting=10.0, omit=("retrywatch_executions_queued",)), "x")
    assert _frame(eng, 65.0).values["proxy_queued"] is None
    # vLLM's series vanish: no signal is computed at all (every one is joined on vLLM's labels
    # in PromQL), only the NoData verdict
    eng.add(snapshot(70.0, first=70.0, omit=("vllm:num_requests_waiting",)), "x")
    frame = _frame(eng, 70.0)
    assert frame.values["data_missing"] == frame.values["vllm_data_missing"] == 1.0
    assert all(v is None for k, v in frame.values.items() if k not in ("data_missing", "vllm_data_missing"))


def test_queue_littles_law_counts_the_proxy_queue_and_only_created_executions() -> None:
    """Behind a proxy cap the deadline's worth of executions waits in the proxy, not the engine;
    attempts shed or attached wait nowhere, so Little's law runs over executions created."""
    eng = SignalEngine()
    for snap in steady(
        120, first=1.0, retry=5.0, created=4.0, cancelled=3.0, completed=1.0, waiting=80,
        queued=400, capacity=2.0, deadline=120.0,
    ):  # fmt: skip
        eng.add(snap, "proxy-a")
    v = _frame(eng, 120.0).values
    assert v["waiting_littles_law_ratio"] == pytest.approx(80 / (6.0 * 120))
    assert v["queue_littles_law_ratio"] == pytest.approx(480 / (4.0 * 120))
    assert v["cancelled_fraction"] == pytest.approx(0.75)


def test_a_data_parallel_vllm_is_one_engine_named_all_its_series_summed() -> None:
    """One instance whose vLLM labels its series with several engines (data parallel) is one
    engine named ``all`` (as the recording rules name it), its series summed; one engine keeps
    its label."""
    base = snapshot(0.0, waiting=3.0, model="m")
    second = [(n, {**lb, "engine": "1"}, 4.0) for n, lb, _ in base.samples if n == mn.VLLM_NUM_WAITING]
    ((row, engine, model),) = split_snapshot(Snapshot(0.0, [*base.samples, *second]), "dp").values()
    assert (engine, model) == (ALL_ENGINES, "m")
    assert row[list(RAW_KEYS).index("waiting")] == 7.0
    ((_, engine, _),) = split_snapshot(base, "one").values()
    assert engine == "0"


def test_a_counter_reset_among_several_series_of_an_instance_is_that_series_alone() -> None:
    """Two proxies behind one ``instance`` (told apart by another label): one restarts. Like
    ``sum by (instance) (rate(...))``, only its own counter restarts from zero; the other's value
    is no increase."""
    eng = SignalEngine()
    for t in range(0, 181, 5):
        a = 2.0 * t
        b = 2.0 * t if t < 125 else 2.0 * (t - 125)  # proxy b restarts at t=125
        samples = [
            *((n, {**lb, "pod": "a"}, a if n == mn.ATTEMPTS and lb.get("kind") == "first" else v)
              for n, lb, v in snapshot(float(t), waiting=1.0).samples),
            (mn.ATTEMPTS, {"kind": "first", "pod": "b"}, b),
        ]  # fmt: skip
        eng.add(Snapshot(float(t), samples), "x")
    # a: 2/s over the window; b: 2/s, one 5-s step lost to its reset
    assert _frame(eng, 180.0).values["attempt_rate_first"] == pytest.approx(2.0 + 2.0 * 55 / 60)


def test_a_non_finite_counter_sample_does_not_poison_later_rates() -> None:
    eng = SignalEngine()
    for t in range(0, 201, 5):
        first = math.inf if t == 50 else 2.0 * t
        eng.add(snapshot(float(t), first=first, waiting=1.0), "x")
    assert _frame(eng, 200.0).values["attempt_rate_first"] == pytest.approx(2.0)


def test_the_delivery_sli_over_its_two_windows_and_its_burn_rate() -> None:
    # calls judged at 1/s: 0.9/s delivered in time; from 300 s a quarter of them miss instead
    eng = SignalEngine()
    snaps = steady(300, within=0.9, missed=0.1)
    snaps += [
        snapshot(t, within=270 + 0.75 * (t - 300), missed=30 + 0.25 * (t - 300)) for t in range(305, 361, 5)
    ]
    for snap in snaps:
        eng.add(snap, "x")
    v = _frame(eng, 360.0).values
    assert v["delivery_error_ratio_short"] == pytest.approx(0.25)
    assert v["delivery_burn_rate_short"] == pytest.approx(0.25 / 0.02)
    # over 5 min: 240 s at 10 %, 60 s at 25 %
    assert v["delivery_error_ratio_long"] == pytest.approx((240 * 0.1 + 60 * 0.25) / 300)
    assert v["delivery_burn_rate_long"] == pytest.approx((240 * 0.1 + 60 * 0.25) / 300 / 0.02)
    # the objective is a setting: at 90 % the same errors burn a fifth as fast
    eng = SignalEngine(SignalConfig(objective=0.9))
    for snap in snaps:
        eng.add(snap, "x")
    assert _frame(eng, 360.0).values["delivery_burn_rate_short"] == pytest.approx(2.5)
    with pytest.raises(ValueError, match="objective"):
        SignalConfig(objective=1.0)


def test_no_call_judged_is_no_verdict_and_a_proxy_without_the_miss_counter_is_missing_data() -> None:
    eng = SignalEngine()
    for snap in steady(120, first=1.0):  # nothing delivered, nothing missed: idle
        eng.add(snap, "x")
    f = _frame(eng, 120.0)
    assert f.values["delivery_error_ratio_short"] is None and f.values["delivery_burn_rate_long"] is None
    assert f.values["data_missing"] == 0.0
    eng = SignalEngine(SignalConfig(deadline=120.0))  # the detector knows the deadline, the proxy not
    for snap in steady(120, first=1.0, within=1.0):
        snap.samples = [s for s in snap.samples if s[0] != mn.CALLS_MISSED_DEADLINE]
        eng.add(snap, "x")
    f = _frame(eng, 120.0)
    assert f.values["data_missing"] == 1.0 and mn.CALLS_MISSED_DEADLINE in f.missing
    assert f.values["delivery_error_ratio_short"] is None


def _vllm_alone(
    t: float,
    *,
    finished: float,
    in_time: float,
    admitted: float,
    started: float,
    waiting: float,
    queued_s: float = 0.0,
    late_le: str = "120.0",
) -> Snapshot:
    """One scrape of vLLM's own /metrics (no retrywatch series): cumulative ``finished``
    requests, ``in_time`` of them within ``late_le``, prompt tokens ``admitted`` (prefix-cache
    queries) and ``started`` (at the first token), 1000 per finished request."""
    vl = {"engine": "0", "model_name": "m"}
    return Snapshot(
        t,
        [
            (mn.VLLM_NUM_WAITING, vl, waiting),
            (mn.VLLM_NUM_RUNNING, vl, 8.0),
            (mn.VLLM_REQUEST_SUCCESS, {**vl, "finished_reason": "length"}, finished),
            (f"{mn.VLLM_E2E_LATENCY}_bucket", {**vl, "le": "60.0"}, 0.0),
            (f"{mn.VLLM_E2E_LATENCY}_bucket", {**vl, "le": late_le}, in_time),
            (f"{mn.VLLM_E2E_LATENCY}_bucket", {**vl, "le": "+Inf"}, finished),
            (f"{mn.VLLM_E2E_LATENCY}_count", vl, finished),
            (f"{mn.VLLM_QUEUE_TIME}_sum", vl, queued_s),
            (f"{mn.VLLM_QUEUE_TIME}_count", vl, finished),
            (f"{mn.VLLM_REQUEST_PROMPT_TOKENS}_sum", vl, 1000 * finished),
            (mn.VLLM_PREFIX_CACHE_QUERIES, vl, admitted),
            (mn.VLLM_PROMPT_TOKENS, vl, started),
        ],
    )


def _feed_vllm(eng: SignalEngine, t_end: float, **rates: float) -> None:
    waiting = rates.pop("waiting")
    t = 0.0
    while t <= t_end:
        eng.add(_vllm_alone(t, waiting=waiting, **{k: v * t for k, v in rates.items()}), "v")
        t += 5.0


def test_the_vllm_tier_from_vllms_series_alone_with_the_default_deadline() -> None:
    """2 finishes/s at Ĉ = 2, half of them after the 120-s default deadline, queued 90 s each,
    300 waiting: 1.25 deadlines of work; every admitted prompt reached its first token."""
    eng = SignalEngine(SignalConfig(capacity=2.0))
    _feed_vllm(eng, 400, finished=2, in_time=1, admitted=2000, started=2000, waiting=300, queued_s=180)
    v = _frame(eng, 400.0).values
    assert v["vllm_deadline"] == 120.0 and v["vllm_capacity"] == 2.0
    assert v["vllm_finish_rate"] == pytest.approx(2.0)
    assert v["vllm_finish_capacity_ratio"] == pytest.approx(1.0)
    assert v["vllm_late_fraction"] == pytest.approx(0.5)
    assert v["vllm_queue_deadline_ratio"] == pytest.approx(300 / 240)
    assert v["vllm_queue_time_deadline_ratio"] == pytest.approx(90 / 120)
    assert v["vllm_unfinished_fraction"] == pytest.approx(0.0)
    assert v["vllm_delivery_error_ratio_short"] == pytest.approx(0.5)
    assert v["vllm_delivery_burn_rate_long"] == pytest.approx(0.5 / 0.02)
    assert v["vllm_data_missing"] == 0.0
    # the proxy tier has nothing to read here, and says so; the vLLM tier does not
    frame = _frame(eng, 400.0)
    assert frame.values["data_missing"] == 1.0 and frame.missing_for("vllm") == ()


def test_the_vllm_tier_counts_admitted_prompts_that_never_start_as_not_answered() -> None:
    """Cancellation on, in the loop: vLLM admits 2000 prompt tokens/s, a tenth reach their first
    token, nothing finishes: every admitted request is lost."""
    eng = SignalEngine(SignalConfig(capacity=2.0))
    _feed_vllm(eng, 400, finished=0, in_time=0, admitted=2000, started=200, waiting=400)
    v = _frame(eng, 400.0).values
    assert v["vllm_finish_capacity_ratio"] == 0.0
    assert v["vllm_late_fraction"] is None  # nothing finished: no share of it is late
    assert v["vllm_unfinished_fraction"] == pytest.approx(1.0)
    assert v["vllm_delivery_error_ratio_short"] == pytest.approx(1.0)
    # some finish, all in time, but 40 % of the admitted prompts never start
    eng = SignalEngine(SignalConfig(capacity=2.0))
    _feed_vllm(eng, 400, finished=1, in_time=1, admitted=2000, started=1200, waiting=0)
    assert _frame(eng, 400.0).values["vllm_delivery_error_ratio_short"] == pytest.approx(0.4)


def test_without_a_deadline_the_vllm_tier_does_not_count_unfinished_requests_as_late() -> None:
    """Admitted requests, none finished yet (a run's first seconds on a slow engine): with no
    deadline known, late cannot be told from not yet finished, so no error ratio (the live
    detector and the replay with nothing stated paged VLLMRequestsNotAnsweredInTime here); with
    one, they count as not answered, as before."""
    feed = {"finished": 0, "in_time": 0, "admitted": 2000, "started": 2000, "waiting": 0}
    eng = SignalEngine(SignalConfig(capacity=2.0, assumed_deadline=None))
    _feed_vllm(eng, 400, **feed)
    v = _frame(eng, 400.0).values
    assert v["vllm_deadline"] is None
    assert v["vllm_delivery_error_ratio_short"] is None and v["vllm_delivery_burn_rate_long"] is None
    eng = SignalEngine(SignalConfig(capacity=2.0, deadline=120.0))
    _feed_vllm(eng, 400, **feed)
    assert _frame(eng, 400.0).values["vllm_delivery_error_ratio_short"] == pytest.approx(1.0)


def _with_refusals(snap: Snapshot, refused: float) -> Snapshot:
    """``snap`` with vLLM 0.32's refusal counter at ``refused`` (no ``engine`` label, as vLLM's)."""
    labels = {"model_name": "m", "reason": "max_num_queued_reqs"}
    return Snapshot(snap.t, [*snap.samples, (mn.VLLM_ADMISSION_REJECTIONS, labels, refused)])


def test_the_vllm_tier_counts_refused_requests_as_not_answered_and_reads_none_where_uncounted() -> None:
    """2 finishes/s, all in time, while the queue cap refuses 2/s: half of the requests judged
    (finished or refused) were not answered; a vLLM that does not count refusals reads 0 errors,
    with no missing data, and a vLLM that refuses everything, finishing nothing, 1."""
    for refused, expected in ((2.0, 0.5), (None, 0.0)):
        eng = SignalEngine(SignalConfig(capacity=2.0))
        t = 0.0
        while t <= 400:
            snap = _vllm_alone(
                t, waiting=10, finished=2 * t, in_time=2 * t, admitted=2000 * t, started=2000 * t
            )
            eng.add(snap if refused is None else _with_refusals(snap, refused * t), "v")
            t += 5.0
        frame = _frame(eng, 400.0)
        v = frame.values
        assert v["vllm_delivery_error_ratio_short"] == pytest.approx(expected)
        assert v["vllm_delivery_error_ratio_long"] == pytest.approx(expected)
        assert v["vllm_refusal_rate"] == (None if refused is None else pytest.approx(refused))
        assert v["vllm_refused_recently"] == (None if refused is None else 1.0)
        assert v["vllm_data_missing"] == 0.0 and frame.missing_for("vllm") == ()
    eng = SignalEngine(SignalConfig(capacity=2.0))
    for i in range(81):
        eng.add(
            _with_refusals(
                _vllm_alone(5.0 * i, waiting=0, finished=0, in_time=0, admitted=0, started=0), 15.0 * i
            ),
            "v",
        )
    assert _frame(eng, 400.0).values["vllm_delivery_error_ratio_short"] == pytest.approx(1.0)


def test_a_refusal_is_remembered_for_the_lookback_past_the_raw_history() -> None:
    """The queue cap refuses from 100 to 200 s only: an hour (the lookback) after the last
    refusal's step the tier still says refused recently, a scrape later it no longer does; the
    unfinished requests in deadlines of work at Ĉ are waiting + running over Ĉ × deadline."""
    eng = SignalEngine(SignalConfig(capacity=2.0))
    seen: dict[float, float | None] = {}
    t = 0.0
    while t <= 3900.0:
        refused = min(max(t - 100.0, 0.0), 100.0)
        eng.add(
            _with_refusals(
                _vllm_alone(t, waiting=200, finished=t, in_time=t, admitted=1000 * t, started=1000 * t),
                refused,
            ),
            "v",
        )
        if t in (100.0, 105.0, 3795.0, 3800.0):
            seen[t] = _frame(eng, t).values["vllm_refused_recently"]
        t += 5.0
    # the last step that counted a refusal starts at 195 s: within [t - 3600, t] until 3795
    assert seen == {100.0: 0.0, 105.0: 1.0, 3795.0: 1.0, 3800.0: 0.0}
    v = _frame(eng, 3900.0).values
    assert v["vllm_occupancy_deadline_ratio"] == pytest.approx((200 + 8) / 240)


def test_a_stated_deadline_picks_the_bucket_at_or_below_it_and_without_one_the_verdict_is_unknown() -> None:
    assert deadline_bucket(120.0) == 120.0 and deadline_bucket(100.0) == 60.0
    assert deadline_bucket(0.2) is None  # below vLLM's first bucket: finishes in time cannot be told
    eng = SignalEngine(SignalConfig(capacity=2.0, deadline=100.0))
    _feed_vllm(eng, 400, finished=2, in_time=1, admitted=2000, started=2000, waiting=0)
    v = _frame(eng, 400.0).values
    assert v["vllm_deadline"] == 100.0
    assert v["vllm_late_fraction"] == pytest.approx(1.0)  # the 60-s bucket is empty
    eng = SignalEngine(SignalConfig(capacity=2.0, deadline=0.2))
    _feed_vllm(eng, 400, finished=2, in_time=1, admitted=2000, started=2000, waiting=0)
    v = _frame(eng, 400.0).values
    assert v["vllm_late_fraction"] is None and v["vllm_delivery_error_ratio_short"] is None


def test_the_vllm_tiers_capacity_is_estimated_from_vllms_finishes_and_its_nodata_names_what_is_missing() -> (
    None
):
    eng = SignalEngine(SignalConfig())
    _feed_vllm(eng, 900, finished=3, in_time=3, admitted=3000, started=3000, waiting=5)
    frame = _frame(eng, 900.0)
    assert frame.values["vllm_capacity"] == pytest.approx(3.0)  # the queue never emptied
    assert frame.values["vllm_data_missing"] == 0.0
    eng.add(Snapshot(905.0, [s for s in _vllm_alone(905.0, finished=2715, in_time=2715, admitted=2715e3,
                                                     started=2715e3, waiting=5).samples
                             if not s[0].endswith("_count")]), "v")  # fmt: skip
    frame = _frame(eng, 905.0)
    assert frame.values["vllm_data_missing"] == 1.0
    assert frame.missing_for("vllm") == (f"{mn.VLLM_E2E_LATENCY}_count",)
    # never saturated and no Ĉ stated: the vLLM tier lacks Ĉ
    eng = SignalEngine(SignalConfig())
    _feed_vllm(eng, 300, finished=1, in_time=1, admitted=1000, started=1000, waiting=0)
    assert _frame(eng, 300.0).missing_for("vllm") == ("capacity",)
