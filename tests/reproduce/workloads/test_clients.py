"""Client profiles (``reproduce.workloads.clients``) as the client model carries them out: each profile's
numbers as its library's source has them, its backoff and caps, its Retry-After handling, which
failures it retries, when it gives an attempt up, and ``--client``'s parsing."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from reproduce.conditions import block, expand
from reproduce.workloads.client import (
    AttemptOutcome,
    Backoff,
    CallRecord,
    ClientConfig,
    ClientConfigError,
    ClientModel,
)
from reproduce.workloads.clients import KEYS, PROFILES, parse_client, with_client
from retrywatch.cli import main
from tests.reproduce.test_cli import small_options

SDK_STATUSES = frozenset({408, 409, 429, *range(500, 600)})


class Fixed(random.Random):
    """An RNG whose every draw is ``u``: U(a, b) = a + (b - a) u."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


def model(name: str, u: float = 0.5, **changes: object) -> ClientModel:
    config = PROFILES[name].config
    return ClientModel(ClientConfig(**{**config.__dict__, **changes}), Fixed(u))


def fail(
    client: ClientModel, call: CallRecord, at: float, outcome: AttemptOutcome, **kw: object
) -> float | None:
    client.send(call, at)
    return client.failed(call, at + 1.0, outcome, **kw)  # type: ignore[arg-type]


def test_each_profile_has_its_librarys_numbers() -> None:
    assert list(PROFILES) == ["study", "openai-sdk", "anthropic-sdk", "litellm", "none"]
    study = PROFILES["study"].config
    assert (study.retries, study.attempt_timeout_s, study.read_timeout_s) == (3, 120.0, None)
    assert (study.backoff, study.backoff_min_s, study.backoff_max_s) == (Backoff.UNIFORM, 0.25, 3.0)
    assert (study.retry_statuses, study.retry_after_max_s, study.retry_after_first_byte) == (
        None,
        120.0,
        True,
    )
    for name in ("openai-sdk", "anthropic-sdk"):
        sdk = PROFILES[name].config
        assert (sdk.retries, sdk.attempt_timeout_s, sdk.read_timeout_s) == (2, None, 600.0)
        assert (sdk.backoff, sdk.backoff_min_s, sdk.backoff_max_s) == (Backoff.EXPONENTIAL, 0.5, 8.0)
        assert (sdk.jitter_fraction, sdk.jitter_s, sdk.retry_statuses) == (0.25, 0.0, SDK_STATUSES)
        assert sdk.should_retry_header and sdk.retry_after_any_status and sdk.zero_retry_after_is_backoff
        assert not sdk.retry_after_first_byte
    assert PROFILES["openai-sdk"].config.retry_after_max_s == 120.0  # MAX_RETRY_AFTER_DELAY = 2 * 60
    assert PROFILES["anthropic-sdk"].config.retry_after_max_s is None
    litellm = PROFILES["litellm"].config
    assert (litellm.retries, litellm.read_timeout_s, litellm.attempt_timeout_s) == (2, 600.0, None)
    assert (litellm.backoff_min_s, litellm.backoff_max_s, litellm.jitter_fraction, litellm.jitter_s) == (
        0.5, 8.0, 0.0, 0.75
    )  # fmt: skip
    assert (litellm.retry_statuses, litellm.retry_after_max_s, litellm.retry_after_over_max_gives_up) == (
        None, 60.0, False
    )  # fmt: skip
    assert PROFILES["none"].config.retries == 0
    assert {p.config.deadline_s for p in PROFILES.values()} == {120.0}  # every call judged on the same
    for name in ("openai-sdk", "anthropic-sdk", "litellm"):
        assert any(ch.isdigit() for ch in PROFILES[name].source)  # a version is cited


