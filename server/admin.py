"""Administrative operations shared by the CLI, the launcher and tests: users and keys."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from server import migrate
from server.auth import hash_key, new_user_key, new_worker_key
from server.db import SessionFactory, create_engine, create_session_factory
from server.models import ApiKey, User, WorkerKey, utcnow
from server.settings import ServerSettings
from shared.api import ApiKeyRead, UserRead, WorkerKeyRead


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


async def list_users(sessions: SessionFactory) -> list[UserRead]:
    async with sessions() as s:
        users = (await s.scalars(select(User).order_by(User.created_at, User.id))).all()
        keys = (await s.scalars(select(ApiKey).order_by(ApiKey.created_at))).all()
    by_user: dict[str, list[ApiKeyRead]] = {}
    for k in keys:
        by_user.setdefault(k.user_id, []).append(_api_key_read(k))
    return [
        UserRead(
            id=u.id,
            display_name=u.display_name,
            provider=u.provider,
            is_admin=u.is_admin,
            created_at=u.created_at,
            api_keys=by_user.get(u.id, []),
        )
        for u in users
    ]


async def list_worker_keys(sessions: SessionFactory) -> list[WorkerKeyRead]:
    async with sessions() as s:
        keys = (await s.scalars(select(WorkerKey).order_by(WorkerKey.created_at))).all()
    return [_worker_key_read(k) for k in keys]


def _worker_key_read(k: WorkerKey) -> WorkerKeyRead:
    return WorkerKeyRead(id=k.id, name=k.name, created_at=k.created_at, revoked_at=k.revoked_at)


def _api_key_read(k: ApiKey) -> ApiKeyRead:
    return ApiKeyRead(id=k.id, created_at=k.created_at, revoked_at=k.revoked_at)


_Key = TypeVar("_Key", WorkerKey, ApiKey)


async def _revoke(sessions: SessionFactory, model: type[_Key], key_id: str) -> _Key | None:
    """Revoke (idempotently) and return the key row; None if there is no such key."""
    async with sessions() as s:
        key = await s.get(model, key_id)
        if key is not None:
            key.revoked_at = key.revoked_at or utcnow()
            await s.commit()
        return key


async def revoke_worker_key(sessions: SessionFactory, key_id: str) -> WorkerKeyRead | None:
    key = await _revoke(sessions, WorkerKey, key_id)
    return _worker_key_read(key) if key is not None else None


async def revoke_api_key(sessions: SessionFactory, key_id: str) -> ApiKeyRead | None:
    key = await _revoke(sessions, ApiKey, key_id)
    return _api_key_read(key) if key is not None else None


async def open_database(settings: ServerSettings) -> tuple[AsyncEngine, SessionFactory]:
    """An engine on the settings' database, migrated first when the settings say so."""
    url = settings.effective_database_url
    if settings.should_migrate_on_start:
        await asyncio.to_thread(migrate.upgrade, url, "head", settings.db_pooler)
    engine = create_engine(url, pooler=settings.db_pooler)
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
