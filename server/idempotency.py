"""Idempotent writes: the ``Idempotency-Key`` request header (the IETF httpapi draft) on every POST that
creates data or work.

A key belongs to its user: another user's request with the same key value is a request of its own. The
first request that carries a key stores a record in the very transaction that creates what it makes: the
key, a fingerprint of the request (method, path and body, the body as canonical JSON) and the ids a retry
needs. So either both are stored or neither is; a replica that dies after its commit leaves the record
behind, and one that dies before leaves nothing to find.

A later request with the same key and fingerprint creates nothing: it is answered from the record, as the
route renders those ids now (a message as it stands; a generation's finished answer, or a stream that
follows the same message from its first token), by any replica. The same key with another fingerprint
is refused (422 ``idempotency_key_reused``). Two requests racing with one key both try to insert the
record; the loser's transaction is rolled back, nothing of it stored, and it answers as a retry.

Records are kept ``idempotency_ttl_s`` (a day by default) and deleted by the sweep; a key is free again
after that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, timedelta
from typing import Any, TypeVar

import orjson
from sqlalchemy import and_, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.dml import Insert

from server.errors import ApiError
from server.hot_sql import Step
from server.models import IDEMPOTENCY_KEYS, utcnow
from shared.errors import ErrorCode

T = TypeVar("T")

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255

_T = IDEMPOTENCY_KEYS.c
# The record goes first in its transaction; a key already taken inserts no row and the transaction is
# rolled back (a required step), whichever database.
_INSERT: dict[str, Insert] = {
    "sqlite": sqlite.insert(IDEMPOTENCY_KEYS).on_conflict_do_nothing(),
    "postgresql": postgresql.insert(IDEMPOTENCY_KEYS).on_conflict_do_nothing(),
}


class KeyTaken(Exception):
    """Another request with this key stored its record first: this one's transaction was rolled back
    and it is to be answered from that record."""


@dataclass(frozen=True)
class IdempotencyKey:
    user_id: str
    key: str
    fingerprint: str
    ttl_s: float

    def _row(self, result: dict[str, Any]) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "key": self.key,
            "fingerprint": self.fingerprint,
            "result": result,
            "created_at": utcnow(),
        }

    def step(self, dialect: str, result: dict[str, Any]) -> Step:
        """The record's insert, as the first step of a ``HotSql.transact``: ``transact`` returns None
        (rolled back) when the key was taken meanwhile."""
        return Step(_INSERT[dialect], self._row(result), required=True)

    async def record(self, session: AsyncSession, result: dict[str, Any]) -> None:
        """Insert the record in ``session``'s transaction, before its commit; ``KeyTaken`` (rolled back)
        when another request stored it first."""
        dialect = session.get_bind().dialect.name
        res = await session.execute(_INSERT[dialect], self._row(result))
        if not res.rowcount:  # type: ignore[attr-defined]
            await session.rollback()
            raise KeyTaken(self.key)

    async def find(self, session: AsyncSession) -> dict[str, Any] | None:
        """The first request's result, or None when the key is new (or expired: then it is freed).
        A key used with another request: 422 ``idempotency_key_reused``."""
        where = and_(_T.user_id == self.user_id, _T.key == self.key)
        row = (await session.execute(select(_T.fingerprint, _T.result, _T.created_at).where(where))).first()
        if row is None:
            return None
        created = row.created_at
        if created.tzinfo is None:  # SQLite hands back naive UTC
            created = created.replace(tzinfo=UTC)
        if created < utcnow() - timedelta(seconds=self.ttl_s):
            await session.execute(delete(IDEMPOTENCY_KEYS).where(where))
            await session.commit()
            return None
        if row.fingerprint != self.fingerprint:
            raise ApiError(
                ErrorCode.idempotency_key_reused,
                f"this {HEADER} was used with another request (method, path or body); use a new key",
                param=HEADER,
            )
        result: dict[str, Any] = row.result
        return result


def fingerprint(method: str, path: str, body: bytes) -> str:
    """Method, path (with its query) and body; a JSON body as canonical JSON (key order and spacing do
    not make two requests different)."""
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS) if body else b""
    except orjson.JSONDecodeError:
        canonical = body
    digest = hashlib.sha256()
    for part in (method.upper().encode(), path.encode(), canonical):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def parse_key(raw: str) -> str:
    """The header's value: the draft's structured-field string (``"..."``), or the bare token most
    clients send; 1 to 255 printable ASCII characters."""
    value = raw.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if not 1 <= len(value) <= MAX_KEY_LENGTH or not all(" " <= ch <= "~" for ch in value):
        raise ApiError(
            ErrorCode.invalid_idempotency_key,
            f"{HEADER} must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
            param=HEADER,
        )
    return value


async def purge_expired(session: AsyncSession, ttl_s: float) -> int:
    """Delete the records older than ``ttl_s`` (the sweep's pass)."""
    cutoff = utcnow() - timedelta(seconds=ttl_s)
    res = await session.execute(delete(IDEMPOTENCY_KEYS).where(_T.created_at < cutoff))
    await session.commit()
    return int(res.rowcount or 0)  # type: ignore[attr-defined]


async def once(
    idem: IdempotencyKey | None,
    session: AsyncSession,
    create: Callable[[], Awaitable[T]],
    replay: Callable[[dict[str, Any]], Awaitable[T]],
    *,
    looked: bool = False,
) -> T:
    """``create`` (which stores the record through ``record`` or ``step``), unless the key's request was
    made already: then ``replay`` of its result, also when it wins a race with this one. ``looked``:
    the caller found no record a moment ago (it checks before its own validation: a retry is answered
    even when what the first request needed, such as a connected worker, is gone meanwhile)."""
    if idem is not None and not looked and (found := await idem.find(session)) is not None:
        return await replay(found)
    try:
        return await create()
    except KeyTaken:
        assert idem is not None
        found = await idem.find(session)
        if found is None:  # stored and expired in between: only with a TTL shorter than a request
            raise ApiError(ErrorCode.idempotency_key_reused, f"this {HEADER} expired meanwhile; retry") from None
        return await replay(found)
