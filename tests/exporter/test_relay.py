"""The relay: replay then live bytes for every subscriber, compressed blocks, the replay bound."""

from __future__ import annotations

import asyncio

from exporter.relay import BLOCK_BYTES, READ_BYTES, Outcome, Relay


def _chunk(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"text":" t%d","finish_reason":null}]}\n\n' % i


def test_a_late_subscriber_gets_everything_from_the_start_across_compressed_blocks() -> None:
    relay = Relay(1, None, stream=True, created_at=0.0, limit_bytes=10 * BLOCK_BYTES)
    early = relay.subscribe(1)
    sent = [_chunk(i) for i in range(2000)]  # well over several blocks
    got_early: list[bytes] = []
    for c in sent:
        relay.append(c)
        got_early.append(relay.read(early))
    late = relay.subscribe(2)
    assert b"".join(got_early) == b"".join(sent)
    assert relay.read(late) == b"".join(sent)
    assert relay.read(late) == b""
    assert relay.stored_bytes() < len(b"".join(sent)) / 4  # blocks compress
    assert relay.attachable


def test_a_bounded_read_leaves_the_rest_in_the_relay_where_its_lag_is_seen() -> None:
    """A writer that found megabytes waiting took them all at once into its transport's buffer:
    its offset at the end, its lag was never seen again, and a client that was not reading kept
    them. Bounded reads return at most what was asked, from any offset, in order, and what is
    left unread still counts against the bound."""
    relay = Relay(3, None, stream=True, created_at=0.0, limit_bytes=BLOCK_BYTES)
    sub = relay.subscribe(1)
    chunks = [_chunk(i) for i in range(20_000)]  # 1.4 MB: about 90 blocks, compressed past the bound
    for c in chunks:
        relay.append(c)
    sent = b"".join(chunks)
    first = relay.read(sub, READ_BYTES)
    assert first == sent[:READ_BYTES]
    assert relay.overrun(sub)  # the rest is still unread, and far past the bound
    got = [first]
    while data := relay.read(sub, 1000):  # any size, across block and tail boundaries
        assert len(data) <= 1000
        got.append(data)
    assert b"".join(got) == sent and not relay.overrun(sub)
    assert relay.read(sub, READ_BYTES) == b""


def test_past_the_limit_the_relay_stops_attaching_and_releases_what_was_read() -> None:
    overflowed: list[int] = []
    relay = Relay(7, None, stream=True, created_at=0.0, limit_bytes=2048, on_overflow=overflowed.append)
    sub = relay.subscribe(1)
    total = b""
    for i in range(3000):
        relay.append(_chunk(i))
        total += _chunk(i)
        assert relay.read(sub) == _chunk(i)
    assert overflowed == [7] and not relay.attachable
    assert relay.stored_bytes() < 2 * BLOCK_BYTES  # released blocks are gone
    assert relay.end == len(total)


def test_waiters_wake_on_data_end_and_disconnect() -> None:
    async def scenario() -> list[str]:
        relay = Relay(1, None, stream=True, created_at=0.0, limit_bytes=1 << 20)
        a, b = relay.subscribe(1), relay.subscribe(2)
        events: list[str] = []

        async def reader(sub_id: int) -> None:
            sub = relay.subscriptions[sub_id]
            while not sub.left:
                data = relay.read(sub)
                if data:
                    events.append(f"{sub_id}:{data.decode()}")
                    continue
                if relay.outcome is not None:
                    events.append(f"{sub_id}:end")
                    return
                await relay.wait(sub)
            events.append(f"{sub_id}:left")

        tasks = [asyncio.create_task(reader(1)), asyncio.create_task(reader(2))]
        await asyncio.sleep(0)
        relay.append(b"x")
        await asyncio.sleep(0)
        b.left = True
        b.wake()
        await asyncio.sleep(0)
        relay.finish(Outcome.COMPLETED)
        await asyncio.gather(*tasks)
        assert a.offset == 1
        return events

    events = asyncio.run(scenario())
    assert events == ["1:x", "2:x", "2:left", "1:end"]


def test_non_streaming_subscribers_wait_for_the_whole_body() -> None:
    async def scenario() -> bytes:
        relay = Relay(1, None, stream=False, created_at=0.0, limit_bytes=1 << 20)
        sub = relay.subscribe(1)
        waiter = asyncio.create_task(relay.wait(sub))
        relay.append(b'{"partial":')
        await asyncio.sleep(0)
        assert not waiter.done()  # a partial body does not wake a non-streaming subscriber
        relay.append(b"1}")
        relay.finish(Outcome.COMPLETED)
        await waiter
        return relay.read(sub)

    assert asyncio.run(scenario()) == b'{"partial":1}'


def test_a_whole_answer_is_let_go_once_every_subscriber_has_it_or_at_once_when_it_fails() -> None:
    """The proxy bounds the non-streaming answers held at once (--answer-buffer-bytes): a relay
    tells it, once, how many bytes it held when they are no longer needed."""
    released: list[int] = []
    relay = Relay(3, None, stream=False, created_at=0.0, limit_bytes=2048, on_release=released.append)
    first, second = relay.subscribe(1), relay.subscribe(2)
    relay.append(b'{"id": ')
    relay.append(b'"cmpl-x"}')
    relay.finish(Outcome.COMPLETED)
    assert released == []  # both still have it to read
    relay.read(first)
    relay.unsubscribe(1)
    assert released == []
    relay.read(second)
    relay.unsubscribe(2)
    assert released == [len(b'{"id": "cmpl-x"}')]
    relay.unsubscribe(2)
    assert len(released) == 1

    failed: list[int] = []
    broken = Relay(4, None, stream=False, created_at=0.0, limit_bytes=2048, on_release=failed.append)
    broken.subscribe(1)
    broken.append(b"x" * 100)
    broken.finish(Outcome.FAILED, (502, b"{}"))
    assert failed == [100]  # its subscriber reads the error, not the bytes
    orphaned: list[int] = []
    alone = Relay(5, None, stream=False, created_at=0.0, limit_bytes=2048, on_release=orphaned.append)
    alone.append(b"y" * 10)
    alone.finish(Outcome.COMPLETED)
    assert orphaned == [10]  # nobody left to read it
