"""Anthropic message bodies built from a stored reply, and the pieces its stream events share.

A reply is one Anthropic ``message``: its id is ``msg_`` + the stored message id, its content blocks
``thinking`` (the reasoning; ``signature`` is empty: there is nothing to verify), ``text`` and
``tool_use`` (the tool call's id, name and arguments as an object), in that order.

``usage`` follows Anthropic's arithmetic: ``input_tokens + cache_read_input_tokens`` is the prompt
(the engine's prefix-cache hits are the cache reads; nothing is written to a cache on request, so
``cache_creation_input_tokens`` is 0). The token fields ride as extensions: ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` at the top (as NeMo Gym reads them), and
``tokentrail`` with where the request landed in the chat tree (as on the chat routes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from server.anthropic.translate import tool_input
from server.chats.finished import Finished
from server.errors import anthropic_error_body
from server.models import Message, MessageTokens
from server.openai.render import failure, finite, stop_reason, stored_logprobs, tokentrail_info
from shared.api import MessageState
from shared.packing import unpack_ids

SIGNATURE = ""  # thinking blocks carry no signature: tokentrail ignores the one echoed back


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames them: its name, then its data."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(status: int, message: str, code: str) -> bytes:
    return event("error", anthropic_error_body(status, message, code))


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", {})
    return {
        "type": "tool_use",
        "id": str(call.get("id")),
        "name": str(fn.get("name")),
        "input": tool_input(str(fn.get("arguments") or "{}")),
    }


def usage(prompt: int, output: int, cached: int | None) -> dict[str, int]:
    cached = min(cached or 0, prompt)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": output,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def token_fields(tokens: MessageTokens) -> dict[str, Any]:
    return {
        "prompt_token_ids": unpack_ids(tokens.prompt_ids),
        "generation_token_ids": unpack_ids(tokens.completion_ids),
        "generation_log_probs": [finite(lp) for lp in stored_logprobs(tokens)],
    }


@dataclass
class MessageContext:
    """What rendering one request's reply needs."""

    model: str
    with_tools: bool  # tool_choice is not "none"
    stops: list[str]  # the request's stop_sequences
    request_info: dict[str, Any]  # chat_id, message_ids, matched_messages, new_messages, parent_id
    forked: bool

    def message_id(self, message_id: str) -> str:
        return f"msg_{message_id}"

    def calls(self, msg: Message) -> list[dict[str, Any]]:
        return list(msg.tool_calls or []) if self.with_tools else []

    def stop(self, msg: Message, tokens: MessageTokens) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``."""
        if msg.finish_reason == "length":
            return "max_tokens", None
        if self.calls(msg):
            return "tool_use", None
        reason = stop_reason(tokens)
        if isinstance(reason, str) and reason in self.stops:
            return "stop_sequence", reason
        return "end_turn", None

    def info(self, done: Finished) -> dict[str, Any]:
        return {**self.request_info, **tokentrail_info(done.message, done.tokens, forked=self.forked)}

    def shell(self, message_id: str, usage_now: dict[str, int]) -> dict[str, Any]:
        """The message without content or stop reason (``message_start``)."""
        return {
            "id": self.message_id(message_id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_now,
            "tokentrail": self.request_info,
        }

    def body(self, done: Finished) -> dict[str, Any]:
        msg, tokens = done.message, done.tokens
        if msg.state != MessageState.complete.value or tokens is None:
            raise failure(msg)
        content: list[dict[str, Any]] = []
        if msg.reasoning_content:
            content.append({"type": "thinking", "thinking": msg.reasoning_content, "signature": SIGNATURE})
        calls = self.calls(msg)
        if msg.content or not calls:
            content.append({"type": "text", "text": msg.content or ""})
        content += [tool_use_block(c) for c in calls]
        reason, sequence = self.stop(msg, tokens)
        fields = token_fields(tokens)
        used = usage(len(fields["prompt_token_ids"]), len(fields["generation_token_ids"]), tokens.num_cached_tokens)
        return {
            **self.shell(msg.id, used),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            **fields,
            "tokentrail": self.info(done),
        }
