"""Starting a turn, the same for every dialect's route (chat completions, Responses, Messages): the
request's conversation continues the longest stored path (``ConversationStore.continue_path``), the new
messages are remembered, the assistant messages queued, and the request's session closed (generation may
take minutes; the follower opens its own sessions).

With an ``Idempotency-Key`` (``server/idempotency.py``) the turn is stored once: a retry gets the first
request's ``Turn`` back, and its routes answer from it as they did the first time (the same messages,
followed from their first token)."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from server.chats.enqueue import enqueue, ensure_queued
from server.hot_sql import Step
from server.idempotency import IdempotencyKey, once
from server.openai.conversations import Continued, Conversation, ConversationStore, seed_for
from server.state import AppState
from shared.api import SamplingParameters


@dataclass(frozen=True)
class Turn:
    """What a turn created, as its routes answer from it."""

    chat_id: str
    message_ids: list[str]  # the assistant messages to generate
    matched: int
    new_messages: int
    parent_id: str | None
    forked: bool
    lineage: dict[str, Any]
    created: int  # Unix time of the first request

    @classmethod
    def of(cls, cont: Continued, created: int) -> Turn:
        ids = [m.id for m in cont.assistants]
        lineage = cont.lineage_info()
        return cls(cont.chat_id, ids, cont.matched, cont.new_messages, cont.parent_id, cont.forked, lineage, created)

    def info(self) -> dict[str, Any]:
        """The request's part of the answer's ``tokentrail`` object."""
        return {
            "chat_id": self.chat_id,
            "message_ids": self.message_ids,
            "matched_messages": self.matched,
            "new_messages": self.new_messages,
            "parent_id": self.parent_id,
            "lineage": self.lineage,
        }


async def start_turn(
    state: AppState,
    session: AsyncSession,
    user_id: str,
    *,
    idem: IdempotencyKey | None,
    admission: Callable[[], Awaitable[None]],
    conv: Conversation,
    model: str,
    tools: list[Any] | None,
    sampling: SamplingParameters,
    n: int,
    conversation_id: str | None,
    template_kwargs: dict[str, Any] | None,
    client_prompt_ids: list[int] | None = None,
    required_prefix_ids: list[int] | None = None,
    session_key: str | None = None,
) -> Turn:
    """``admission`` runs before anything is stored. The caller asked ``replayed_turn`` first."""
    created = int(time.time())

    def claim(cont: Continued) -> Step:
        assert idem is not None
        return idem.step(state.sql.dialect, asdict(Turn.of(cont, created)))

    async def create() -> Turn:
        await admission()
        cont = await ConversationStore(session, user_id, state.sql).continue_path(
            conv=conv,
            seed=seed_for(user_id, model, conv, tools, template_kwargs),
            model=model,
            tools=tools,
            sampling=sampling,
            n=n,
            conversation_id=conversation_id,
            extra_params={
                "template_kwargs": template_kwargs,
                "client_prompt_ids": client_prompt_ids,
                "required_prefix_ids": required_prefix_ids,
            },
            session_key=session_key,
            claim=claim if idem is not None else None,
        )
        state.metrics.lineage.labels(model, cont.lineage).inc()
        if cont.prefix_break:
            state.metrics.prefix_breaks.labels(model).inc()
        state.paths.remember(cont.stored)
        await enqueue(state, cont.assistants, holder=cont.holder, session_key=session_key)
        return Turn.of(cont, created)

    turn = await once(idem, session, create, functools.partial(_replay, state), looked=True)
    await session.close()
    return turn


async def replayed_turn(state: AppState, session: AsyncSession, idem: IdempotencyKey | None) -> Turn | None:
    """The turn a request with this key made already (a retry), or None. Routes ask first, before
    their own checks: the retry is answered as the first request was, whatever changed meanwhile
    (the model's workers gone for a moment, the user's rate). The caller closes the session."""
    if idem is None or (found := await idem.find(session)) is None:
        return None
    return await _replay(state, found)


async def _replay(state: AppState, result: dict[str, Any]) -> Turn:
    turn = Turn(**result)
    await ensure_queued(state, turn.message_ids)
    return turn
