"""Starting a turn, the same for every dialect's route (chat completions, Responses, Messages): the
request's conversation continues the longest stored path (``ConversationStore.continue_path``), the new
messages are remembered, the assistant messages queued, and the request's session closed (generation may
take minutes; the follower opens its own sessions)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from server.chats.enqueue import enqueue
from server.openai.conversations import Continued, Conversation, ConversationStore, seed_for
from server.state import AppState
from shared.api import SamplingParameters


async def start_turn(
    state: AppState,
    session: AsyncSession,
    user_id: str,
    *,
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
) -> Continued:
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
    )
    state.metrics.lineage.labels(model, cont.lineage).inc()
    if cont.prefix_break:
        state.metrics.prefix_breaks.labels(model).inc()
    state.paths.remember(cont.stored)
    await enqueue(state, cont.assistants, holder=cont.holder, session_key=session_key)
    await session.close()
    return cont
