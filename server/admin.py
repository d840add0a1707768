"""Administrative operations shared by the CLI, the launcher and tests: users and keys."""

from __future__ import annotations

import asyncio

from sqlalchemy.ext.asyncio import AsyncEngine

from server import migrate
from server.auth import hash_key, new_user_key, new_worker_key
from server.db import SessionFactory, create_engine, create_session_factory
from server.models import ApiKey, User, WorkerKey
from server.settings import ServerSettings


async def create_user(sessions: SessionFactory, name: str, *, admin: bool = False) -> str:
    """Create (or reuse) user ``name`` and return a new API key for it; the key is not stored."""
    key = new_user_key()
    async with sessions() as s:
        user = await s.get(User, name)
        if user is None:
            s.add(User(id=name, display_name=name, provider="apikey", is_admin=admin))
            await s.flush()  # the key's row references it
        elif admin and not user.is_admin:
            user.is_admin = True
        s.add(ApiKey(user_id=name, key_hash=hash_key(key)))
        await s.commit()
    return key


async def create_worker_key(sessions: SessionFactory, name: str) -> str:
    key = new_worker_key()
    async with sessions() as s:
        s.add(WorkerKey(name=name, key_hash=hash_key(key)))
        await s.commit()
    return key


async def open_database(settings: ServerSettings) -> tuple[AsyncEngine, SessionFactory]:
    """An engine on the settings' database, migrated first when the settings say so."""
    url = settings.effective_database_url
    if settings.should_migrate_on_start:
        await asyncio.to_thread(migrate.upgrade, url)
    engine = create_engine(url)
    return engine, create_session_factory(engine)


def issue_user_key(settings: ServerSettings, name: str, *, admin: bool = False) -> str:
    """Blocking: a new API key of user ``name`` (created if needed) in the settings' database."""

    async def go() -> str:
        engine, sessions = await open_database(settings)
        try:
            return await create_user(sessions, name, admin=admin)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def issue_worker_key(settings: ServerSettings, name: str) -> str:
    """Blocking: a new worker key in the settings' database (migrated first when the settings say so).
    For launchers, scripts and tests that run outside an event loop."""

    async def go() -> str:
        engine, sessions = await open_database(settings)
        try:
            return await create_worker_key(sessions, name)
        finally:
            await engine.dispose()

    return asyncio.run(go())
