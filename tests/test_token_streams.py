"""TokenStreams contract, run against the memory and the Redis backends."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from server.constants import TOKEN_STREAM
from server.streams.memory import MemoryTokenStreams
from server.streams.protocol import StreamConflict, StreamDone, StreamEntry, TokenBatch, TokenStreams
from server.streams.redis import RedisTokenStreams

StreamsFactory = Callable[..., TokenStreams]


@pytest.fixture(params=["memory", "redis", "redis-decoded"])
async def make_streams(request: pytest.FixtureRequest) -> AsyncIterator[StreamsFactory]:
    clients: list[Redis] = []
    made: list[TokenStreams] = []

    def make(expire_after_s: float = 300, **client_kwargs: object) -> TokenStreams:
        streams: TokenStreams
        if request.param == "memory":
            streams = MemoryTokenStreams(expire_after_s)
        else:
            url = request.getfixturevalue("redis_url")
            decode = request.param == "redis-decoded"
            clients.append(Redis.from_url(url, decode_responses=decode, **client_kwargs))  # type: ignore[arg-type]
            streams = RedisTokenStreams(clients[-1], expire_after_s)
        made.append(streams)
        return streams

    yield make
    for streams in made:
        await streams.close()
    for client in clients:
        await client.aclose()


@pytest.fixture
def streams(make_streams: StreamsFactory) -> TokenStreams:
    return make_streams()


@pytest.fixture
def mid() -> str:
    return f"msg-{uuid.uuid4().hex[:8]}"


def batch(start: int, n: int, logprob: float | None = -0.5) -> TokenBatch:
    ids = list(range(100 + start, 100 + start + n))
    return TokenBatch(start, ids, [logprob] * n, [f"<{i}>" for i in ids])


def starts(entries: list[StreamEntry]) -> list[int | str]:
    return [e.start if isinstance(e, TokenBatch) else type(e).__name__ for e in entries]


async def test_append_and_read_from_any_position(streams: TokenStreams, mid: str) -> None:
    for b in (batch(0, 3), batch(3, 2), batch(5, 1)):
        await streams.append(mid, b)
    assert await streams.read(mid, after=-1, timeout_s=0) == [batch(0, 3), batch(3, 2), batch(5, 1)]
    assert starts(await streams.read(mid, after=1, timeout_s=0)) == [0, 3, 5]  # mid-batch
    assert starts(await streams.read(mid, after=2, timeout_s=0)) == [3, 5]
    assert starts(await streams.read(mid, after=3, timeout_s=0)) == [3, 5]
    assert starts(await streams.read(mid, after=4, timeout_s=0)) == [5]
    assert await streams.read(mid, after=5, timeout_s=0) == []
    assert await streams.length(mid) == 6
    assert await streams.exists(mid)


async def test_missing_stream(streams: TokenStreams, mid: str) -> None:
    assert await streams.length(mid) == 0
    assert not await streams.exists(mid)
    assert await streams.read(mid, after=-1, timeout_s=0) == []
    assert await streams.read(mid, after=-1, timeout_s=0.05) == []
    assert not await streams.exists(mid)  # a waiting reader leaves nothing behind


async def test_duplicate_gap_and_reorder_rejected(streams: TokenStreams, mid: str) -> None:
    with pytest.raises(StreamConflict):
        await streams.append(mid, batch(1, 2))  # must start at 0
    await streams.append(mid, batch(0, 3))
    with pytest.raises(StreamConflict):
        await streams.append(mid, batch(0, 3))  # republished
    with pytest.raises(StreamConflict):
        await streams.append(mid, batch(2, 3))  # overlaps
    with pytest.raises(StreamConflict):
        await streams.append(mid, batch(5, 1))  # gap
    await streams.append(mid, batch(3, 0))  # empty batch at the end: no-op
    await streams.append(mid, batch(3, 1))
    assert starts(await streams.read(mid, after=-1, timeout_s=0)) == [0, 3]


async def test_blocked_reader_wakes_on_append(streams: TokenStreams, mid: str) -> None:
    await streams.append(mid, batch(0, 2))
    started = time.monotonic()
    task = asyncio.create_task(streams.read(mid, after=1, timeout_s=5))
    await asyncio.sleep(0.1)
    assert not task.done()
    await streams.append(mid, batch(2, 2))
    assert await task == [batch(2, 2)]
    assert time.monotonic() - started < 1.5


async def test_cancelled_reader_leaves_streams_usable(streams: TokenStreams, mid: str) -> None:
    # An SSE client that disconnects cancels its reader in the middle of a blocking read.
    task = asyncio.create_task(streams.read(mid, after=-1, timeout_s=5))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await streams.exists(mid)
    await streams.append(mid, batch(0, 2))
    assert await streams.read(mid, after=-1, timeout_s=1) == [batch(0, 2)]


async def test_read_times_out(streams: TokenStreams, mid: str) -> None:
    await streams.append(mid, batch(0, 1))
    started = time.monotonic()
    assert await streams.read(mid, after=0, timeout_s=0.3) == []
    assert 0.25 <= time.monotonic() - started < 2


async def test_read_waits_longer_than_socket_timeout(make_streams: StreamsFactory, mid: str) -> None:
    streams = make_streams(socket_timeout=0.5)
    started = time.monotonic()
    assert await streams.read(mid, after=-1, timeout_s=1.2) == []
    assert 1.1 <= time.monotonic() - started < 3


async def _follow(streams: TokenStreams, mid: str) -> tuple[list[int], StreamDone]:
    tokens: list[int] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for entry in await streams.read(mid, after=len(tokens) - 1, timeout_s=5):
            if isinstance(entry, StreamDone):
                return tokens, entry
            assert isinstance(entry, TokenBatch)
            tokens.extend(entry.token_ids[len(tokens) - entry.start :])
    raise AssertionError(f"no terminal entry after {len(tokens)} tokens")


async def test_concurrent_readers_see_every_token(make_streams: StreamsFactory, mid: str) -> None:
    writer = make_streams()
    # Redis: a reader on another client, as another server process would be.
    reader = writer if isinstance(writer, MemoryTokenStreams) else make_streams()
    readers = [asyncio.create_task(_follow(s, mid)) for s in (writer, reader, reader)]
    expected: list[int] = []
    for i in range(30):
        b = batch(len(expected), 1 + i % 3)
        await writer.append(mid, b)
        expected += b.token_ids
        await asyncio.sleep(0.005 * (i % 2))
    await writer.finish(mid, StreamDone("complete"))
    for tokens, done in await asyncio.gather(*readers):
        assert tokens == expected
        assert done == StreamDone("complete")


async def test_many_blocked_readers_on_default_pool(make_streams: StreamsFactory, mid: str) -> None:
    streams = make_streams()
    readers = [asyncio.create_task(streams.read(mid, after=-1, timeout_s=5)) for _ in range(50)]
    await asyncio.sleep(0.2)
    await streams.append(mid, batch(0, 1))
    assert all(r == [batch(0, 1)] for r in await asyncio.gather(*readers))


async def test_finish_then_read_returns_done(streams: TokenStreams, mid: str) -> None:
    await streams.append(mid, batch(0, 2))
    await streams.finish(mid, StreamDone("error", error="worker lost", code="WORKER_LOST"))
    done = StreamDone("error", error="worker lost", code="WORKER_LOST")
    assert await streams.read(mid, after=-1, timeout_s=0) == [batch(0, 2), done]
    assert await streams.read(mid, after=1, timeout_s=5) == [done]
    with pytest.raises(StreamConflict):
        await streams.append(mid, batch(2, 1))
    assert await streams.length(mid) == 2


async def test_finish_wakes_reader_and_is_idempotent(streams: TokenStreams, mid: str) -> None:
    task = asyncio.create_task(streams.read(mid, after=-1, timeout_s=5))
    await asyncio.sleep(0.1)
    await streams.finish(mid, StreamDone("complete"))
    assert await task == [StreamDone("complete")]
    await streams.finish(mid, StreamDone("error", error="late"))
    assert await streams.read(mid, after=-1, timeout_s=0) == [StreamDone("complete")]
    assert await streams.exists(mid)
    assert await streams.length(mid) == 0


async def test_logprobs_round_trip(streams: TokenStreams, mid: str) -> None:
    logprobs = [-math.inf, None, -0.0, -1.2345678806304932, 0.0, -1e-30]
    b = TokenBatch(0, [1, 2, 3, 4, 5, 6], logprobs, ["a", "é", "\n", "", "🙂", '"'])
    await streams.append(mid, b)
    [got] = await streams.read(mid, after=-1, timeout_s=0)
    assert got == b
    assert isinstance(got, TokenBatch) and got.logprobs[0] == -math.inf


async def test_finished_stream_expires(make_streams: StreamsFactory, mid: str) -> None:
    streams = make_streams(expire_after_s=0.3)
    await streams.append(mid, batch(0, 1))
    await streams.finish(mid, StreamDone("complete"))
    assert await streams.exists(mid)
    await asyncio.sleep(0.5)
    assert not await streams.exists(mid)
    assert await streams.length(mid) == 0


async def test_redis_finish_sets_ttl(redis_url: str, mid: str) -> None:
    async with Redis.from_url(redis_url) as client:
        streams = RedisTokenStreams(client, expire_after_s=120)
        await streams.append(mid, batch(0, 1))
        await streams.finish(mid, StreamDone("complete"))
        assert 110_000 < await client.pttl(TOKEN_STREAM.format(message_id=mid)) <= 120_000


async def test_redis_concurrent_appends_from_two_clients(redis_url: str, mid: str) -> None:
    async with Redis.from_url(redis_url) as one, Redis.from_url(redis_url) as two:
        a, b = RedisTokenStreams(one), RedisTokenStreams(two)
        for round_ in range(20):
            results = await asyncio.gather(
                a.append(mid, batch(round_, 1)), b.append(mid, batch(round_, 1)), return_exceptions=True
            )
            assert sorted(type(r).__name__ for r in results) == ["NoneType", "StreamConflict"]
        assert await a.length(mid) == 20
        assert starts(await b.read(mid, after=-1, timeout_s=0)) == list(range(20))


async def test_append_many_appends_in_order_and_reports_each_conflict(streams: TokenStreams, mid: str) -> None:
    other = mid + "-b"
    results = await streams.append_many(
        [(mid, batch(0, 2)), (other, batch(0, 1)), (mid, batch(2, 1)), (mid, batch(9, 1)), (other, batch(1, 2))]
    )
    assert [type(r).__name__ for r in results] == ["NoneType", "NoneType", "NoneType", "StreamConflict", "NoneType"]
    assert starts(await streams.read(mid, after=-1, timeout_s=0)) == [0, 2]
    assert starts(await streams.read(other, after=-1, timeout_s=0)) == [0, 1]
    await streams.finish(other, StreamDone("complete"))
    [done] = await streams.append_many([(other, batch(3, 1))])
    assert isinstance(done, StreamConflict)


async def test_redis_append_many_reloads_flushed_scripts(redis_url: str, mid: str) -> None:
    async with Redis.from_url(redis_url) as client:
        streams = RedisTokenStreams(client)
        await client.script_flush()  # as after a Redis restart: the append script is gone
        results = await streams.append_many([(mid, batch(0, 1)), (mid, batch(1, 2))])
        assert results == [None, None]
        assert await streams.length(mid) == 3


async def test_redis_waiting_readers_share_one_blocking_read(redis_url: str) -> None:
    """Fifty readers waiting on fifty streams hold one connection in a blocking XREAD, not fifty,
    and each still gets its own batch as soon as it is appended."""
    name = f"mux-{uuid.uuid4().hex[:8]}"
    mids = [f"msg-{uuid.uuid4().hex[:8]}" for _ in range(50)]
    async with Redis.from_url(redis_url, client_name=name) as client, Redis.from_url(redis_url) as admin:
        streams = RedisTokenStreams(client)
        try:
            readers = [asyncio.create_task(streams.read(m, after=-1, timeout_s=10)) for m in mids]
            await asyncio.sleep(0.5)
            clients = await admin.client_list()
            blocked = [c for c in clients if c.get("name") == name and c.get("cmd") in ("xread", "xread|")]
            assert len(blocked) == 1, blocked
            for k, m in enumerate(mids):
                await streams.append(m, batch(0, 1 + k % 3))
            results = await asyncio.wait_for(asyncio.gather(*readers), timeout=10)
            assert [starts(r) for r in results] == [[0]] * 50
            assert [len(r[0].token_ids) for r in results if isinstance(r[0], TokenBatch)] == [
                1 + k % 3 for k in range(50)
            ]
        finally:
            await streams.close()


async def test_finished_memory_stream_is_one_batch_that_reads_the_same(mid: str) -> None:
    """A finished stream is kept for resuming readers as one batch (few objects for the garbage
    collector); a reader at any position still gets exactly the tokens after it."""
    streams = MemoryTokenStreams()
    for start in range(0, 12, 3):
        ids = list(range(100 + start, 103 + start))
        texts = [f"t{start + i}" for i in range(3)]
        await streams.append(
            mid, TokenBatch(start, ids, [-0.5] * 3, texts, "c" * 3, None, [7, 8] if start == 0 else None)
        )
    before = {after: await streams.read(mid, after, timeout_s=0) for after in (-1, 0, 4, 10)}
    await streams.finish(mid, StreamDone("complete"))
    assert len(streams._streams[mid].batches) == 1
    for after, entries in before.items():
        got = await streams.read(mid, after, timeout_s=0)
        assert isinstance(got[-1], StreamDone)
        old = [(i, t, x, c) for e in entries if isinstance(e, TokenBatch) for i, (t, x, c) in _tokens(e) if i > after]
        new = [(i, t, x, c) for e in got if isinstance(e, TokenBatch) for i, (t, x, c) in _tokens(e) if i > after]
        assert new == old and len(new) == 11 - after
    (merged,) = [e for e in await streams.read(mid, -1, timeout_s=0) if isinstance(e, TokenBatch)]
    assert merged.prompt_ids == [7, 8] and merged.channels == "c" * 12 and merged.logprobs == [-0.5] * 12


def _tokens(b: TokenBatch) -> list[tuple[int, tuple[int, str, str]]]:
    return [(b.start + k, (t, b.texts[k], b.channels[k])) for k, t in enumerate(b.token_ids)]


async def test_memory_reads_that_time_out_or_are_cancelled_leave_no_waiter_behind(mid: str) -> None:
    """A read's wait ends at its timeout (at most one tick late) or with its task, and takes its waiter
    off the stream: a reader that polls an idle stream for long must not pile waiters up on it."""
    streams = MemoryTokenStreams(tick_s=0.05)
    await streams.append(mid, batch(0, 2))
    t0 = time.monotonic()
    for _ in range(3):
        assert await streams.read(mid, 1, timeout_s=0.1) == []
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.3 + 3 * 0.05 + 0.2
    assert not streams._streams[mid].waiters
    task = asyncio.create_task(streams.read(mid, 1, timeout_s=30))
    await asyncio.sleep(0.01)
    assert len(streams._streams[mid].waiters) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not streams._streams[mid].waiters and streams._streams[mid].readers == 0
    # readers waiting on one stream all wake at its next append
    readers = [asyncio.create_task(streams.read(mid, 1, timeout_s=30)) for _ in range(5)]
    await asyncio.sleep(0.01)
    await streams.append(mid, batch(2, 1))
    for entries in await asyncio.wait_for(asyncio.gather(*readers), timeout=1):
        assert [e.token_ids for e in entries if isinstance(e, TokenBatch)] == [[102]]
    assert not streams._streams[mid].waiters


async def test_restart_drops_what_is_left_and_is_remembered(streams: TokenStreams, mid: str) -> None:
    assert await streams.restarted_at(mid) is None
    await streams.append(mid, batch(0, 4))
    await streams.restart(mid, 0, 3)  # attempt 3 streams the message again from its first token
    assert await streams.restarted_at(mid) == (0, 3)
    assert await streams.length(mid) == 0
    await streams.append(mid, batch(0, 2))
    assert starts(await streams.read(mid, after=-1, timeout_s=0)) == [0]


def _reading_state(streams: TokenStreams) -> object:
    """What ``chats.follow`` reads from the app state when a stream neither waits long nor ends unseen:
    the streams and one setting (no database is touched)."""
    from types import SimpleNamespace

    return SimpleNamespace(streams=streams, settings=SimpleNamespace(pending_event_interval_s=0.2))


async def test_a_reader_behind_gets_the_batches_it_missed_joined(streams: TokenStreams, mid: str) -> None:
    from server.chats.follow import Ended, follow

    for i in range(5):
        await streams.append(mid, batch(i, 1))
    reader = follow(_reading_state(streams), mid)  # type: ignore[arg-type]
    first = await anext(reader)
    assert isinstance(first, TokenBatch) and (first.start, len(first.token_ids)) == (0, 5)
    assert first.texts == [f"<{100 + i}>" for i in range(5)]
    await streams.append(mid, batch(5, 2))
    await streams.append(mid, batch(7, 1))
    await streams.finish(mid, StreamDone("complete"))
    # Redis's shared reader may have taken the first of these two before the second was written, so
    # they can come as one batch or as two; either way in order, from where the first one ended.
    rest: list[TokenBatch] = []
    async for item in reader:
        if isinstance(item, Ended):
            break
        assert isinstance(item, TokenBatch)
        rest.append(item)
    assert 1 <= len(rest) <= 2 and rest[0].start == 5
    assert [t for b in rest for t in b.token_ids] == [105, 106, 107]


async def test_an_interval_holds_tokens_until_that_many_arrived(streams: TokenStreams, mid: str) -> None:
    from server.chats.follow import Ended, follow

    got: list[TokenBatch] = []

    async def read() -> None:
        async for item in follow(_reading_state(streams), mid, interval=3):  # type: ignore[arg-type]
            if isinstance(item, TokenBatch):
                got.append(item)
            elif isinstance(item, Ended):
                return

    reader = asyncio.create_task(read())
    for i in range(8):
        await streams.append(mid, batch(i, 1))
        await asyncio.sleep(0.01)
    await streams.finish(mid, StreamDone("complete"))
    await asyncio.wait_for(reader, 10)
    assert [t for b in got for t in b.token_ids] == list(range(100, 108))
    assert all(len(b.token_ids) >= 3 for b in got[:-1]), [len(b.token_ids) for b in got]
