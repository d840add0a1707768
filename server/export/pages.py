"""Reading an export page by page on a connection of the database driver itself (``sqlite3`` or asyncpg),
past SQLAlchemy's execution and result layers: a page is the filters' chats with ids in a range, their
messages, and the token records of their complete assistant messages (``query.page_statements``).

The statements are compiled once by SQLAlchemy for the engine's dialect (the SQL and its parameter
order: what is read is the same as through SQLAlchemy; no column read here needs its result
processing, see ``Decoders``). A ``PageQueries`` is plain data: export worker processes
(``server/export/parallel.py``) open their own connections with it."""

from __future__ import annotations

import itertools
import operator
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from server.db import SQLITE_PRAGMAS, pooler_of
from server.export.query import (
    M_CHAT,
    M_ID,
    M_ROLE,
    M_STATE,
    T_ID,
    Decoders,
    ExportFilters,
    PolicyPaths,
    decoders,
    page_statements,
)
from shared.api import MessageState

# cancelled messages keep the tokens generated until the abort (finish_reason "abort")
_DONE = (MessageState.complete.value, MessageState.cancelled.value)


@dataclass(frozen=True)
class _Statement:
    sql: str
    names: tuple[str, ...]  # the parameters in the SQL's positional order
    constants: dict[str, Any]  # the values SQLAlchemy binds itself (literals of the statement)

    def args(self, **params: Any) -> list[Any]:
        values = self.constants | params
        return [values[name] for name in self.names]


@dataclass(frozen=True)
class PageQueries:
    """An export's page statements for one database, and how to connect to it."""

    postgres: bool
    statements: dict[str, _Statement]
    connect_args: tuple[list[Any], dict[str, Any]]  # the driver's connect(*args, **kwargs)
    decoders: Decoders
    pooled: bool = False  # PostgreSQL behind a transaction pooler: no statement stays prepared (server.db.Pooler)


def page_queries(engine: AsyncEngine, filters: ExportFilters) -> PageQueries:
    dialect = engine.dialect
    postgres = dialect.name == "postgresql"
    statements = {}
    for name, stmt in page_statements(filters, postgres).items():
        compiled = stmt.compile(dialect=dialect)
        constants = {k: v for k, v in compiled.construct_params(_check=False).items() if v is not None}
        statements[name] = _Statement(compiled.string, tuple(compiled.positiontup or ()), constants)
    args, kwargs = dialect.create_connect_args(engine.url)
    for key in ("async_creator_fn", "prepared_statement_cache_size", "prepared_statement_name_func"):
        kwargs.pop(key, None)  # SQLAlchemy's own options of its asyncpg adapter
    pooled = postgres and pooler_of(engine) == "transaction"
    if pooled:
        kwargs["statement_cache_size"] = 0  # asyncpg's: each statement parsed where it runs
    return PageQueries(postgres, statements, (list(args), dict(kwargs)), decoders(dialect), pooled)


class Connection(Protocol):
    async def rows(self, stmt: _Statement, **params: Any) -> list[Any]: ...

    async def close(self) -> None: ...


class _Sqlite:
    """Runs each statement to its end in the calling thread (a page takes milliseconds): through the
    compiled reader where it was built and finds SQLite's library (``fastpage.SqliteReader``: the same
    rows, less CPU), else through ``sqlite3``."""

    def __init__(self, queries: PageQueries) -> None:
        from server.export.fastpage import SqliteReader

        args, kwargs = queries.connect_args
        # the server's settings (busy_timeout: wait for a writer)
        self._fast = SqliteReader.open(*args, pragmas=SQLITE_PRAGMAS, **kwargs)
        self._conn = None
        if self._fast is None:
            self._conn = sqlite3.connect(*args, **kwargs)
            for pragma in SQLITE_PRAGMAS:
                self._conn.execute(f"PRAGMA {pragma}")

    async def rows(self, stmt: _Statement, **params: Any) -> list[Any]:
        if isinstance(params.get("ids"), list):
            params["ids"] = orjson.dumps(params["ids"]).decode()  # json_each reads the list
        if self._fast is not None:
            return self._fast.rows(stmt.sql, stmt.args(**params))
        assert self._conn is not None
        rows: list[Any] = self._conn.execute(stmt.sql, stmt.args(**params)).fetchall()
        return rows

    async def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
        if self._conn is not None:
            self._conn.close()


