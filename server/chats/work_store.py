"""Database side of the work lifecycle: what a worker gets, and the fenced state transitions.

Every transition is a conditional UPDATE on ``(id, attempt)`` so that a stale attempt (a worker
that was presumed lost, a redelivered queue entry) can never overwrite newer state.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, case, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.orm import aliased

from server.chats.repository import decode_stop_reason, encode_stop_reason
from server.db import SessionFactory
from server.hot_sql import HotSql, Step
from server.models import MESSAGE_IS_OPEN, MESSAGE_TOKENS, MESSAGES, Chat, Message, MessageTokens, utcnow
from server.sql_lists import state_in
from shared.api import FINISHED_STATES, MessageState, WorkParameters
from shared.chain import chain_hash, normalized
from shared.errors import ErrorCode
from shared.packing import pack_floats, pack_ids, unpack_ids
from shared.protocol import GenerationRecord, PriorChain, WorkMessage

Parent = aliased(Message)


def work_message(m: Message) -> WorkMessage:
    """A stored message as the template sees it (OA roles mapped)."""
    if m.role == "assistant":
        return WorkMessage(
            id=m.id,
            role="assistant",
            content=m.content or "",
            tool_calls=m.tool_calls or None,
            reasoning_content=m.reasoning_content,
        )
    if m.role == "tool":
        return WorkMessage(id=m.id, role="tool", content=m.content or "", tool_call_id=m.tool_call_id)
    return WorkMessage(id=m.id, role="user", content=m.content or "")


def reply_chain_hash(parent_chain: str | None, record: GenerationRecord) -> str | None:
    """A finished reply's prefix-index key: under an indexed parent (OpenAI API chats) only."""
    if parent_chain is None:
        return None
    return chain_hash(parent_chain, normalized("assistant", record.content, record.tool_calls))


_OPEN_STATES = (MessageState.pending.value, MessageState.in_progress.value)
_STORABLE = state_in(MessageState.pending, MessageState.in_progress, MessageState.cancelled)


# The statements of every turn, built once (compiled and cached once): Core, no ORM objects.
_M = MESSAGES.c
_START = (
    update(MESSAGES)
    .where(_M.id == bindparam("b_id"), _M.attempt == bindparam("b_attempt"), MESSAGE_IS_OPEN)
    .values(state=MessageState.in_progress.value, worker_id=bindparam("b_worker_id"), modified_at=bindparam("b_now"))
)
_STORE = (
    update(MESSAGES)
    .where(_M.id == bindparam("b_id"), _M.attempt == bindparam("b_attempt"), _STORABLE)
    .values(
        # a cancelled message keeps its state and gets the tokens generated until the abort
        state=case(
            (_M.state == MessageState.cancelled.value, MessageState.cancelled.value),
            else_=MessageState.complete.value,
        ),
        content=bindparam("b_content"),
        reasoning_content=bindparam("b_reasoning_content"),
        tool_calls=bindparam("b_tool_calls", type_=_M.tool_calls.type),
        finish_reason=bindparam("b_finish_reason"),
        prompt_token_count=bindparam("b_prompt_token_count"),
        completion_token_count=bindparam("b_completion_token_count"),
        policy_versions=bindparam("b_policy_versions", type_=_M.policy_versions.type),
        modified_at=bindparam("b_now"),
    )
)
_STORE_INDEXED = _STORE.values(chain_hash=bindparam("b_chain_hash"))
_INSERT_TOKENS = insert(MESSAGE_TOKENS)
_PARENT_CHAIN = (
    select(Parent.chain_hash).join(Message, Message.parent_id == Parent.id).where(Message.id == bindparam("b_id"))
)
_SET_CHAIN = update(MESSAGES).where(_M.id == bindparam("b_id")).values(chain_hash=bindparam("b_chain_hash"))


