"""User-scoped reads and writes of chats and their message trees.

Every query filters by the owner, so another user's chat is indistinguishable from a missing one
(404). Tree rules: a prompter message hangs off an assistant message that completed (or is a
root); an assistant message hangs off a prompter message. Siblings are branches.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.errors import ApiError
from server.idempotency import IdempotencyKey
from server.models import Chat, Message, MessageEval, MessageReport, MessageTokens, User, new_id, utcnow
from shared.api import (
    MAX_MESSAGES_PER_CHAT,
    ChatListRead,
    ChatRead,
    MessageRead,
    MessageState,
    SamplingParameters,
    WorkParameters,
)
from shared.errors import ErrorCode
from shared.packing import unpack_floats, unpack_ids

# assistant messages a conversation may go on from: generated and complete, or written by the client
_CONTINUABLE = (MessageState.complete, MessageState.manual)


def encode_cursor(chat_id: str) -> str:
    return base64.urlsafe_b64encode(chat_id.encode()).decode()


def decode_cursor(cursor: str | None) -> str | None:
    if cursor is None:
        return None
    try:
        return base64.b64decode(cursor.encode(), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError, binascii.Error) as exc:
        raise ApiError(ErrorCode.bad_request, "invalid pagination cursor") from exc


def message_to_read(msg: Message, tokens: MessageTokens | None = None) -> MessageRead:
    work = WorkParameters.model_validate(msg.work_parameters) if msg.work_parameters else None
    read = MessageRead(
        id=msg.id,
        parent_id=msg.parent_id,
        content=msg.content,
        chat_id=msg.chat_id,
        created_at=msg.created_at,
        role=msg.role,
        state=MessageState(msg.state),
        tool_call_id=msg.tool_call_id,
        reasoning_content=msg.reasoning_content,
        tool_calls=msg.tool_calls,
        score=msg.score,
        work_parameters=work,
        error=msg.error,
        error_code=msg.error_code,
        finish_reason=msg.finish_reason,
        prompt_token_count=msg.prompt_token_count,
        completion_token_count=msg.completion_token_count,
        attempt=msg.attempt if msg.role == "assistant" else None,
        worker_id=msg.worker_id if msg.role == "assistant" else None,
        session_key=msg.session_key,
        policy_versions=policy_spans(msg) if msg.role == "assistant" else None,
        reward=msg.reward,
        episode_done=msg.episode_done if msg.role == "assistant" else None,
    )
    if tokens is not None:
        read.prompt_token_ids = unpack_ids(tokens.prompt_ids)
        read.completion_token_ids = unpack_ids(tokens.completion_ids)
        read.logprobs = [None if lp != lp else lp for lp in unpack_floats(tokens.logprobs)]
        read.stop_reason = decode_stop_reason(tokens.stop_reason)
        read.prior_message_id = tokens.prior_message_id
        read.reused_prefix_len = tokens.reused_prefix_len
        read.synthetic_token_count = tokens.synthetic_token_count
        read.fork = tokens.fork
        read.num_cached_tokens = tokens.num_cached_tokens
        read.prompt_method = tokens.prompt_method
    return read


def policy_spans(msg: Message) -> list[tuple[int, int]] | None:
    """A finished assistant message's [start, version] spans: the weights version of each completion
    token ([(0, 0)] for one stored before versions were kept)."""
    if msg.policy_versions:
        return [(int(a), int(v)) for a, v in msg.policy_versions]
    return [(0, 0)] if msg.completion_token_count else None


def pending_assistant(chat_id: str, parent_id: str, work: WorkParameters) -> Message:
    """An assistant message to generate, as every front door stores one (enqueued after commit:
    ``server.chats.enqueue``). The work parameters are stored whole, nulls included, so that exports
    read one shape."""
    return Message(
        id=new_id(),
        chat_id=chat_id,
        parent_id=parent_id,
        role="assistant",
        state=MessageState.pending.value,
        model_config_name=work.model_config_name,
        work_parameters=work.model_dump(mode="json"),
        attempt=1,
    )


def message_row(m: Message, now: datetime) -> dict[str, Any]:
    """Every column of a new message, for a Core insert (the ORM's per-object flush costs a request
    several times more). ``m`` gets its timestamps and the defaults it lacked, as a flush would set."""
    m.created_at = m.modified_at = now
    return {
        "id": m.id,
        "chat_id": m.chat_id,
        "parent_id": m.parent_id,
        "role": m.role,
        "content": m.content,
        "tool_call_id": m.tool_call_id,
        "reasoning_content": m.reasoning_content,
        "tool_calls": m.tool_calls,
        "state": m.state,
        "created_at": now,
        "modified_at": now,
        "score": 0,
        "voted_at": None,
        "model_config_name": m.model_config_name,
        "work_parameters": m.work_parameters,
        "attempt": m.attempt or 0,
        "failures": 0,
        "worker_id": None,
        "error": None,
        "error_code": None,
        "finish_reason": None,
        "prompt_token_count": None,
        "completion_token_count": None,
        "chain_hash": m.chain_hash,
        "session_key": m.session_key,
    }


def encode_stop_reason(value: int | str | None) -> str | None:
    if value is None:
        return None
    return f"i:{value}" if isinstance(value, int) else f"s:{value}"


def decode_stop_reason(value: str | None) -> int | str | None:
    if value is None:
        return None
    kind, _, rest = value.partition(":")
    return int(rest) if kind == "i" else rest


def chat_to_list_read(chat: Chat) -> ChatListRead:
    return ChatListRead(
        id=chat.id,
        created_at=chat.created_at,
        modified_at=chat.modified_at,
        title=chat.title,
        hidden=chat.hidden,
        allow_data_use=chat.allow_data_use,
        active_thread_tail_message_id=chat.active_thread_tail_message_id,
        system_prompt=chat.system_prompt,
        tools=chat.tools,
    )


class ChatRepository:
    def __init__(self, session: AsyncSession, user: User) -> None:
        self.session = session
        self.user = user
        self._chats: dict[str, Chat] = {}
        # The request's Idempotency-Key: its record is stored in the transaction of what it creates.
        self.idempotency: IdempotencyKey | None = None

    async def _commit(self, result: dict[str, Any]) -> None:
        """Commit what the request created, with its idempotency record (``KeyTaken``: rolled back,
        another request with the key stored first)."""
        if self.idempotency is not None:
            await self.idempotency.record(self.session, result)
        await self.session.commit()

    async def create_chat(self, *, system_prompt: str | None = None, tools: list[Any] | None = None) -> Chat:
        chat = Chat(id=new_id(), user_id=self.user.id, system_prompt=system_prompt, tools=tools)
        self.session.add(chat)
        await self._commit({"chat_id": chat.id})
        return chat

    async def list_chats(
        self, *, limit: int, after: str | None, before: str | None, include_hidden: bool
    ) -> tuple[list[Chat], str | None, str | None]:
        """Newest first. ``after``/``before`` are cursors from an earlier page's next/prev."""
        after_id, before_id = decode_cursor(after), decode_cursor(before)
        q = select(Chat).where(Chat.user_id == self.user.id)
        if not include_hidden:
            q = q.where(Chat.hidden.is_(False))
        if before_id is not None:  # the page before: newer chats, fetched oldest-first
            q = q.where(Chat.id > before_id).order_by(Chat.id.asc())
        else:
            if after_id is not None:
                q = q.where(Chat.id < after_id)
            q = q.order_by(Chat.id.desc())
        rows = list((await self.session.scalars(q.limit(limit + 1))).all())
        more = len(rows) > limit
        rows = rows[:limit]
        if before_id is not None:
            rows.reverse()
        next_cursor = encode_cursor(rows[-1].id) if rows and (more or before_id is not None) else None
        prev_cursor = encode_cursor(rows[0].id) if rows and (after_id is not None or (before_id and more)) else None
        return rows, next_cursor, prev_cursor

    async def get_chat(self, chat_id: str) -> Chat:
        chat = self._chats.get(chat_id)  # a request checks its chat once, however many steps ask
        if chat is None:
            chat = await self.session.scalar(select(Chat).where(Chat.id == chat_id, Chat.user_id == self.user.id))
            if chat is None:
                raise ApiError(ErrorCode.chat_not_found, f"chat {chat_id} not found")
            self._chats[chat_id] = chat
        return chat

    async def chat_read(self, chat_id: str) -> ChatRead:
        chat = await self.get_chat(chat_id)
        msgs = (
            await self.session.scalars(select(Message).where(Message.chat_id == chat.id).order_by(Message.id))
        ).all()
        return ChatRead(**chat_to_list_read(chat).model_dump(), messages=[message_to_read(m) for m in msgs])

    async def get_message(self, chat_id: str, message_id: str) -> Message:
        q = select(Message).where(Message.id == message_id, Message.chat_id == chat_id)
        if chat_id not in self._chats:  # the ownership check in the same statement
            q = q.join(Chat, Chat.id == Message.chat_id).where(Chat.user_id == self.user.id)
        msg = await self.session.scalar(q)
        if msg is None:
            await self.get_chat(chat_id)  # chat_not_found when it is the chat that is missing
            raise ApiError(ErrorCode.message_not_found, f"message {message_id} not found in chat {chat_id}")
        return msg

    async def get_tokens(self, message_id: str) -> MessageTokens | None:
        return await self.session.get(MessageTokens, message_id)

    async def add_prompter_message(self, chat_id: str, parent_id: str | None, content: str) -> Message:
        chat = await self.get_chat(chat_id)
        if parent_id is not None:
            parent = await self.get_message(chat_id, parent_id)
            if parent.role != "assistant":
                raise ApiError(ErrorCode.parent_wrong_role, "a prompter message must follow an assistant message")
            if parent.state not in _CONTINUABLE:
                raise ApiError(ErrorCode.parent_not_complete, f"parent message is {parent.state}, not complete")
        msg = Message(chat_id=chat.id, parent_id=parent_id, role="prompter", content=content, state=MessageState.manual)
        await self._add(chat, msg)
        return msg

    async def _assistant_parent(self, chat_id: str, parent_id: str) -> tuple[Chat, Message]:
        """The chat and the parent an assistant message may follow: a prompter message or a tool result."""
        chat = await self.get_chat(chat_id)
        parent = await self.get_message(chat_id, parent_id)
        if parent.role not in ("prompter", "tool"):
            raise ApiError(
                ErrorCode.parent_wrong_role,
                "an assistant message must follow a prompter message or a tool result",
            )
        return chat, parent

    async def add_assistant_message(
        self, chat_id: str, parent_id: str, model_config_name: str, sampling: SamplingParameters, seed: int | None
    ) -> Message:
        chat, parent = await self._assistant_parent(chat_id, parent_id)
        work = WorkParameters(
            model_config_name=model_config_name,
            sampling_parameters=sampling,
            seed=seed,
            system_prompt=chat.system_prompt,
            tools=chat.tools,
        )
        msg = pending_assistant(chat.id, parent.id, work)
        await self._add(chat, msg)
        return msg

    async def add_written_assistant_message(
        self,
        chat_id: str,
        parent_id: str,
        content: str,
        tool_calls: list[dict[str, Any]] | None,
        reasoning: str | None,
    ) -> Message:
        """An assistant message the client wrote: stored ``manual`` (context, never a completion)."""
        chat, parent = await self._assistant_parent(chat_id, parent_id)
        msg = Message(
            chat_id=chat.id,
            parent_id=parent.id,
            role="assistant",
            content=content,
            tool_calls=tool_calls,
            reasoning_content=reasoning,
            state=MessageState.manual,
        )
        await self._add(chat, msg)
        return msg

    async def add_tool_message(self, chat_id: str, parent_id: str, tool_call_id: str, content: str) -> Message:
        """A tool result follows the assistant message that made the call, or another tool result of it."""
        chat = await self.get_chat(chat_id)
        parent = await self.get_message(chat_id, parent_id)
        caller = parent
        while caller.role == "tool":  # results of several calls follow each other under their caller
            caller = await self.get_message(chat_id, caller.parent_id or "")
        if caller.role != "assistant":
            raise ApiError(ErrorCode.parent_wrong_role, "a tool result must follow an assistant message or tool result")
        if caller.state not in _CONTINUABLE:
            raise ApiError(ErrorCode.parent_not_complete, f"the assistant message is {caller.state}, not complete")
        call_ids = {c.get("id") for c in caller.tool_calls or []}
        if tool_call_id not in call_ids:
            raise ApiError(
                ErrorCode.unknown_tool_call,
                f"the assistant message made no tool call {tool_call_id!r}; its calls: {sorted(map(str, call_ids))}",
            )
        msg = Message(
            chat_id=chat.id,
            parent_id=parent.id,
            role="tool",
            content=content,
            tool_call_id=tool_call_id,
            state=MessageState.manual,
        )
        await self._add(chat, msg)
        return msg

    async def vote(self, chat_id: str, message_id: str, score: int) -> Message:
        msg = await self.get_message(chat_id, message_id)
        if msg.role != "assistant":
            raise ApiError(ErrorCode.not_assistant_message, "only assistant messages can be voted on")
        msg.score, msg.voted_at = score, utcnow()
        await self._commit({})
        return msg

    async def report(self, chat_id: str, message_id: str, report_type: str, reason: str) -> None:
        msg = await self.get_message(chat_id, message_id)
        self.session.add(MessageReport(message_id=msg.id, user_id=self.user.id, report_type=report_type, reason=reason))
        await self._commit({})

    async def message_eval(self, chat_id: str, message_id: str, inferior_ids: list[str]) -> None:
        """The user preferred ``message_id`` over ``inferior_ids``: assistant siblings in this chat."""
        msg = await self.get_message(chat_id, message_id)
        if msg.role != "assistant":
            raise ApiError(ErrorCode.not_assistant_message, "only assistant messages can be preferred")
        wanted = set(inferior_ids) - {msg.id}
        if len(wanted) != len(inferior_ids):
            raise ApiError(ErrorCode.bad_request, "inferior_message_ids repeats an id or names the preferred message")
        siblings = set(
            (
                await self.session.scalars(
                    select(Message.id).where(
                        Message.chat_id == msg.chat_id,
                        Message.role == "assistant",
                        Message.id.in_(wanted),
                        Message.parent_id.is_(None) if msg.parent_id is None else Message.parent_id == msg.parent_id,
                    )
                )
            ).all()
        )
        if missing := sorted(wanted - siblings):
            raise ApiError(
                ErrorCode.message_not_found, f"not assistant siblings of {msg.id} in chat {chat_id}: {missing}"
            )
        self.session.add(
            MessageEval(chat_id=msg.chat_id, message_id=msg.id, user_id=self.user.id, inferior_message_ids=inferior_ids)
        )
        await self._commit({})

    async def open_message_ids(self, chat_id: str) -> list[str]:
        chat = await self.get_chat(chat_id)
        open_states = (MessageState.pending.value, MessageState.in_progress.value)
        q = select(Message.id).where(Message.chat_id == chat.id, Message.state.in_(open_states))
        return list((await self.session.scalars(q)).all())

    async def delete_chat(self, chat_id: str) -> None:
        """Delete the chat with its messages; their tokens, reports and evals go with them (cascades).
        One statement for all messages: foreign keys between them are checked at its end."""
        chat = await self.get_chat(chat_id)
        await self.session.execute(delete(Message).where(Message.chat_id == chat.id))
        await self.session.execute(delete(Chat).where(Chat.id == chat.id))
        await self.session.commit()
        self._chats.pop(chat_id, None)

    async def hide_all_chats(self) -> None:
        await self.session.execute(update(Chat).where(Chat.user_id == self.user.id).values(hidden=True))
        await self.session.commit()

    async def _add(self, chat: Chat, msg: Message) -> None:
        count = await self.session.scalar(select(func.count()).select_from(Message).where(Message.chat_id == chat.id))
        if (count or 0) >= MAX_MESSAGES_PER_CHAT:
            raise ApiError(
                ErrorCode.chat_too_long,
                f"this chat holds {MAX_MESSAGES_PER_CHAT} messages, the most a chat can hold; start a new chat",
            )
        self._touch(chat, msg)
        self.session.add(msg)
        await self._commit({"chat_id": chat.id, "message_id": msg.id})

    def _touch(self, chat: Chat, msg: Message) -> None:
        if msg.id is None:
            msg.id = new_id()
        chat.modified_at = utcnow()
        chat.active_thread_tail_message_id = msg.id

    async def update_chat(self, chat_id: str, fields: dict[str, Any]) -> Chat:
        chat = await self.get_chat(chat_id)
        for key, value in fields.items():
            setattr(chat, key, value)
        chat.modified_at = utcnow()
        await self.session.commit()
        return chat
