"""Server presence (server/workers/presence.py) on a real Redis: a process whose key expired is presumed
dead, a live one never, and none while Redis has just come back empty (every key was lost at once)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from server.constants import SERVER_EPOCH
from server.workers.presence import MemoryPresence, RedisPresence

pytestmark = [pytest.mark.redis]


async def test_expired_presence_is_dead_and_a_new_redis_presumes_nobody_dead(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    a, b = (f"{n}{uuid.uuid4().hex[:6]}" for n in "ab")
    try:
        await redis.delete(SERVER_EPOCH)  # as after a restart: Redis is new
        pa, pb = RedisPresence(redis, a, 0.3), RedisPresence(redis, b, 0.3)
        assert await pa.beat()  # it found Redis new: the queue lost what it held
        assert not await pb.beat()
        assert await pa.dead({a, b, "never-seen"}) == set()  # the epoch is younger than the grace
        await asyncio.sleep(0.7)
        await pa.beat()
        await pb.beat()
        assert await pa.dead({a, b, "never-seen"}) == {"never-seen"}  # b is alive; itself is never dead
        await asyncio.sleep(0.4)  # b stopped beating: its key expired
        assert await pa.dead({b}) == {b}
        await pb.beat()
        assert await pa.dead({b}) == set()
        await pb.leave()
        assert await pa.dead({b}) == {b}
        await redis.delete(SERVER_EPOCH)  # Redis lost everything: nobody can be told dead for a while
        assert await pa.dead({b}) == set()
    finally:
        await redis.aclose()


async def test_one_process_presumes_its_earlier_runs_dead() -> None:
    assert await MemoryPresence("now").dead({"now", "before"}) == {"before"}
