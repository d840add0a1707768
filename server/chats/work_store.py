"""Database side of the work lifecycle: what a worker gets, and the fenced state transitions.

Every transition is a conditional UPDATE on ``(id, attempt)`` so that a stale attempt (a worker
that was presumed lost, a redelivered queue entry) can never overwrite newer state.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import case, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from server.chats.repository import decode_stop_reason, encode_stop_reason
from server.db import SessionFactory
from server.models import Chat, Message, MessageTokens, utcnow
from shared.api import FINISHED_STATES, MessageState, WorkParameters
from shared.chain import chain_hash, normalized
from shared.errors import ErrorCode
from shared.packing import pack_floats, pack_ids, unpack_ids
from shared.protocol import GenerationRecord, PriorChain, WorkMessage

Parent = aliased(Message)
_OPEN_STATES = (MessageState.pending.value, MessageState.in_progress.value)
_STORABLE_STATES = (*_OPEN_STATES, MessageState.cancelled.value)


class WorkStore:
    def __init__(self, sessions: SessionFactory) -> None:
        self.sessions = sessions

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

    @staticmethod
    def work_messages(path: list[Message], params: WorkParameters) -> list[WorkMessage]:
        """The conversation as the template sees it: system prompt first, OA roles mapped."""
        out = []
        if params.system_prompt is not None:
            out.append(WorkMessage(id="system", role="system", content=params.system_prompt))
        for m in path:
            if m.role == "assistant":
                out.append(
                    WorkMessage(
                        id=m.id,
                        role="assistant",
                        content=m.content or "",
                        tool_calls=m.tool_calls or None,
                        reasoning_content=m.reasoning_content,
                    )
                )
            elif m.role == "tool":
                out.append(WorkMessage(id=m.id, role="tool", content=m.content or "", tool_call_id=m.tool_call_id))
            else:
                out.append(WorkMessage(id=m.id, role="user", content=m.content or ""))
        return out

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
        async with self.sessions() as s:
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, Message.state.in_(_OPEN_STATES))
                .values(state=MessageState.in_progress.value, worker_id=worker_id, modified_at=utcnow())
            )
            await s.commit()
            return bool(res.rowcount)  # type: ignore[attr-defined]

    async def next_attempt(self, message_id: str, attempt: int, *, failed: bool = False) -> int | None:
        """Fence off ``attempt`` and return the new attempt number, or None if it is already stale.
        ``failed``: the attempt ended by its worker's fault, which counts toward ``max_attempts``."""
        async with self.sessions() as s:
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, Message.state.in_(_OPEN_STATES))
                .values(
                    attempt=attempt + 1,
                    failures=Message.failures + int(failed),
                    state=MessageState.pending.value,
                    worker_id=None,
                    modified_at=utcnow(),
                )
            )
            await s.commit()
            return attempt + 1 if res.rowcount else None  # type: ignore[attr-defined]

    async def open_before(self, cutoff: datetime, limit: int = 1000) -> list[Message]:
        """Pending and in-progress messages last changed before ``cutoff`` (the partial index)."""
        async with self.sessions() as s:
            rows = await s.scalars(
                select(Message)
                .where(Message.state.in_(_OPEN_STATES), Message.modified_at < cutoff)
                .order_by(Message.modified_at)
                .limit(limit)
            )
            return list(rows.all())

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
            q = update(Message).where(Message.id == message_id, Message.state.in_(_OPEN_STATES))
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
    async def _index(s: AsyncSession, message_id: str, record: GenerationRecord) -> None:
        """Put the finished message in the prefix index if its path is indexed (OpenAI API chats)."""
        parent_hash = await s.scalar(
            select(Parent.chain_hash).join(Message, Message.parent_id == Parent.id).where(Message.id == message_id)
        )
        if parent_hash is None:
            return
        key = chain_hash(parent_hash, normalized("assistant", record.content, record.tool_calls))
        await s.execute(update(Message).where(Message.id == message_id).values(chain_hash=key))

    async def store(
        self,
        message_id: str,
        attempt: int,
        record: GenerationRecord,
        *,
        parent_chain: str | None = None,
        chain_known: bool = False,
    ) -> bool:
        """Write the finished record and complete the message, once, in one transaction.
        ``chain_known``: the caller knows the parent's chain hash (``parent_chain``, None if the
        path is not indexed), so the prefix index costs no extra statement."""
        index: dict[str, str] = {}
        if chain_known and parent_chain is not None:
            index["chain_hash"] = chain_hash(parent_chain, normalized("assistant", record.content, record.tool_calls))
        async with self.sessions() as s, s.begin():
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, Message.state.in_(_STORABLE_STATES))
                .values(
                    **index,
                    # a cancelled message keeps its state and gets the tokens generated until the abort
                    state=case(
                        (Message.state == MessageState.cancelled.value, MessageState.cancelled.value),
                        else_=MessageState.complete.value,
                    ),
                    content=record.content,
                    reasoning_content=record.reasoning_content,
                    tool_calls=record.tool_calls or None,
                    finish_reason=record.finish_reason,
                    prompt_token_count=len(record.prompt_ids),
                    completion_token_count=len(record.completion_ids),
                    modified_at=utcnow(),
                )
            )
            if not res.rowcount:  # type: ignore[attr-defined]
                return False
            if not chain_known:
                await self._index(s, message_id, record)
            s.add(
                MessageTokens(
                    message_id=message_id,
                    prompt_ids=pack_ids(record.prompt_ids),
                    completion_ids=pack_ids(record.completion_ids),
                    logprobs=pack_floats([float("nan") if lp is None else lp for lp in record.logprobs]),
                    text_offsets=pack_ids(record.text_offsets),
                    completion_text=record.completion_text,
                    finish_reason=record.finish_reason,
                    stop_reason=encode_stop_reason(record.stop_reason),
                    engine=record.engine,
                    tokenizer_hash=record.tokenizer_hash,
                    template_hash=record.template_hash,
                    prior_message_id=record.prior_message_id,
                    reused_prefix_len=record.reused_prefix_len,
                    synthetic_token_count=record.synthetic_token_count,
                    fork=record.fork,
                    num_cached_tokens=record.num_cached_tokens,
                    prompt_method=record.prompt_method,
                    resumed_at=pack_ids(record.resumed_at),
                    prompt_check=record.prompt_check,
                )
            )
            try:
                await s.flush()
            except IntegrityError:
                return False
        return True
