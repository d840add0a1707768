"""Redis token streams (DESIGN D4): one stream per message, readable by every server process.

Entry IDs are explicit: a batch covering ``[start, end)`` has ID ``0-<end>``, the terminal entry
``1-0`` sorts after every batch. Batch fields: ``start`` (decimal), ``ids`` (JSON list of ints),
``logprobs`` (JSON list; non-finite values as the strings ``"-inf"``/``"inf"``/``"nan"`` because
JSON has no infinities), ``texts`` (JSON list of strings), and when present ``ch`` (channels),
``top`` (JSON top logprobs), ``prompt`` (JSON prompt ids) and ``v`` (the weights version, when not
0). Terminal fields: ``status`` and, when
set, ``error`` and ``code``. Appends go through a Lua script, so the length check and the XADD
are atomic across server processes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from server.constants import TOKEN_RESTART, TOKEN_STREAM
from server.queue.redis import max_block_s, stream_entries, text
from server.streams.protocol import StreamConflict, StreamDone, StreamEntry, TokenBatch
from server.streams.redis_mux import StreamMux

_RESTART_TTL_MS = 24 * 3600 * 1000  # a restart mark outlives any reader that may resume

# ARGV: start, end, ttl ms, field/value pairs. Returns {1, end} or {0, length} (-1: finished).
_APPEND = """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local length = 0
if #top > 0 then
  local ms, seq = string.match(top[1][1], '^(%d+)-(%d+)$')
  if ms ~= '0' then return {0, -1} end
  length = tonumber(seq)
