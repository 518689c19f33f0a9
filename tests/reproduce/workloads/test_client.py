"""The client model: deadline, retries with backoff, Retry-After, giving up."""

from __future__ import annotations

import random

import pytest

from reproduce.workloads.client import (
    AttemptOutcome,
    CallRecord,
    ClientConfig,
    ClientConfigError,
    ClientModel,
)


def make_client(retries: int = 3, seed: int = 1) -> ClientModel:
    return ClientModel(ClientConfig(retries=retries), random.Random(seed))


def test_first_attempt_deadline_is_on_the_whole_attempt() -> None:
    client = make_client()
    call = client.new_call("c1", 10.0)
    attempt = client.send(call, 10.0)
    assert attempt.index == 0 and attempt.deadline_at == pytest.approx(130.0)
    client.first_byte(call, 12.0)
    client.delivered(call, 20.0)
    assert call.done and call.delivered_at == 20.0
    assert call.attempts[0].outcome is AttemptOutcome.DELIVERED
    assert call.attempts[0].first_byte_at == 12.0


def test_retries_use_uniform_backoff_and_stop_after_r_plus_one_attempts() -> None:
    client = make_client(retries=3)
    call = client.new_call("c1", 0.0)
    now = 0.0
    waits = []
    for _ in range(3):
        client.send(call, now)
        nxt = client.failed(call, now + 120.0, AttemptOutcome.DISCONNECTED)
        assert nxt is not None
        waits.append(nxt - (now + 120.0))
        now = nxt
    client.send(call, now)
    assert client.failed(call, now + 120.0, AttemptOutcome.DISCONNECTED) is None
    assert call.done and not call.delivered and len(call.attempts) == 4
    assert all(0.25 <= w <= 3.0 for w in waits)
    assert [a.index for a in call.attempts] == [0, 1, 2, 3]


def test_retries_off_fails_after_one_attempt() -> None:
    client = make_client(retries=0)
    call = client.new_call("c1", 0.0)
    client.send(call, 0.0)
    assert client.failed(call, 1.0, AttemptOutcome.REFUSED) is None
    assert call.done


def test_refused_attempt_is_retried_after_backoff() -> None:
    client = make_client()
    call = client.new_call("c1", 0.0)
    client.send(call, 0.0)
    nxt = client.failed(call, 0.5, AttemptOutcome.REFUSED)
    assert nxt is not None and 0.75 <= nxt <= 3.5


def test_retry_after_is_obeyed_and_too_long_gives_up() -> None:
    client = make_client()
    call = client.new_call("c1", 0.0)
    client.send(call, 0.0)
    assert client.failed(call, 1.0, AttemptOutcome.SHED, retry_after_s=40.0) == pytest.approx(41.0)
    client.send(call, 41.0)
    assert client.failed(call, 41.0, AttemptOutcome.SHED, retry_after_s=121.0) is None
    assert call.done and len(call.attempts) == 2


def test_backoff_is_deterministic_for_a_seed() -> None:
    def waits(seed: int) -> list[float]:
        client = make_client(seed=seed)
        out = []
        for i in range(5):
            call = client.new_call(f"c{i}", 0.0)
            client.send(call, 0.0)
            out.append(client.failed(call, 1.0, AttemptOutcome.FAILED))
        return out

    assert waits(7) == waits(7)
    assert waits(7) != waits(8)


def test_misuse_is_refused_clearly() -> None:
    client = make_client()
    call = client.new_call("c1", 0.0)
    with pytest.raises(ValueError, match="no attempt outstanding"):
        client.delivered(call, 1.0)
    client.send(call, 0.0)
    with pytest.raises(ValueError, match="still has an attempt"):
        client.send(call, 0.5)
    client.delivered(call, 1.0)
    with pytest.raises(ValueError, match="is over"):
        client.send(call, 2.0)


def test_config_validation_and_scaling() -> None:
    with pytest.raises(ClientConfigError):
        ClientConfig(deadline_s=0)
    with pytest.raises(ClientConfigError):
        ClientConfig(retries=-1)
    with pytest.raises(ClientConfigError):
        ClientConfig(backoff_min_s=3, backoff_max_s=1)
    scaled = ClientConfig().scaled(10)
    assert scaled.deadline_s == 12.0 and scaled.backoff_max_s == pytest.approx(0.3)
    assert scaled.horizon_s == 84.0 and scaled.retries == 3


def test_records_round_trip_through_dicts() -> None:
    client = make_client()
    call = client.new_call("c1", 3.0, prompt_len=12000, response_len=300, phase="pulse")
    client.send(call, 3.0)
    client.failed(call, 123.0, AttemptOutcome.DISCONNECTED)
    client.send(call, 124.0)
    client.delivered(call, 130.0)
    again = CallRecord.from_dict(call.to_dict())
    assert again == call
