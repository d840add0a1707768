"""Apply Alembic migrations to a database URL (``tokentrail db upgrade`` and embedded start-up)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

from alembic import command
from server.db import Pooler, ensure_sqlite_dir

ROOT = Path(__file__).resolve().parent.parent


def alembic_config(database_url: str, pooler: Pooler = "none") -> Config:
    ini = ROOT / "alembic.ini"
    if not ini.exists():
        raise RuntimeError(
            f"alembic.ini not found at {ini}: install tokentrail from its source tree (pip install -e .)"
        )
    cfg = Config(str(ini))
    cfg.set_main_option("script_location", str(ROOT / "alembic"))
    cfg.attributes["database_url"] = database_url
    cfg.attributes["db_pooler"] = pooler
    return cfg


def upgrade(database_url: str, revision: str = "head", pooler: Pooler = "none") -> None:
    """Blocking: run it in a thread from async code (env.py runs its own event loop)."""
    ensure_sqlite_dir(database_url)
    command.upgrade(alembic_config(database_url, pooler), revision)


def current_heads() -> set[str]:
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())
