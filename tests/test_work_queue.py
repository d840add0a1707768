"""WorkQueue and WorkerDirectory contract, run against the memory and the Redis backends."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from server.queue.memory import MemoryWorkerDirectory, MemoryWorkQueue
from server.queue.protocol import QueueFull, WorkerDirectory, WorkerEntry, WorkQueue
from server.queue.redis import RedisWorkerDirectory, RedisWorkQueue

BACKENDS = ["memory", "redis", "redis-decoded"]
QueueFactory = Callable[..., WorkQueue]


@pytest.fixture(params=BACKENDS)
async def make_queue(request: pytest.FixtureRequest) -> AsyncIterator[QueueFactory]:
    clients: list[Redis] = []
    queues: list[WorkQueue] = []

    def make(max_queue_size: int = 1000, route_wait_s: float = 0.5, **client_kwargs: object) -> WorkQueue:
        queue: WorkQueue
        if request.param == "memory":
            queue = MemoryWorkQueue(max_queue_size, route_wait_s)
        else:
            decode = request.param == "redis-decoded"
            url = request.getfixturevalue("redis_url")
            clients.append(Redis.from_url(url, decode_responses=decode, **client_kwargs))  # type: ignore[arg-type]
            queue = RedisWorkQueue(clients[-1], max_queue_size, route_wait_s)
        queues.append(queue)
        return queue

    yield make
    for queue in queues:
        await queue.close()
    for client in clients:
        await client.aclose()


@pytest.fixture
def model() -> str:
    return f"model-{uuid.uuid4().hex[:8]}"


async def test_claim_is_fifo(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    for i in range(3):
        await queue.enqueue(model, f"msg-{i}", attempt=i + 1)
    items = await queue.claim(model, "c1", count=10, timeout_s=0)
    assert [(it.message_id, it.attempt, it.deliveries) for it in items] == [
        ("msg-0", 1, 1),
        ("msg-1", 2, 1),
        ("msg-2", 3, 1),
    ]
    assert all(it.model == model for it in items)
    assert len({it.delivery_id for it in items}) == 3


async def test_claim_respects_count_and_times_out(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    for i in range(3):
        await queue.enqueue(model, f"msg-{i}", 1)
    assert len(await queue.claim(model, "c1", count=2, timeout_s=1)) == 2
    assert [it.message_id for it in await queue.claim(model, "c1", count=5, timeout_s=1)] == ["msg-2"]
    started = time.monotonic()
    assert await queue.claim(model, "c1", count=1, timeout_s=0.3) == []
    assert 0.25 <= time.monotonic() - started < 2


async def test_blocked_claim_wakes_on_enqueue(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    started = time.monotonic()
    task = asyncio.create_task(queue.claim(model, "c1", count=1, timeout_s=5))
    await asyncio.sleep(0.1)
    await queue.enqueue(model, "msg-0", 1)
    items = await task
    assert [it.message_id for it in items] == ["msg-0"]
    assert time.monotonic() - started < 2


async def test_claim_waits_longer_than_socket_timeout(make_queue: QueueFactory, model: str) -> None:
    # redis-py 8 applies socket_timeout to blocking commands: long waits must be split.
    queue = make_queue(socket_timeout=0.5)
    started = time.monotonic()
    assert await queue.claim(model, "c1", count=1, timeout_s=1.2) == []
    assert 1.1 <= time.monotonic() - started < 3


async def test_ack_removes(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(max_queue_size=1)
    await queue.enqueue(model, "msg-0", 1)
    [item] = await queue.claim(model, "c1", count=1, timeout_s=0)
    await queue.ack(item)
    assert await queue.reclaim(model, "c2", min_idle_s=0, count=10) == []
    await queue.enqueue(model, "msg-1", 1)  # the acked item no longer takes room


async def test_unacked_items_are_reclaimed(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    await queue.enqueue(model, "msg-0", 7)
    [item] = await queue.claim(model, "dead", count=1, timeout_s=0)
    assert await queue.reclaim(model, "c2", min_idle_s=5, count=10) == []
    await asyncio.sleep(0.3)
    [again] = await queue.reclaim(model, "c2", min_idle_s=0.2, count=10)
    assert (again.message_id, again.attempt, again.deliveries) == ("msg-0", 7, 2)
    assert again.delivery_id == item.delivery_id
    assert await queue.reclaim(model, "c3", min_idle_s=0.2, count=10) == []  # freshly claimed
    await queue.ack(again)
    await asyncio.sleep(0.3)
    assert await queue.reclaim(model, "c3", min_idle_s=0.2, count=10) == []


async def test_touch_prevents_reclaim(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    await queue.enqueue(model, "msg-0", 1)
    items = await queue.claim(model, "c1", count=1, timeout_s=0)
    for _ in range(3):
        await asyncio.sleep(0.15)
        await queue.touch(items, "c1")
        assert await queue.reclaim(model, "c2", min_idle_s=0.25, count=10) == []
    await asyncio.sleep(0.3)
    [taken] = await queue.reclaim(model, "c2", min_idle_s=0.25, count=10)
    assert taken.deliveries == 2
    # The former owner's touch must not take the item back or keep it alive.
    await asyncio.sleep(0.3)
    await queue.touch(items, "c1")
    [taken] = await queue.reclaim(model, "c3", min_idle_s=0.25, count=10)
    assert taken.deliveries == 3


async def test_take_over_moves_a_dead_processs_claims_at_once(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=0.0)
    await queue.enqueue(model, "m1", 1)
    await queue.enqueue(model, "m2", 1, prefer="w-dead-2")
    await queue.enqueue(model, "m3", 1)
    assert [i.message_id for i in await queue.claim(model, "w-dead-1", 1, 0.1)] == ["m1"]
    assert [i.message_id for i in await queue.claim(model, "w-dead-2", 1, 0.1)] == ["m2"]
    assert [i.message_id for i in await queue.claim(model, "w-live-1", 1, 0.1)] == ["m3"]
    taken = await queue.take_over(model, "reaper-live", ["w-dead-", "reaper-dead"])
    assert sorted(i.message_id for i in taken) == ["m1", "m2"]  # however recently claimed; m3 is left
    assert all(i.deliveries == 2 for i in taken)
    assert await queue.take_over(model, "reaper-other", ["w-dead-"]) == []  # taken once only
    for item in taken:
        await queue.ack(item)
    assert [i.message_id for i in await queue.reclaim(model, "x", 0.0, 10)] == ["m3"]


async def test_reclaim_respects_count(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    for i in range(5):
        await queue.enqueue(model, f"msg-{i}", 1)
    await queue.claim(model, "dead", count=5, timeout_s=0)
    await asyncio.sleep(0.15)
    first = await queue.reclaim(model, "c2", min_idle_s=0.1, count=3)
    rest = await queue.reclaim(model, "c3", min_idle_s=0.1, count=3)
    assert [it.message_id for it in first + rest] == [f"msg-{i}" for i in range(5)]


async def test_queue_full(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(max_queue_size=3)
    for i in range(3):
        await queue.enqueue(model, f"msg-{i}", 1)
    with pytest.raises(QueueFull):
        await queue.enqueue(model, "msg-3", 1)
    [item] = await queue.claim(model, "c1", count=1, timeout_s=0)
    with pytest.raises(QueueFull):  # claimed but unacked still counts
        await queue.enqueue(model, "msg-3", 1)
    await queue.ack(item)
    await queue.enqueue(model, "msg-3", 1)
    await queue.enqueue(f"{model}-other", "msg-x", 1)  # limits are per model


async def test_retry_lane_is_served_first_and_never_full(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(max_queue_size=2)
    await queue.enqueue(model, "new-0", 1)
    await queue.enqueue(model, "new-1", 1)
    await queue.enqueue(model, "lost-0", 2, retry=True)  # the new-work lane is full; retries still fit
    await queue.enqueue(model, "lost-1", 3, retry=True)
    assert await queue.holds(model, "lost-1")
    assert (await queue.position(model, "lost-0"))[0] == 0
    first = await queue.claim(model, "c1", count=3, timeout_s=0)
    assert [(it.message_id, it.attempt, it.retry) for it in first] == [
        ("lost-0", 2, True),
        ("lost-1", 3, True),
        ("new-0", 1, False),
    ]
    for item in first:
        await queue.ack(item)
    [rest] = await queue.claim(model, "c1", count=3, timeout_s=0)
    assert rest.message_id == "new-1"
    assert await queue.position(model, "new-1") == (0, 0)  # retries take no place in the count


async def test_blocked_claim_wakes_on_a_retry(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    claim = asyncio.create_task(queue.claim(model, "c1", count=1, timeout_s=5))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await queue.enqueue(model, "lost", 2, retry=True)
    [item] = await claim
    assert item.message_id == "lost" and item.retry
    assert time.monotonic() - started < 2


async def test_both_lanes_filling_at_once_never_overfill_a_claim(make_queue: QueueFactory, model: str) -> None:
    """A claim blocked on both lanes may be woken with an entry from each; it keeps ``count``
    items and hands the rest back, losing nothing."""
    queue = make_queue()
    for round_ in range(5):
        claim = asyncio.create_task(queue.claim(model, "c1", count=1, timeout_s=5))
        await asyncio.sleep(0.1)
        await asyncio.gather(
            queue.enqueue(model, f"new-{round_}", 1), queue.enqueue(model, f"lost-{round_}", 2, retry=True)
        )
        assert len(await claim) == 1
    left: list[str] = []
    while batch := await queue.claim(model, "c2", count=10, timeout_s=0):
        left += [it.message_id for it in batch]
        for item in batch:
            await queue.ack(item)
    # What is still claimed is exactly the five items c1 kept: no handed-back copy stayed pending.
    kept = [it.message_id for it in await queue.reclaim(model, "c3", min_idle_s=0, count=100)]
    assert len(kept) == 5 and set(kept).isdisjoint(left)
    assert sorted(kept + left) == sorted([f"new-{i}" for i in range(5)] + [f"lost-{i}" for i in range(5)])


async def test_position_and_size(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue()
    for i in range(4):
        await queue.enqueue(model, f"msg-{i}", 1)
    assert await queue.position(model, "msg-0") == (0, 4)
    assert await queue.position(model, "msg-2") == (2, 4)
    await queue.claim(model, "c1", count=1, timeout_s=0)
    assert await queue.position(model, "msg-2") == (1, 3)
    assert await queue.position(model, "msg-0") == (0, 3)  # dequeued
    await queue.claim(model, "c1", count=3, timeout_s=0)
    assert await queue.position(model, "msg-3") == (0, 0)
    assert await queue.position(model, "unknown") == (0, 0)


async def test_two_queues_share_redis_without_duplicates(redis_url: str, model: str) -> None:
    clients = [Redis.from_url(redis_url) for _ in range(2)]
    queues = [RedisWorkQueue(client) for client in clients]
    try:
        for i in range(20):
            await queues[i % 2].enqueue(model, f"msg-{i}", 1)
        batches = await asyncio.gather(
            *(q.claim(model, f"c{n}-{k}", count=3, timeout_s=0.2) for k in range(5) for n, q in enumerate(queues))
        )
        ids = [it.message_id for batch in batches for it in batch]
        assert sorted(ids) == sorted(f"msg-{i}" for i in range(20))
    finally:
        for client in clients:
            await client.aclose()


@pytest.fixture(params=BACKENDS)
async def directory(request: pytest.FixtureRequest) -> AsyncIterator[WorkerDirectory]:
    if request.param == "memory":
        yield MemoryWorkerDirectory()
        return
    client = Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=request.param != "redis")
    yield RedisWorkerDirectory(client)
    await client.aclose()


def _entry(worker_id: str, capacity: int = 4) -> WorkerEntry:
    return WorkerEntry(worker_id, "llama", "hash-1", "hf", max_context=None, capacity=capacity)


async def test_directory_register_unregister_expire(directory: WorkerDirectory) -> None:
    a, b, c = (f"w-{uuid.uuid4().hex[:8]}" for _ in range(3))

    async def mine() -> dict[str, WorkerEntry]:
        return {w.worker_id: w for w in await directory.workers() if w.worker_id in (a, b, c)}

    await directory.register(_entry(a), ttl_s=30)
    await directory.register(_entry(b), ttl_s=30)
    await directory.register(_entry(c), ttl_s=0.2)
    assert set(await mine()) == {a, b, c}
    await directory.register(_entry(a, capacity=8), ttl_s=30)  # refresh replaces the entry
    assert (await mine())[a] == _entry(a, capacity=8)
    await directory.unregister(b)
    await asyncio.sleep(0.3)
    assert set(await mine()) == {a}
    await directory.register(_entry(c), ttl_s=30)  # a worker may come back
    assert set(await mine()) == {a, c}
    await directory.unregister("never-registered")


# ---- routing lanes (server.workers.routing) ---------------------------------------------------------


async def test_lane_is_claimed_by_its_worker_first(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    assert await queue.claim(model, "w1", count=4, timeout_s=0, capacity=4) == []  # w1 is known, free
    await queue.enqueue(model, "shared-0", 1)
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    await queue.enqueue(model, "retry-0", 2, retry=True)
    # another worker gets the shared and retry lanes, not w1's lane (its item is young, w1 has room)
    other = await queue.claim(model, "w2", count=4, timeout_s=0, capacity=4)
    assert [(i.message_id, i.lane, i.retry) for i in other] == [("retry-0", "", True), ("shared-0", "", False)]
    [mine] = await queue.claim(model, "w1", count=4, timeout_s=0, capacity=4)
    assert (mine.message_id, mine.lane, mine.deliveries) == ("routed-0", "w1", 1)
    assert await queue.holds(model, "routed-0")
    await queue.ack(mine)
    assert await queue.claim(model, "w2", count=4, timeout_s=0, capacity=4) == []


async def test_lane_order_retry_then_own_then_shared(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    await queue.claim(model, "w1", count=1, timeout_s=0, capacity=8)
    await queue.enqueue(model, "shared-0", 1)
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    await queue.enqueue(model, "retry-0", 2, retry=True)
    got = [i.message_id for i in await queue.claim(model, "w1", count=2, timeout_s=0, capacity=8)]
    assert got == ["retry-0", "routed-0"]
    assert [i.message_id for i in await queue.claim(model, "w1", count=2, timeout_s=0, capacity=8)] == ["shared-0"]


async def test_lane_is_handed_over_after_the_wait(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=0.3)
    await queue.claim(model, "w1", count=1, timeout_s=0, capacity=4)  # w1 live, then busy (never claims again)
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    start = time.monotonic()
    [item] = await queue.claim(model, "w2", count=4, timeout_s=3, capacity=4)
    waited = time.monotonic() - start
    assert item.message_id == "routed-0" and item.lane == "w1"
    assert 0.2 <= waited < 2.0, waited  # waited for the bound, then woke without a new enqueue
    await queue.ack(item)


async def test_lane_overflow_is_handed_over_at_once(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    await queue.claim(model, "w1", count=2, timeout_s=0, capacity=2)
    for i in range(5):
        await queue.enqueue(model, f"routed-{i}", 1, prefer="w1")
    # w1 can take 2 at once: the 3 beyond its capacity go to an idle worker now, oldest first
    stolen = await queue.claim(model, "w2", count=8, timeout_s=0, capacity=8)
    assert [i.message_id for i in stolen] == ["routed-0", "routed-1", "routed-2"]
    kept = await queue.claim(model, "w1", count=2, timeout_s=0, capacity=2)
    assert [i.message_id for i in kept] == ["routed-3", "routed-4"]


async def test_lane_of_an_unknown_worker_is_taken_at_once(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    await queue.enqueue(model, "routed-0", 1, prefer="never-claimed")
    [item] = await queue.claim(model, "w2", count=1, timeout_s=0, capacity=1)
    assert (item.message_id, item.lane) == ("routed-0", "never-claimed")


async def test_lane_owner_wakes_for_its_item(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    await queue.claim(model, "w1", count=1, timeout_s=0, capacity=4)
    waiting = asyncio.create_task(queue.claim(model, "w1", count=4, timeout_s=5, capacity=4))
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    [item] = await waiting
    assert item.lane == "w1" and time.monotonic() - start < 1.0


async def test_lane_items_are_reclaimed_from_a_dead_claimer(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(route_wait_s=30)
    await queue.claim(model, "w1", count=1, timeout_s=0, capacity=4)
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    [claimed] = await queue.claim(model, "w1", count=1, timeout_s=0, capacity=4)
    await asyncio.sleep(0.3)
    [again] = await queue.reclaim(model, "reaper", min_idle_s=0.2, count=10)
    assert again.delivery_id == claimed.delivery_id
    assert (again.message_id, again.lane, again.deliveries) == ("routed-0", "w1", 2)
    await queue.ack(again)
    assert await queue.reclaim(model, "reaper", min_idle_s=0, count=10) == []


async def test_lanes_count_in_the_bound_and_positions(make_queue: QueueFactory, model: str) -> None:
    queue = make_queue(max_queue_size=3, route_wait_s=30)
    await queue.claim(model, "w1", count=1, timeout_s=0, capacity=4)
    await queue.enqueue(model, "shared-0", 1)
    await queue.enqueue(model, "routed-0", 1, prefer="w1")
    await queue.enqueue(model, "routed-1", 1, prefer="w1")
    with pytest.raises(QueueFull):
        await queue.enqueue(model, "routed-2", 1, prefer="w1")
    ahead, size = await queue.position(model, "routed-1")
    assert size == 3 and 0 < ahead < 3
