"""``GET /v1/rollouts``: finished episodes as a stream of rollouts (server-sent events) with resumable cursors.

Each ``rollout`` event carries one rollout (root -> the reply a ``done`` reward ended the episode at) and
its cursor as the event id. A client resumes with ``Last-Event-ID`` (or ``?after=``) and gets every
rollout after it, from any replica; delivery is at least once (a client that crashes between receiving
and recording a rollout gets it again), so consumers keep the last ``rollout_id`` seen per id. When a
batch of finished episodes holds none for this reader (another user's, filtered out), a ``cursor``
event moves its position past them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query
from sse_starlette import EventSourceResponse, ServerSentEvent

from server.api.deps import CurrentUser, StateDep
from server.errors import ApiError
from server.export.feed import CursorError, read_batch
from server.export.query import ExportFilters
from server.outages import is_unavailable
from server.state import AppState
from shared.errors import ErrorCode

log = logging.getLogger(__name__)
router = APIRouter(tags=["rollouts"])

_OUTAGE_RETRY_S = 1.0


_STREAM = {200: {"description": "Server-sent events: `rollout` and `cursor`.", "content": {"text/event-stream": {}}}}


@router.get("/v1/rollouts", response_class=EventSourceResponse, responses=_STREAM)  # type: ignore[arg-type]
async def rollout_feed(
    user: CurrentUser,
    state: StateDep,
    after: Annotated[
        str | None, Query(description="Resume after this cursor (an event id); default: the start.")
    ] = None,
    last_event_id: Annotated[str | None, Header()] = None,
    schema: Annotated[str, Query(description="tokentrail (native) or a trainer schema, as `tokentrail export`.")] = (
        "tokentrail"
    ),
    model: Annotated[str | None, Query(description="Only rollouts whose last turn used this model.")] = None,
    user_id: Annotated[
        str | None, Query(alias="user", description="Admin keys: only this user's rollouts (default: all).")
    ] = None,
    rated_only: bool = False,
    include_incomplete: bool = False,
    reward_rule: Annotated[str, Query(pattern="^(last|mean|min|leaf)$")] = "last",
    min_version: Annotated[int | None, Query(ge=0)] = None,
    max_staleness: Annotated[int | None, Query(ge=0)] = None,
    follow: Annotated[bool, Query(description="Keep the stream open for new episodes; false: end when caught up.")] = (
        True
    ),
    limit: Annotated[int | None, Query(ge=1, description="End after this many rollouts.")] = None,
) -> EventSourceResponse:
    """Finished, rewarded episodes (``POST /v1/rewards`` with ``done``) as rollouts, in the order they
    finished. A user's key reads its own; an admin's reads every user's (or ``user``'s)."""
    from shared.rollout_adapters import SCHEMAS

    if schema not in SCHEMAS:
        raise ApiError(
            ErrorCode.unknown_schema, f"unknown schema {schema!r}; choose from {', '.join(SCHEMAS)}", param="schema"
        )
    if user_id is not None and user_id != user.id and not user.is_admin:
        raise ApiError(ErrorCode.forbidden, "only an admin key may read another user's rollouts", param="user")
    cursor = last_event_id or after
    start = 0
    if cursor:
        try:
            start = await state.cursors.decode(cursor)
        except CursorError as exc:
            raise ApiError(ErrorCode.invalid_cursor, str(exc), param="after") from exc
    filters = ExportFilters(
        model=model,
        user=user_id if user.is_admin else user.id,
        rated_only=rated_only,
        include_incomplete=include_incomplete,
        reward_rule=reward_rule,  # type: ignore[arg-type]
        min_version=min_version,
        max_staleness=max_staleness,
    )
    return EventSourceResponse(_events(state, start, filters, schema, follow, limit), ping=15)


async def _events(
    state: AppState, position: int, filters: ExportFilters, schema: str, follow: bool, limit: int | None
) -> AsyncIterator[ServerSentEvent]:
    from shared.rollout_adapters import adapt

    sent = 0
    while True:
        try:
            batch = await read_batch(state.sessions, position, filters)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("rollout feed: database unavailable (%s); retrying", type(exc).__name__)
            await asyncio.sleep(_OUTAGE_RETRY_S)
            continue
        for seq, rollout in batch.rollouts:
            cursor = await state.cursors.encode(seq)
            yield ServerSentEvent(data=_payload(rollout, schema, adapt), event="rollout", id=cursor)
            sent += 1
            if limit is not None and sent >= limit:
                return
        if batch.scanned_to > position and (not batch.rollouts or batch.rollouts[-1][0] < batch.scanned_to):
            cursor = await state.cursors.encode(batch.scanned_to)
            yield ServerSentEvent(data=orjson.dumps({"cursor": cursor}).decode(), event="cursor", id=cursor)
        position = batch.scanned_to
        if batch.full:
            continue
        if not follow:
            return
        await state.feed.wait(state.settings.rollout_feed_poll_s)


def _payload(rollout: dict[str, Any], schema: str, adapt: Any) -> str:
    """The event's JSON: the native rollout itself, or a trainer schema's records for it."""
    if schema == "tokentrail":
        return orjson.dumps(rollout).decode()
    records = adapt(rollout, schema)
    return orjson.dumps({"rollout_id": rollout["rollout_id"], "schema": schema, "records": records}).decode()
