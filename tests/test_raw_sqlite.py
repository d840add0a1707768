"""SQLite's raw connection (``server/raw_sqlite.py``) stores and reads exactly what SQLAlchemy does.

The same Core statements of a turn (chat and message inserts, the fenced start, the finished record,
the admission count, the prefix match) run once through SQLAlchemy and once on the raw connection, on
two database files; every column of every row, read back through the ORM, must be equal.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from server.chats.admission import open_messages
from server.chats.work_store import WorkStore
from server.db import create_engine, create_session_factory
from server.hot_sql import HotSql, Step
from server.models import Base, Chat, Message, MessageTokens, User
from server.openai.conversations import ConversationStore, parse_messages, seed_for
from shared.api import SamplingParameters
from shared.protocol import GenerationRecord

NOW = datetime(2026, 11, 26, 12, 0, 0, 123456, tzinfo=UTC)


def _record(content: str) -> GenerationRecord:
    return GenerationRecord(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, None],
        text_offsets=[2, len(content)],
        completion_text=content,
        content=content,
        finish_reason="stop",
        stop_reason=7,
        engine="fake",
        tokenizer_hash="t",
        template_hash="h",
        tool_calls=[{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    )


def _columns(row: Any) -> dict[str, Any]:
    values = {c.key: getattr(row, c.key) for c in row.__table__.columns}
    ids = ("id", "chat_id", "parent_id", "message_id", "active_thread_tail_message_id")
    return {k: v for k, v in values.items() if k not in ids}


async def _turns(path: Path, raw: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    sessions = create_session_factory(engine)
    async with sessions() as s:
        s.add(User(id="u1", display_name="u1", provider="apikey"))
        await s.commit()
    sql = HotSql.for_engine(engine, raw=raw)
    assert (sql.raw is not None) == raw
    store = WorkStore(sessions, sql)
    seen: list[Any] = []
    try:
        history: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
        for turn in range(3):
            history.append({"role": "user", "content": f"question {turn}"})
            conv = parse_messages(history)
            async with sessions() as s:
                seen.append(await open_messages(sql, s, "u1", "m"))
                cont = await ConversationStore(s, "u1", sql).continue_path(
                    conv=conv,
                    seed=seed_for("u1", "m", conv, None, None),
                    model="m",
                    tools=None,
                    sampling=SamplingParameters(max_new_tokens=8),
                    n=1,
                    conversation_id=None,
                    extra_params={"template_kwargs": None, "client_prompt_ids": None, "required_prefix_ids": None},
                    session_key="s1",
                )
            seen.append((cont.matched, cont.lineage, cont.forked))
            (msg,) = cont.assistants
            attempt = msg.attempt
            assert await store.start(msg.id, attempt + 1, "w1") is False  # a stale attempt changes nothing
            assert await store.start(msg.id, attempt, "w1") is True
            record = _record(f"answer {turn}")
            parent_chain = cont.stored[-1].chain_hash
            assert await store.store(msg.id, attempt, record, parent_chain=parent_chain, chain_known=True) is not None
            assert await store.store(msg.id, attempt, record, parent_chain=parent_chain, chain_known=True) is None
            seen.append(await open_messages(sql, None, "u1", "m"))
            history.append({"role": "assistant", "content": record.content, "tool_calls": record.tool_calls})
        async with sessions() as s:
            chats = [_columns(c) for c in (await s.scalars(select(Chat).order_by(Chat.created_at))).all()]
            messages = (await s.scalars(select(Message).order_by(Message.created_at, Message.role))).all()
            tokens_rows = {t.message_id: t for t in (await s.scalars(select(MessageTokens))).all()}
            rows = [_columns(m) for m in messages]
            rows += [_columns(tokens_rows[m.id]) for m in messages if m.id in tokens_rows]
        return chats, rows, seen
    finally:
        sql.close()
        await engine.dispose()


def _normalized(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # timestamps differ between the runs; their type and zone must not
    out = []
    for r in rows:
        r = dict(r)
        for k, v in r.items():
            if isinstance(v, datetime):
                r[k] = ("datetime", v.tzinfo is not None)
        out.append(r)
    return out


def test_raw_connection_stores_and_reads_what_sqlalchemy_does(tmp_path: Path) -> None:
    via_sqlalchemy = asyncio.run(_turns(tmp_path / "a.db", raw=False))
    via_raw = asyncio.run(_turns(tmp_path / "b.db", raw=True))
    chats_a, rows_a, seen_a = via_sqlalchemy
    chats_b, rows_b, seen_b = via_raw
    assert len(rows_a) == 3 * 2 + 3  # three user messages, three replies, three token rows
    # the third turn extends the stored path of the first two (its 4 earlier messages matched)
    assert seen_a[-2] == (4, "extended", False)
    assert _normalized(chats_a) == _normalized(chats_b)
    assert _normalized(rows_a) == _normalized(rows_b)
    assert seen_a == seen_b


def test_a_required_step_that_changes_nothing_rolls_the_transaction_back(tmp_path: Path) -> None:
    async def run() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'c.db'}")
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
            await conn.execute(User.__table__.insert(), {"id": "u", "display_name": "u", "provider": "apikey"})
        sql = HotSql.for_engine(engine)
        assert sql.raw is not None
        try:
            chat = {"id": "c1", "user_id": "u", "created_at": NOW, "modified_at": NOW}
            fenced = Step(Message.__table__.update().where(Message.id == "nope").values(content="x"), {}, required=True)
            assert await sql.transact(None, [Step(Chat.__table__.insert(), chat), fenced]) is None
            assert await sql.rows(None, select(Chat.id), {}) == []  # the chat insert was rolled back
            assert await sql.transact(None, [Step(Chat.__table__.insert(), chat)]) == [1]
            (row,) = await sql.rows(None, select(Chat.id, Chat.created_at, Chat.hidden), {})
            assert (row.id, row.created_at, row.hidden) == ("c1", NOW.replace(tzinfo=None), False)
            with pytest.raises(sqlite3.IntegrityError):
                await sql.transact(None, [Step(Chat.__table__.insert(), chat)])
            assert len(await sql.rows(None, select(Chat.id), {})) == 1
        finally:
            sql.close()
            await engine.dispose()

    asyncio.run(run())
