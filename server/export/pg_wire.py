"""An export's statements run on PostgreSQL by the compiled reader (``fastpage_c/pg_rows.c``) on the
socket of an asyncpg connection: asyncpg connects and authenticates (its TLS, auth methods and options
as configured), then stops reading; the extended query protocol's messages are built here and the
answers read in C, each row a tuple of what asyncpg's ``fetch`` gives for it. Only for a process that
may block on its reads (an export's own processes): a read waits in the calling thread, the event loop
held, as ``pages._Sqlite`` does.

Statements are prepared once per connection, named; parameters go as text (PostgreSQL parses each by
its type in the statement), results come in binary. A connection over TLS, or a result column of a type
the reader does not decode, stays with asyncpg (``take`` gives None, ``prepare`` False)."""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from server.export import fastpage

# the compiled module as ``fastpage`` loads it (None: not built, or TOKENTRAIL_EXPORT_PURE_PYTHON=1)
_native: Any = getattr(fastpage, "_native", None)
if not hasattr(_native, "pg_rows"):  # (an older build)
    _native = None

# result type oid -> the reader's decoder (pg_rows.c): the values asyncpg gives for these types
_CODES = {
    25: b"s",  # text
    1043: b"s",  # varchar
    1042: b"s",  # bpchar
    19: b"s",  # name
    114: b"s",  # json (its text)
    17: b"b",  # bytea
    21: b"h",  # int2
    23: b"i",  # int4
    20: b"q",  # int8
    700: b"f",  # float4
    701: b"d",  # float8
    16: b"?",  # bool
    1114: b"t",  # timestamp
    1184: b"T",  # timestamptz
}
_TEXT_ARRAYS = {1009, 1015}  # text[], varchar[]
_BOOL = 16

_I16, _I32 = struct.Struct("!h"), struct.Struct("!i")
_SYNC = b"S\x00\x00\x00\x04"
_EXECUTE = b"E" + _I32.pack(9) + b"\x00" + _I32.pack(0)  # the unnamed portal, every row
_RESULTS_BINARY = _I16.pack(1) + _I16.pack(1)


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + _I32.pack(len(body) + 4) + body


class Unsupported(Exception):
    """A statement whose parameters or result columns this reader does not take."""


@dataclass(frozen=True, slots=True)
class _Prepared:
    name: bytes  # the statement's name on this connection
    params: tuple[int, ...]  # its parameters' type oids
    codes: bytes | None  # the reader's decoder of each result column (None: no result columns)


def _array_text(values: Sequence[Any]) -> str:
    """A text[] literal of ``values`` (str): each element as it is where that reads back the same (ids:
    no quote, backslash, brace, comma or space, not empty, not NULL), else each one quoted."""
    if not all(isinstance(v, str) for v in values):
        bad = next(v for v in values if not isinstance(v, str))
        raise Unsupported(f"an array parameter holding {type(bad).__name__}")
    plain = ",".join(values)
    if plain.count(",") == len(values) - 1 and not _ARRAY_SPECIAL.search(plain):
        return "{" + plain + "}"
    return "{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}"


# what an unquoted array element may not hold or be: PostgreSQL's array_in would read it otherwise
_ARRAY_SPECIAL = re.compile(r'["\\{}\s]|(?:^|,)(?:null)?(?:,|$)', re.IGNORECASE)


def _param_text(oid: int, value: Any) -> bytes | None:
    """A parameter's text form for PostgreSQL's input function of its type (None: NULL)."""
    if value is None:
        return None
    if oid in _TEXT_ARRAYS:
        if not isinstance(value, (list, tuple)):
            raise Unsupported(f"a {type(value).__name__} for an array parameter")
        return _array_text(value).encode()
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, (str, int)):
        return str(value).encode()
    if isinstance(value, float):
        return repr(value).encode()
    if isinstance(value, (datetime, date)):
        return value.isoformat().encode()
    raise Unsupported(f"a parameter of type {type(value).__name__}")


def _error(fields: dict[str, str], sql: str) -> Exception:
    try:
        from asyncpg.exceptions import PostgresError  # type: ignore[import-untyped]

        return PostgresError.new(fields, query=sql)  # type: ignore[no-any-return]
    except Exception:  # (a change in asyncpg's internals: the plain message)
        return RuntimeError(f"PostgreSQL {fields.get('C', '')}: {fields.get('M', '')}")


