"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, answered by a worker of the model.

The server stays model-agnostic: it forwards the call over the worker websocket (``rpc`` frames). A chat
(``messages``) is rendered the way the worker renders a fresh prompt (message text never becomes
control tokens), with the request's ``chat_template``, ``chat_template_kwargs``, ``tools`` and
``documents``; ``return_assistant_mask`` adds which tokens an assistant turn generated.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.api.deps import CurrentUser, StateDep
from server.errors import ApiError
from server.openai.params import resolve_model, rpc_call
from shared.api import MAX_TOOLS
from shared.errors import ErrorCode
from shared.openai_api import MAX_MESSAGES, DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["openai"])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep, _user: CurrentUser) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(ErrorCode.validation_error, "give either prompt or messages", param="prompt", status_code=400)
    model = await resolve_model(state, body.model)
    if body.prompt is not None:
        params: dict[str, Any] = {
            "prompt": body.prompt,
            "add_special_tokens": True if body.add_special_tokens is None else body.add_special_tokens,
            "return_token_strs": body.return_token_strs,
        }
        result = await rpc_call(state, model, "tokenize", params)
    else:
        assert body.messages is not None
        if not body.messages or len(body.messages) > MAX_MESSAGES:
            raise ApiError(
                ErrorCode.invalid_messages, f"messages must hold 1 to {MAX_MESSAGES} messages", param="messages"
            )
        if body.tools is not None and len(body.tools) > MAX_TOOLS:
            raise ApiError(ErrorCode.validation_error, f"at most {MAX_TOOLS} tools", param="tools", status_code=400)
        params = {
            "messages": body.messages,
            "tools": body.tools,
            "documents": body.documents,
            "chat_template": body.chat_template,
            "chat_template_kwargs": body.chat_template_kwargs,
            "add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "add_special_tokens": bool(body.add_special_tokens),  # the template writes BOS itself
            "return_token_strs": body.return_token_strs,
            "return_assistant_mask": body.return_assistant_mask,
        }
        result = await rpc_call(state, model, "render_chat", params)
    tokens = result.get("tokens") or []
    offered = (await state.catalog.offered()).get(model)
    return {
        "count": len(tokens),
        "max_model_len": offered.max_context if offered else None,
        **result,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep, _user: CurrentUser) -> dict[str, Any]:
    model = await resolve_model(state, body.model)
    return await rpc_call(state, model, "detokenize", {"tokens": body.tokens})
