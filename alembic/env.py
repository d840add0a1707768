"""Alembic environment: async engines, batch mode so that migrations also run on SQLite."""

from __future__ import annotations

import asyncio
import os

from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from server.db import POOLERS, postgres_connect_args
from server.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("database_url") or os.environ.get("TOKENTRAIL_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set TOKENTRAIL_DATABASE_URL or use `tokentrail db upgrade`")
    return str(url)


def _pooler() -> str:
    pooler = str(config.attributes.get("db_pooler") or os.environ.get("TOKENTRAIL_DB_POOLER") or "none")
    if pooler not in POOLERS:
        raise RuntimeError(f"TOKENTRAIL_DB_POOLER must be one of {', '.join(POOLERS)}, not {pooler!r}")
    return pooler


def _configure(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    url = _url()
    pooler = _pooler()
    args = postgres_connect_args("transaction") if pooler == "transaction" and url.startswith("postgres") else {}
    engine = create_async_engine(url, poolclass=pool.NullPool, connect_args=args)
    async with engine.connect() as conn:
        await conn.run_sync(_configure)
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(_run_online())