@pytest.mark.parametrize(
    ("name", "u", "expected"),
    [
        # min(0.5 x 2^n, 8) x (1 - 0.25 u): the full wait at u = 0, three quarters of it at u = 1
        ("openai-sdk", 0.0, [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]),
        ("anthropic-sdk", 1.0, [0.375, 0.75, 1.5, 3.0, 6.0, 6.0, 6.0]),
        # min(0.5 x 2^n, 8) + 0.75 u
        ("litellm", 1.0, [1.25, 1.75, 2.75, 4.75, 8.75, 8.75, 8.75]),
        ("litellm", 0.0, [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]),
        # U(0.25, 3) whatever the retry
        ("study", 0.5, [1.625] * 7),
    ],
)
def test_backoff_sequence_and_cap(name: str, u: float, expected: list[float]) -> None:
    client = model(name, u, retries=7)
    call = client.new_call("c", 0.0)
    now, waits = 0.0, []
    for _ in expected:
        client.send(call, now)
        nxt = client.failed(call, now + 1.0, AttemptOutcome.FAILED)
        assert nxt is not None
        waits.append(nxt - (now + 1.0))
        now = nxt
    assert waits == pytest.approx(expected)
    client.send(call, now)
    assert client.failed(call, now + 1.0, AttemptOutcome.FAILED) is None and len(call.attempts) == 8


def test_each_profile_stops_after_its_attempts() -> None:
    for name, attempts in (
        ("study", 4),
        ("openai-sdk", 3),
        ("anthropic-sdk", 3),
        ("litellm", 3),
        ("none", 1),
    ):
        client = model(name)
        call = client.new_call("c", 0.0)
        now: float | None = 0.0
        while now is not None:
            now = fail(client, call, now, AttemptOutcome.REFUSED)
        assert len(call.attempts) == attempts, name


@pytest.mark.parametrize(
    ("name", "status", "retry_after", "expected"),
    [
        ("study", 429, 40.0, 40.0),
        ("study", 429, 121.0, None),  # past the deadline: the call is given up
        ("study", 503, 40.0, 1.625),  # only a 429's Retry-After is the study client's
        ("study", 429, 0.0, 0.0),
        ("openai-sdk", 429, 120.0, 120.0),
        ("openai-sdk", 429, 121.0, None),  # over MAX_RETRY_AFTER_DELAY: not retried
        ("openai-sdk", 503, 7.0, 7.0),  # any retried status's Retry-After
        ("openai-sdk", 429, 0.0, 0.5),  # 0 < retry_after, else the backoff
        ("anthropic-sdk", 429, 3600.0, 3600.0),  # no limit
        ("anthropic-sdk", 503, 0.0, 0.5),
        ("litellm", 429, 30.0, 30.0 + 0.75 * 0.5),  # its jitter on top
        ("litellm", 429, 61.0, 0.5 + 0.75 * 0.5),  # over 60 s: the backoff, not a give-up
    ],
)
def test_retry_after_per_profile(name: str, status: int, retry_after: float, expected: float | None) -> None:
    client = model(name, 0.5 if name != "openai-sdk" and name != "anthropic-sdk" else 0.0)
    call = client.new_call("c", 0.0)
    outcome = AttemptOutcome.SHED if status == 429 else AttemptOutcome.REFUSED
    nxt = fail(client, call, 0.0, outcome, retry_after_s=retry_after, status=status)
    if expected is None:
        assert nxt is None and call.done
    else:
        assert nxt is not None and nxt - 1.0 == pytest.approx(expected)


