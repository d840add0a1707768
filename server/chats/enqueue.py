"""Enqueue after commit (DESIGN §3, step 2): the one way every front door hands stored pending
assistant messages to the work queue.

A full queue refuses the request: the messages not queued are deleted (a refused request leaves
nothing behind) and the client gets 503 ``queue_full`` with Retry-After. With Redis away the messages
stay pending in SQL and are queued in the background once it answers (the sweep is the backstop).
Each message is also registered with this process's path cache, so that a dispatch here reads nothing
back, and queued for the worker that holds its prefix when routing names one (``server.workers.routing``).
"""

from __future__ import annotations

from server.chats.path_cache import PendingWork
from server.errors import ApiError
from server.models import Message
from server.outages import is_unavailable
from server.queue.protocol import QueueFull
from server.state import AppState
from shared.api import MessageState
from shared.errors import ErrorCode


async def enqueue(
    state: AppState, messages: list[Message], *, holder: str | None = None, session_key: str | None = None
) -> None:
    """``holder``: the worker that generated the path's last reply, when the caller knows it and this
    process's path cache may not (another replica stored that reply); ``session_key``: the client's
    session hint."""
    for k, msg in enumerate(messages):
        model = msg.model_config_name or ""
        # this process's dispatch takes it from memory if it claims it (server.workers.work_source)
        params = msg.work_parameters or {}
        state.paths.pending(
            PendingWork(msg.id, msg.chat_id, msg.parent_id or "", msg.attempt, params, msg.created_at, msg.session_key)
        )
        try:
            prefer = await state.hub.router.prefer(model, state.paths.holder(msg.parent_id) or holder, session_key)
            await state.queue.enqueue(model, msg.id, msg.attempt, prefer=prefer)
        except QueueFull as exc:
            await state.hub.store.discard([m.id for m in messages[k:]])
            raise ApiError(
                ErrorCode.queue_full, "the server is busy; try again later", headers={"Retry-After": "5"}
            ) from exc
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            state.hub.recovery.enqueue_later(model, msg.id, msg.attempt)


async def ensure_queued(state: AppState, message_ids: list[str]) -> None:
    """A retried request's messages (an Idempotency-Key's replay): any still pending that the queue
    never got, because the first request's process died between its commit and its enqueue, gets a new
    attempt (fencing off a late enqueue of the old one) and is queued now."""
    for message_id, attempt, model, state_ in await state.hub.store.states(message_ids):
        if state_ != MessageState.pending.value or await state.queue.holds(model, message_id):
            continue
        new = await state.hub.store.next_attempt(message_id, attempt)
        if new is not None:
            await state.queue.enqueue(model, message_id, new, retry=True)
