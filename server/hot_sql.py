"""Where the per-turn statements run: on SQLite, on the raw connection (``server/raw_sqlite.py``); on
PostgreSQL, through SQLAlchemy on the caller's session or a connection of the engine. The statements are
the same Core constants either way, so both databases store and read exactly the same rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.sql.base import Executable

from server.raw_sqlite import RawSqlite, Step

__all__ = ["HotSql", "Step"]


class HotSql:
    def __init__(self, engine: AsyncEngine, raw: RawSqlite | None = None) -> None:
        self.engine = engine
        self.raw = raw
        self.dialect = engine.dialect.name

    @classmethod
    def for_engine(cls, engine: AsyncEngine, *, raw: bool = True) -> HotSql:
        """With ``raw``, a SQLite file database gets a raw connection of its own (an in-memory one cannot:
        a second connection would see another database)."""
        url = engine.url
        path = url.database
        if raw and url.get_backend_name() == "sqlite" and path and path != ":memory:" and "mode=memory" not in path:
            return cls(engine, RawSqlite(path, engine.dialect))
        return cls(engine)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()

    async def rows(self, session: AsyncSession | None, stmt: Executable, params: dict[str, Any]) -> list[Any]:
        """A SELECT's rows; on PostgreSQL in ``session``'s transaction (or a connection of its own)."""
        if self.raw is not None:
            return self.raw.rows(stmt, params)
        if session is not None:
            conn = await session.connection()
            return list((await conn.execute(stmt, params)).all())
        async with self.engine.connect() as own:
            return list((await own.execute(stmt, params)).all())

    async def transact(self, session: AsyncSession | None, steps: Sequence[Step]) -> list[int] | None:
        """Run ``steps`` in one transaction and commit it (``session``'s, when given): each step's row
        count, or None (rolled back) when a ``required`` step changed no row."""
        if self.raw is not None:
            return self.raw.transact(steps)
        if session is not None:
            counts = await _run(await session.connection(), steps)
            await (session.commit() if counts is not None else session.rollback())
            return counts
        async with self.engine.connect() as conn:
            counts = await _run(conn, steps)
            await (conn.commit() if counts is not None else conn.rollback())
            return counts


async def _run(conn: AsyncConnection, steps: Sequence[Step]) -> list[int] | None:
    counts = []
    for step in steps:
        params = step.params if isinstance(step.params, dict) else list(step.params)
        res = await conn.execute(step.stmt, params)
        counts.append(res.rowcount)
        if step.required and res.rowcount <= 0:
            return None
    return counts
