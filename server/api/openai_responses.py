"""OpenAI Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``): a translation layer over
the ``/v1/chat/completions`` pipeline, on the same chat trees and prefix matching.

A request's ``instructions``, ``input`` items and ``tools`` become chat messages and tools
(``server/openai/responses.py``), which continue the longest stored path as a chat request's do
(``ConversationStore.continue_path``); the assistant message generated is the response, rendered as
Responses output items (``responses_render.py``) or streamed as Responses events
(``responses_stream.py``). ``previous_response_id`` names a stored assistant message: the request is
its stored path (read back from the database, with its system prompt, tools and template arguments
unless the request gives its own) followed by the new input, pinned to its chat, so the prompt
extends the stored tokens. Everything is stored (``store: false`` included), as every request is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.api.deps import CurrentUser, Idempotency, SessionDep, SessionHint, StateDep, session_key
from server.chats.admission import admit
from server.chats.finished import Finished
from server.errors import ApiError
from server.models import MESSAGES, Chat, Message, MessageTokens
from server.openai.choices import collect
from server.openai.params import require_model, sampling_params
from server.openai.render import dumps, failure, tokentrail_info
from server.openai.responses import chat_tools, conversation, refuse_unsupported, response_tools, translate
from server.openai.responses_render import (
    Echo,
    error_body,
    message_id_of,
    output_items,
    response_id,
    status_of,
    usage,
)
from server.openai.responses_stream import ResponseEvents
from server.openai.streaming import event_stream
from server.openai.turns import replayed_turn, start_turn
from shared.api import MessageState, WorkParameters
from shared.errors import ErrorCode
from shared.responses_api import ResponsesRequest

router = APIRouter(tags=["openai"])

_ROLE = {"prompter": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class _Previous:
    """The stored response ``previous_response_id`` names: its chat, path and request parameters."""

    chat_id: str
    messages: list[dict[str, Any]]  # root first, chat messages as parse_messages takes them
    work: WorkParameters


def _not_found(rid: str, param: str | None) -> ApiError:
    return ApiError(ErrorCode.message_not_found, f"Response with id '{rid}' not found.", param=param, status_code=404)


async def _owned_response(session: AsyncSession, user_id: str, rid: str, param: str | None) -> Message:
    q = (
        select(Message)
        .join(Chat, Chat.id == Message.chat_id)
        .where(Message.id == message_id_of(rid), Chat.user_id == user_id, Message.role == "assistant")
    )
    msg = await session.scalar(q)
    if msg is None or msg.state == MessageState.manual.value:  # a client-written turn is no response
        raise _not_found(rid, param)
    return msg


def _as_chat_message(m: Any) -> dict[str, Any]:
    role = _ROLE[m.role]
    out: dict[str, Any] = {"role": role, "content": m.content}
    if role == "assistant":
        calls = json.loads(m.tool_calls) if isinstance(m.tool_calls, str) else m.tool_calls
        if calls:
            out["tool_calls"] = calls
        if m.reasoning_content is not None:
            out["reasoning_content"] = m.reasoning_content
    elif role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


async def _previous(session: AsyncSession, user_id: str, rid: str) -> _Previous:
    msg = await _owned_response(session, user_id, rid, "previous_response_id")
    if msg.state != MessageState.complete.value:
        raise ApiError(
            ErrorCode.invalid_messages,
            f"previous response {rid} is {msg.state}: only a completed response can be continued",
            param="previous_response_id",
        )
    # the path root..msg, one primary-key step per message (a recursive CTE: SQLite and PostgreSQL)
    m = MESSAGES.c
    fields = (m.id, m.parent_id, m.role, m.content, m.tool_calls, m.reasoning_content, m.tool_call_id)
    path_cte = select(*fields).where(m.id == msg.id).cte("path", recursive=True)
    up = MESSAGES.alias("up")
    path_cte = path_cte.union_all(
        select(*(up.c[f.name] for f in fields)).where(up.c.id == path_cte.c.parent_id, up.c.chat_id == msg.chat_id)
    )
    by_id = {r.id: r for r in await session.execute(select(path_cte))}
    path = []
    at: str | None = msg.id
    while at is not None and at in by_id:
        path.append(by_id[at])
        at = by_id[at].parent_id
    path.reverse()
    work = WorkParameters.model_validate(msg.work_parameters or {"model_config_name": "", "seed": None})
    return _Previous(msg.chat_id, [_as_chat_message(m) for m in path], work)


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest,
    user: CurrentUser,
    session: SessionDep,
    state: StateDep,
    hint: SessionHint,
    idem: Idempotency,
) -> Response:
    replayed = await replayed_turn(state, session, idem)  # a retry: answered as the first request was
    if replayed is None:
        await require_model(state, body.model)
    refuse_unsupported(body)
    prev = await _previous(session, user.id, body.previous_response_id) if body.previous_response_id else None
    tools = chat_tools(body.tools) if body.tools is not None or prev is None else prev.work.tools
    kwargs = body.chat_template_kwargs
    if kwargs is None and prev is not None:
        kwargs = prev.work.template_kwargs
    tr = translate(
        body,
        history=prev.messages if prev is not None else None,
        system_prompt=prev.work.system_prompt if prev is not None else None,
    )
    conv = conversation(tr)
    sampling = sampling_params(body, body.max_output_tokens or body.max_tokens, 0)
    if replayed is not None:
        await session.close()
    turn = replayed or await start_turn(
        state,
        session,
        user.id,
        idem=idem,
        admission=lambda: admit(state.settings, state.rate_limiter, state.sql, session, user.id, body.model, 1),
        conv=conv,
        model=body.model,
        tools=tools,
        sampling=sampling,
        n=1,
        conversation_id=prev.chat_id if prev is not None else body.conversation_id,
        template_kwargs=kwargs or None,
        required_prefix_ids=body.required_prefix_token_ids or tr.required_prefix,
        session_key=session_key(body.prompt_cache_key) or hint,
    )
    mid = turn.message_ids[0]
    rid = response_id(mid)
    with_tools = body.tool_choice != "none"
    echo = Echo(
        model=body.model,
        created_at=turn.created,
        instructions=conv.system_prompt,
        tools=response_tools(tools),
        tool_choice=body.tool_choice if isinstance(body.tool_choice, str) else "auto",
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        metadata=body.metadata,
        user=body.user,
        store=body.store is not False,
        reasoning=body.reasoning,
    )
    request_info = turn.info()

    def body_of(status: str, output: list[dict[str, Any]], done: Finished | None) -> dict[str, Any]:
        info = dict(request_info)
        error = None
        if done is not None:
            info.update(tokentrail_info(done.message, done.tokens, forked=turn.forked))
            if done.message.state != MessageState.complete.value:
                error = error_body(done.message)
        return echo.body(rid, status, output, usage=usage(done.tokens) if done else None, error=error, tokentrail=info)

    if body.stream:
        events = ResponseEvents(mid, body.stop_strings(), body_of, with_tools=with_tools)
        return event_stream(events.stream(state), state.metrics)
    done, _ = await collect(state, mid)
    msg = done.message
    if msg.state != MessageState.complete.value or done.tokens is None:
        raise failure(msg)
    output = output_items(msg, done.tokens, with_tools=with_tools)
    return Response(dumps(body_of(status_of(msg), output, done)), media_type="application/json")


@router.get("/v1/responses/{rid}")
async def get_response(rid: str, user: CurrentUser, session: SessionDep) -> Response:
    """A stored response of the key's user, as ``POST /v1/responses`` answered it (without the
    request-only fields: ``metadata``, ``previous_response_id``, ``user``)."""
    msg = await _owned_response(session, user.id, rid, None)
    tokens = await session.get(MessageTokens, msg.id)
    work = WorkParameters.model_validate(msg.work_parameters or {"model_config_name": "", "seed": None})
    sampling = work.sampling_parameters
    echo = Echo(
        model=msg.model_config_name or work.model_config_name,
        created_at=int(msg.created_at.timestamp()),
        instructions=work.system_prompt,
        tools=response_tools(work.tools),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_output_tokens=sampling.max_new_tokens,
    )
    status = status_of(msg)
    complete = msg.state == MessageState.complete.value
    output = output_items(msg, tokens, with_tools=True) if complete else []
    error = error_body(msg) if status in ("failed", "cancelled") else None
    info = {**tokentrail_info(msg, tokens, forked=False), "message_ids": [msg.id]}
    body = echo.body(response_id(msg.id), status, output, usage=usage(tokens), error=error, tokentrail=info)
    return Response(dumps(body), media_type="application/json")