end
if length ~= tonumber(ARGV[1]) then return {0, length} end
if ARGV[2] == ARGV[1] then return {1, length} end
redis.call('XADD', KEYS[1], '0-' .. ARGV[2], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, tonumber(ARGV[2])}
"""
# ARGV: ttl ms, field/value pairs. A second finish changes nothing.
_FINISH = """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 and top[1][1] == '1-0' then return 0 end
redis.call('XADD', KEYS[1], '1-0', unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
_DONE_ID = "1-0"


def _encode_logprob(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else repr(value)


def _decode_logprob(value: float | str | None) -> float | None:
    return float(value) if isinstance(value, str | int) else value


def _encode_batch(batch: TokenBatch) -> list[EncodableT]:
    fields: list[EncodableT] = [
        "start",
        str(batch.start),
        "ids",
        orjson.dumps(batch.token_ids),
        "logprobs",
        orjson.dumps([_encode_logprob(lp) for lp in batch.logprobs]),
        "texts",
        orjson.dumps(batch.texts),
    ]
    if batch.channels:
        fields += ["ch", batch.channels]
    if batch.top_logprobs is not None:
        top = [[[i, _encode_logprob(lp), t] for i, lp, t in row] for row in batch.top_logprobs]
        fields += ["top", orjson.dumps(top)]
    if batch.prompt_ids is not None:
        fields += ["prompt", orjson.dumps(batch.prompt_ids)]
    if batch.policy_version:
        fields += ["v", str(batch.policy_version)]
    return fields


def _decode_entry(entry_id: bytes | str, raw: Any) -> StreamEntry:
    fields = {text(k): v for k, v in raw.items()}
    if text(entry_id) == _DONE_ID:
        error, code = fields.get("error"), fields.get("code")
        return StreamDone(
            status="error" if text(fields["status"]) == "error" else "complete",
            error=text(error) if error is not None else None,
            code=text(code) if code is not None else None,
        )
    return TokenBatch(
        start=int(fields["start"]),
        token_ids=orjson.loads(fields["ids"]),
        logprobs=[_decode_logprob(lp) for lp in orjson.loads(fields["logprobs"])],
        texts=orjson.loads(fields["texts"]),
        channels=text(fields["ch"]) if "ch" in fields else "",
        top_logprobs=(
            [[(i, _decode_logprob(lp) or 0.0, t) for i, lp, t in row] for row in orjson.loads(fields["top"])]
            if "top" in fields
            else None
        ),
        prompt_ids=orjson.loads(fields["prompt"]) if "prompt" in fields else None,
        policy_version=int(fields["v"]) if "v" in fields else 0,
    )


class RedisTokenStreams:
    """Token streams shared by all server processes.

    Works with clients created either way (``decode_responses`` True or False). The client
    belongs to the caller; ``close`` leaves it open.

    Readers waiting in ``read`` share one blocking XREAD per process (``redis_mux.StreamMux``): one
    pooled connection however many SSE readers wait, and one round trip per batch for all of them.
    A reader resuming before what the shared reader holds reads directly (one connection while it
    waits); size ``max_connections`` for those plus blocked claimers and ~20 for everything else.

    ``idle_expire_s`` is a safety net: a stream that never finishes (its server died and
    recovery never ran) still expires that long after its last append.
    """

    def __init__(self, redis: Redis, expire_after_s: float = 300, *, idle_expire_s: float = 86400) -> None:
        self.redis = redis
        self.expire_after_s = expire_after_s
        self.idle_expire_s = idle_expire_s
        self._append = redis.register_script(_APPEND)
        self._finish = redis.register_script(_FINISH)
        self._block_s = max_block_s(redis)
        self._mux = StreamMux(redis, self._block_s)  # one XREAD for all of this process's readers

    def _append_args(self, batch: TokenBatch) -> list[EncodableT]:
        return [batch.start, batch.end, int(self.idle_expire_s * 1000), *_encode_batch(batch)]

    @staticmethod
    def _conflict(message_id: str, batch: TokenBatch, reply: Any) -> StreamConflict | None:
        ok, length = reply
        if ok:
            return None
        if length < 0:
            return StreamConflict(f"stream {message_id} has finished")
        return StreamConflict(f"batch starts at {batch.start}, stream {message_id} has {length}")

    async def append(self, message_id: str, batch: TokenBatch) -> None:
        key = TOKEN_STREAM.format(message_id=message_id)
        conflict = self._conflict(message_id, batch, await self._append(keys=[key], args=self._append_args(batch)))
        if conflict is not None:
            raise conflict

    async def append_many(self, items: list[tuple[str, TokenBatch]]) -> list[StreamConflict | None]:
        if len(items) == 1:
            try:
                await self.append(*items[0])
                return [None]
            except StreamConflict as exc:
                return [exc]
        # EVALSHA by hand: a Script in a pipeline costs a SCRIPT EXISTS round trip per pipeline.
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for message_id, batch in items:
                    key = TOKEN_STREAM.format(message_id=message_id)
                    pipe.evalsha(self._append.sha, 1, key, *self._append_args(batch))
                replies = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self.redis.script_load(_APPEND)  # Redis restarted or flushed its scripts: none ran
                continue
            break
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [self._conflict(m, b, r) for (m, b), r in zip(items, replies, strict=True)]

    async def finish(self, message_id: str, done: StreamDone) -> None:
        fields: list[str] = ["status", done.status]
        if done.error is not None:
            fields += ["error", done.error]
        if done.code is not None:
            fields += ["code", done.code]
        args: list[EncodableT] = [int(self.expire_after_s * 1000), *fields]
        await self._finish(keys=[TOKEN_STREAM.format(message_id=message_id)], args=args)

    async def length(self, message_id: str) -> int:
        # The newest entry below the terminal one holds the length in its ID.
        top: Any = await self.redis.xrevrange(TOKEN_STREAM.format(message_id=message_id), "(" + _DONE_ID, "-", 1)
        return int(text(top[0][0]).split("-")[1]) if top else 0

    async def read(self, message_id: str, after: int, timeout_s: float) -> list[StreamEntry]:
        key = TOKEN_STREAM.format(message_id=message_id)
        # A batch with ID 0-E holds indices < E: it has something new iff E > after + 1.
        last_id = f"0-{max(after, -1) + 1}"
        if timeout_s <= 0.001:
            raw: list[Any] = await self.redis.xrange(key, "(" + last_id, "+") or []
            return [_decode_entry(entry_id, fields) for entry_id, fields in raw]
        shared = await self._mux.read(key, after, timeout_s)
        if shared is not None:
            return [_decode_entry(entry_id, fields) for entry_id, fields in shared]
        # A position before what the shared reader holds (a reader resuming far back): XREAD from an
        # explicit ID answers at once when entries after it exist, and blocks otherwise.
        raw = []
        deadline = time.monotonic() + timeout_s
        while not raw:
            remaining = deadline - time.monotonic()
            if remaining <= 0.001:  # BLOCK 0 would wait forever
                return []
            block_ms = max(int(min(remaining, self._block_s) * 1000), 1)
            raw = stream_entries(await self.redis.xread({key: last_id}, block=block_ms))
        return [_decode_entry(entry_id, fields) for entry_id, fields in raw]

    async def exists(self, message_id: str) -> bool:
        return bool(await self.redis.exists(TOKEN_STREAM.format(message_id=message_id)))

    async def restart(self, message_id: str, from_index: int, attempt: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(TOKEN_STREAM.format(message_id=message_id))  # what is left of the lost stream
            pipe.set(TOKEN_RESTART.format(message_id=message_id), f"{from_index}:{attempt}", px=_RESTART_TTL_MS)
            await pipe.execute()

    async def restarted_at(self, message_id: str) -> tuple[int, int] | None:
        value = await self.redis.get(TOKEN_RESTART.format(message_id=message_id))
        if value is None:
            return None
        start, _, attempt = text(value).partition(":")
        return int(start), int(attempt)

    async def close(self) -> None:
        await self._mux.close()
