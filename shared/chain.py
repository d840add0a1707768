"""The prefix index of OpenAI-style conversations (DESIGN D12): a hash chain of normalized messages.

Every message stored through the OpenAI API carries ``chain_hash = H(parent's chain_hash, normalized
message)``; a root message hashes onto a seed made of the user, the model, the system prompt, the tools
and the chat-template arguments. A request's messages are hashed the same way, prefix by prefix, and
the longest prefix whose hash is stored is the conversation to continue: a few indexed lookups whatever
the number of stored chats.

Normalization makes equal what clients change when they echo a conversation back:

- content ``None``, ``""`` and a list of text parts with the same text are equal;
- an assistant message is compared by its visible content (surrounding whitespace ignored: streamed
  deltas may carry it) and its tool calls (name and arguments parsed as JSON, key order ignored); its
  reasoning (under any name) and tool-call ids are left out, so it matches echoed with or without them;
- a tool result is compared by its content (its call id is left out: some clients rename ids).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CHAIN_VERSION = "tokentrail-chain-1"


class MessageFormatError(ValueError):
    """A message cannot be understood; ``param`` names the offending field (OpenAI error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def text_content(content: Any, param: str = "content") -> str:
    """The text of an OpenAI message ``content``: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MessageFormatError(f"only text content parts are supported, got {kind!r}", f"{param}[{k}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise MessageFormatError("a text part needs a string 'text'", f"{param}[{k}].text")
            parts.append(text)
        return "".join(parts)
    raise MessageFormatError("content must be a string, null or a list of text parts", param)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON (sorted keys); text that is not JSON is kept as given."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return json.dumps({"$raw": arguments})
    if arguments is None:
        arguments = {}
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def tool_call_key(call: Mapping[str, Any]) -> tuple[str, str]:
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise MessageFormatError("a tool call needs a 'function' object", "tool_calls")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise MessageFormatError("a tool call needs a function name", "tool_calls")
    return name, canonical_arguments(fn.get("arguments"))


def normalized(role: str, content: Any, tool_calls: Sequence[Mapping[str, Any]] | None = None) -> list[Any]:
    """The comparable form of one non-system message (see the module docstring)."""
    text = text_content(content)
    if role == "assistant":
        return ["assistant", text.strip(), [list(tool_call_key(c)) for c in tool_calls or []]]
    if role in ("user", "tool"):
        return [role, text]
    raise MessageFormatError(f"role {role!r} has no place in a conversation path", "role")


def _digest(parts: list[Any]) -> str:
    raw = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def chain_seed(
    user_id: str,
    model: str,
    system_prompt: str | None,
    tools: Sequence[Any] | None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """What a root message hashes onto: a different system prompt, tool list or template arguments
    start a different conversation."""
    return _digest([CHAIN_VERSION, user_id, model, system_prompt or "", list(tools or []), dict(template_kwargs or {})])


def chain_hash(parent: str, message: list[Any]) -> str:
    return _digest([parent, message])


def chain_hashes(seed: str, messages: Iterable[list[Any]]) -> list[str]:
    """The chain hash of every prefix: ``out[k]`` is the hash of messages ``0..k``."""
    out = []
    current = seed
    for m in messages:
        current = chain_hash(current, m)
        out.append(current)
    return out
