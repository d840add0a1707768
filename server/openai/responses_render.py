"""Responses API bodies built from a stored assistant message (``/v1/responses``).

One assistant message is one response: its id is ``resp_<message id>`` (``previous_response_id`` and
``GET /v1/responses/{id}`` take it, or the bare message id). Its output items, in OpenAI's shapes and
order: a ``reasoning`` item (the parsed reasoning as one ``summary_text``) when the reply reasoned, a
``message`` item (one ``output_text``) when it has content or nothing else, and one ``function_call``
item per tool call (``call_id`` is the stored call id). The last output item carries the token fields
NeMo Gym reads: ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.models import Message, MessageTokens
from server.openai.render import failure, finite, stored_logprobs
from shared.api import MessageState
from shared.errors import ErrorCode
from shared.packing import unpack_ids

RESPONSE_PREFIX = "resp_"


def response_id(message_id: str) -> str:
    return RESPONSE_PREFIX + message_id


def message_id_of(response_id: str) -> str:
    return response_id.removeprefix(RESPONSE_PREFIX)


def reasoning_item(message_id: str, text: str) -> dict[str, Any]:
    return {
        "id": f"rs_{message_id}",
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}],
        "encrypted_content": None,
        "status": "completed",
    }


def message_item(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": f"msg_{message_id}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(message_id: str, index: int, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function", {})
    return {
        "id": f"fc_{message_id}_{index}",
        "type": "function_call",
        "call_id": str(call.get("id")),
        "name": fn.get("name"),
        "arguments": fn.get("arguments") or "",
        "status": status,
    }


def token_fields(tokens: MessageTokens) -> dict[str, Any]:
    return {
        "prompt_token_ids": unpack_ids(tokens.prompt_ids),
        "generation_token_ids": unpack_ids(tokens.completion_ids),
        "generation_log_probs": [finite(lp) for lp in stored_logprobs(tokens)],
    }


def item_status(msg: Message) -> str:
    return "incomplete" if msg.finish_reason == "length" else "completed"


def output_items(msg: Message, tokens: MessageTokens | None, *, with_tools: bool) -> list[dict[str, Any]]:
    """The output items of a completed message; the token fields on the last."""
    items = []
    if msg.reasoning_content:
        items.append(reasoning_item(msg.id, msg.reasoning_content))
    calls = (msg.tool_calls or []) if with_tools else []
    if msg.content or not calls:
        items.append(message_item(msg.id, msg.content or "", item_status(msg)))
    items += [function_call_item(msg.id, k, call) for k, call in enumerate(calls)]
    if tokens is not None:
        items[-1].update(token_fields(tokens))
    return items


def usage(tokens: MessageTokens | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    prompt, completion = len(unpack_ids(tokens.prompt_ids)), len(unpack_ids(tokens.completion_ids))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": tokens.num_cached_tokens or 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        # the engines report no per-channel counts: reasoning tokens are in output_tokens
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def error_body(msg: Message) -> dict[str, Any]:
    """A failed message as the response object's ``error`` (OpenAI's codes; tokentrail's in the text)."""
    exc = failure(msg)
    prompt_error = exc.code in (ErrorCode.context_overflow, ErrorCode.bad_request, ErrorCode.template_rejected)
    return {"code": "invalid_prompt" if prompt_error else "server_error", "message": f"{exc.code.value}: {exc.detail}"}


@dataclass
class Echo:
    """The request fields a response object repeats."""

    model: str
    created_at: int
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    store: bool = True
    reasoning: dict[str, Any] | None = None

    def body(
        self,
        rid: str,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        tokentrail: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning,
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": self.user,
        }
        if tokentrail is not None:
            out["tokentrail"] = tokentrail
        return out


def status_of(msg: Message) -> str:
    if msg.state == MessageState.complete.value:
        return item_status(msg)
    if msg.state in (MessageState.pending.value, MessageState.in_progress.value):
        return "in_progress"
    if msg.state == MessageState.cancelled.value:
        return "cancelled"
    return "failed"