class PgWire:
    """The compiled reader on an asyncpg connection's socket (``take``). One thread at a time."""

    def __init__(self, conn: Any, reader: Any) -> None:
        self._conn = conn  # kept: its transport owns the socket
        self._reader = reader
        self._prepared: dict[str, _Prepared] = {}
        self._named = 0  # statements parsed (their names)

    @classmethod
    def take(cls, conn: Any) -> PgWire | None:
        """The reader on ``conn``'s socket, asyncpg no longer reading it; None (``conn`` as it was) where
        the module was not built, the connection is over TLS or its socket cannot be had."""
        if _native is None:
            return None
        transport = getattr(conn, "_transport", None)
        if transport is None or transport.get_extra_info("sslcontext") is not None:
            return None
        if transport.get_extra_info("ssl_object") is not None:
            return None
        sock = transport.get_extra_info("socket")
        fileno = getattr(sock, "fileno", None)
        if fileno is None or fileno() < 0:
            return None
        transport.pause_reading()
        return cls(conn, _native.pg_open(fileno()))

    def release(self) -> Any:
        """The asyncpg connection, asyncpg reading it again (between statements only)."""
        self._conn._transport.resume_reading()
        return self._conn

    def prepare(self, sqls: Sequence[str]) -> bool:
        """Parse the statements (one round trip) as named statements of this connection; False where a
        result column's type is not one the reader decodes (the caller then reads through asyncpg)."""
        todo = [sql for sql in dict.fromkeys(sqls) if sql not in self._prepared]
        if not todo:
            return True
        names = [f"tokentrail_export_{self._named + i}".encode() for i in range(len(todo))]
        self._named += len(todo)
        payload = b"".join(
            _message(b"P", name + b"\x00" + sql.encode() + b"\x00" + _I16.pack(0))
            + _message(b"D", b"S" + name + b"\x00")
            for name, sql in zip(names, todo, strict=True)
        )
        _, messages, error = _native.pg_rows(self._reader, payload + _SYNC, None)
        if error is not None:
            raise _error(error, todo[0] if len(todo) == 1 else "; ".join(todo))
        described: list[list[tuple[str, bytes]]] = []
        for kind, body in messages:
            if kind == "1":  # ParseComplete: the next statement's answers follow
                described.append([])
            elif described:
                described[-1].append((kind, body))
        if len(described) != len(todo):
            raise ConnectionError(f"PostgreSQL described {len(described)} of {len(todo)} statements")
        supported = True
        for name, sql, answers in zip(names, todo, described, strict=True):
            params: tuple[int, ...] = ()
            codes: bytes | None = None
            try:
                for kind, body in answers:
                    if kind == "t":
                        (n,) = _I16.unpack_from(body)
                        params = struct.unpack_from(f"!{n}I", body, 2)
                    elif kind == "T":
                        codes = self._codes(body)
            except Unsupported:
                supported = False
                continue
            self._prepared[sql] = _Prepared(name, params, codes)
        return supported

    def _statement(self, sql: str) -> _Prepared:
        known = self._prepared.get(sql)
        if known is None:
            if not self.prepare([sql]):
                raise Unsupported(f"a result column of a type the reader does not decode: {sql}")
            known = self._prepared[sql]
        return known

    @staticmethod
    def _codes(body: bytes) -> bytes:
        (n,) = _I16.unpack_from(body)
        at, codes = 2, []
        for _ in range(n):
            at = body.index(b"\x00", at) + 1  # the column's name
            _table, _attnum, oid, _size, _mod, _fmt = struct.unpack_from("!IhIhih", body, at)
            at += 18
            code = _CODES.get(oid)
            if code is None:
                raise Unsupported(f"a result column of type oid {oid}")
            codes.append(code)
        return b"".join(codes)

    def rows(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """The statement's rows, as asyncpg's ``fetch(sql, *params)`` gives them but as tuples."""
        stmt = self._statement(sql)
        if len(params) != len(stmt.params):
            raise ValueError(f"{len(params)} parameters for a statement of {len(stmt.params)}")
        parts = [b"\x00", stmt.name, b"\x00", _I16.pack(1), _I16.pack(0), _I16.pack(len(params))]
        for oid, value in zip(stmt.params, params, strict=True):
            text = _param_text(oid, value)
            if text is None:
                parts.append(_I32.pack(-1))
            else:
                parts += (_I32.pack(len(text)), text)
        parts.append(_RESULTS_BINARY if stmt.codes else _I16.pack(0))
        payload = _message(b"B", b"".join(parts)) + _EXECUTE + _SYNC
        rows, _, error = _native.pg_rows(self._reader, payload, stmt.codes)
        if error is not None:
            raise _error(error, sql)
        return rows  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Terminate the session and close the connection."""
        try:
            self._conn._transport.write(b"X\x00\x00\x00\x04")  # Terminate
        finally:
            self._conn.terminate()
