"""``/chats``: Open-Assistant's chat API (chats, prompter and assistant messages, events)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.deps import Idempotency, RepoDep, StateDep
from server.api.sse import message_events
from server.chats.admission import admit
from server.chats.enqueue import enqueue, ensure_queued
from server.chats.repository import ChatRepository, chat_to_list_read, message_to_read
from server.errors import ApiError
from server.idempotency import IdempotencyKey, once
from server.models import Message
from shared.api import (
    MAX_CONTENT_CHARS,
    ChatListRead,
    ChatRead,
    ChatUpdateRequest,
    CreateAssistantMessageRequest,
    CreateChatRequest,
    CreatePrompterMessageRequest,
    CreateToolMessageRequest,
    CreateWrittenAssistantMessageRequest,
    ListChatsResponse,
    MessageEvalRequest,
    MessageRead,
    MessageState,
    ModelConfigRead,
    ReportRequest,
    VoteRequest,
)
from shared.errors import ErrorCode

router = APIRouter(prefix="/chats", tags=["chats"])
# OA's acknowledgements: 200 with an empty body (documented so, not as JSON).
_DONE: dict[int | str, dict[str, object]] = {200: {"description": "Done; the body is empty, as in Open-Assistant."}}
configs_router = APIRouter(prefix="/configs", tags=["configs"])


@configs_router.get("/model_configs")
async def model_configs(state: StateDep) -> list[ModelConfigRead]:
    models = sorted((await state.catalog.offered()).values(), key=lambda m: m.name)
    versions = await state.hub.registry.fresh()
    return [m.model_copy(update={"policy_version": versions.get(m.name, 0)}) for m in models]


@configs_router.get("/builtin_plugins")
async def builtin_plugins() -> list[dict[str, object]]:
    """OA's plugin list. tokentrail runs no plugins (tools are the chat's ``tools``): always empty."""
    return []


def _check_length(content: str) -> None:
    if len(content) > MAX_CONTENT_CHARS:
        raise ApiError(
            ErrorCode.content_too_long, f"content has {len(content)} characters; the limit is {MAX_CONTENT_CHARS}"
        )


@router.get("")
async def list_chats(
    repo: RepoDep,
    limit: Annotated[int, Query(gt=0, le=100)] = 10,
    after: str | None = None,
    before: str | None = None,
    include_hidden: bool = False,
) -> ListChatsResponse:
    chats, next_cursor, prev_cursor = await repo.list_chats(
        limit=limit, after=after, before=before, include_hidden=include_hidden
    )
    return ListChatsResponse(chats=[chat_to_list_read(c) for c in chats], next=next_cursor, prev=prev_cursor)


@router.post("")
async def create_chat(repo: RepoDep, idem: Idempotency, body: CreateChatRequest | None = None) -> ChatListRead:
    new = body or CreateChatRequest()

    async def create() -> ChatListRead:
        repo.idempotency = idem
        return chat_to_list_read(await repo.create_chat(system_prompt=new.system_prompt, tools=new.tools))

    async def replay(result: dict[str, Any]) -> ChatListRead:
        return chat_to_list_read(await repo.get_chat(result["chat_id"]))

    return await once(idem, repo.session, create, replay)


@router.put("/hide_all", response_class=Response, responses=_DONE)
async def hide_all_chats(repo: RepoDep) -> Response:
    """OA's "hide all": every chat of the user is hidden (still listed with include_hidden)."""
    await repo.hide_all_chats()
    return Response(status_code=200)


@router.api_route("/hide_all", methods=["GET", "DELETE"], include_in_schema=False)
async def hide_all_other_methods() -> None:
    """``/chats/hide_all`` is a path of its own, not a chat id: only PUT is served there."""
    raise StarletteHTTPException(status_code=405)


@router.get("/{chat_id}")
async def get_chat(chat_id: str, repo: RepoDep) -> ChatRead:
    return await repo.chat_read(chat_id)


@router.delete("/{chat_id}", response_class=Response, responses=_DONE)
async def delete_chat(chat_id: str, repo: RepoDep, state: StateDep) -> Response:
    """Delete a chat and everything in it; generations still running are cancelled first."""
    running = await repo.open_message_ids(chat_id)
    await repo.session.commit()  # end this session's read snapshot: the hub writes through its own
    for message_id in running:
        await state.hub.cancel(message_id)
    await repo.delete_chat(chat_id)
    return Response(status_code=200)


