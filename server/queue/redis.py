"""Redis work queue and worker directory (DESIGN D3), shared by every server process.

One stream per model with one consumer group: XADD to enqueue, XREADGROUP to claim, XACK+XDEL
to ack (so XLEN counts waiting plus claimed items), XAUTOCLAIM to reclaim from dead consumers.
Enqueue/dequeue counters plus a per-message ticket give approximate queue positions.
Redis 7.0 commands only.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.typing import EncodableT

from server.constants import (
    MODELS_SEEN,
    WORK_DEQ_COUNTER,
    WORK_ENQ_COUNTER,
    WORK_GROUP,
    WORK_STREAM,
    WORK_TICKET,
    WORKER_DIRECTORY,
)
from server.queue.protocol import QueueFull, WorkerEntry, WorkItem

# Check size, add, take a ticket: atomic so concurrent servers never overfill the queue.
_ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[5], '0', 'MKSTREAM')
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('XADD', KEYS[1], '*', 'message_id', ARGV[2], 'attempt', ARGV[3])
local ticket = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[3], ticket, 'PX', ARGV[4])
return ticket
"""
# XAUTOCLAIM omits delivery counts; read them from the PEL in the same atomic step.
_RECLAIM = """
local out, cursor, want = {}, '0-0', tonumber(ARGV[4])
repeat
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', want - #out)
  cursor = r[1]
  for _, e in ipairs(r[2]) do
    if e and e[2] then
      local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
      out[#out + 1] = {e[1], e[2], p[1][4]}
    end
  end
until cursor == '0-0' or #out >= want
return out
"""
# Reset idle time only for items the consumer still owns: a plain XCLAIM would steal back an
# item that the reaper already handed to someone else.
_TOUCH = """
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return 0
"""
_FORGET_WORKER = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def max_block_s(redis: Redis) -> float:
    """Longest BLOCK one command may use: redis-py 8 applies its socket timeout (5 s unless
    configured) to blocking commands too, so longer waits are split into several commands."""
    timeout = redis.connection_pool.connection_kwargs.get("socket_timeout", 5.0)
    if not timeout:
        return 60.0
    return max(float(timeout) * 0.5, float(timeout) - 1.0)


def stream_entries(reply: Any) -> list[Any]:
    """The entries of the single stream in an XREAD/XREADGROUP reply, whatever its shape:
    RESP2 ``[[key, entries]]``, RESP3 ``{key: entries}`` or legacy RESP3 ``{key: [entries]}``."""
    if not reply:
        return []
    value = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    if value and isinstance(value[0], list) and (not value[0] or isinstance(value[0][0], list | tuple)):
        value = value[0]
    return list(value or [])


def _fields(raw: Any) -> dict[str, str]:
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
    return {text(k): text(v) for k, v in pairs}


