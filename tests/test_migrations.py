"""Alembic migrations: upgrade and downgrade on SQLite and PostgreSQL, and no drift from the models."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import command
from server import migrate
from server.models import Base

TABLES = {
    "users",
    "api_keys",
    "worker_keys",
    "chats",
    "messages",
    "message_tokens",
    "idempotency_keys",
    "policy_versions",
    "alembic_version",
}


async def _inspect(url: str) -> tuple[set[str], list[Any], str | None]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:

            def run(sync_conn: Any) -> tuple[set[str], list[Any], str | None]:
                ctx = MigrationContext.configure(sync_conn)
                return (
                    set(inspect(sync_conn).get_table_names()),
                    compare_metadata(ctx, Base.metadata),
                    ctx.get_current_revision(),
                )

            return await conn.run_sync(run)
    finally:
        await engine.dispose()


def _check_round_trip(url: str) -> None:
    migrate.upgrade(url)
    tables, diff, rev = asyncio.run(_inspect(url))
    assert tables >= TABLES
    assert diff == [], f"models and migrations differ: {diff}"
    assert rev in migrate.current_heads()
    migrate.upgrade(url)  # idempotent at head
    command.downgrade(migrate.alembic_config(url), "base")
    tables, _, rev = asyncio.run(_inspect(url))
    assert rev is None and not (TABLES - {"alembic_version"}) & tables
    migrate.upgrade(url)


def test_upgrade_sqlite(tmp_path: Path) -> None:
    _check_round_trip(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_upgrade_postgres(postgres_url: str) -> None:
    _check_round_trip(postgres_url)


def test_cli_db_upgrade(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tokentrail.cli import app

    result = CliRunner().invoke(app, ["db", "upgrade", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tokentrail.db").exists()


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("TOKENTRAIL_DB_POOLER", "bogus", "DB_POOLER: Input should be 'none' or 'transaction' (got 'bogus')"),
        ("TOKENTRAIL_DB_POOL_SIZE", "0", "TOKENTRAIL_DB_POOL_SIZE: Input should be greater than or equal to 1"),
    ],
)
def test_a_bad_setting_is_named_with_its_variable_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    from typer.testing import CliRunner

    from tokentrail.cli import app

    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(app, ["db", "upgrade", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.replace("│", " ").split()), result.output  # (the box wraps lines)
    assert not (tmp_path / "tokentrail.db").exists()