@router.put("/{chat_id}")
async def update_chat(chat_id: str, body: ChatUpdateRequest, repo: RepoDep) -> ChatListRead:
    # title, system prompt and tools can be cleared with null; the flags cannot
    nullable = {"title", "system_prompt", "tools"}
    fields = {k: v for k, v in body.model_dump(exclude_unset=True).items() if v is not None or k in nullable}
    return chat_to_list_read(await repo.update_chat(chat_id, fields))


@router.post("/{chat_id}/prompter_message")
async def create_prompter_message(
    chat_id: str, body: CreatePrompterMessageRequest, repo: RepoDep, state: StateDep, idem: Idempotency
) -> MessageRead:
    _check_length(body.content)

    async def create() -> Message:
        return await repo.add_prompter_message(chat_id, body.parent_id, body.content)

    return await _message_once(repo, state, idem, chat_id, create)


@router.post("/{chat_id}/tool_message")
async def create_tool_message(
    chat_id: str, body: CreateToolMessageRequest, repo: RepoDep, state: StateDep, idem: Idempotency
) -> MessageRead:
    """A tool's result for one call of the assistant message (or tool result) it follows."""
    _check_length(body.content)

    async def create() -> Message:
        return await repo.add_tool_message(chat_id, body.parent_id, body.tool_call_id, body.content)

    return await _message_once(repo, state, idem, chat_id, create)


@router.post("/{chat_id}/written_assistant_message")
async def create_written_assistant_message(
    chat_id: str, body: CreateWrittenAssistantMessageRequest, repo: RepoDep, state: StateDep, idem: Idempotency
) -> MessageRead:
    """An assistant message the client wrote itself (a tool call it made, a reply it typed): stored as
    context (state ``manual``), never generated or exported as a completion. The next assistant
    message's prompt keeps the stored tokens of the last generated turn and renders this one after
    them (``prompt_method`` ``stitch-written``)."""
    _check_length(body.content)
    if body.reasoning_content is not None:
        _check_length(body.reasoning_content)
    calls = [c.model_dump() for c in body.tool_calls] if body.tool_calls else None

    async def create() -> Message:
        return await repo.add_written_assistant_message(
            chat_id, body.parent_id, body.content, calls, body.reasoning_content
        )

    return await _message_once(repo, state, idem, chat_id, create)


@router.post("/{chat_id}/assistant_message")
async def create_assistant_message(
    chat_id: str, body: CreateAssistantMessageRequest, repo: RepoDep, state: StateDep, idem: Idempotency
) -> MessageRead:
    await repo.get_chat(chat_id)  # 404 before 422 for an unknown chat

    async def create() -> Message:
        if not await state.catalog.is_offered(body.model_config_name):
            raise ApiError(
                ErrorCode.unknown_model,
                f"no connected worker offers model {body.model_config_name!r}; see GET /configs/model_configs",
            )
        await admit(state.settings, state.rate_limiter, state.sql, repo.session, repo.user.id, body.model_config_name)
        sampling = body.sampling_parameters
        # no seed unless the client asked for one (DESIGN D17): the engine then samples with its own
        # randomness, on vLLM's batched path rather than per-request generators
        msg = await repo.add_assistant_message(chat_id, body.parent_id, body.model_config_name, sampling, sampling.seed)
        await enqueue(state, [msg])
        return msg

    return await _message_once(repo, state, idem, chat_id, create, generated=True)


async def _message_once(
    repo: ChatRepository,
    state: StateDep,
    idem: IdempotencyKey | None,
    chat_id: str,
    create: Callable[[], Awaitable[Message]],
    *,
    generated: bool = False,
) -> MessageRead:
    """A message made once per Idempotency-Key: a retry gets the same message as it stands now (an
    assistant message the first request's replica stored but could not queue is queued then)."""

    async def made() -> MessageRead:
        repo.idempotency = idem
        msg = await create()
        if not generated:
            state.paths.remember([msg])
        return message_to_read(msg)

    async def replay(result: dict[str, Any]) -> MessageRead:
        if generated:
            await ensure_queued(state, [result["message_id"]])
        return message_to_read(await repo.get_message(chat_id, result["message_id"]))

    return await once(idem, repo.session, made, replay)


