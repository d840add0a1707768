"""OpenAI's Responses API translated onto the chat-completions pipeline (``/v1/responses``).

The request side turns ``instructions``, ``input`` items and ``tools`` into the chat messages and
tools ``parse_messages`` and ``ConversationStore.continue_path`` take, so a Responses request lands on
the same stored trees and prefix matching as a chat request:

- ``instructions`` and the system/developer messages that open the input form the system prompt
  (joined by a blank line);
- one assistant turn is split by Responses into several items, in the order ``reasoning``, ``message``,
  ``function_call``...; consecutive assistant-side items in that order are merged back into one
  assistant message (reasoning -> ``reasoning_content``, output text -> ``content``, function calls ->
  ``tool_calls`` with ``call_id`` as the call id); an item out of that order starts the next turn;
- ``function_call_output`` items are tool messages;
- token ids echoed on input items (NeMo Gym's ``prompt_token_ids`` + ``generation_token_ids``, on the
  last item of a call) become NeMo-RL's ``required_prefix_token_ids``: checked by the worker against
  the stored chain, reported as ``tokentrail.prompt_check``, never used to generate.

Errors name the Responses field (``input[3].call_id``), not the translated message.

The response side (output items, the response object) is ``responses_render.py``; streaming is
``responses_stream.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from server.errors import ApiError
from server.openai.conversations import Conversation, parse_messages
from server.openai.params import unsupported
from shared.api import check_tools
from shared.chain import MessageFormatError, text_content
from shared.errors import ErrorCode
from shared.responses_api import ResponsesRequest

SUPPORTED_ITEMS = "message, function_call, function_call_output, reasoning"
_TURN_ORDER = {"reasoning": 1, "message": 2, "function_call": 3}
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_PARAM_IN_TEXT = re.compile(r"messages\[\d+\](?:[\w.\[\]]*[\w\]])?")


def _bad(message: str, param: str) -> ApiError:
    return ApiError(ErrorCode.invalid_messages, f"{param}: {message}", param=param)


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Fields tokentrail cannot honour, refused with the field named (never silently dropped)."""
    choice = body.tool_choice
    if isinstance(choice, dict) or choice not in (None, "auto", "none"):
        raise unsupported("tool_choice", "tokentrail does not constrain decoding: use auto or none")
    if body.n != 1:
        raise unsupported("n", "a response has one output; send several requests")
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise unsupported("text.format", "structured output is not supported; omit it or use type text")
    if body.background:
        raise unsupported("background", "background responses are not supported; use stream")
    if body.truncation not in (None, "disabled"):
        raise unsupported("truncation", "only disabled: tokentrail never drops input items")
    if body.conversation is not None:
        raise unsupported("conversation", "use previous_response_id (or tokentrail's conversation_id)")
    if body.prompt is not None:
        raise unsupported("prompt", "prompt templates are not supported; send instructions and input")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "logprobs come as generation_log_probs on the last output item")
    if "message.output_text.logprobs" in (body.include or []):
        raise unsupported("include", "logprobs come as generation_log_probs on the last output item")
    if body.previous_response_id is not None and body.conversation_id is not None:
        raise ApiError(
            ErrorCode.validation_error,
            "give previous_response_id or conversation_id, not both",
            param="conversation_id",
            status_code=400,
        )


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools (``{type, name, description, parameters, strict}``) in the chat shape
    (``{type, function: {name, description, parameters}}``); the chat shape is taken as it is.
    ``strict`` is dropped: tokentrail does not constrain decoding."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for k, tool in enumerate(tools):
        param = f"tools[{k}]"
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"{param}.type", f"only function tools are supported, got {kind!r}")
        nested = tool.get("function")
        if isinstance(nested, dict):
            out.append({"type": "function", "function": nested})
            continue
        fn: dict[str, Any] = {"name": tool.get("name")}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    try:
        return check_tools(out) or None
    except ValueError as exc:
        raise ApiError(ErrorCode.validation_error, str(exc), param="tools", status_code=400) from exc


def response_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """Chat-shaped tools as the response object lists them (OpenAI's ``FunctionTool``)."""
    out = []
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        out.append(
            {
                "type": "function",
                "name": fn.get("name"),
                "description": fn.get("description"),
                "parameters": fn.get("parameters"),
                "strict": None,
            }
        )
    return out