class _Postgres:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def rows(self, stmt: _Statement, **params: Any) -> list[Any]:
        return await self._conn.fetch(stmt.sql, *stmt.args(**params))  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._conn.close()


class _PostgresWire:
    """Reads through the compiled reader on the connection's socket (``pg_wire``): each statement to
    its end in the calling thread."""

    def __init__(self, wire: Any) -> None:
        self._wire = wire

    async def rows(self, stmt: _Statement, **params: Any) -> list[Any]:
        return self._wire.rows(stmt.sql, stmt.args(**params))  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._wire.close()


async def connect(queries: PageQueries, *, blocking: bool = False) -> Connection:
    """A connection for the page statements. ``blocking``: the caller's thread may wait on each read
    (an export's own process, not a server's event loop): PostgreSQL's rows are then read by the
    compiled reader where it takes the connection and every statement (``pg_wire``), else by asyncpg.
    Behind a transaction pooler always by asyncpg: the compiled reader keeps its statements prepared by
    name, and the pooler may hand the next statement another server connection."""
    if not queries.postgres:
        return _Sqlite(queries)
    import asyncpg  # type: ignore[import-untyped]

    from server.export.pg_wire import PgWire

    args, kwargs = queries.connect_args
    conn = await asyncpg.connect(*args, **kwargs)
    wire = PgWire.take(conn) if blocking and not queries.pooled else None
    if wire is None:
        return _Postgres(conn)
    try:
        if wire.prepare([stmt.sql for stmt in queries.statements.values()]):
            return _PostgresWire(wire)
    except BaseException:
        await wire.close()
        raise
    return _Postgres(wire.release())


async def page_bounds(conn: Connection, queries: PageQueries, size: int) -> list[tuple[str, str]]:
    """The export's pages of ``size`` chats (the last one maybe fewer) as bounds (after, last]."""
    return [bounds async for bounds in iter_page_bounds(conn, queries, size)]


async def iter_page_bounds(conn: Connection, queries: PageQueries, size: int) -> AsyncIterator[tuple[str, str]]:
    """``page_bounds``, each as soon as it is read."""
    st = queries.statements
    after = ""
    while rows := await conn.rows(st["bound"], after=after, skip=size - 1):
        yield after, rows[0][0]
        after = rows[0][0]
    last = (await conn.rows(st["last"], after=after))[0][0]
    if last is not None:
        yield after, last


async def read_paths(conn: Connection, queries: PageQueries) -> PolicyPaths:
    """The registry of weights versions (``query.read_policy_paths``) on a page connection."""
    return PolicyPaths.from_rows(await conn.rows(queries.statements["policy"]))


# Chats per read. Few on SQLite: their rows become rollouts while still in the CPU's caches; more on
# PostgreSQL, where each statement costs a round trip and its planning on the server.
READ_BATCH = 50
READ_BATCH_POSTGRES = 250


async def page_chats(
    conn: Connection, queries: PageQueries, after: str, last: str
) -> AsyncIterator[tuple[str, str, list[Any], dict[str, Any]]]:
    """The chats with ids in (``after``, ``last``] that the filters select, in id order, each with its
    message rows (``M_*`` layout, in id order) and the token rows of its complete assistant messages
    (``T_*`` layout, by message id)."""
    st = queries.statements
    chats = await conn.rows(st["chats"], after=after, last=last)
    size = READ_BATCH_POSTGRES if queries.postgres else READ_BATCH
    for i in range(0, len(chats), size):
        batch = chats[i : i + size]
        start = chats[i - 1][0] if i else after
        msgs = await conn.rows(st["messages"], after=start, last=batch[-1][0], ids=[c[0] for c in batch])
        replies = [m[M_ID] for m in msgs if m[M_ROLE] == "assistant" and m[M_STATE] in _DONE]
        tokens = {t[T_ID]: t for t in await conn.rows(st["tokens"], ids=replies)} if replies else {}
        by_chat = {cid: list(group) for cid, group in itertools.groupby(msgs, key=operator.itemgetter(M_CHAT))}
        for chat_id, user_id in batch:
            yield chat_id, user_id, by_chat.get(chat_id, []), tokens
