"""What "the database (or Redis) is unavailable" means (DESIGN D18), and waiting it out.

One classification for every route and loop: ``is_unavailable(exc)`` is true for a fault of a backing
service that retrying later cures, never for a bug. Routes answer it with 503 ``not_ready`` and
``Retry-After`` (``server/errors.py``); open streams keep following Redis (``server/chats/follow.py``);
the worker hub holds its work and retries (``server/workers/hub.py``), and never takes it for the
worker's socket going away (that is ``WorkerGone``, raised only by the socket).

The database is unavailable when:
- it cannot be reached: connection refused or reset, DNS, connect timeout (any ``OSError`` but a
  missing or forbidden file), or SQLAlchemy's pool timing out (pool exhausted);
- a connection broke under a statement (``DBAPIError.connection_invalidated``);
- PostgreSQL says so (SQLSTATE): class 08 (connection exception), 57P01 admin shutdown, 57P02 crash
  shutdown, 57P03 cannot connect now ("the database system is starting up" / "not yet accepting
  connections": crash recovery), 53300 too many connections, 25006 read-only transaction (a standby
  during failover). asyncpg raises the connect-time ones bare, SQLAlchemy wraps the others: the
  whole cause chain is searched. A pooler in front says so in class 08 too (PgBouncer's
  ``query_wait_timeout`` and ``server_login_retry`` are 08P01, and it closes the client's connection);
- SQLite is locked or busy, and any other ``OperationalError`` (the driver's "operational" class).
Redis is unavailable on its connection and timeout errors (loading, restarting, failing over).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_AFTER_S = 2  # what a client is told to wait when a backing service is unavailable
RETRY_CAP_S = 1.0  # loops that wait for the database retry at least this often: back within a second

_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "25006"})


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception, the driver error SQLAlchemy wrapped (``orig``) and their causes, each once."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "orig", None), e.__cause__]  # not __context__: a bug raised while handling one is a bug
    return seen


def _sqlstate(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    return state if isinstance(state, str) else None


def is_database_unavailable(exc: BaseException) -> bool:
    """The database cannot serve now (see the module docstring), as opposed to a bug or a bad query."""
    from sqlalchemy.exc import DBAPIError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    for e in _chain(exc):
        # sqlite3's own error: a statement on SQLite's raw connection (server/raw_sqlite.py), e.g. locked
        if isinstance(e, PoolTimeout | OperationalError | sqlite3.OperationalError):
            return True
        if isinstance(e, DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError | PermissionError):
            return True
        state = _sqlstate(e)
        if state is not None and (state.startswith("08") or state in _UNAVAILABLE_SQLSTATES):
            return True
    return False


def is_redis_unavailable(exc: BaseException) -> bool:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ReadOnlyError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    return any(isinstance(e, RedisConnectionError | RedisTimeoutError | ReadOnlyError) for e in _chain(exc))


def is_unavailable(exc: BaseException) -> bool:
    """The database or Redis is away, restarting or saturated: retry later; not a bug."""
    return is_database_unavailable(exc) or is_redis_unavailable(exc)


async def until_available(step: Callable[[], Awaitable[T]], what: str, *, within_s: float | None = None) -> T:
    """``step()``, run again while it fails because a backing service is unavailable (at least every
    ``RETRY_CAP_S``, so work resumes within a second of the service's return). Any other error, or
    the last one after ``within_s``, is raised."""
    deadline = None if within_s is None else time.monotonic() + within_s
    delay = 0.05
    failures = 0
    while True:
        try:
            return await step()
        except Exception as exc:
            if not is_unavailable(exc) or (deadline is not None and time.monotonic() >= deadline):
                raise
            failures += 1
            if failures == 1:
                log.warning("%s: %r; retrying until the service is back", what, exc)
        await asyncio.sleep(delay)
        delay = min(delay * 2, RETRY_CAP_S)
