"""Fair load: whether a user may ask for more generations now (checked before anything is stored).

Two checks, both answered with 429 and Retry-After:

- ``rate_limited``: a per-user rate of assistant messages (GCRA: ``rate_limit_per_minute`` with a
  burst of ``rate_limit_burst``). With Redis the state lives there, so every server process counts
  against one budget, timed by Redis' clock; embedded it lives in the process.
- ``queue_share_exceeded``: a user's open (pending or in-progress) messages for one model may take
  at most ``user_queue_share`` of the model's queue, so one user cannot fill it for everyone. Counted
  in SQL, the source of truth, over the partial index of open messages.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError
from sqlalchemy import bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.constants import RATE_LIMIT
from server.errors import ApiError
from server.hot_sql import HotSql
from server.models import CHATS, MESSAGE_IS_OPEN, MESSAGES
from server.settings import ServerSettings
from shared.errors import ErrorCode

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from redis.asyncio import Redis

# KEYS[1]: the user's theoretical arrival time (ms). ARGV: interval ms, tolerance ms, cost.
# Returns 0 when admitted, else the milliseconds to wait.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval, tolerance, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new = tat + interval * cost
local wait = new - tolerance - interval - now
if wait > 0 then return wait end
redis.call('SET', KEYS[1], new, 'PX', math.max(1, math.ceil(new - now)))
return 0
"""


class RateLimiter:
    """GCRA per user: ``per_minute`` assistant messages a minute, ``burst`` at once."""

    def __init__(self, per_minute: int, burst: int, redis: Redis | None = None) -> None:
        self.interval_ms = 60_000 / per_minute if per_minute > 0 else 0.0
        self.burst = max(burst, 1)
        self.tolerance_ms = self.interval_ms * (self.burst - 1)
        self.redis = redis
        self._tat: dict[str, float] = {}  # embedded: user -> theoretical arrival time (ms)
        self._script = redis.register_script(_GCRA) if redis is not None else None

    @property
    def enabled(self) -> bool:
        return self.interval_ms > 0

    async def wait_ms(self, user_id: str, cost: int = 1) -> float:
        """0 if ``cost`` messages are admitted (and counted), else how long to wait."""
        if not self.enabled:
            return 0.0
        cost = min(cost, self.burst)  # a request larger than the burst takes all of it, not forever
        if self._script is not None:
            try:
                wait = await self._script(
                    keys=[RATE_LIMIT.format(user_id=user_id)], args=[self.interval_ms, self.tolerance_ms, cost]
                )
            except RedisError as exc:  # Redis away: admit (fail open) rather than refuse everyone
                log.warning("rate limit not checked: %r", exc)
                return 0.0
            return float(wait)
        now = time.monotonic() * 1000
        tat = max(self._tat.get(user_id, now), now)
        new = tat + self.interval_ms * cost
        wait = new - self.tolerance_ms - self.interval_ms - now
        if wait > 0:
            return wait
        self._tat[user_id] = new
        if len(self._tat) > 100_000:  # forget users whose budget is whole again
            self._tat = {u: t for u, t in self._tat.items() if t > now}
        return 0.0


_M, _C = MESSAGES.c, CHATS.c
# Built once: a Core statement with bound parameters is compiled and cached once (every request asks).
_OPEN_MESSAGES = (
    select(func.count())
    .select_from(MESSAGES.join(CHATS, _C.id == _M.chat_id))
    .where(
        MESSAGE_IS_OPEN,
        _M.model_config_name == bindparam("model"),
        # "|| ''" keeps the planner off the user's chats (all their messages would be scanned): it
        # starts from the few open messages instead
        (_C.user_id + "") == bindparam("user_id"),
    )
)


async def open_messages(sql: HotSql, session: AsyncSession, user_id: str, model: str) -> int:
    rows = await sql.rows(session, _OPEN_MESSAGES, {"model": model, "user_id": user_id})
    return int(rows[0][0] or 0) if rows else 0


async def admit(
    settings: ServerSettings,
    limiter: RateLimiter,
    sql: HotSql,
    session: AsyncSession,
    user_id: str,
    model: str,
    count: int = 1,
) -> None:
    """Raise 429 unless ``user_id`` may queue ``count`` more generations of ``model`` now. Uses the
    request's own session (a second connection per request could exhaust the pool under load), or
    SQLite's raw connection."""
    share = max(1, math.floor(settings.user_queue_share * settings.max_queue_size))
    if count > share:
        raise ApiError(ErrorCode.queue_share_exceeded, f"one request may ask for at most {share} generations")
    open_now = await open_messages(sql, session, user_id, model)
    if open_now + count > share:
        raise ApiError(
            ErrorCode.queue_share_exceeded,
            f"you have {open_now} generations of {model!r} queued or running; at most {share} at once",
            headers={"Retry-After": "2"},
        )
    wait = await limiter.wait_ms(user_id, count)
    if wait > 0:
        raise ApiError(
            ErrorCode.rate_limited,
            f"too many generations requested; try again in {wait / 1000:.1f}s",
            headers={"Retry-After": str(max(1, math.ceil(wait / 1000)))},
        )
