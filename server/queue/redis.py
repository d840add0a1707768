"""Redis work queue and worker directory (DESIGN D3), shared by every server process.

Two streams per model (new work, and the retry lane served first), each with one consumer group:
XADD to enqueue, XREADGROUP to claim, XACK+XDEL to ack (so XLEN counts waiting plus claimed items),
XAUTOCLAIM to reclaim from dead consumers. Enqueue/dequeue counters of the new-work lane plus a
per-message ticket give approximate queue positions.

Routed work (``prefer``) goes to the preferred worker's lane, a stream of its own in the same group;
a hash of the model's lane owners holds each one's capacity and last claim. ``claim`` is one script:
the retry lane, the claimer's lane, the shared lane, then other lanes' items due for hand-over (the
oldest not yet delivered, past ``route_wait_s`` or beyond the owner's capacity), all by XREADGROUP, so
every claimed item is pending in its stream, acked and reclaimed alike.
Redis 7.0 commands only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
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
    WORK_LANE_STREAM,
    WORK_LANES,
    WORK_RETRY_STREAM,
    WORK_STREAM,
    WORK_TICKET,
    WORKER_DIRECTORY,
)
from server.queue.protocol import QueueFull, WorkerEntry, WorkItem

# Check size, add, take a ticket: atomic so concurrent servers never overfill the queue.
_ENTRY_FIELDS = {f.name for f in fields(WorkerEntry)}

# KEYS[4] is the shared lane (counted in the bound) and KEYS[1] the stream to add to: the shared lane
# itself or a worker's lane, whose owner KEYS[5] then knows of (capacity unknown until it claims).
_ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[5], '0', 'MKSTREAM')
end
local size = redis.call('XLEN', KEYS[1])
if KEYS[1] ~= KEYS[4] then
  size = size + redis.call('XLEN', KEYS[4])
  redis.call('HSETNX', KEYS[5], ARGV[6], '0:0')
end
if size >= tonumber(ARGV[1]) then return 0 end
redis.call('XADD', KEYS[1], '*', 'message_id', ARGV[2], 'attempt', ARGV[3])
local ticket = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[3], ticket, 'PX', ARGV[4])
return ticket
"""
# One claim: KEYS retry lane, claimer's lane, shared lane, lane owners hash, dequeue counter; ARGV group,
# consumer, count, route wait ms, owner live ms, capacity, lane key prefix. Returns {entries, wait ms}:
# entries {lane tag ('r' retry, '' shared, else the lane's owner), id, fields}; wait ms until another
# lane's oldest item is due for hand-over (-1: none waits).
_CLAIM = """
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local wait_ms, live_ms, prefix = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[7]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[4], consumer, ARGV[6] .. ':' .. now)
local out, next_due = {}, -1
local function read(key, n, tag)
  if n <= 0 then return 0 end
  redis.pcall('XGROUP', 'CREATE', key, group, '0', 'MKSTREAM')
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', key, '>')
  if not r then return 0 end
  for _, e in ipairs(r[1][2]) do out[#out + 1] = {tag, e[1], e[2]} end
  return #r[1][2]
end
local function last_delivered(key)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local name, last = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == group then return last end
  end
  return nil
end
local retried = read(KEYS[1], count, 'r')
read(KEYS[2], count - #out, consumer)
read(KEYS[3], count - #out, '')
local owners = redis.call('HGETALL', KEYS[4])
for i = 1, #owners, 2 do
  local owner, v = owners[i], owners[i + 1]
  if owner ~= consumer then
    local key = prefix .. owner
    local sep = string.find(v, ':', 1, true)
    local slots, seen = tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
    if now - seen > live_ms then slots = 0 end
    local last = last_delivered(key)
    local waiting = {}
    if last then waiting = redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', slots + count + 1) end
    if #waiting == 0 then
      if now - seen > live_ms and redis.call('XLEN', key) == 0 then
        redis.call('DEL', key)
        redis.call('HDEL', KEYS[4], owner)
      end
    else
      local due = 0
      for _, e in ipairs(waiting) do
        local ms = tonumber(string.sub(e[1], 1, string.find(e[1], '-', 1, true) - 1))
        if now - ms >= wait_ms then due = due + 1 else
          local left = ms + wait_ms - now
          if next_due < 0 or left < next_due then next_due = left end
          break
        end
      end
      local k = math.min(count - #out, math.max(#waiting - slots, due))
      if k > 0 then read(key, k, owner) end
    end
  end
end
if #out > retried then redis.call('INCRBY', KEYS[5], #out - retried) end
return {out, next_due}
"""
# The retry lane is uncapped and takes no place in the new-work count; its ticket (0) keeps
# ``holds`` true and puts the message at the head in ``position``.
_ENQUEUE_RETRY = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[4], '0', 'MKSTREAM')
end
redis.call('XADD', KEYS[1], '*', 'message_id', ARGV[1], 'attempt', ARGV[2])
redis.call('SET', KEYS[2], 0, 'PX', ARGV[3])
return 1
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
# Take over every item pending for consumers whose names start with one of ARGV[3..] (the workers and
# the reaper of server processes presumed dead), whatever their idle time; atomic, so that two
# survivors never both take one. Returns {key, id, fields, deliveries}.
_TAKE_OVER = """
local out = {}
for _, key in ipairs(KEYS) do
  local summary = redis.pcall('XPENDING', key, ARGV[1])
  if type(summary) == 'table' and not summary.err and summary[4] then
    for _, c in ipairs(summary[4]) do
      local name, n = c[1], tonumber(c[2])
      for i = 3, #ARGV do
        if string.sub(name, 1, #ARGV[i]) == ARGV[i] then
          for _, p in ipairs(redis.call('XPENDING', key, ARGV[1], '-', '+', n, name)) do
            local got = redis.call('XCLAIM', key, ARGV[1], ARGV[2], 0, p[1])
            if got[1] and got[1][2] then out[#out + 1] = {key, p[1], got[1][2], p[4] + 1} end
          end
          break
        end
      end
    end
  end
end
return out
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


def streams_entries(reply: Any) -> dict[str, list[Any]]:
    """Entries per stream key of a multi-stream XREAD/XREADGROUP reply (RESP2 or RESP3)."""
    if not reply:
        return {}
    pairs = reply.items() if isinstance(reply, dict) else [(k, v) for k, v in reply]
    return {text(key): stream_entries({key: value}) for key, value in pairs}


def _fields(raw: Any) -> dict[str, str]:
    pairs = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
    return {text(k): text(v) for k, v in pairs}


class RedisWorkQueue:
    """Work queue shared by all server processes.

    Works with clients created either way (``decode_responses`` True or False): replies are
    decoded here. The client belongs to the caller; ``close`` leaves it open.
    """

    ticket_ttl_s = 24 * 3600.0

    def __init__(
        self, redis: Redis, max_queue_size: int = 1000, route_wait_s: float = 0.5, owner_live_s: float = 30.0
    ) -> None:
        self.redis = redis
        self.max_queue_size = max_queue_size
        self.route_wait_s = route_wait_s
        self.owner_live_s = owner_live_s
        self._enqueue = redis.register_script(_ENQUEUE)
        self._claim = redis.register_script(_CLAIM)
        self._enqueue_retry = redis.register_script(_ENQUEUE_RETRY)
        self._reclaim = redis.register_script(_RECLAIM)
        self._touch = redis.register_script(_TOUCH)
        self._take_over = redis.register_script(_TAKE_OVER)
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

    async def enqueue(
        self, model: str, message_id: str, attempt: int, *, retry: bool = False, prefer: str = ""
    ) -> None:
        ticket = WORK_TICKET.format(message_id=message_id)
        ttl_ms = int(self.ticket_ttl_s * 1000)
        if retry:
            keys = [WORK_RETRY_STREAM.format(model=model), ticket]
            await self._enqueue_retry(keys=keys, args=[message_id, attempt, ttl_ms, WORK_GROUP])
            return
        main = WORK_STREAM.format(model=model)
        target = WORK_LANE_STREAM.format(model=model, worker=prefer) if prefer else main
        keys = [target, WORK_ENQ_COUNTER.format(model=model), ticket, main, WORK_LANES.format(model=model)]
        args: list[EncodableT] = [self.max_queue_size, message_id, attempt, ttl_ms, WORK_GROUP, prefer]
        if not await self._enqueue(keys=keys, args=args):
            raise QueueFull(model)

    async def _read(self, consumer: str, keys: list[str], count: int, block_ms: int | None) -> dict[str, list[Any]]:
        for key in keys:
            await self._ensure_group(key)
        try:
            reply = await self.redis.xreadgroup(WORK_GROUP, consumer, {k: ">" for k in keys}, count, block_ms)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._groups.difference_update(keys)  # a stream was deleted under us: recreate it
            return {}
        return streams_entries(reply)

    async def claim(self, model: str, consumer: str, count: int, timeout_s: float, capacity: int = 0) -> list[WorkItem]:
        if count <= 0:
            return []
        items, due_s = await self._claim_now(model, consumer, count, capacity)
        deadline = time.monotonic() + timeout_s
        own = WORK_LANE_STREAM.format(model=model, worker=consumer)
        lanes = {WORK_RETRY_STREAM.format(model=model): "r", own: consumer, WORK_STREAM.format(model=model): ""}
        while not items and (remaining := deadline - time.monotonic()) > 0.001:
            # Wait on the three lanes this worker reads first, one entry each (at most two more than
            # asked for when they fill at once, handed back below), or until another lane's item is due.
            block = min(remaining, self._block_s, due_s)
            got = await self._read(consumer, list(lanes), 1, max(int(block * 1000), 1))
            items = [self._item(model, lanes[key], eid, raw, 1) for key, entries in got.items() for eid, raw in entries]
            new = sum(not item.retry for item in items)
            if new:
                await self.redis.incrby(WORK_DEQ_COUNTER.format(model=model), new)
            more, due_s = await self._claim_now(model, consumer, count - len(items), capacity)
            items += more
        for extra in items[count:]:
            await self._hand_back(extra)
        return items[:count]

    async def _claim_now(self, model: str, consumer: str, count: int, capacity: int) -> tuple[list[WorkItem], float]:
        """What can be claimed at once, and seconds until another lane's item is due (inf: none)."""
        if count <= 0:
            return [], float("inf")
        keys = [
            WORK_RETRY_STREAM.format(model=model),
            WORK_LANE_STREAM.format(model=model, worker=consumer),
            WORK_STREAM.format(model=model),
            WORK_LANES.format(model=model),
            WORK_DEQ_COUNTER.format(model=model),
        ]
        args: list[EncodableT] = [
            WORK_GROUP,
            consumer,
            count,
            int(self.route_wait_s * 1000),
            int(self.owner_live_s * 1000),
            max(capacity, count),
            WORK_LANE_STREAM.format(model=model, worker=""),
        ]
        entries, due_ms = await self._claim(keys=keys, args=args)
        items = [self._item(model, text(tag), eid, raw, 1) for tag, eid, raw in entries]
        return items, (int(due_ms) / 1000 if int(due_ms) >= 0 else float("inf"))

    async def _hand_back(self, item: WorkItem) -> None:
        """Return an item claimed beyond ``count`` to the head of the queue (the retry lane)."""
        await self.enqueue(item.model, item.message_id, item.attempt, retry=True)
        await self.ack(item)

    @staticmethod
    def _key(item: WorkItem) -> str:
        if item.lane:
            return WORK_LANE_STREAM.format(model=item.model, worker=item.lane)
        return (WORK_RETRY_STREAM if item.retry else WORK_STREAM).format(model=item.model)

    @staticmethod
    def _item(model: str, tag: str, entry_id: bytes | str, raw: Any, deliveries: int) -> WorkItem:
        """``tag``: the lane it came from ("r" the retry lane, "" the shared lane, else its owner)."""
        fields = _fields(raw)
        retry, lane = tag == "r", "" if tag == "r" else tag
        return WorkItem(model, fields["message_id"], int(fields["attempt"]), text(entry_id), deliveries, retry, lane)

    async def ack(self, item: WorkItem) -> None:
        key = self._key(item)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(key, WORK_GROUP, item.delivery_id)
            pipe.xdel(key, item.delivery_id)
            await pipe.execute()

    async def touch(self, items: list[WorkItem], consumer: str) -> None:
        by_key: dict[str, list[str]] = {}
        for item in items:
            by_key.setdefault(self._key(item), []).append(item.delivery_id)
        for key, ids in by_key.items():
            try:
                await self._touch(keys=[key], args=[WORK_GROUP, consumer, *ids])
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise

    async def reclaim(self, model: str, consumer: str, min_idle_s: float, count: int) -> list[WorkItem]:
        if count <= 0:
            return []
        items: list[WorkItem] = []
        owners: dict[Any, Any] = await self.redis.hgetall(WORK_LANES.format(model=model))
        lanes = [("r", WORK_RETRY_STREAM.format(model=model)), ("", WORK_STREAM.format(model=model))]
        lanes += [(text(o), WORK_LANE_STREAM.format(model=model, worker=text(o))) for o in owners]
        for tag, key in lanes:
            args: list[EncodableT] = [WORK_GROUP, consumer, int(min_idle_s * 1000), count - len(items)]
            try:
                rows = await self._reclaim(keys=[key], args=args)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                continue
            items += [self._item(model, tag, entry_id, raw, int(n)) for entry_id, raw, n in rows]
            if len(items) >= count:
                break
        return items

    async def take_over(self, model: str, consumer: str, prefixes: list[str]) -> list[WorkItem]:
        if not prefixes:
            return []
        owners: dict[Any, Any] = await self.redis.hgetall(WORK_LANES.format(model=model))
        tags = {WORK_RETRY_STREAM.format(model=model): "r", WORK_STREAM.format(model=model): ""}
        tags |= {WORK_LANE_STREAM.format(model=model, worker=text(o)): text(o) for o in owners}
        rows = await self._take_over(keys=list(tags), args=[WORK_GROUP, consumer, *prefixes])
        return [self._item(model, tags[text(key)], eid, raw, int(n)) for key, eid, raw, n in rows]

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
                # fields a newer replica added are left out (rolling upgrades)
                entries.append(WorkerEntry(**{k: v for k, v in data.items() if k in _ENTRY_FIELDS}))
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
