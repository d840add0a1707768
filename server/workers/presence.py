"""Which server processes are alive, so that a dead one's work moves at once (DESIGN D3, D10).

Every process keeps a presence key with a short TTL (``replica_timeout_s``) and refreshes it four times
per TTL. A process that stops refreshing (SIGKILL, its host gone) is presumed dead once its key has
expired: a survivor then fences and requeues the messages its workers were generating
(``Recovery.fail_over``), instead of waiting for those workers to come back or for the sweep. Worker ids
name the process that minted them (``w-<server id>-...``), so the database says whose work a message is.

A Redis restart loses every presence key at once; an epoch key (no TTL) tells survivors that Redis is
new, and no process is presumed dead until every live one has had time to refresh. The beat that sets
the epoch tells its process that the queue lost what it held, so that the pending messages are queued
again at once rather than at the sweep. Presuming a live but
stalled process dead costs a restarted attempt, never a reply: the old attempt is fenced off and the
next one resumes after the tokens already streamed.

Without Redis (embedded) there is one process: every other server id is a previous run of it.
"""

from __future__ import annotations

from typing import Protocol

from redis.asyncio import Redis

from server.constants import SERVER_EPOCH, SERVER_PRESENCE

# KEYS[1] epoch key; ARGV[1] grace ms, ARGV[2..] presence keys. Returns the keys that are absent,
# none while the epoch is missing or younger than the grace (Redis came back empty a moment ago).
_ABSENT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = redis.call('GET', KEYS[1])
if not epoch then return {} end
if now - tonumber(epoch) < tonumber(ARGV[1]) then return {} end
local out = {}
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[i]) == 0 then out[#out + 1] = ARGV[i] end
end
return out
"""
# Refresh KEYS[1] for ARGV[1] ms; 1 when this beat found no epoch KEYS[2] (Redis is new) and set it.
_BEAT = """
local t = redis.call('TIME')
local new = redis.call('SET', KEYS[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 'NX')
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
if new then return 1 end
return 0
"""


class Presence(Protocol):
    async def beat(self) -> bool:
        """Refresh this process's presence; True when it found Redis new (started, or restarted empty):
        the work queue then lost what it held."""
        ...

    async def dead(self, server_ids: set[str]) -> set[str]:
        """Those of ``server_ids`` presumed dead (none while that cannot be told)."""
        ...

    async def leave(self) -> None:
        """This process is stopping: presume it dead from now on."""
        ...


class MemoryPresence:
    """One process: every other server id is an earlier run of it."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id

    async def beat(self) -> bool:
        return False

    async def dead(self, server_ids: set[str]) -> set[str]:
        return server_ids - {self.server_id}

    async def leave(self) -> None:
        return None


class RedisPresence:
    def __init__(self, redis: Redis, server_id: str, timeout_s: float) -> None:
        self.redis = redis
        self.server_id = server_id
        self.timeout_ms = max(int(timeout_s * 1000), 100)
        self._beat = redis.register_script(_BEAT)
        self._absent = redis.register_script(_ABSENT)

    async def beat(self) -> bool:
        key = SERVER_PRESENCE.format(server_id=self.server_id)
        return bool(await self._beat(keys=[key, SERVER_EPOCH], args=[self.timeout_ms]))

    async def dead(self, server_ids: set[str]) -> set[str]:
        others = sorted(server_ids - {self.server_id})
        if not others:
            return set()
        keys = {SERVER_PRESENCE.format(server_id=s): s for s in others}
        absent = await self._absent(keys=[SERVER_EPOCH], args=[2 * self.timeout_ms, *keys])
        return {keys[k.decode() if isinstance(k, bytes) else str(k)] for k in absent}

    async def leave(self) -> None:
        await self.redis.delete(SERVER_PRESENCE.format(server_id=self.server_id))
