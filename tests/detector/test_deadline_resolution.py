"""How the detector finds the clients' deadline: stated (--deadline), else the proxy's (stated to
it or learned by it), else missing (``retrywatch detect`` assumes none); and what it says where
a deadline falls between vLLM's e2e buckets."""

from __future__ import annotations

import logging

import pytest

from detector.cli import deadline_text
from detector.signals import SignalConfig, SignalEngine, SignalFrame, between_buckets, describe_deadline
from foundation import metricnames as mn
from foundation.timeseries import Snapshot

# As ``retrywatch detect`` configures the engine: no deadline assumed, each one logged as found.
DETECT = {"capacity": 2.0, "assumed_deadline": None, "log_deadlines": True}


def _scrape(t: float, proxy: tuple[float, str, float] | None) -> Snapshot:
    """vLLM's series (1 finish/s, all within 60 s), and the proxy's deadline gauges when
    ``proxy`` = (deadline in force, its source, the abandons it rests on)."""
    vl = {"engine": "0", "model_name": "m"}
    samples = [
        (mn.VLLM_NUM_WAITING, vl, 3.0),
        (mn.VLLM_REQUEST_SUCCESS, {**vl, "finished_reason": "stop"}, t),
        *((f"{mn.VLLM_E2E_LATENCY}_bucket", {**vl, "le": le}, t) for le in ("60.0", "120.0", "+Inf")),
        (f"{mn.VLLM_E2E_LATENCY}_count", vl, t),
    ]
    if proxy is not None:
        deadline, source, abandons = proxy
        samples.append((mn.CLIENT_DEADLINE, {}, deadline))
        samples += [
            (mn.CLIENT_DEADLINE_SOURCE, {"source": s}, float(s == source)) for s in mn.DEADLINE_SOURCES
        ]
        samples.append((mn.CLIENT_DEADLINE_ABANDONS, {"class": "1"}, abandons))
    return Snapshot(t, samples)


def _frame(config: SignalConfig, proxy: tuple[float, str, float] | None) -> SignalFrame:
    eng = SignalEngine(config)
    for t in range(0, 125, 5):
        eng.add(_scrape(float(t), proxy), "i")
    (frame,) = eng.compute(120.0)
    return frame


def test_each_deadline_is_logged_once_not_per_abandon(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    eng = SignalEngine(SignalConfig(**DETECT))
    for t in range(0, 125, 5):  # the abandons grow, the learned deadline holds
        eng.add(_scrape(float(t), (120.0, mn.DEADLINE_LEARNED, 50 + t)), "i")
        eng.compute(float(t))
    for t in range(125, 250, 5):  # the proxy's learned deadline moves
        eng.add(_scrape(float(t), (60.0, mn.DEADLINE_LEARNED, 200)), "i")
        (frame,) = eng.compute(float(t))
    assert caplog.messages == [
        "instance i: deadline learned 120 s from 50 abandons",
        "instance i: deadline learned 60 s from 200 abandons",
    ]
    assert frame.deadline_note == "learned 60 s from 200 abandons"


def test_a_deadline_declared_before_any_abandon_says_so() -> None:
    frame = _frame(SignalConfig(capacity=2.0), (42.5, mn.DEADLINE_LEARNED, 0))
    assert frame.deadline_note.startswith("learned 42.5 s from the timeout its clients declare")


def test_a_replay_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    frame = _frame(SignalConfig(capacity=2.0), (93.0, mn.DEADLINE_LEARNED, 57))
    assert caplog.messages == [] and frame.deadline_note.startswith("learned 93 s from 57 abandons; ")


def test_the_operators_deadline_wins_over_the_proxys_learned_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    frame = _frame(SignalConfig(deadline=120.0, **DETECT), (30.0, mn.DEADLINE_LEARNED, 57))
    assert frame.values["deadline"] == frame.values["vllm_deadline"] == 120.0
    assert "instance i: deadline stated 120 s" in caplog.messages


def test_without_a_stated_one_the_proxys_learned_deadline_is_used_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    frame = _frame(SignalConfig(**DETECT), (120.0, mn.DEADLINE_LEARNED, 57))
    assert frame.values["deadline"] == frame.values["vllm_deadline"] == 120.0
    assert frame.missing_for("vllm") == ()
    assert "instance i: deadline learned 120 s from 57 abandons" in caplog.messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_deadline_the_proxy_was_given_is_said_to_be_stated_by_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    _frame(SignalConfig(**DETECT), (60.0, mn.DEADLINE_STATED, 0))
    assert "instance i: deadline stated by the proxy 60 s" in caplog.messages


def test_without_either_the_vllm_tier_says_it_lacks_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "retrywatch.detector")
    frame = _frame(SignalConfig(**DETECT), None)
    assert frame.values["vllm_deadline"] is None
    assert frame.values["vllm_queue_deadline_ratio"] is None and frame.values["vllm_late_fraction"] is None
    assert "deadline" in frame.missing_for("vllm") and frame.values["vllm_data_missing"] == 1.0
    assert "deadline" in frame.missing_for("proxy")
    assert "instance i: deadline missing" in caplog.messages
    # a replay compares against the rendered rules, which assume their default: so does it
    replayed = _frame(SignalConfig(capacity=2.0), None)
    assert replayed.values["vllm_deadline"] == 120.0 and "deadline" not in replayed.missing_for("vllm")
    assert replayed.deadline_note == "assumed 120 s"


def test_a_learned_deadline_between_vllms_buckets_is_warned_of_and_counted_at_the_bucket_below(
    caplog: pytest.LogCaptureFixture,
) -> None:
    frame = _frame(SignalConfig(**DETECT), (93.0, mn.DEADLINE_LEARNED, 57))
    assert frame.values["vllm_deadline"] == 93.0
    assert frame.deadline_note.endswith(
        "finishes within 60 s count as in time, those from 60 to 93 s as late"
    )
    # every finish is within 60 s here: counted at the 60-s bucket, none is late
    assert frame.values["vllm_late_fraction"] == pytest.approx(0.0)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        "instance i: deadline learned 93 s from 57 abandons; the deadline 93 s falls between vLLM's "
        "e2e buckets: finishes within 60 s count as in time, those from 60 to 93 s as late"
    )


def test_the_start_line_says_how_the_deadline_is_found() -> None:
    assert deadline_text(120.0) == "deadline: stated 120 s"
    assert deadline_text(90.0) == (
        "deadline: stated 90 s (WARNING: the deadline 90 s falls between vLLM's e2e buckets: "
        "finishes within 60 s count as in time, those from 60 to 90 s as late)"
    )
    assert "below vLLM's first e2e bucket" in deadline_text(0.1)
    assert deadline_text(None).endswith("else missing")
    assert between_buckets(60.0) is None
    assert describe_deadline(None) == "missing"
    assert describe_deadline(None, 30.0) == "the proxy's 30 s"  # an older proxy: no source series
    # said in three significant digits, whole seconds from 1000
    assert describe_deadline(None, 2.06259, mn.DEADLINE_LEARNED, 14) == "learned 2.06 s from 14 abandons"
    assert describe_deadline(None, 1920.4, mn.DEADLINE_LEARNED, 9) == "learned 1920 s from 9 abandons"
    assert "within 2 s count as in time, those from 2 to 2.06 s as late" in (between_buckets(2.06259) or "")
