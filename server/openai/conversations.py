"""OpenAI-style requests onto stored chat trees (DESIGN D12).

A request carries the whole conversation. ``parse_messages`` turns it into a system prompt and a path
of user, assistant and tool messages; ``ConversationStore.continue_path`` finds the longest stored path
of the user (and model, system prompt, tools, template arguments) that equals a prefix of it, through
the chain-hash index (``shared/chain.py``), appends the rest as new messages and creates the assistant
messages to generate. The worker then stitches the prompt from the stored tokens of that path.

- a request that matches nothing starts a new chat (or new roots in the chat ``conversation_id`` pins);
- messages after the matched prefix are stored as given: user and tool messages as written, assistant
  messages the client wrote or edited as ``manual`` assistant messages without tokens (the worker's
  prompt then forks: a full render, recorded);
- the new messages branch off the matched message; when it already had other continuations the
  response says ``forked`` (an edited or alternative history is recorded as a branch, never spliced).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.chats.repository import message_row, pending_assistant
from server.errors import ApiError
from server.hot_sql import HotSql, Step
from server.idempotency import KeyTaken
from server.models import CHATS, MESSAGES, Chat, Message, new_id, utcnow
from server.sql_lists import in_list, list_param, state_in
from shared.api import MAX_CONTENT_CHARS, MAX_TOOL_ARGUMENTS_CHARS, MessageState, SamplingParameters, WorkParameters
from shared.chain import (
    MessageFormatError,
    chain_hash,
    chain_hashes,
    chain_seed,
    normalized,
    text_content,
    tool_call_key,
)
from shared.errors import ErrorCode

_REASONING_FIELDS = ("reasoning_content", "reasoning", "reasoning_text", "thinking")
_TREE_ROLE = {"user": "prompter", "assistant": "assistant", "tool": "tool"}
_MATCHABLE = (MessageState.manual, MessageState.complete)


@dataclass
class PathMessage:
    role: str  # user | assistant | tool
    content: str
    norm: list[Any]
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    tool_call_id: str | None = None


@dataclass
class Conversation:
    system_prompt: str | None
    path: list[PathMessage]


@dataclass
class Continued:
    chat_id: str
    assistants: list[Message]
    matched: int  # request messages (system prompt excluded) found stored
    forked: bool  # the new messages branch off a stored message that had other continuations
    new_messages: int = 0
    parent_id: str | None = None
    stored: list[Message] = field(default_factory=list)  # the request's new messages, root side first
    lineage: str = "root"  # extended | forked | root
    lineage_stop: str = "no_stored_prefix"  # why the match stopped where it did (``lineage``)
    prefix_break: bool = False  # the request's history left the stored path
    holder: str | None = None  # the worker that generated the matched message (an assistant one)

    def lineage_info(self) -> dict[str, Any]:
        return {"decision": self.lineage, "matched_messages": self.matched, "stopped": self.lineage_stop}


def lineage(conv: Conversation, matched: int, found: bool, forked: bool) -> tuple[str, str, bool]:
    """How a request met the stored tree: (decision, why the match stopped, prefix break).

    ``extended``: the stored path ends where the request's new messages begin (``end_of_stored_path``),
    or the whole request was stored (``all_stored``: a regeneration); ``forked``: the stored path goes
    on differently at the request's message ``matched`` (``differs_from_stored_<role>``: an edited,
    re-rendered or alternative history); ``root``: nothing stored matched (``no_stored_prefix``). A
    fork, or a root that echoes assistant messages, is a prefix break: a trainer sees the client's
    history leave what the model produced."""
    if not found:
        history = any(m.role == "assistant" for m in conv.path)
        return "root", "no_stored_prefix", history
    if forked:
        return "forked", f"differs_from_stored_{conv.path[matched].role}", True
    return "extended", "all_stored" if matched == len(conv.path) else "end_of_stored_path", False


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(ErrorCode.invalid_messages, message, param=param)


def _tool_calls(raw: Any, param: str) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tool_calls must be a list", param)
    calls = []
    for k, call in enumerate(raw):
        if not isinstance(call, dict):
            raise _bad("a tool call must be an object", f"{param}[{k}]")
        name, _ = tool_call_key(call)
        fn = call.get("function", call)
        args = fn.get("arguments")
        text = args if isinstance(args, str) else _dumps(args or {})
        if len(text) > MAX_TOOL_ARGUMENTS_CHARS:
            raise _bad(f"tool call arguments are limited to {MAX_TOOL_ARGUMENTS_CHARS} characters", f"{param}[{k}]")
        calls.append(
            {
                "id": str(call.get("id") or f"call_{k}"),
                "type": "function",
                "function": {"name": name, "arguments": text},
            }
        )
    return calls or None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_messages(messages: list[dict[str, Any]]) -> Conversation:
    """The request's system prompt and path; ApiError(invalid_messages) names the offending field."""
    system: str | None = None
    path: list[PathMessage] = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad("each message must be an object", param)
        role = m.get("role")
        try:
            content = text_content(m.get("content"), f"{param}.content")
            if len(content) > MAX_CONTENT_CHARS:
                raise ApiError(
                    ErrorCode.content_too_long,
                    f"{param}.content has {len(content)} characters; the limit is {MAX_CONTENT_CHARS}",
                    param=f"{param}.content",
                )
            if role in ("system", "developer"):
                if i != 0:
                    raise _bad("a system or developer message is supported only as the first message", param)
                system = content
                continue
            if role == "user":
                path.append(PathMessage("user", content, normalized("user", content)))
            elif role == "assistant":
                calls = _tool_calls(m.get("tool_calls"), f"{param}.tool_calls")
                reasoning = next((m[k] for k in _REASONING_FIELDS if isinstance(m.get(k), str)), None)
                path.append(
                    PathMessage("assistant", content, normalized("assistant", content, calls), calls, reasoning)
                )
            elif role == "tool":
                call_id = m.get("tool_call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise _bad("a tool message needs its tool_call_id", f"{param}.tool_call_id")
                path.append(PathMessage("tool", content, normalized("tool", content), tool_call_id=call_id))
            else:
                raise _bad(f"unsupported role {role!r}: system, developer, user, assistant or tool", f"{param}.role")
        except MessageFormatError as exc:
            raise _bad(str(exc), exc.param if exc.param and exc.param.startswith("messages") else param) from exc
    if not path:
        raise _bad("the conversation needs a user message", "messages")
    if path[-1].role not in ("user", "tool"):
        raise _bad("the last message must be a user or tool message", f"messages[{len(messages) - 1}].role")
    return Conversation(system, path)


def seed_for(
    user_id: str, model: str, conv: Conversation, tools: list[Any] | None, template_kwargs: dict[str, Any] | None
) -> str:
    return chain_seed(user_id, model, conv.system_prompt, tools, template_kwargs)


_M, _C = MESSAGES.c, CHATS.c


@dataclass(frozen=True)
class _Lookups:
    """The statements that take a list (chain hashes, chat ids), in the database's dialect."""

    dialect: str
    matches: Any
    matches_in_chat: Any
    owned: Any


@functools.cache
def _lookups(dialect: str) -> _Lookups:
    # Built once per dialect, so that each is compiled and cached once: every chat request runs them.
    matches = select(_M.id, _M.chat_id, _M.chain_hash, _M.role, _M.tool_calls, _M.worker_id, _M.session_key).where(
        in_list(_M.chain_hash, "hashes", dialect), state_in(*_MATCHABLE)
    )
    owned = select(_C.id).where(in_list(_C.id, "chat_ids", dialect), _C.user_id == bindparam("user_id"))
    # "|| ''" keeps the planner on the chain-hash index (a few rows) rather than the chat's messages (all of them)
    in_chat = matches.where((_M.chat_id + "") == bindparam("chat_id"))
    return _Lookups(dialect, matches, in_chat, owned)


_HAS_CHILD = select(_M.id).where(_M.chat_id == bindparam("chat_id"), _M.parent_id == bindparam("parent_id")).limit(1)
_HAS_ROOT = select(_M.id).where(_M.chat_id == bindparam("chat_id"), _M.parent_id.is_(None)).limit(1)
_INSERT_CHAT = insert(CHATS)
_INSERT_MESSAGES = insert(MESSAGES)
_TOUCH_CHAT = (
    update(CHATS)
    .where(_C.id == bindparam("chat_id"))
    .values(modified_at=bindparam("now"), active_thread_tail_message_id=bindparam("tail"))
)


@dataclass
class _Match:
    id: str
    chat_id: str
    role: str
    tool_calls: list[dict[str, Any]] | None
    worker_id: str | None


class ConversationStore:
    """Core statements (a chat turn runs five or six of them) in the request's session, or on SQLite's
    raw connection (``server/hot_sql.py``)."""

    def __init__(self, session: AsyncSession, user_id: str, sql: HotSql) -> None:
        self.session = session
        self.user_id = user_id
        self.sql = sql

    async def _lookups(self) -> _Lookups:
        return _lookups(self.sql.dialect)

    async def _rows(self, stmt: Any, params: dict[str, Any]) -> list[Any]:
        return await self.sql.rows(self.session, stmt, params)

    async def longest_match(
        self, hashes: list[str], chat_id: str | None, session_key: str | None = None
    ) -> tuple[_Match | None, int]:
        """The stored message ending the longest matching prefix, and that prefix's length; with
        ``session_key``, the longest of that session's paths when it has one; among identical
        siblings, the newest."""
        if not hashes:
            return None, 0
        # By hash alone, so that the planner probes the chain-hash index (joined to chats it may scan
        # the user's chats instead, which grows with them); ownership is checked on the few hits.
        sql = await self._lookups()
        listed = list_param(hashes, sql.dialect)
        if chat_id is None:
            hits = await self._rows(sql.matches, {"hashes": listed})
        else:
            hits = await self._rows(sql.matches_in_chat, {"hashes": listed, "chat_id": chat_id})
        if not hits:
            return None, 0
        chat_ids = list_param(list({h.chat_id for h in hits}), sql.dialect)
        owned = {r.id for r in await self._rows(sql.owned, {"chat_ids": chat_ids, "user_id": self.user_id})}
        rows = [h for h in hits if h.chat_id in owned]
        if not rows:
            return None, 0
        if session_key is not None:
            # a session continues its own path, never another session's that repeats it (two rollouts
            # with the same opening); it shares another's only where it has none of its own yet
            rows = [h for h in rows if h.session_key == session_key] or rows
        position = {h: k for k, h in enumerate(hashes)}
        # longest prefix first; among equal paths (identical siblings) the newest
        best = max(rows, key=lambda m: (position[m.chain_hash or ""], m.id))
        calls = best.tool_calls
        if isinstance(calls, str):  # a JSON column read through Core on a driver that hands back text
            calls = json.loads(calls)
        worker = best.worker_id if best.role == "assistant" else None
        return _Match(best.id, best.chat_id, best.role, calls, worker), position[best.chain_hash or ""] + 1

    async def _owned_chat(self, chat_id: str) -> str:
        sql = await self._lookups()
        if not await self._rows(sql.owned, {"chat_ids": list_param([chat_id], sql.dialect), "user_id": self.user_id}):
            raise ApiError(ErrorCode.chat_not_found, f"conversation {chat_id} not found", param="conversation_id")
        return chat_id

    async def _has_children(self, chat_id: str, parent_id: str | None) -> bool:
        if parent_id is None:
            return bool(await self._rows(_HAS_ROOT, {"chat_id": chat_id}))
        return bool(await self._rows(_HAS_CHILD, {"chat_id": chat_id, "parent_id": parent_id}))

    async def continue_path(
        self,
        *,
        conv: Conversation,
        seed: str,
        model: str,
        tools: list[Any] | None,
        sampling: SamplingParameters,
        n: int,
        conversation_id: str | None,
        extra_params: dict[str, Any],
        session_key: str | None = None,
        claim: Callable[[Continued], Step] | None = None,
    ) -> Continued:
        """``claim``: the step that stores the request's idempotency record, from what it continues
        (``KeyTaken`` when the key was taken meanwhile: nothing stored)."""
        hashes = chain_hashes(seed, [m.norm for m in conv.path])
        pinned = await self._owned_chat(conversation_id) if conversation_id is not None else None
        match, matched = await self.longest_match(hashes, conversation_id, session_key)
        now = utcnow()
        writes: list[Step] = []
        if match is not None:
            chat_id = pinned or match.chat_id
        elif pinned is not None:
            chat_id = pinned
        else:
            title = conv.path[0].content.strip()[:80] or None
            chat_id = new_id()
            chat_row = {
                "id": chat_id,
                "user_id": self.user_id,
                "created_at": now,
                "modified_at": now,
                "title": title,
                "hidden": False,
                "allow_data_use": True,
                "system_prompt": conv.system_prompt,
                "tools": tools,
                "active_thread_tail_message_id": None,
            }
            writes.append(Step(_INSERT_CHAT, chat_row))
        tail = conv.path[matched:]
        parent_id = match.id if match is not None else None
        # a new chat has no other continuations to fork from
        known_chat = match is not None or pinned is not None
        forked = bool(tail) and known_chat and await self._has_children(chat_id, parent_id)
        parent_hash = hashes[matched - 1] if matched else seed
        calls = list(match.tool_calls or []) if match is not None and match.role == "assistant" else []
        tool_index = 0
        stored: list[Message] = []
        for pm in tail:
            key = chain_hash(parent_hash, pm.norm)
            msg = Message(
                id=new_id(),
                chat_id=chat_id,
                parent_id=parent_id,
                role=_TREE_ROLE[pm.role],
                content=pm.content,
                state=MessageState.manual.value,
                chain_hash=key,
                session_key=session_key,
            )
            if pm.role == "assistant":
                msg.tool_calls = pm.tool_calls
                msg.reasoning_content = pm.reasoning
                msg.model_config_name = model
                calls, tool_index = list(pm.tool_calls or []), 0
            elif pm.role == "tool":
                msg.tool_call_id = _resolve_call_id(pm.tool_call_id or "", calls, tool_index)
                tool_index += 1
            else:
                calls, tool_index = [], 0
            stored.append(msg)
            parent_id, parent_hash = msg.id, key
        assert parent_id is not None
        assistants = pending_assistants(
            chat_id,
            parent_id,
            n,
            sampling,
            lambda seed: WorkParameters(
                model_config_name=model,
                sampling_parameters=sampling,
                seed=seed,
                system_prompt=conv.system_prompt,
                tools=tools,
                **extra_params,
            ),
        )
        for a in assistants:
            a.session_key = session_key
        writes.append(Step(_INSERT_MESSAGES, [message_row(m, now) for m in (*stored, *assistants)]))
        writes.append(Step(_TOUCH_CHAT, {"chat_id": chat_id, "now": now, "tail": assistants[0].id}))
        decision, stop, broke = lineage(conv, matched, match is not None, forked)
        holder = match.worker_id if match is not None else None
        cont = Continued(
            chat_id, assistants, matched, forked, len(tail), parent_id, stored, decision, stop, broke, holder
        )
        if claim is not None:  # first: a key taken meanwhile stores nothing of this request
            writes.insert(0, claim(cont))
        if await self.sql.transact(self.session, writes) is None:  # the request's transaction, committed
            raise KeyTaken("idempotency key")
        return cont


def pending_assistants(
    chat_id: str, parent_id: str, n: int, sampling: SamplingParameters, work: Callable[[int | None], WorkParameters]
) -> list[Message]:
    """``n`` sibling assistant messages to generate, seeded ``seed``, ``seed + 1``... when the request
    gives a seed; unseeded otherwise (DESIGN D17: each samples with the engine's own randomness)."""
    seed = sampling.seed
    return [pending_assistant(chat_id, parent_id, work(None if seed is None else (seed + i) % 2**63)) for i in range(n)]


async def store_raw(
    session: AsyncSession,
    user_id: str,
    *,
    text: str,
    raw: dict[str, Any],
    title: str,
    model: str,
    sampling: SamplingParameters,
    n: int,
) -> tuple[Chat, Message, list[Message]]:
    """A raw-prompt request (text completions, tokens in) as a chat of its own: the prompt as a
    prompter message and n assistant messages generated from the prompt as given (no template).
    Such chats are not in the prefix index: chat requests never continue them. Added to ``session``,
    for the caller to commit (one transaction for all of a request's prompts)."""
    chat = Chat(user_id=user_id, title=title[:80] or None)
    session.add(chat)
    await session.flush()
    prompt = Message(
        id=new_id(), chat_id=chat.id, parent_id=None, role="prompter", content=text, state=MessageState.manual.value
    )
    session.add(prompt)
    assistants = pending_assistants(
        chat.id,
        prompt.id,
        n,
        sampling,
        lambda seed: WorkParameters(model_config_name=model, sampling_parameters=sampling, seed=seed, raw_prompt=raw),
    )
    session.add_all(assistants)
    chat.active_thread_tail_message_id = assistants[0].id
    return chat, prompt, assistants


def _resolve_call_id(given: str, calls: list[dict[str, Any]], index: int) -> str:
    """A tool result answers one call of the assistant message before it. Its id is kept when that
    message made such a call; a client that renamed ids is mapped by position (the k-th result after
    the message answers its k-th call), so templates that render call ids see the stored ones."""
    ids = [str(c.get("id")) for c in calls]
    if given in ids or not ids:
        return given
    return ids[index] if index < len(ids) else given
