"""``/admin``: administrator endpoints (API key of a user with the admin role)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from server.admin import list_users, list_worker_keys, revoke_api_key, revoke_worker_key
from server.api.deps import AdminUser, StateDep
from server.db import create_engine, create_session_factory, is_sqlite
from server.errors import ApiError
from server.export.pairs import iter_pairs
from server.export.query import ExportFilters
from server.export.stream import export_lines
from shared.api import ApiKeyRead, UserRead, WorkerKeyRead, WorkerRead
from shared.errors import ErrorCode
from shared.pairs import PAIR_SCHEMAS, adapt_pair

router = APIRouter(prefix="/admin", tags=["admin"])


def _utc(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


@router.get("/export")
async def export(
    _admin: AdminUser,
    state: StateDep,
    schema: str = "tokentrail",
    since: datetime | None = None,
    until: datetime | None = None,
    model: str | None = None,
    user: str | None = None,
    chat: str | None = None,
    rated_only: bool = False,
    min_score: float | None = None,
    include_incomplete: bool = False,
    reward_rule: Annotated[str, Query(pattern="^(last|mean|min|leaf)$")] = "last",
    min_version: Annotated[
        int | None,
        Query(ge=0, description="Only rollouts whose every generated token has this policy version or above."),
    ] = None,
    max_staleness: Annotated[
        int | None,
        Query(
            ge=0,
            description="Only rollouts whose every generated token's policy version is at least the model's newest"
            " registered version minus this.",
        ),
    ] = None,
    pairs: Annotated[
        bool,
        Query(description="Preference pairs of sibling drafts instead (schema tokentrail or trl): export --pairs."),
    ] = False,
) -> StreamingResponse:
    """Rollouts as JSON Lines, streamed (same filters and schemas as ``tokentrail export``)."""
    from shared.rollout_adapters import SCHEMAS

    if pairs:  # preference pairs (server/export/pairs.py)
        _check_pair_request(schema, rated_only or min_score is not None or include_incomplete or reward_rule != "last")
    elif schema not in SCHEMAS:
        raise ApiError(ErrorCode.bad_request, f"unknown schema {schema!r}; choose from {', '.join(SCHEMAS)}")
    filters = ExportFilters(
        since=_utc(since),
        until=_utc(until),
        model=model,
        user=user,
        chat=chat,
        rated_only=rated_only,
        min_score=min_score,
        include_incomplete=include_incomplete,
        reward_rule=reward_rule,  # type: ignore[arg-type]
        min_version=min_version,
        max_staleness=max_staleness,
    )

    async def lines() -> AsyncIterator[bytes]:
        url = state.settings.effective_database_url
        # SQLite: the pairs' export reads batches on aiosqlite's thread, not the thread serving the streams
        engine = create_engine(url, inline=False) if is_sqlite(url) else None
        sessions = create_session_factory(engine) if engine is not None else state.sessions
        try:
            if pairs:
                async for pair in iter_pairs(sessions, filters):
                    yield orjson.dumps(adapt_pair(pair, schema)) + b"\n"
                return
            # the rollouts: what tokentrail export writes, by its page path (connections of its own)
            compiler = engine if engine is not None else create_engine(url, pooler=state.settings.db_pooler)
            try:
                async for text in export_lines(compiler, sessions, filters, schema):
                    yield text
            finally:
                if compiler is not engine:
                    await compiler.dispose()
        finally:
            if engine is not None:
                await engine.dispose()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _check_pair_request(schema: str, rollout_filters: bool) -> None:
    if schema not in PAIR_SCHEMAS:
        raise ApiError(ErrorCode.bad_request, f"schema {schema!r} with pairs: choose from {', '.join(PAIR_SCHEMAS)}")
    if rollout_filters:
        raise ApiError(
            ErrorCode.bad_request, "rated_only, min_score, include_incomplete and reward_rule are not taken with pairs"
        )


@router.get("/workers")
async def workers(_admin: AdminUser, state: StateDep) -> list[WorkerRead]:
    """Workers connected to any server process, as of their last heartbeat."""
    entries = sorted(await state.directory.workers(), key=lambda w: (w.model_name, w.worker_id))
    # the directory entry's fields, with the heartbeat as a time (WorkerRead leaves out the rest)
    return [
        WorkerRead.model_validate(
            {**asdict(w), "last_seen": datetime.fromtimestamp(w.last_seen, UTC) if w.last_seen else None}
        )
        for w in entries
    ]


@router.get("/users")
async def users(_admin: AdminUser, state: StateDep) -> list[UserRead]:
    return await list_users(state.sessions)


@router.get("/worker_keys")
async def worker_keys(_admin: AdminUser, state: StateDep) -> list[WorkerKeyRead]:
    keys = await list_worker_keys(state.sessions)
    connected: dict[str, int] = {}
    for w in await state.directory.workers():
        connected[w.key_id] = connected.get(w.key_id, 0) + 1
    return [k.model_copy(update={"connected_workers": connected.get(k.id, 0)}) for k in keys]


@router.post("/worker_keys/{key_id}/revoke")
async def revoke_worker(key_id: str, _admin: AdminUser, state: StateDep) -> WorkerKeyRead:
    """Revoke a worker key: new connections with it are refused, this process's workers that use
    it are disconnected now, other processes' at their next heartbeat; their work is requeued."""
    key = await revoke_worker_key(state.sessions, key_id)
    if key is None:
        raise ApiError(ErrorCode.not_found, f"no worker key {key_id}")
    await state.hub.disconnect_key(key_id)
    return key


@router.post("/api_keys/{key_id}/revoke")
async def revoke_user_key(key_id: str, _admin: AdminUser, state: StateDep) -> ApiKeyRead:
    """Revoke a user's API key; requests with it are refused within a few seconds (auth cache)."""
    key = await revoke_api_key(state.sessions, key_id)
    if key is None:
        raise ApiError(ErrorCode.not_found, f"no API key {key_id}")
    state.auth_cache.clear()  # this process refuses it at once
    return key
