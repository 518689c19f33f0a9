"""Behaviour of the simulation environment: ordering, ties, cancellation, run limits."""

from __future__ import annotations

import pytest

from reproduce.simenv import Environment, SimulationError


def test_events_fire_in_time_order_and_ties_in_schedule_order() -> None:
    env = Environment()
    fired: list[tuple[float, str]] = []
    for at, name in [(2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "z")]:
        env.schedule(at, lambda n=name: fired.append((env.now, n)))
    env.run()
    assert fired == [(0.5, "z"), (1.0, "a"), (1.0, "b"), (2.0, "c")]
    assert env.now == 2.0


def test_callbacks_can_schedule_more_events_with_args() -> None:
    env = Environment()
    seen: list[tuple[float, int]] = []

    def tick(k: int) -> None:
        seen.append((env.now, k))
        if k < 3:
            env.schedule_in(0.25, tick, k + 1)

    env.schedule(0.0, tick, 0)
    env.run()
    assert seen == [(0.0, 0), (0.25, 1), (0.5, 2), (0.75, 3)]


def test_cancel_is_lazy_and_idempotent() -> None:
    env = Environment()
    fired: list[str] = []
    h = env.schedule(1.0, fired.append, "x")
    env.schedule(2.0, fired.append, "y")
    assert env.pending == 2
    env.cancel(h)
    env.cancel(h)
    assert env.pending == 1
    env.run()
    assert fired == ["y"]
    assert env.pending == 0
    env.cancel(h)  # already gone: no-op
    assert env.pending == 0


def test_run_until_stops_before_later_events_and_resumes() -> None:
    env = Environment()
    fired: list[float] = []
    for t in (1.0, 2.0, 3.0):
        env.schedule(t, lambda: fired.append(env.now))
    env.run(until=2.0)
    assert fired == [1.0, 2.0]
    assert env.now == 2.0
    env.run(until=2.5)
    assert env.now == 2.5
    env.run()
    assert fired == [1.0, 2.0, 3.0]


def test_bad_times_raise_clear_errors() -> None:
    env = Environment()
    env.run(until=5.0)
    with pytest.raises(SimulationError, match="already at"):
        env.schedule(4.0, print)
    with pytest.raises(SimulationError, match="finite"):
        env.schedule(float("nan"), print)
    with pytest.raises(SimulationError, match="already at"):
        env.run(until=1.0)


def test_same_schedule_gives_same_sequence() -> None:
    def trace() -> list[tuple[float, int]]:
        env = Environment()
        out: list[tuple[float, int]] = []
        for i in range(50):
            env.schedule((i * 7) % 5 * 0.1, lambda i=i: out.append((env.now, i)))
        env.run()
        return out

    assert trace() == trace()
