"""Anthropic Messages API (``POST /v1/messages``), stream or not, on the same chat trees and prefix
matching as ``/v1/chat/completions``: the request's ``system`` and ``messages`` are translated into chat
messages (``server/anthropic/translate.py``), continued and generated through the chat routes' pipeline
(``parse_messages`` -> ``admit`` -> ``ConversationStore.continue_path`` -> ``enqueue``), and the stored
reply is answered as an Anthropic message or its stream events (``server/anthropic/render.py``,
``streaming.py``). Errors use Anthropic's shape (``server/errors.py``); the SDK's ``x-api-key`` header
authenticates like ``Authorization: Bearer`` (``server/api/deps.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from server.anthropic.render import MessageContext
from server.anthropic.streaming import message_events
from server.anthropic.translate import parse, to_chat
from server.api.deps import CurrentUser, Idempotency, SessionDep, SessionHint, StateDep
from server.chats.admission import admit
from server.errors import ApiError
from server.openai.choices import collect
from server.openai.params import require_model, rpc_call, sampling_params, unsupported
from server.openai.render import dumps
from server.openai.streaming import event_stream
from server.openai.turns import replayed_turn, start_turn
from shared.anthropic_api import ANTHROPIC_ERROR_RESPONSES, CountTokensRequest, MessagesRequest
from shared.api import MAX_NEW_TOKENS_LIMIT, check_tools
from shared.errors import ErrorCode
from shared.openai_api import SamplingKnobs

router = APIRouter(tags=["anthropic"])

# Fields that would change the output in ways tokentrail cannot honour (refused, never dropped).
_REFUSED = {
    "output_format": "structured output is not supported",
    "mcp_servers": "MCP servers are not supported; run the tools in the client",
    "container": "containers (server tools) are not supported",
}


def _refuse_unsupported(body: CountTokensRequest) -> None:
    extra = body.model_extra or {}
    for name, why in _REFUSED.items():
        if extra.get(name) is not None:
            raise unsupported(name, why)
    config = extra.get("output_config")
    if isinstance(config, dict) and config.get("format") is not None:
        raise unsupported("output_config.format", "structured output is not supported")


@router.post("/v1/messages", responses=ANTHROPIC_ERROR_RESPONSES)
async def create_message(
    body: MessagesRequest,
    user: CurrentUser,
    session: SessionDep,
    state: StateDep,
    hint: SessionHint,
    idem: Idempotency,
) -> Response:
    replayed = await replayed_turn(state, session, idem)  # a retry: answered as the first request was
    if replayed is None:
        await require_model(state, body.model)
    _refuse_unsupported(body)
    request = to_chat(body.system, body.messages, body.tools, body.tool_choice)
    try:
        tools = check_tools(request.tools) or None
    except ValueError as exc:
        raise ApiError(ErrorCode.validation_error, str(exc), param="tools", status_code=400) from exc
    conv = parse(request)
    stops = body.stop_sequences or []
    knobs = SamplingKnobs(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=stops, seed=body.seed)
    # max_tokens is an upper bound: tokentrail's own ceiling (and the model's context) may end sooner
    sampling = sampling_params(knobs, min(body.max_tokens, MAX_NEW_TOKENS_LIMIT), 0)
    kwargs = body.chat_template_kwargs or None
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
        conversation_id=body.conversation_id,
        template_kwargs=kwargs,
        required_prefix_ids=body.required_prefix_token_ids,
        session_key=hint,
    )
    message_id = turn.message_ids[0]
    info: dict[str, Any] = {"chat_id": turn.chat_id, "message_id": message_id}
    info |= {k: v for k, v in turn.info().items() if k not in ("chat_id", "message_ids")}
    ctx = MessageContext(body.model, request.with_tools, stops, info, turn.forked)
    if body.stream:
        return event_stream(message_events(ctx, state, message_id), state.metrics)
    done, _ = await collect(state, message_id)
    return Response(dumps(ctx.body(done)), media_type="application/json")


@router.post("/v1/messages/count_tokens", responses=ANTHROPIC_ERROR_RESPONSES)
async def count_tokens(body: CountTokensRequest, state: StateDep, _user: CurrentUser) -> dict[str, Any]:
    """The prompt length of the conversation as the model's template renders it fresh (a worker's
    ``/tokenize``); a continued chat's stitched prompt may differ by the tokens the model wrote."""
    await require_model(state, body.model)
    _refuse_unsupported(body)
    request = to_chat(body.system, body.messages, body.tools, body.tool_choice)
    parse(request)  # refused as /v1/messages would refuse it
    params: dict[str, Any] = {
        "messages": request.messages,
        "tools": request.tools,
        "documents": None,
        "chat_template": None,
        "chat_template_kwargs": body.chat_template_kwargs,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
        "return_token_strs": False,
        "return_assistant_mask": False,
    }
    result = await rpc_call(state, body.model, "render_chat", params)
    return {"input_tokens": len(result.get("tokens") or [])}
