"""Database side of the work lifecycle: what a worker gets, and the fenced state transitions.

Every transition is a conditional UPDATE on ``(id, attempt)`` so that a stale attempt (a worker
that was presumed lost, a redelivered queue entry) can never overwrite newer state.
"""

from __future__ import annotations

import json

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from server.db import SessionFactory
from server.models import Message, MessageTokens, utcnow
from server.repository import encode_stop_reason
from shared.api import FINISHED_STATES, MessageState, WorkParameters
from shared.errors import ErrorCode
from shared.packing import pack_floats, pack_ids
from shared.protocol import GenerationRecord, WorkMessage

_OPEN_STATES = (MessageState.pending.value, MessageState.in_progress.value)


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
    def work_messages(path: list[Message]) -> list[WorkMessage]:
        return [
            WorkMessage(
                id=m.id, role="assistant" if m.role == "assistant" else "user", content=m.content or ""
            )
            for m in path
        ]

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

    async def next_attempt(self, message_id: str, attempt: int) -> int | None:
        """Fence off ``attempt`` and return the new attempt number, or None if it is already stale."""
        async with self.sessions() as s:
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, Message.state.in_(_OPEN_STATES))
                .values(
                    attempt=attempt + 1,
                    state=MessageState.pending.value,
                    worker_id=None,
                    modified_at=utcnow(),
                )
            )
            await s.commit()
            return attempt + 1 if res.rowcount else None  # type: ignore[attr-defined]

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

    async def store(self, message_id: str, attempt: int, record: GenerationRecord) -> bool:
        """Write the finished record and complete the message, once, in one transaction."""
        async with self.sessions() as s, s.begin():
            res = await s.execute(
                update(Message)
                .where(Message.id == message_id, Message.attempt == attempt, Message.state.in_(_OPEN_STATES))
                .values(
                    state=MessageState.complete.value,
                    content=record.content,
                    finish_reason=record.finish_reason,
                    prompt_token_count=len(record.prompt_ids),
                    completion_token_count=len(record.completion_ids),
                    modified_at=utcnow(),
                )
            )
            if not res.rowcount:  # type: ignore[attr-defined]
                return False
            s.add(
                MessageTokens(
                    message_id=message_id,
                    prompt_ids=pack_ids(record.prompt_ids),
                    completion_ids=pack_ids(record.completion_ids),
                    logprobs=pack_floats([float("nan") if lp is None else lp for lp in record.logprobs]),
                    text_offsets=pack_ids(record.text_offsets),
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
                    resumed_at=pack_ids(record.resumed_at),
                )
            )
            try:
                await s.flush()
            except IntegrityError:
                return False
        return True


def record_summary(record: GenerationRecord) -> str:
    return json.dumps({"prompt": len(record.prompt_ids), "completion": len(record.completion_ids)})