class RedisWorkQueue:
    """Work queue shared by all server processes.

    Works with clients created either way (``decode_responses`` True or False): replies are
    decoded here. The client belongs to the caller; ``close`` leaves it open.
    """

    ticket_ttl_s = 24 * 3600.0

    def __init__(self, redis: Redis, max_queue_size: int = 1000) -> None:
        self.redis = redis
        self.max_queue_size = max_queue_size
        self._enqueue = redis.register_script(_ENQUEUE)
        self._reclaim = redis.register_script(_RECLAIM)
        self._touch = redis.register_script(_TOUCH)
        self._groups: set[str] = set()
        self._block_s = max_block_s(redis)

    async def _ensure_group(self, key: str) -> None:
        if key in self._groups:
            return
        try:
            await self.redis.xgroup_create(key, WORK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(key)

    async def enqueue(self, model: str, message_id: str, attempt: int) -> None:
        keys = [WORK_STREAM.format(model=model), WORK_ENQ_COUNTER.format(model=model)]
        keys.append(WORK_TICKET.format(message_id=message_id))
        ttl_ms = int(self.ticket_ttl_s * 1000)
        args: list[EncodableT] = [self.max_queue_size, message_id, attempt, ttl_ms, WORK_GROUP]
        if not await self._enqueue(keys=keys, args=args):
            raise QueueFull(model)

    async def claim(self, model: str, consumer: str, count: int, timeout_s: float) -> list[WorkItem]:
        if count <= 0:
            return []
        key = WORK_STREAM.format(model=model)
        await self._ensure_group(key)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            # BLOCK 0 would wait forever: no timeout left means a single non-blocking read.
            block = int(min(remaining, self._block_s) * 1000) if remaining > 0.001 else None
            try:
                reply = await self.redis.xreadgroup(WORK_GROUP, consumer, {key: ">"}, count, block)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self._groups.discard(key)  # the stream was deleted under us
                await self._ensure_group(key)
                continue
            entries = stream_entries(reply)
            if entries or block is None:
                break
        if entries:
            await self.redis.incrby(WORK_DEQ_COUNTER.format(model=model), len(entries))
        return [self._item(model, entry_id, fields, 1) for entry_id, fields in entries]

    @staticmethod
    def _item(model: str, entry_id: bytes | str, raw: Any, deliveries: int) -> WorkItem:
        fields = _fields(raw)
        return WorkItem(model, fields["message_id"], int(fields["attempt"]), text(entry_id), deliveries)

    async def ack(self, item: WorkItem) -> None:
        key = WORK_STREAM.format(model=item.model)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(key, WORK_GROUP, item.delivery_id)
            pipe.xdel(key, item.delivery_id)
            await pipe.execute()

    async def touch(self, items: list[WorkItem], consumer: str) -> None:
        by_model: dict[str, list[str]] = {}
        for item in items:
            by_model.setdefault(item.model, []).append(item.delivery_id)
        for model, ids in by_model.items():
            try:
                await self._touch(keys=[WORK_STREAM.format(model=model)], args=[WORK_GROUP, consumer, *ids])
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise

    async def reclaim(self, model: str, consumer: str, min_idle_s: float, count: int) -> list[WorkItem]:
        if count <= 0:
            return []
        args: list[EncodableT] = [WORK_GROUP, consumer, int(min_idle_s * 1000), count]
        try:
            rows = await self._reclaim(keys=[WORK_STREAM.format(model=model)], args=args)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return []
        return [self._item(model, entry_id, raw, int(n)) for entry_id, raw, n in rows]

    async def holds(self, model: str, message_id: str) -> bool:
        return bool(await self.redis.exists(WORK_TICKET.format(message_id=message_id)))

    async def position(self, model: str, message_id: str) -> tuple[int, int]:
        ticket, enqueued, dequeued = (
            int(value or 0)
            for value in await self.redis.mget(
                WORK_TICKET.format(message_id=message_id),
                WORK_ENQ_COUNTER.format(model=model),
                WORK_DEQ_COUNTER.format(model=model),
            )
        )
        # Tickets count from 1: ticket - 1 items were enqueued before this one.
        ahead = max(ticket - 1 - dequeued, 0)
        size = max(enqueued - dequeued, ahead + 1 if ticket > dequeued else 0)
        return ahead, size

    async def close(self) -> None:
        self._groups.clear()


class RedisWorkerDirectory:
    """Worker directory shared by all server processes: one hash field per worker holding the
    entry and its wall-clock expiry (servers' clocks are assumed roughly in sync)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._forget = redis.register_script(_FORGET_WORKER)

    async def register(self, entry: WorkerEntry, ttl_s: float) -> None:
        value = orjson.dumps({**asdict(entry), "expires_at": time.time() + ttl_s})
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(WORKER_DIRECTORY, entry.worker_id, value)
            pipe.hset(MODELS_SEEN, entry.model_name, time.time())
            await pipe.execute()

    async def unregister(self, worker_id: str) -> None:
        await self.redis.hdel(WORKER_DIRECTORY, worker_id)

    async def workers(self) -> list[WorkerEntry]:
        now = time.time()
        entries: list[WorkerEntry] = []
        raw: dict[Any, Any] = await self.redis.hgetall(WORKER_DIRECTORY)
        for worker_id, value in raw.items():
            data = orjson.loads(value)
            if data.pop("expires_at") > now:
                entries.append(WorkerEntry(**data))
            else:
                # Delete only if unchanged: another server may have just refreshed it.
                await self._forget(keys=[WORKER_DIRECTORY], args=[worker_id, value])
        return entries

    async def recent_models(self, within_s: float) -> set[str]:
        raw: dict[Any, Any] = await self.redis.hgetall(MODELS_SEEN)
        since = time.time() - within_s
        return {k.decode() if isinstance(k, bytes) else str(k) for k, v in raw.items() if float(v) >= since}

    async def close(self) -> None:
        pass
