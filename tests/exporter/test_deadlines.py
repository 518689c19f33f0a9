"""The clients' deadline learned from abandon ages: the learner on mixtures, its bounds, its
classes, what /metrics publishes, and the real proxy learning its clients' 2-s timeout."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from exporter.deadlines import (
    MAX_AGES,
    MAX_CLASSES,
    MIN_ABANDONS,
    DeadlineLearner,
    LearnedDeadline,
    find_classes,
)
from exporter.metrics import ProxyMetrics
from exporter.policy import Policy, PolicyConfig
from foundation import metricnames as mn
from tests.exporter.support import RunningProxy, until


def _timeouts(rng: random.Random, deadline: float, n: int) -> list[float]:
    """Abandons of clients timing out at ``deadline``, with network jitter."""
    return [deadline * (1 + rng.gauss(0, 0.01)) + rng.expovariate(1 / 0.2) for _ in range(n)]


def _learner(ages: list[float], seed: int = 0) -> DeadlineLearner:
    random.Random(seed).shuffle(ages)
    learner = DeadlineLearner()
    for age in ages:
        learner.observe(age)
    return learner


@pytest.mark.parametrize("seed", range(5))
def test_one_class_is_learned_within_ten_percent_from_fifty_abandons(seed: int) -> None:
    rng = random.Random(seed)
    learner = _learner(_timeouts(rng, 120.0, 50), seed)
    (only,) = learner.classes()
    assert only.deadline_s == pytest.approx(120.0, rel=0.1)
    assert only.abandons >= 45


@pytest.mark.parametrize("seed", range(5))
def test_early_cancels_below_the_deadline_do_not_move_it(seed: int) -> None:
    rng = random.Random(seed)
    ages = _timeouts(rng, 120.0, 35) + [rng.uniform(0.0, 120.0) for _ in range(15)]
    learner = _learner(ages, seed)
    in_force = learner.in_force()
    assert in_force is not None and in_force.deadline_s == pytest.approx(120.0, rel=0.1)
    # a 0.9 quantile of the same ages (the former estimator) is no better than the cluster
    assert abs(in_force.deadline_s - 120.0) <= abs(sorted(ages)[int(0.9 * len(ages))] - 120.0) + 1.0


@pytest.mark.parametrize("seed", range(5))
def test_two_client_classes_are_told_apart(seed: int) -> None:
    rng = random.Random(seed)
    learner = _learner(_timeouts(rng, 30.0, 40) + _timeouts(rng, 600.0, 20), seed)
    found = learner.classes()
    assert [round(c.deadline_s / 10) * 10 for c in found] == [30, 600]  # most abandons first
    assert found[0].abandons > found[1].abandons
    in_force = learner.in_force()
    assert in_force is not None and in_force.deadline_s == pytest.approx(30.0, rel=0.1)


def test_no_deadline_from_too_few_abandons_or_a_spread_without_a_sharp_mode() -> None:
    rng = random.Random(1)
    assert _learner(_timeouts(rng, 30.0, MIN_ABANDONS - 1)).in_force() is None
    # users cancelling whenever (uniform in [0, 120] s): no client timeout to find
    assert _learner([rng.uniform(0.0, 120.0) for _ in range(300)]).classes() == ()
    # nor in an exponential spread of early leavers
    assert _learner([rng.expovariate(1 / 10.0) for _ in range(300)]).classes() == ()


def test_ages_that_are_no_deadline_are_ignored() -> None:
    learner = DeadlineLearner()
    for age in (0.0, -1.0, math.nan, math.inf, 1e12):
        learner.observe(age)
    assert learner.observed == 0 and learner.classes() == ()


def test_memory_is_bounded_and_follows_a_change_of_clients() -> None:
    rng = random.Random(2)
    learner = _learner(_timeouts(rng, 120.0, 2000))
    assert len(learner._ages) == MAX_AGES  # the ring: the most recent ages only
    for age in _timeouts(rng, 30.0, MAX_AGES):  # the clients now time out at 30 s
        learner.observe(age)
    in_force = learner.in_force()
    assert in_force is not None and in_force.deadline_s == pytest.approx(30.0, rel=0.05)


def test_classes_are_at_most_max_classes() -> None:
    rng = random.Random(3)
    ages = [a for d in (5.0, 20.0, 60.0, 200.0, 900.0) for a in _timeouts(rng, d, 40)]
    found = find_classes(ages)
    assert len(found) == MAX_CLASSES == len(mn.DEADLINE_CLASSES)


def test_the_deadline_in_force_holds_within_the_hysteresis() -> None:
    learner = DeadlineLearner()
    for _ in range(20):
        learner.observe(100.0)
    first = learner.in_force()
    assert first is not None and first.deadline_s == pytest.approx(100.0)
    for _ in range(200):  # a shift of 3 %: within the hysteresis, the one in force holds
        learner.observe(103.0)
    held = learner.in_force()
    assert held is not None and held.deadline_s == first.deadline_s
    for _ in range(500):  # a shift of 20 %: followed
        learner.observe(120.0)
    moved = learner.in_force()
    assert moved is not None and moved.deadline_s == pytest.approx(120.0)


# --- what /metrics publishes --------------------------------------------------------------


def _metrics(deadline_s: float | None) -> ProxyMetrics:
    return ProxyMetrics(Policy(PolicyConfig(deadline_s=deadline_s)), window_s=60.0, capacity=None)


def test_declared_timeouts_name_the_deadline_until_abandons_do() -> None:
    learner = DeadlineLearner()
    for _ in range(MIN_ABANDONS - 1):
        learner.declare(600.0)
    assert learner.in_force() is None  # too few declarations, as too few abandons
    for bad in (0.0, -5.0, math.nan, math.inf):
        learner.declare(bad)
    assert learner.in_force() is None
    learner.declare(600.0)
    assert learner.in_force() == LearnedDeadline(600.0, 0, MIN_ABANDONS)
    for _ in range(3 * MIN_ABANDONS):  # a second class of SDK clients, configured at 60 s
        learner.declare(60.0)
    assert [c.deadline_s for c in learner.classes()] == [60.0, 600.0]
    # clients that declare nothing (a gateway at 30 s) abandon: the abandons name the deadline
    for age in _timeouts(random.Random(8), 30.0, 20):
        learner.observe(age)
    in_force = learner.in_force()
    assert in_force is not None and in_force.abandons == 20 and in_force.declared == 0
    assert in_force.deadline_s == pytest.approx(30.0, rel=0.02)


def test_metrics_say_the_deadline_is_unknown_then_learned() -> None:
    metrics = _metrics(None)
    reg = metrics.registry
    assert math.isnan(reg.get_sample_value(mn.CLIENT_DEADLINE) or 0.0)
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_SOURCE, {"source": "unknown"}) == 1.0
    for label in mn.DEADLINE_CLASSES:  # every class label present from the start
        assert math.isnan(reg.get_sample_value(mn.CLIENT_DEADLINE_LEARNED, {"class": label}) or 0.0)
        assert reg.get_sample_value(mn.CLIENT_DEADLINE_ABANDONS, {"class": label}) == 0.0
    for age in _timeouts(random.Random(4), 45.0, 30):
        metrics.observe_attempt("disconnected", age)
    metrics.observe_attempt("delivered", 300.0)  # a delivered attempt is no abandon
    learned = reg.get_sample_value(mn.CLIENT_DEADLINE_LEARNED, {"class": "1"})
    assert learned == pytest.approx(45.0, rel=0.02)
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_ABANDONS, {"class": "1"}) == 30.0
    # the proxy sets the learned deadline on the policy (``Proxy._sample``); from then on it is
    # the one in force
    in_force = metrics.deadlines.in_force()
    assert in_force is not None
    metrics.policy.set_deadline(in_force.deadline_s)
    assert reg.get_sample_value(mn.CLIENT_DEADLINE) == learned
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_SOURCE, {"source": "learned"}) == 1.0
    assert reg.get_sample_value(mn.CALLS_MISSED_DEADLINE) == 0.0


def test_metrics_say_a_stated_deadline_is_stated_beside_the_learned_one() -> None:
    metrics = _metrics(120.0)
    for age in _timeouts(random.Random(5), 45.0, 30):
        metrics.observe_attempt("disconnected", age)
    reg = metrics.registry
    assert reg.get_sample_value(mn.CLIENT_DEADLINE) == 120.0
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_SOURCE, {"source": "stated"}) == 1.0
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_SOURCE, {"source": "learned"}) == 0.0
    assert reg.get_sample_value(mn.CLIENT_DEADLINE_LEARNED, {"class": "1"}) == pytest.approx(45.0, rel=0.02)


# --- the real proxy -----------------------------------------------------------------------

StartProxy = Callable[..., RunningProxy]
CLIENT_TIMEOUT_S = 2.0


def _abandon(url: str, prompt: int, timeout_s: float) -> None:
    """One client that gives up after ``timeout_s`` without an answer (the upstream's first token
    comes after 10 s)."""
    body = {"model": "test-model", "prompt": [prompt, 2, 3], "max_tokens": 1, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers={"x-test-ttft": "10"}, timeout=timeout_s)


def _clients(url: str, timeouts: list[float]) -> None:
    threads = [
        threading.Thread(target=_abandon, args=(url, 100 + i, t), daemon=True) for i, t in enumerate(timeouts)
    ]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=20)


def _timeout_jitter(rng: random.Random, n: int) -> list[float]:
    return [CLIENT_TIMEOUT_S + rng.uniform(0.0, 0.1) for _ in range(n)]


@pytest.mark.parametrize(
    "settings", [{}, {"deadline_auto": True, "deadline_check": True}], ids=["none", "auto"]
)
def test_the_proxy_learns_its_clients_timeout(start_proxy: StartProxy, settings: dict[str, bool]) -> None:
    p = start_proxy(cancellation="on", **settings)
    rng = random.Random(6)
    # 14 clients time out at 2 s (+ jitter); 4 users cancel early
    _clients(p.url, _timeout_jitter(rng, 14) + [rng.uniform(0.3, 1.5) for _ in range(4)])

    def learned() -> bool:
        m = p.metrics()
        return m[(mn.CLIENT_DEADLINE_SOURCE, (("source", "learned"),))] == 1.0

    assert until(learned, 10.0)
    m = p.metrics()
    assert m[(mn.CLIENT_DEADLINE, ())] == pytest.approx(CLIENT_TIMEOUT_S, rel=0.1)
    assert m[(mn.CLIENT_DEADLINE_LEARNED, (("class", "1"),))] == pytest.approx(CLIENT_TIMEOUT_S, rel=0.1)
    assert m[(mn.CLIENT_DEADLINE_ABANDONS, (("class", "1"),))] >= MIN_ABANDONS
    # the proxy's own uses: its policy judges calls against the learned deadline
    assert p.proxy.policy.deadline_s == m[(mn.CLIENT_DEADLINE, ())]
    assert (mn.CALLS_MISSED_DEADLINE, ()) in m


def test_a_stated_deadline_wins_over_the_learned_one(start_proxy: StartProxy) -> None:
    p = start_proxy(cancellation="on", deadline_s=30.0)
    _clients(p.url, _timeout_jitter(random.Random(7), 12))
    assert until(lambda: p.metrics()[(mn.CLIENT_DEADLINE_ABANDONS, (("class", "1"),))] >= MIN_ABANDONS, 10.0)
    m = p.metrics()
    assert m[(mn.CLIENT_DEADLINE_LEARNED, (("class", "1"),))] == pytest.approx(CLIENT_TIMEOUT_S, rel=0.1)
    assert m[(mn.CLIENT_DEADLINE, ())] == 30.0
    assert m[(mn.CLIENT_DEADLINE_SOURCE, (("source", "stated"),))] == 1.0
    assert p.proxy.policy.deadline_s == 30.0