def test_which_failures_each_profile_retries() -> None:
    def retried(name: str, outcome: AttemptOutcome, status: int | None = None, **kw: object) -> bool:
        client = model(name)
        call = client.new_call("c", 0.0)
        return fail(client, call, 0.0, outcome, status=status, **kw) is not None

    for status in (408, 409, 429, 500, 502, 503, 599):
        assert retried("openai-sdk", AttemptOutcome.FAILED, status), status
    for status in (400, 401, 404, 422):
        assert not retried("openai-sdk", AttemptOutcome.FAILED, status), status
        assert not retried("anthropic-sdk", AttemptOutcome.FAILED, status), status
        assert retried("study", AttemptOutcome.FAILED, status), status
        assert retried("litellm", AttemptOutcome.FAILED, status), status
    # a timeout, a broken connection: retried by all (the status of a stream that began is 200)
    for name in ("study", "openai-sdk", "anthropic-sdk", "litellm"):
        assert retried(name, AttemptOutcome.DISCONNECTED, 200) and retried(name, AttemptOutcome.FAILED), name
    # x-should-retry decides first for the SDKs, and is no header to the others
    assert not retried("openai-sdk", AttemptOutcome.REFUSED, 503, should_retry=False)
    assert retried("anthropic-sdk", AttemptOutcome.FAILED, 400, should_retry=True)
    assert retried("study", AttemptOutcome.REFUSED, 503, should_retry=False)
    assert retried("litellm", AttemptOutcome.FAILED, 400, should_retry=False)


def test_a_failure_after_the_response_began_is_retried_by_the_study_only() -> None:
    for name, again in (("study", True), ("openai-sdk", False), ("anthropic-sdk", False), ("litellm", False)):
        client = model(name)
        call = client.new_call("c", 0.0)
        client.send(call, 0.0)
        client.first_byte(call, 2.0)
        assert (client.failed(call, 700.0, AttemptOutcome.DISCONNECTED) is not None) is again, name


def test_when_an_attempt_is_given_up() -> None:
    study = model("study")
    call = study.new_call("c", 10.0)
    attempt = study.send(call, 10.0)
    assert attempt.deadline_at == study.give_up_at(attempt, 100.0) == study.attempt_limit_at(attempt) == 130.0
    sdk = model("openai-sdk")
    call = sdk.new_call("c", 10.0)
    attempt = sdk.send(call, 10.0)
    assert attempt.deadline_at == 610.0  # no byte for 600 s after sending
    assert sdk.give_up_at(attempt, 500.0) == 1100.0  # the read timeout moves with every byte
    assert sdk.attempt_limit_at(attempt) == float("inf")  # nothing bounds the whole attempt
    both = model("study", read_timeout_s=30.0)
    call = both.new_call("c", 0.0)
    attempt = both.send(call, 0.0)
    assert (attempt.deadline_at, both.give_up_at(attempt, 100.0)) == (30.0, 120.0)


def test_scaling_divides_every_duration() -> None:
    scaled = PROFILES["litellm"].config.scaled(10)
    assert (scaled.read_timeout_s, scaled.backoff_min_s, scaled.backoff_max_s) == (60.0, 0.05, 0.8)
    assert (scaled.jitter_s, scaled.retry_after_max_s, scaled.jitter_fraction) == (0.075, 6.0, 0.0)
    assert scaled.attempt_timeout_s is None and scaled.retries == 2


