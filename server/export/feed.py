"""The rollout feed (``GET /v1/rollouts``): finished episodes, in the order they finished, as rollouts.

An episode finishes when ``POST /v1/rewards`` marks a reply ``done``; that reply then takes the next
feed position (``messages.feed_seq``, see ``assign_position``). Positions are given under a lock held
until commit (PostgreSQL: an advisory transaction lock; SQLite: its single writer), so positions
become visible in order: a reader that has seen position N has seen every position below N, and a
cursor (the last position read) never skips a rollout, whichever replica serves the next read.

Cursors are opaque: the position and an HMAC under a key kept in the database (``server_secrets``),
so every replica of a deployment accepts the others' cursors and a cursor that was altered, or comes
from another deployment, is refused rather than silently resumed somewhere else.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from server.db import SessionFactory
from server.export.query import (
    IN_CHUNK,
    M_CHAT,
    M_ID,
    M_ROLE,
    M_STATE,
    MSG_COLUMNS,
    NO_PATHS,
    T_ID,
    TOKEN_COLUMNS,
    ExportFilters,
    decoders,
    read_policy_paths,
)
from server.export.rollouts import leaf_path, path_rollout
from server.models import Chat, Message, MessageTokens, ServerSecret
from shared.api import MessageState

FEED_BATCH = 64  # finished episodes read per query
_LOCK_ID = 0x7474_6665_6564  # "ttfeed": PostgreSQL advisory lock that orders feed positions
_CURSOR_PREFIX = "rf1_"
_TAG_BYTES = 12


class CursorError(ValueError):
    """A cursor this deployment did not issue (malformed, altered, or from another database)."""


async def assign_position(session: AsyncSession, message_id: str) -> None:
    """Give ``message_id`` the next feed position unless it has one, in the caller's transaction (which
    must commit soon: on PostgreSQL the lock that orders positions is held until then)."""
    if (await session.connection()).dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_ID})
    # one statement: SQLite holds its write lock from the first write of the transaction to commit
    top = select(func.coalesce(func.max(Message.feed_seq), 0) + 1).scalar_subquery()
    await session.execute(
        update(Message)
        .where(Message.id == message_id, Message.feed_seq.is_(None))
        .values(feed_seq=top)
        .execution_options(synchronize_session=False)
    )


class Cursors:
    """Signs and checks cursors with the deployment's feed key (read or created on first use)."""

    SECRET = "rollout_feed_cursor"

    def __init__(self, sessions: SessionFactory) -> None:
        self.sessions = sessions
        self._key: bytes | None = None
        self._lock = asyncio.Lock()

    async def key(self) -> bytes:
        if self._key is None:
            async with self._lock:
                if self._key is None:
                    self._key = await self._read_or_create()
        return self._key

    async def _read_or_create(self) -> bytes:
        async with self.sessions() as s:
            stored = await s.scalar(select(ServerSecret.value).where(ServerSecret.name == self.SECRET))
            if stored is None:
                insert = pg_insert if (await s.connection()).dialect.name == "postgresql" else sqlite_insert
                stmt = insert(ServerSecret).values(name=self.SECRET, value=secrets.token_hex(32))
                await s.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
                await s.commit()  # another replica may have won the race: read what was kept
                stored = await s.scalar(select(ServerSecret.value).where(ServerSecret.name == self.SECRET))
        if stored is None:
            raise RuntimeError("the rollout feed's cursor key could not be stored")
        return bytes.fromhex(stored)

    @staticmethod
    def _tag(key: bytes, payload: bytes) -> bytes:
        return hmac.new(key, b"rollout-feed:" + payload, hashlib.sha256).digest()[:_TAG_BYTES]

    async def encode(self, position: int) -> str:
        payload = position.to_bytes(8, "big")
        raw = payload + self._tag(await self.key(), payload)
        return _CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    async def decode(self, cursor: str) -> int:
        if not cursor.startswith(_CURSOR_PREFIX):
            raise CursorError("not a rollout-feed cursor (they start with 'rf1_')")
        body = cursor[len(_CURSOR_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError) as exc:
            raise CursorError("malformed rollout-feed cursor") from exc
        if len(raw) != 8 + _TAG_BYTES:
            raise CursorError("malformed rollout-feed cursor")
        payload, tag = raw[:8], raw[8:]
        if not hmac.compare_digest(tag, self._tag(await self.key(), payload)):
            raise CursorError("this cursor was not issued by this deployment (altered, or from another database)")
        return int.from_bytes(payload, "big")


@dataclass
class FeedBatch:
    rollouts: list[tuple[int, dict[str, Any]]]  # (position, native rollout), in position order
    scanned_to: int  # the last position read, rollouts or not (filters, opted-out chats)
    full: bool  # as many episodes as a batch reads: more may follow at once


async def read_batch(
    sessions: SessionFactory, after: int, filters: ExportFilters, limit: int = FEED_BATCH
) -> FeedBatch:
    """The finished episodes after position ``after`` (at most ``limit``) as native rollouts; ``filters.user``
    scopes it to one user's chats. Chats that opted out of data use are never read, as in an export."""
    done = (
        select(Message.feed_seq, Message.id, Message.chat_id, Chat.user_id)
        .join(Chat, Chat.id == Message.chat_id)
        .where(Message.feed_seq > after)
        .order_by(Message.feed_seq)
        .limit(limit)
    )
    async with sessions() as s:
        rows = (await s.execute(done)).all()
        if not rows:
            return FeedBatch([], after, False)
        conn = await s.connection()
        dec = decoders(conn.dialect)
        chat_ids = sorted({r.chat_id for r in rows})
        readable = select(Chat.id).where(Chat.id.in_(chat_ids), Chat.allow_data_use.is_(True))
        if filters.user is not None:
            readable = readable.where(Chat.user_id == filters.user)
        allowed = set((await s.execute(readable)).scalars())
        wanted = [r for r in rows if r.chat_id in allowed]
        by_chat, tokens = await _chat_rows(s, sorted({r.chat_id for r in wanted}))
    paths = await read_policy_paths(sessions) if wanted else NO_PATHS
    out = []
    for r in wanted:
        by_id = by_chat.get(r.chat_id, {})
        if r.id not in by_id:
            continue
        rollout = path_rollout(r.chat_id, r.user_id, leaf_path(by_id, r.id), tokens, filters, dec, paths)
        if rollout is not None:
            out.append((int(r.feed_seq), rollout))
    return FeedBatch(out, int(rows[-1].feed_seq), len(rows) == limit)


async def _chat_rows(s: AsyncSession, chat_ids: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The message rows of ``chat_ids`` (by chat, by id) and the token rows of their finished replies."""
    if not chat_ids:
        return {}, {}
    msgs = (await s.execute(select(*MSG_COLUMNS).where(Message.chat_id.in_(chat_ids)))).all()
    finished = (MessageState.complete.value, MessageState.cancelled.value)
    reply_ids = [m[M_ID] for m in msgs if m[M_ROLE] == "assistant" and m[M_STATE] in finished]
    tokens = {}
    for i in range(0, len(reply_ids), IN_CHUNK):
        rows = await s.execute(select(*TOKEN_COLUMNS).where(MessageTokens.message_id.in_(reply_ids[i : i + IN_CHUNK])))
        tokens.update({t[T_ID]: t for t in rows})
    by_chat: dict[str, dict[str, Any]] = {}
    for m in msgs:
        by_chat.setdefault(m[M_CHAT], {})[m[M_ID]] = m
    return by_chat, tokens


class FeedSignal:
    """Wakes this process's feed readers when an episode finishes here; readers also poll, for episodes
    finished on other replicas."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, within_s: float) -> None:
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), within_s)