class WorkStore:
    def __init__(self, sessions: SessionFactory, sql: HotSql | None = None) -> None:
        self.sessions = sessions
        self.engine: AsyncEngine = sessions.kw["bind"]  # Core statements run on it directly
        self.sql = sql or HotSql(self.engine)  # the per-turn statements (start, store)

    async def load(self, message_id: str) -> tuple[Message, list[Message]] | None:
        """The message and its ancestors root-first (excluding itself), or None if it is gone."""
        async with self.sessions() as s:
            msg = await s.get(Message, message_id)
            if msg is None:
                return None
            rows = (await s.scalars(select(Message).where(Message.chat_id == msg.chat_id))).all()
        by_id = {m.id: m for m in rows}
        path: list[Message] = []
        cur = by_id.get(msg.parent_id) if msg.parent_id else None
        while cur is not None:
            path.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id else None
        path.reverse()
        return msg, path

    @staticmethod
    def is_open(msg: Message, attempt: int) -> bool:
        return msg.attempt == attempt and msg.state not in {s.value for s in FINISHED_STATES}

    async def prior_chain(self, path: list[Message]) -> PriorChain | None:
        """The stored tokens of the nearest assistant ancestor that has them."""
        assistants = [m for m in path if m.role == "assistant" and m.state == MessageState.complete.value]
        if not assistants:
            return None
        async with self.sessions() as s:
            rows = (
                await s.scalars(select(MessageTokens).where(MessageTokens.message_id.in_([m.id for m in assistants])))
            ).all()
        by_id = {r.message_id: r for r in rows}
        for m in reversed(assistants):
            tokens = by_id.get(m.id)
            if tokens is None:
                continue
            params = WorkParameters.model_validate(m.work_parameters) if m.work_parameters else None
            return PriorChain(
                message_id=m.id,
                prompt_ids=unpack_ids(tokens.prompt_ids),
                completion_ids=unpack_ids(tokens.completion_ids),
                finish_reason=tokens.finish_reason,
                stop_reason=decode_stop_reason(tokens.stop_reason),
                tokenizer_hash=tokens.tokenizer_hash,
                template_hash=tokens.template_hash,
                system_prompt=params.system_prompt if params else None,
                tools=params.tools if params else None,
                has_tool_calls=bool(m.tool_calls),
            )
        return None

    @staticmethod
    def work_parameters(msg: Message) -> WorkParameters:
        return WorkParameters.model_validate(msg.work_parameters)

    async def start(self, message_id: str, attempt: int, worker_id: str) -> bool:
        params = {"b_id": message_id, "b_attempt": attempt, "b_worker_id": worker_id, "b_now": utcnow()}
        return await self.sql.transact(None, [Step(_START, params, required=True)]) is not None

    async def next_attempt(
        self, message_id: str, attempt: int, *, failed: bool = False, engine_death: bool = False
    ) -> int | None:
        """Fence off ``attempt`` and return the new attempt number, or None if it is already stale.
        ``failed``: the attempt ended by its worker's fault, which counts toward ``max_attempts``;
        ``engine_death``: its worker's engine died while generating it (counted in ``engine_deaths``)."""
        async with self.sessions() as s:
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, MESSAGE_IS_OPEN)
                .values(
                    attempt=attempt + 1,
                    failures=Message.failures + int(failed),
                    engine_deaths=Message.engine_deaths + int(engine_death),
                    state=MessageState.pending.value,
                    worker_id=None,
                    modified_at=utcnow(),
                )
            )
            await s.commit()
            return attempt + 1 if res.rowcount else None  # type: ignore[attr-defined]

    async def engine_deaths(self, message_id: str) -> int:
        async with self.sessions() as s:
            return int(await s.scalar(select(Message.engine_deaths).where(Message.id == message_id)) or 0)

    async def open_before(self, cutoff: datetime, limit: int = 1000) -> list[Message]:
        """Pending and in-progress messages last changed before ``cutoff`` (the partial index)."""
        async with self.sessions() as s:
            rows = await s.scalars(
                select(Message)
                .where(MESSAGE_IS_OPEN, Message.modified_at < cutoff)
                .order_by(Message.modified_at)
                .limit(limit)
            )
            return list(rows.all())

    async def states(self, message_ids: list[str]) -> list[tuple[str, int, str, str]]:
        """``(message id, attempt, model, state)`` of these messages."""
        async with self.sessions() as s:
            rows = await s.execute(
                select(Message.id, Message.attempt, Message.model_config_name, Message.state).where(
                    Message.id.in_(message_ids)
                )
            )
            return [(mid, attempt, model or "", state) for mid, attempt, model, state in rows.all()]

    async def running_workers(self) -> set[str]:
        """The workers that in-progress messages are assigned to (the partial index of open ones)."""
        async with self.sessions() as s:
            rows = await s.scalars(
                select(Message.worker_id)
                .where(MESSAGE_IS_OPEN, Message.state == MessageState.in_progress.value)
                .distinct()
            )
            return {w for w in rows.all() if w}

    async def running_on(self, worker_ids: list[str]) -> list[tuple[str, int, str]]:
        """``(message id, attempt, model)`` of the messages in progress on these workers."""
        async with self.sessions() as s:
            rows = await s.execute(
                select(Message.id, Message.attempt, Message.model_config_name).where(
                    MESSAGE_IS_OPEN,
                    Message.state == MessageState.in_progress.value,
                    Message.worker_id.in_(worker_ids),
                )
            )
            return [(mid, attempt, model or "") for mid, attempt, model in rows.all()]

    async def cancel(self, message_id: str) -> tuple[str, int, str | None] | None:
        """Mark an open message cancelled; its (previous state, attempt, worker id), or None if it had
        already ended. A worker's record for that attempt is still stored (the tokens so far)."""
        async with self.sessions() as s:
            msg = await s.get(Message, message_id)
            if msg is None or msg.state not in _OPEN_STATES:
                return None
            before = (msg.state, msg.attempt, msg.worker_id)
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == msg.attempt, Message.state == msg.state)
                .values(
                    state=MessageState.cancelled.value,
                    error="cancelled by the user",
                    error_code=ErrorCode.cancelled.value,
                    modified_at=utcnow(),
                )
            )
            await s.commit()
            return before if res.rowcount else None  # type: ignore[attr-defined]

    async def completed_at(self, message_id: str, attempt: int) -> bool:
        """Whether the message is complete with the record of ``attempt``."""
        async with self.sessions() as s:
            state = await s.scalar(select(Message.state).where(Message.id == message_id, Message.attempt == attempt))
        return state == MessageState.complete.value

    async def is_cancelled_or_deleted(self, message_id: str) -> bool:
        """Cancelled, or deleted with its chat: either way its readers get the cancelled end."""
        async with self.sessions() as s:
            state = await s.scalar(select(Message.state).where(Message.id == message_id))
        return state is None or state == MessageState.cancelled.value

    async def discard(self, message_ids: list[str]) -> None:
        """Delete assistant messages that were never queued (their request was refused); a chat whose
        tail one was gets its parent back as the tail."""
        parent = select(Message.parent_id).where(Message.id == Chat.active_thread_tail_message_id).scalar_subquery()
        async with self.sessions() as s, s.begin():
            await s.execute(
                update(Chat)
                .where(Chat.active_thread_tail_message_id.in_(message_ids))
                .values(active_thread_tail_message_id=parent)
            )
            await s.execute(
                delete(Message).where(Message.id.in_(message_ids), Message.state == MessageState.pending.value)
            )

    async def fail(self, message_id: str, attempt: int | None, code: ErrorCode | str, error: str) -> bool:
        async with self.sessions() as s:
            q = update(Message).where(Message.id == message_id, MESSAGE_IS_OPEN)
            if attempt is not None:
                q = q.where(Message.attempt == attempt)
            res = await s.execute(
                q.values(
                    state=MessageState.aborted_by_worker.value,
                    error=error,
                    error_code=str(code),
                    modified_at=utcnow(),
                )
            )
            await s.commit()
            return bool(res.rowcount)  # type: ignore[attr-defined]

    @staticmethod
    async def _index(conn: AsyncConnection, message_id: str, record: GenerationRecord) -> None:
        """Put the finished message in the prefix index if its path is indexed (OpenAI API chats)."""
        parent_hash = (await conn.execute(_PARENT_CHAIN, {"b_id": message_id})).scalar()
        key = reply_chain_hash(parent_hash, record)
        if key is not None:
            await conn.execute(_SET_CHAIN, {"b_id": message_id, "b_chain_hash": key})

    async def store(
        self,
        message_id: str,
        attempt: int,
        record: GenerationRecord,
        *,
        parent_chain: str | None = None,
        chain_known: bool = False,
    ) -> dict[str, Any] | None:
        """Write the finished record and complete the message, once, in one transaction; the token
        row as written, or None if the attempt was stale (nothing written).
        ``chain_known``: the caller knows the parent's chain hash (``parent_chain``, None if the
        path is not indexed), so the prefix index costs no extra statement."""
        now = utcnow()
        values: dict[str, Any] = {
            "b_id": message_id,
            "b_attempt": attempt,
            "b_content": record.content,
            "b_reasoning_content": record.reasoning_content,
            "b_tool_calls": record.tool_calls or None,
            "b_finish_reason": record.finish_reason,
            "b_prompt_token_count": len(record.prompt_ids),
            "b_completion_token_count": len(record.completion_ids),
            "b_policy_versions": [list(span) for span in record.policy_versions] or None,
            "b_now": now,
        }
        key = reply_chain_hash(parent_chain, record) if chain_known else None
        tokens = {
            "message_id": message_id,
            "prompt_ids": pack_ids(record.prompt_ids),
            "completion_ids": pack_ids(record.completion_ids),
            "logprobs": pack_floats([float("nan") if lp is None else lp for lp in record.logprobs]),
            "text_offsets": pack_ids(record.text_offsets),
            "completion_text": record.completion_text,
            "finish_reason": record.finish_reason,
            "stop_reason": encode_stop_reason(record.stop_reason),
            "engine": record.engine,
            "tokenizer_hash": record.tokenizer_hash,
            "template_hash": record.template_hash,
            "prior_message_id": record.prior_message_id,
            "reused_prefix_len": record.reused_prefix_len,
            "synthetic_token_count": record.synthetic_token_count,
            "fork": record.fork,
            "num_cached_tokens": record.num_cached_tokens,
            "prompt_method": record.prompt_method,
            "resumed_at": pack_ids(record.resumed_at),
            "prompt_check": record.prompt_check,
            "created_at": now,
        }
        try:
            if not chain_known:  # recovery's rare path: the parent's chain hash is read in the transaction
                async with self.engine.begin() as conn:
                    if not (await conn.execute(_STORE, values)).rowcount:
                        return None
                    await self._index(conn, message_id, record)
                    await conn.execute(_INSERT_TOKENS, tokens)
                return tokens
            update = Step(_STORE_INDEXED, {**values, "b_chain_hash": key}) if key is not None else Step(_STORE, values)
            steps = [Step(update.stmt, update.params, required=True), Step(_INSERT_TOKENS, tokens)]
            if await self.sql.transact(None, steps) is None:
                return None
        except (IntegrityError, sqlite3.IntegrityError):
            return None  # the record of this attempt was stored already
        return tokens