def test_parse_client() -> None:
    assert parse_client("openai-sdk") is PROFILES["openai-sdk"]
    spec = parse_client("retries=3,deadline=60,backoff=exponential:0.5:8,jitter=0.25,statuses=429+5xx")
    c = spec.config
    assert (c.retries, c.attempt_timeout_s, c.backoff, c.backoff_min_s, c.backoff_max_s) == (
        3, 60.0, Backoff.EXPONENTIAL, 0.5, 8.0
    )  # fmt: skip
    assert c.jitter_fraction == 0.25 and c.retry_statuses == frozenset({429, *range(500, 600)})
    assert spec.name.startswith("study,retries=3") and "docs/protocol.md" in spec.source
    more = parse_client("anthropic-sdk, retries=5, read-timeout=none, deadline=90, over-max=backoff").config
    assert (more.retries, more.read_timeout_s, more.attempt_timeout_s) == (5, None, 90.0)
    assert not more.retry_after_over_max_gives_up and more.jitter_fraction == 0.25
    flags = parse_client(
        "after-first-byte=no,should-retry=yes,retry-after-any=on,retry-after-max=none"
    ).config
    assert (flags.retry_after_first_byte, flags.should_retry_header, flags.retry_after_any_status) == (
        False, True, True
    )  # fmt: skip
    assert flags.retry_after_max_s is None
    for bad, says in (
        ("", "empty"),
        ("gpt", "unknown client 'gpt'"),
        ("retries=-1", "retries must be"),
        ("retries=two", "retries='two'"),
        ("speed=3", "keys: retries"),
        ("backoff=fast:1:2", "backoff='fast:1:2'"),
        ("backoff=uniform:3:1", "backoff_min_s <= backoff_max_s"),
        ("deadline=none,read-timeout=none", "an attempt needs a limit"),
        ("deadline=nan", "deadline='nan'"),
        ("statuses=600", "HTTP statuses"),
        ("jitter=2", "jitter_fraction"),
        ("openai-sdk,over-max=maybe", "give-up or backoff"),
    ):
        with pytest.raises(ClientConfigError, match=None) as err:
            parse_client(bad)
        assert says in str(err.value), (bad, str(err.value))
    assert set(KEYS) >= {"retries", "deadline", "backoff"}


def test_with_client_keeps_a_conditions_retries_off() -> None:
    on, off = (block("diagnostic").condition(k) for k in ("retries-on-cancel-off", "retries-off-cancel-off"))
    runs = expand("diagnostic", models="qwen2.5-7b-h100", runs=1, conditions=[on.key, off.key])
    sdk = [with_client(r, PROFILES["openai-sdk"]) for r in runs]
    assert [r.condition.client.config().retries for r in sdk] == [2, 0]
    assert sdk[0].condition.client.config().read_timeout_s == 600.0
    assert (
        sdk[1].condition.describe()["client"] == "openai-sdk" and sdk[1].condition.describe()["retries"] == 0
    )


def test_a_pulse_run_with_openai_sdk_clients_retries_as_the_sdk(tmp_path: Path) -> None:
    """The engine's queue cap refuses attempts (503): the SDK retries each twice at most, after
    its exponential backoff (at time scale 10), and never gives an attempt up at 120 s."""
    k = 10.0
    args = [
        "reproduce", "run", "--backend", "sim", "--model", "qwen2.5-7b-h100", "--block", "engine-cap",
        "--condition", "engine-cap-100", "--runs", "1", "--seed", "3", "--out", str(tmp_path),
        "--time-scale", str(k), "--no-progress", "--client", "openai-sdk", *small_options(),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (entry,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert (entry["settings"]["client"], entry["settings"]["retries"]) == ("openai-sdk", 2)
    assert entry["settings"]["client_settings"]["read_timeout_s"] == 600.0
    assert entry["settings"]["client_settings"]["retry_statuses"] == "408,409,429,5xx"
    assert entry["plan"]["client"]["read_timeout_s"] == 600.0 / k  # the run's own scale
    calls = [json.loads(line) for line in (tmp_path / entry["series"]).with_name("attempts.jsonl").open()]
    counts = {len(c["attempts"]) for c in calls}
    assert max(counts) == 3 and 1 in counts  # some calls used both retries, none more
    waits: dict[int, list[float]] = {0: [], 1: []}
    for c in calls:
        attempts = c["attempts"]
        assert all(a["outcome"] != "disconnected" for a in attempts)  # no 120-s give-up
        for i, (a, b) in enumerate(itertools.pairwise(attempts)):
            assert a["outcome"] == "refused"
            waits[i].append(b["sent_at"] - a["ended_at"])
    for n, found in waits.items():
        full = min(0.5 * 2**n, 8.0) / k
        assert found and all(0.75 * full - 1e-9 <= w <= full + 1e-9 for w in found), (n, found[:5])
