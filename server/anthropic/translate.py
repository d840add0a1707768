"""Anthropic ``system``, ``messages``, ``tools`` and ``tool_choice`` as the chat messages and tools of
``/v1/chat/completions``, so that one pipeline (``parse_messages``, ``ConversationStore``) serves both.

- ``system``: a string or text blocks (joined with ``JOIN``) -> the system message;
- a user turn: its ``tool_result`` blocks -> ``tool`` messages (in order), then its text blocks, if
  any, -> one user message after them; ``is_error`` is accepted and not rendered (chat templates have
  no place for it: say so in the result's text);
- an assistant turn: text blocks -> ``content``, ``thinking`` blocks -> ``reasoning_content`` (the
  ``signature`` is ignored), ``tool_use`` blocks -> ``tool_calls`` with the input as JSON arguments;
- other block types (``image``, ``document``, ``redacted_thinking``, server tools...) -> a 400 naming
  the block; ``cache_control`` and ``citations`` on blocks are ignored.

The translation is deterministic, so a client that echoes a conversation back (content blocks as the
API returned them) gets the same chat messages, and the stored prefix matches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from server.errors import ApiError
from server.openai.conversations import Conversation, parse_messages
from server.openai.params import unsupported
from shared.errors import ErrorCode

JOIN = "\n"  # between text blocks of one turn (vLLM joins text parts so)
RAW_ARGUMENTS = "$raw"  # a tool_use input standing for tool-call arguments that are not a JSON object
_TOOL_TYPES = (None, "custom")


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # chat messages, the system message first when there is one
    origins: list[str]  # for each chat message, the Anthropic field it came from
    tools: list[dict[str, Any]] | None
    with_tools: bool  # tool_choice is not "none": tool calls are reported as tool_use blocks


def _bad(message: str, param: str) -> ApiError:
    return ApiError(ErrorCode.invalid_messages, message, param=param)


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, Mapping):
        raise _bad("a content block must be an object", param)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad("a content block needs a 'type'", f"{param}.type")
    return kind


def _not_supported(kind: str, param: str, where: str) -> ApiError:
    return _bad(f"{kind!r} content blocks are not supported {where}: tokentrail serves text models", f"{param}.type")


def _text(block: Mapping[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad("a text block needs a string 'text'", f"{param}.text")
    return text


def _texts(content: Any, param: str, where: str) -> str:
    """A string, or text blocks joined; None is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks", param)
    parts = []
    for k, block in enumerate(content):
        kind = _block_type(block, f"{param}[{k}]")
        if kind != "text":
            raise _not_supported(kind, f"{param}[{k}]", where)
        parts.append(_text(block, f"{param}[{k}]"))
    return JOIN.join(parts)


def system_prompt(system: str | list[dict[str, Any]] | None) -> str | None:
    text = _texts(system, "system", "in system")
    return text or None


def tool_arguments(value: Any, param: str) -> str:
    """A tool_use ``input`` as the arguments text of a tool call (``tool_input`` reversed)."""
    if not isinstance(value, Mapping):
        raise _bad("a tool_use input must be an object", param)
    raw = value.get(RAW_ARGUMENTS)
    if len(value) == 1 and isinstance(raw, str):
        return raw
    return json.dumps(value, ensure_ascii=False)


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as a tool_use ``input``: the JSON object they hold, else the text as
    ``{"$raw": text}`` (Anthropic's input is always an object; echoed back, it is the same call)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {RAW_ARGUMENTS: arguments}


def _blocks(content: Any, param: str) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """(param, type, block) of each content block of a message's block list."""
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of content blocks", f"{param}.content")
    for k, block in enumerate(content):
        at = f"{param}.content[{k}]"
        yield at, _block_type(block, at), block


def _user_turn(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for at, kind, block in _blocks(content, param):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool_result block needs its tool_use_id", f"{at}.tool_use_id")
            text = _texts(block.get("content"), f"{at}.content", "in a tool_result")
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _not_supported(kind, at, "in user messages")
    if texts or not results:
        results.append({"role": "user", "content": JOIN.join(texts)})
    return results


def _assistant_turn(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, kind, block in _blocks(content, param):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                raise _bad("a thinking block needs a string 'thinking'", f"{at}.thinking")
            thinking.append(text)
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not call_id:
                raise _bad("a tool_use block needs an id", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise _bad("a tool_use block needs a name", f"{at}.name")
            arguments = tool_arguments(block.get("input"), f"{at}.input")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            raise _not_supported(kind, at, "in assistant messages")
    message: dict[str, Any] = {"role": "assistant", "content": JOIN.join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = JOIN.join(thinking)
    return message


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in _TOOL_TYPES:
            raise unsupported(f"tools[{k}].type", f"{kind!r} tools are not supported; only custom tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(ErrorCode.validation_error, "a tool needs a name", param=f"tools[{k}].name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise ApiError(
                ErrorCode.validation_error, "a tool needs an input_schema object", param=f"tools[{k}].input_schema"
            )
        fn: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def _with_tools(choice: dict[str, Any] | None) -> bool:
    kind = None if choice is None else choice.get("type")
    if kind in (None, "auto"):
        return True
    if kind == "none":
        return False
    raise unsupported("tool_choice", f"type {kind!r}: tokentrail does not constrain decoding; use auto or none")


def to_chat(
    system: str | list[dict[str, Any]] | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: dict[str, Any] | None,
) -> ChatRequest:
    with_tools = _with_tools(tool_choice)
    chat: list[dict[str, Any]] = []
    origins: list[str] = []
    prompt = system_prompt(system)
    if prompt is not None:
        chat.append({"role": "system", "content": prompt})
        origins.append("system")
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _bad("each message must be an object", param)
        role = m.get("role")
        if role == "user":
            turn = _user_turn(m.get("content"), param)
        elif role == "assistant":
            turn = [_assistant_turn(m.get("content"), param)]
        else:
            raise _bad(f"unsupported role {role!r}: user or assistant (the system prompt is 'system')", f"{param}.role")
        chat += turn
        origins += [param] * len(turn)
    if messages[-1].get("role") != "user":
        raise _bad(
            "the last message must be a user message: continuing a final assistant message (prefill) is not supported",
            f"messages[{len(messages) - 1}].role",
        )
    return ChatRequest(chat, origins, _tools(tools), with_tools)


_CHAT_PARAM = re.compile(r"^messages\[(\d+)\]")


def parse(request: ChatRequest) -> Conversation:
    """``parse_messages`` of the translated messages; an error names the Anthropic message."""
    try:
        return parse_messages(request.messages)
    except ApiError as exc:
        found = _CHAT_PARAM.match(exc.param or "")
        if found is None or int(found.group(1)) >= len(request.origins):
            raise
        origin = request.origins[int(found.group(1))]
        raise ApiError(exc.code, exc.detail, headers=exc.headers, param=origin, status_code=exc.status_code) from exc
