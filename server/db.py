"""Database engine and sessions (DESIGN D2): SQLite with WAL by default, PostgreSQL in production."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from sqlalchemy import event, text
from sqlalchemy.engine.url import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

SessionFactory = async_sessionmaker[AsyncSession]

Pooler = Literal["none", "transaction"]
"""What stands between tokentrail and PostgreSQL: ``none`` (the server itself, or a session-mode pooler),
or ``transaction``: a pooler that hands each transaction a server connection of its own (PgBouncer's
``pool_mode = transaction``, pgcat, Supavisor), on which a statement prepared in one transaction may be
gone, or belong to another client, in the next."""
POOLERS: tuple[Pooler, ...] = ("none", "transaction")
_POOLER_OPTION = "tokentrail_pooler"  # the engine's execution option that records it (``pooler_of``)

# Every SQLite connection's settings: a locked database is waited for (30 s) rather than failing at once,
# first, so that it covers the others (connections opened at the same moment, as an export's workers are,
# find the database locked while one of them opens its write-ahead log); WAL lets SSE readers run while
# a worker's record is written; NORMAL syncs at checkpoints, not at every commit; FKs are off by default.
SQLITE_PRAGMAS = ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON")


def ensure_sqlite_dir(url: str) -> None:
    """SQLite creates the file but not its folder: make the folder of a file database."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def create_engine(
    url: str, *, inline: bool = True, pool_size: int = 32, max_overflow: int = 8, pooler: Pooler = "none"
) -> AsyncEngine:
    """The engine of ``url``. SQLite runs its statements in the calling thread (``server/sqlite_inline.py``)
    unless ``inline`` is off: long reads (an export through the API) take aiosqlite's worker thread so
    that the event loop keeps serving meanwhile. PostgreSQL keeps ``pool_size`` connections open: a
    burst past it opens (and afterwards closes) up to ``max_overflow`` more, each a new backend, which
    under load cost more than the statements they ran. ``pooler``: see ``Pooler``."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        ensure_sqlite_dir(url)
        if inline:
            from server.sqlite_inline import inline_connector

            engine = create_async_engine(url, async_creator=inline_connector(parsed.database or ":memory:", 30))
        else:
            engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            for pragma in SQLITE_PRAGMAS:
                cur.execute(f"PRAGMA {pragma}")
            cur.close()

        return engine
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=True,
        connect_args=postgres_connect_args(pooler),
        execution_options={_POOLER_OPTION: pooler},
    )


def postgres_connect_args(pooler: Pooler) -> dict[str, Any]:
    """SQLAlchemy's asyncpg ``connect_args`` for ``pooler``. Behind a transaction pooler no statement is
    kept prepared between transactions (asyncpg's cache and SQLAlchemy's off), and each is prepared as
    PostgreSQL's unnamed statement, which the next one replaces. Named ones fail or leak there: asyncpg
    counts its names from 1 per client connection, so two clients sharing a server connection prepare
    the same name twice; unique names collide nowhere, but asyncpg closes a statement it no longer uses
    on whatever server connection its next transaction gets, so some stay prepared where they were made
    for as long as the pooler keeps that connection (``tests/test_pgbouncer.py`` counts them)."""
    if pooler == "none":
        return {}
    return {"statement_cache_size": 0, "prepared_statement_cache_size": 0, "prepared_statement_name_func": _unnamed}


def _unnamed() -> str:
    return ""  # asyncpg prepares a statement given the name "" as the unnamed statement


def pooler_of(engine: AsyncEngine) -> Pooler:
    """The ``pooler`` that ``engine`` was made for (``none`` for one not made by ``create_engine``)."""
    pooler = engine.get_execution_options().get(_POOLER_OPTION, "none")
    return "transaction" if pooler == "transaction" else "none"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_session_factory(engine: AsyncEngine) -> SessionFactory:
    return async_sessionmaker(engine, expire_on_commit=False)


async def ping(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
