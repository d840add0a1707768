"""Reading an export from the database batch by batch, in constant memory: a page of chats, their
messages, then the token records of their complete assistant messages; the next batch is read while
the current one becomes rollouts (``server/export/rollouts.py``). The registry of weights versions is
read once, first."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import operator
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ARRAY, String, any_, bindparam, select
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from server.db import SessionFactory
from server.export.query import (
    IN_CHUNK,
    M_CHAT,
    M_ID,
    M_ROLE,
    M_STATE,
    MSG_COLUMNS,
    T_ID,
    TOKEN_COLUMNS,
    Decoders,
    ExportFilters,
    chat_query,
    decoders,
    read_policy_paths,
)
from server.export.rollouts import rows_rollouts
from server.models import Chat, Message, MessageTokens
from shared.api import MessageState

CHAT_BATCH = 500  # chats per batch (its messages are one IN list: stay below SQLite's 999 parameters)


@dataclass
class _Batch:
    chats: list[Any]  # (id, user_id), in id order
    messages: dict[str, list[Any]]  # chat id -> its message rows, in id order
    tokens: dict[str, Any]  # message id -> token row
    decoders: Decoders


class _Reader:
    """Reads an export batch by batch: a page of chats, their messages, then the token records of the
    complete assistant messages by primary key (a join can make the planner scan the whole table).

    The statements are built once per export. On PostgreSQL an id list is one array parameter; on
    asyncpg the statements, compiled once, run on the driver connection itself: its records instead
    of SQLAlchemy rows take ~40% less CPU, and no column here needs SQLAlchemy's result processing."""

    def __init__(self, sessions: SessionFactory, filters: ExportFilters) -> None:
        self.sessions = sessions
        self.filters = filters
        self.dialect: Dialect | None = None

    def _prepare(self, dialect: Dialect) -> None:
        self.dialect = dialect
        pg = dialect.name == "postgresql"
        ids = bindparam("ids", type_=ARRAY(String)) if pg else bindparam("ids", expanding=True)

        def member(column: Any) -> Any:
            return column == any_(ids) if pg else column.in_(ids)

        self.chunk = 0 if pg else IN_CHUNK  # ids per IN list (0: all at once)
        self.statements: dict[str, Any] = {
            "page": chat_query(self.filters).where(Chat.id > bindparam("after")).order_by(Chat.id).limit(CHAT_BATCH),
            "messages": select(*MSG_COLUMNS).where(member(Message.chat_id)).order_by(Message.chat_id, Message.id),
            "tokens": select(*TOKEN_COLUMNS).where(member(MessageTokens.message_id)),
        }
        self.compiled = (
            {name: stmt.compile(dialect=dialect) for name, stmt in self.statements.items()}
            if dialect.driver == "asyncpg"
            else {}
        )
        self.decoders = decoders(dialect)

    async def _rows(self, conn: AsyncConnection, name: str, **params: Any) -> Sequence[Any]:
        compiled = self.compiled.get(name)
        if compiled is None:
            return (await conn.execute(self.statements[name], params)).all()
        values = compiled.construct_params(params)
        driver: Any = (await conn.get_raw_connection()).driver_connection
        args = [values[key] for key in compiled.positiontup or ()]
        return await driver.fetch(compiled.string, *args)  # type: ignore[no-any-return]

    async def batch(self, after: str) -> _Batch | None:
        """The chats after ``after`` (one page), with their messages and token records; None: no more."""
        async with self.sessions() as s:
            conn = await s.connection()
            if self.dialect is None:
                self._prepare(conn.dialect)
            chats = list(await self._rows(conn, "page", after=after))
            if not chats:
                return None
            msgs = await self._rows(conn, "messages", ids=[c[0] for c in chats])
            # cancelled messages keep the tokens generated until the abort (finish_reason "abort")
            done = (MessageState.complete.value, MessageState.cancelled.value)
            assistant_ids = [m[M_ID] for m in msgs if m[M_ROLE] == "assistant" and m[M_STATE] in done]
            tokens = {}
            chunk = self.chunk or max(1, len(assistant_ids))
            for i in range(0, len(assistant_ids), chunk):
                rows = await self._rows(conn, "tokens", ids=assistant_ids[i : i + chunk])
                tokens.update({r[T_ID]: r for r in rows})
        by_chat = {cid: list(group) for cid, group in itertools.groupby(msgs, key=operator.itemgetter(M_CHAT))}
        return _Batch(chats, by_chat, tokens, self.decoders)


async def iter_rollouts(sessions: SessionFactory, filters: ExportFilters) -> AsyncIterator[dict[str, Any]]:
    paths = await read_policy_paths(sessions)  # the registry as of the export's start (a few rows)
    reader = _Reader(sessions, filters)
    batch = await reader.batch("")
    pending: asyncio.Task[_Batch | None] | None = None
    try:
        while batch is not None:
            # The next batch is read while this one is turned into rollouts: the database (or SQLite's
            # thread) works meanwhile, given a turn of the event loop every few chats.
            if len(batch.chats) == CHAT_BATCH:
                pending = asyncio.ensure_future(reader.batch(batch.chats[-1][0]))
            for i, (chat_id, user_id) in enumerate(batch.chats):
                msgs = batch.messages.pop(chat_id, [])
                for rollout in rows_rollouts(chat_id, user_id, msgs, batch.tokens, filters, batch.decoders, paths):
                    yield rollout
                if pending is not None and i % 8 == 7 and not pending.done():
                    await asyncio.sleep(0)
            batch = None
            if pending is not None:
                batch, pending = await pending, None
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
