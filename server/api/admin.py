"""``/admin``: administrator endpoints (API key of a user with the admin role)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from server.api.deps import AdminUser, StateDep
from server.errors import ApiError
from server.export.rollouts import ExportFilters, iter_rollouts
from shared.errors import ErrorCode

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
) -> StreamingResponse:
    """Rollouts as JSON Lines, streamed (same filters and schemas as ``tokentrail export``)."""
    from shared.rollout_adapters import SCHEMAS, adapt

    if schema not in SCHEMAS:
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
    )

    async def lines() -> AsyncIterator[bytes]:
        async for rollout in iter_rollouts(state.sessions, filters):
            for record in adapt(rollout, schema):
                yield orjson.dumps(record) + b"\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")