@dataclass
class Translated:
    """The chat messages of a request, where each came from, and the prefix its echoed tokens require."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    # per message: the Responses field it came from, and for a merged assistant turn where its
    # content and each of its tool calls came from
    origins: list[dict[str, str]] = field(default_factory=list)
    required_prefix: list[int] | None = None

    def add(self, message: dict[str, Any], origin: str, **parts: str) -> None:
        self.messages.append(message)
        self.origins.append({"": origin, **parts})

    def param(self, param: str | None) -> str | None:
        """A ``messages[i]...`` param of ``parse_messages`` as the Responses field it came from."""
        if param is None:
            return None
        m = _MESSAGE_PARAM.match(param)
        if m is None:
            return "input" if param == "messages" else param
        index, rest = int(m.group(1)), param[m.end() :]
        if index >= len(self.origins):
            return "input"
        origin = self.origins[index]
        calls = re.match(r"^\.tool_calls\[(\d+)\]", rest)
        if calls is not None and f"call{calls.group(1)}" in origin:
            return origin[f"call{calls.group(1)}"] + rest[calls.end() :]
        if rest.startswith(".content") and "content" in origin:
            return origin["content"] + rest[len(".content") :]
        return origin[""] + rest.replace(".tool_call_id", ".call_id")


def _text_of(parts: Any, kind: str) -> str | None:
    if not isinstance(parts, list):
        return None
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
    return "\n\n".join(t for t in texts if isinstance(t, str)) or None


def _ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad("must be a list of token ids", param)
    return value


def translate(
    body: ResponsesRequest,
    *,
    history: list[dict[str, Any]] | None = None,
    system_prompt: str | None = None,
) -> Translated:
    """The request as chat messages: the system prompt, ``history`` (the stored path that
    ``previous_response_id`` names), then the input items."""
    out = Translated()
    items: list[Any] = (
        [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    )
    system: list[str] = []
    origin = "instructions"
    if body.instructions is not None:
        system.append(body.instructions)
    elif system_prompt is not None:
        system.append(system_prompt)
        origin = "previous_response_id"
    start = 0
    if history is None:  # system and developer messages that open the input join the system prompt
        while start < len(items):
            item = items[start]
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                break
            if item.get("role") not in ("system", "developer"):
                break
            system.append(_checked_text(item.get("content"), f"input[{start}].content"))
            origin = "instructions" if body.instructions is not None else f"input[{start}]"
            start += 1
    if system:
        out.add({"role": "system", "content": "\n\n".join(system)}, origin)
    for message in history or []:
        out.add(message, "previous_response_id")

    turn: dict[str, Any] | None = None
    turn_origin: dict[str, str] = {}
    stage = 0

    def flush() -> None:
        nonlocal turn, stage
        if turn is not None:
            out.add(turn, turn_origin[""], **{k: v for k, v in turn_origin.items() if k})
        turn, stage = None, 0

    def open_turn(k: int, kind: str) -> dict[str, Any]:
        nonlocal turn, turn_origin, stage
        if turn is None or (stage >= _TURN_ORDER[kind] and not (kind == "function_call" and stage == 3)):
            flush()
            turn, turn_origin = {"role": "assistant", "content": None}, {"": f"input[{k}]"}
        stage = _TURN_ORDER[kind]
        assert turn is not None
        return turn

    for k, item in enumerate(items[start:], start):
        param = f"input[{k}]"
        if not isinstance(item, dict):
            raise _bad("an input item must be an object", param)
        kind = item.get("type") or ("message" if "role" in item else None)
        if "prompt_token_ids" in item:
            prompt = _ids(item["prompt_token_ids"], f"{param}.prompt_token_ids")
            out.required_prefix = prompt + _ids(item.get("generation_token_ids", []), f"{param}.generation_token_ids")
        if kind == "message":
            if item.get("role") == "assistant":
                msg = open_turn(k, "message")
                msg["content"] = item.get("content")
                turn_origin["content"] = f"{param}.content"
            else:
                flush()
                out.add({"role": item.get("role"), "content": item.get("content")}, param)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call needs its call_id", f"{param}.call_id")
            if not isinstance(name, str) or not name:
                raise _bad("a function_call needs its name", f"{param}.name")
            if not isinstance(arguments, str):
                raise _bad("arguments must be a string of JSON", f"{param}.arguments")
            msg = open_turn(k, "function_call")
            calls = msg.setdefault("tool_calls", [])
            turn_origin[f"call{len(calls)}"] = param
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a function_call_output needs the call_id of its function_call", f"{param}.call_id")
            flush()
            out.add(
                {"role": "tool", "tool_call_id": call_id, "content": item.get("output")},
                param,
                content=f"{param}.output",
            )
        elif kind == "reasoning":
            msg = open_turn(k, "reasoning")
            text = _text_of(item.get("summary"), "summary_text") or _text_of(item.get("content"), "reasoning_text")
            if text is not None:
                msg["reasoning_content"] = text
        elif kind is None:
            raise _bad("an input item needs a type (or a role for a message)", f"{param}.type")
        else:
            raise _bad(
                f"input items of type {kind!r} are not supported; tokentrail takes {SUPPORTED_ITEMS}", f"{param}.type"
            )
    flush()
    return out


def _checked_text(content: Any, param: str) -> str:
    try:
        return text_content(content, param)
    except MessageFormatError as exc:
        raise _bad(str(exc), exc.param or param) from exc


def conversation(tr: Translated) -> Conversation:
    """``parse_messages`` of the translated messages, its errors naming the Responses fields."""
    try:
        return parse_messages(tr.messages)
    except ApiError as exc:
        param = tr.param(exc.param)
        detail = _PARAM_IN_TEXT.sub(lambda m: tr.param(m.group(0)) or "input", exc.detail)
        if param is not None and param not in detail:
            detail = f"{param}: {detail}"
        raise ApiError(exc.code, detail, param=param, status_code=exc.status_code) from exc