@router.get("/{chat_id}/messages/{message_id}")
async def get_message(
    chat_id: str, message_id: str, repo: RepoDep, include: Annotated[str | None, Query()] = None
) -> MessageRead:
    msg = await repo.get_message(chat_id, message_id)
    includes = {part.strip() for part in (include or "").split(",") if part.strip()}
    unknown = includes - {"tokens"}
    if unknown:
        raise ApiError(ErrorCode.bad_request, f"unknown include {sorted(unknown)}; allowed: tokens")
    tokens = await repo.get_tokens(msg.id) if "tokens" in includes else None
    read = message_to_read(msg, tokens)
    if "tokens" in includes and tokens is None:
        read.prompt_token_ids, read.completion_token_ids, read.logprobs = [], [], []
    return read


@router.post("/{chat_id}/messages/{message_id}/cancel")
async def cancel_message(chat_id: str, message_id: str, repo: RepoDep, state: StateDep) -> MessageRead:
    """Stop an assistant message: a queued one never starts; a running one stops within one engine
    step, keeping the tokens generated so far (exported with finish_reason "abort"). Readers of its
    events get a final error event with code ``cancelled``. Cancelling a cancelled message is a no-op."""
    msg = await repo.get_message(chat_id, message_id)
    if msg.role != "assistant":
        raise ApiError(ErrorCode.not_assistant_message, "only assistant messages can be cancelled")
    if msg.state != MessageState.cancelled:
        cancelled = await state.hub.cancel(msg.id)
        await repo.session.commit()  # end this session's snapshot: the hub wrote through its own
        await repo.session.refresh(msg)
        if not cancelled and msg.state != MessageState.cancelled:
            raise ApiError(ErrorCode.message_finished, f"the message has already ended ({msg.state})")
    return message_to_read(msg)


@router.post("/{chat_id}/messages/{message_id}/votes", response_class=Response, responses=_DONE)
async def vote(chat_id: str, message_id: str, body: VoteRequest, repo: RepoDep, idem: Idempotency) -> Response:
    """OA's vote (-1, 0 or 1); exports use it as the turn's reward."""
    repo.idempotency = idem
    return await once(idem, repo.session, lambda: _done(repo.vote(chat_id, message_id, body.score)), _replay_done)


@router.post("/{chat_id}/messages/{message_id}/reports", response_class=Response, responses=_DONE)
async def report(chat_id: str, message_id: str, body: ReportRequest, repo: RepoDep, idem: Idempotency) -> Response:
    """OA's report on a message (spam, offensive, feedback), kept for moderation."""
    repo.idempotency = idem

    def made() -> Awaitable[Response]:
        return _done(repo.report(chat_id, message_id, body.report_type, body.reason))

    return await once(idem, repo.session, made, _replay_done)


@router.post("/{chat_id}/messages/{message_id}/message_evals", response_class=Response, responses=_DONE)
async def message_eval(
    chat_id: str, message_id: str, body: MessageEvalRequest, repo: RepoDep, idem: Idempotency
) -> Response:
    """OA's choice between drafts: this assistant message was preferred over the listed siblings.
    Kept as a preference pair (``message_evals``) next to the votes."""
    repo.idempotency = idem

    def made() -> Awaitable[Response]:
        return _done(repo.message_eval(chat_id, message_id, body.inferior_message_ids))

    return await once(idem, repo.session, made, _replay_done)


async def _done(step: Awaitable[object]) -> Response:
    await step
    return Response(status_code=200)


async def _replay_done(_result: dict[str, Any]) -> Response:
    return Response(status_code=200)


@router.get("/{chat_id}/messages/{message_id}/events")
async def message_events_route(
    chat_id: str,
    message_id: str,
    request: Request,
    repo: RepoDep,
    state: StateDep,
    last_event_id: Annotated[str | None, Header()] = None,
) -> EventSourceResponse:
    msg = await repo.get_message(chat_id, message_id)
    if msg.role != "assistant":
        raise ApiError(ErrorCode.not_assistant_message, "only assistant messages have events")
    after = -1
    raw = last_event_id or request.query_params.get("last_event_id")
    if raw:
        try:
            after = int(raw)
        except ValueError as exc:
            raise ApiError(ErrorCode.bad_request, "Last-Event-ID must be a token index") from exc
    # Release the request's DB connection: the stream may last minutes and uses its own sessions.
    await repo.session.close()
    return EventSourceResponse(message_events(state, msg, after), ping=15)
