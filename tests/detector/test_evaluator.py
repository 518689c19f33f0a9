"""Prometheus' alert state machine: ``for``, ``keep_firing_for``, pending drops, NoData."""

from __future__ import annotations

import pytest

from detector.evaluator import Evaluator
from detector.signals import EngineLabels, SignalFrame
from detector.thresholds import AlertRule, Cmp

RULE = AlertRule(
    name="TestHigh", severity="warning", summary="x is high.", description="{instance}: x={value:.2f}",
    condition=Cmp("x", ">=", 1.0), for_s=10.0, keep_firing_for_s=15.0, value_signal="x",
)  # fmt: skip
LABELS = EngineLabels("0", "m", "i")


def _run(values: list[float | None], rule: AlertRule = RULE, step: float = 5.0) -> list[tuple[str, float]]:
    ev = Evaluator([rule])
    out = []
    for i, x in enumerate(values):
        frame = SignalFrame(t=i * step, labels=LABELS, values={"x": x})
        out += [(tr.kind, tr.at) for tr in ev.evaluate(i * step, [frame])]
    return out


def test_fires_when_the_condition_held_for_the_for_duration() -> None:
    # true from t=5: pending at 5, still pending at 10 (5 s), fires at 15 (10 s)
    assert _run([0, 1, 1, 1, 1]) == [("firing", 15.0)]
    # broken before `for`: never fires
    assert _run([0, 1, 1, 0, 1, 1, 0]) == []


def test_resolves_only_after_keep_firing_for_and_a_true_condition_clears_it() -> None:
    # fires at 10; false from 15: resolves at 15 + 15 = 30
    assert _run([1, 1, 1, 0, 0, 0, 0, 0]) == [("firing", 10.0), ("resolved", 30.0)]
    # a true evaluation during keep-firing resets the timer: no resolve, no second episode
    assert _run([1, 1, 1, 0, 0, 1, 0, 0, 0, 0]) == [("firing", 10.0), ("resolved", 45.0)]


def test_unknown_signal_is_false_and_values_and_descriptions_are_carried() -> None:
    assert _run([1, 1, 1, None, None, None, None]) == [("firing", 10.0), ("resolved", 30.0)]
    ev = Evaluator([RULE])
    tr = []
    for i in range(4):
        tr += ev.evaluate(i * 5.0, [SignalFrame(i * 5.0, LABELS, {"x": 2.5})])
    assert tr[0].description == "i: x=2.50" and tr[0].value == 2.5 and tr[0].started_at == 10.0
    assert ev.firing()[0].as_dict()["state"] == "firing"


def test_zero_for_fires_at_once_and_time_cannot_go_backwards() -> None:
    rule = AlertRule(**{**RULE.__dict__, "for_s": 0.0, "keep_firing_for_s": 0.0})
    assert _run([0, 1, 0], rule) == [("firing", 5.0), ("resolved", 10.0)]
    ev = Evaluator([rule])
    ev.evaluate(10.0, [])
    with pytest.raises(ValueError, match="backwards"):
        ev.evaluate(5.0, [])


def test_an_engine_that_disappears_resolves_its_alerts_after_hysteresis() -> None:
    ev = Evaluator([RULE])
    for i in range(3):
        ev.evaluate(i * 5.0, [SignalFrame(i * 5.0, LABELS, {"x": 5.0})])
    assert [t.kind for t in ev.evaluate(15.0, [])] == []
    assert [t.kind for t in ev.evaluate(30.0, [])] == ["resolved"]


def test_a_firing_alert_whose_condition_cleared_is_resolving_until_keep_firing_for_ends() -> None:
    ev = Evaluator([RULE])
    for i, x in enumerate([1, 1, 1, 0, 0]):  # fires at 10; false from 15; keep firing 15 s
        ev.evaluate(i * 5.0, [SignalFrame(i * 5.0, LABELS, {"x": float(x)})])
    (alert,) = ev.firing()
    doc = alert.as_dict()
    assert doc["state"] == "resolving"
    assert doc["resolving_since"] == 15.0 and doc["resolves_at"] == 30.0
    ev.evaluate(25.0, [SignalFrame(25.0, LABELS, {"x": 1.0})])  # the condition returns
    doc = ev.firing()[0].as_dict()
    assert doc["state"] == "firing" and doc["resolving_since"] is None and doc["resolves_at"] is None


def test_a_no_data_description_names_only_the_engine_labels_it_has() -> None:
    from detector.evaluator import render_description
    from detector.thresholds import NO_DATA

    bare = render_description(NO_DATA, EngineLabels("", "", "http://10.0.0.7:8100/metrics"), 1.0, ("vllm",))
    assert "(engine" not in bare and "model )" not in bare and "()" not in bare
    assert bare.startswith("The detector cannot evaluate instance http://10.0.0.7:8100/metrics: missing vllm")
    model_only = render_description(NO_DATA, EngineLabels("", "m", "i"), 1.0, ())
    assert "instance i (model m):" in model_only
    full = render_description(NO_DATA, EngineLabels("0", "m", "i"), 1.0, ())
    assert "instance i (engine 0, model m):" in full
