"""The compiled PostgreSQL reader of the export (``server/export/pg_wire.py``, ``fastpage_c/pg_rows.c``)
against asyncpg on a real server: the same values of the same types for every type it decodes, the
parameters PostgreSQL parses from their text, errors as asyncpg raises them with the connection still
usable, notices passed over, and a statement it does not take left to asyncpg."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.export import fastpage
from server.export.pg_wire import PgWire

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not fastpage.AVAILABLE, reason="the compiled module is not built"),
]

TYPES_SQL = """
SELECT * FROM (VALUES
  ('plain'::text, 'v'::varchar(8), 'b'::char(3), 'nm'::name, '{"a": [1, 2.5e300]}'::json, '\\x00ff10'::bytea,
   (-32768)::int2, (-2147483648)::int4, (-9223372036854775808)::int8, 1.5::float4, -0.0::float8, true,
   '2000-01-01 00:00:00'::timestamp, '2000-01-01 00:00:00+00'::timestamptz),
  ('é ✓ 𝄞', '', '', '', 'null', ''::bytea, 32767::int2, 2147483647::int4, 9223372036854775807::int8,
   'NaN'::float4, 'Infinity'::float8, false, '1999-12-31 23:59:59.999999'::timestamp,
   '1970-01-01 00:00:00.000001+00'::timestamptz),
  ('plain', 'v', 'b', 'nm', '[]', '\\x'::bytea, 0::int2, 0, 0, '-Infinity'::float4, 1e-310::float8, true,
   'infinity'::timestamp, '-infinity'::timestamptz),
  (NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
   '0001-01-01 00:00:00'::timestamp, '9999-12-31 23:59:59.999999+00'::timestamptz),
  ('x', 'y', 'z', 'w', '1', '\\x01'::bytea, 1::int2, 1, 1, 3.25::float4, 2.5::float8, NULL,
   '1582-10-04 12:34:56.5'::timestamp, '2026-11-30 14:07:01.250000+05:30'::timestamptz)
) AS t(a, b, c, d, e, f, g, h, i, j, k, l, m, n)
"""


def _same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        assert type(row) is tuple and len(row) == len(want)
        for v, w in zip(row, want, strict=True):
            assert type(v) is type(w), (v, w)
            if isinstance(w, float) and math.isnan(w):
                assert math.isnan(v)
            elif isinstance(w, float):
                assert v == w and math.copysign(1, v) == math.copysign(1, w), (v, w)
            else:
                assert v == w, (v, w)
            if hasattr(w, "tzinfo"):
                assert v.tzinfo == w.tzinfo


def _run(url: str, body: Callable[[Any, PgWire], Awaitable[None]]) -> None:
    import asyncpg  # type: ignore[import-untyped]

    async def go() -> None:
        reference = await asyncpg.connect(url.replace("+asyncpg", ""))
        conn = await asyncpg.connect(url.replace("+asyncpg", ""))
        wire = PgWire.take(conn)
        assert wire is not None, "a plain TCP connection: the compiled reader takes it"
        try:
            await body(reference, wire)
        finally:
            await wire.close()
            await reference.close()

    asyncio.run(go())


def test_every_decoded_type_reads_as_asyncpg_reads_it(postgres_url: str) -> None:
    async def body(reference: Any, wire: PgWire) -> None:
        expected = [tuple(r) for r in await reference.fetch(TYPES_SQL)]
        _same(wire.rows(TYPES_SQL, []), expected)
        _same(wire.rows(TYPES_SQL, []), expected)  # the prepared statement again

    _run(postgres_url, body)


def test_parameters_are_parsed_by_postgres_from_their_text(postgres_url: str) -> None:
    sql = "SELECT $1::text, $2::int8, $3::bool, $4::float8, array_to_json($5::varchar[])::text, $6::text"
    odd = ['a"b', "c\\d", "{e,f}", "", " spaced ", "é✓𝄞", "NULL", "x'y"]
    cases: list[list[Any]] = [
        ["it's", 2**62, True, 0.1, odd, None],
        ["", -1, False, -2.5e-300, [], "two"],
        ["é", 0, True, float("inf"), ["one"], None],
        ["ids", 1, False, 0.0, ["01a1f956-b3fd-7b37", "nullish", "x.y_z"], None],  # written unquoted
        ["ids", 1, False, 0.0, ["a", "null"], None],
        ["ids", 1, False, 0.0, ["a", "b,c"], None],
    ]

    async def body(reference: Any, wire: PgWire) -> None:
        for params in cases:
            _same(wire.rows(sql, params), [tuple(r) for r in await reference.fetch(sql, *params)])
        with pytest.raises(ValueError, match="parameters"):
            wire.rows(sql, ["too few"])

    _run(postgres_url, body)


def test_an_error_is_asyncpgs_and_the_connection_goes_on(postgres_url: str) -> None:
    import asyncpg

    async def body(reference: Any, wire: PgWire) -> None:
        with pytest.raises(asyncpg.exceptions.DivisionByZeroError):
            wire.rows("SELECT 1 / $1::int4", [0])
        with pytest.raises(asyncpg.exceptions.UndefinedTableError):
            wire.rows("SELECT * FROM no_such_table_here", [])
        with pytest.raises(asyncpg.exceptions.PostgresSyntaxError):
            wire.prepare(["SELEC 1", "SELECT 2"])
        assert wire.rows("SELECT 1 / $1::int4", [1]) == [(1,)]
        assert wire.rows("SELECT 2", []) == [(2,)]

    _run(postgres_url, body)


def test_notices_and_statements_without_rows(postgres_url: str) -> None:
    async def body(reference: Any, wire: PgWire) -> None:
        assert wire.rows("DO $$BEGIN RAISE NOTICE 'a notice'; RAISE WARNING 'a warning'; END$$", []) == []
        assert wire.rows("SET application_name = 'tokentrail-test'", []) == []  # (a ParameterStatus)
        assert wire.rows("SELECT current_setting('application_name')", []) == [("tokentrail-test",)]
        big = wire.rows("SELECT g, repeat('x', g) FROM generate_series(0, 3000) g", [])
        assert big == [(g, "x" * g) for g in range(3001)]  # rows across many reads of the socket
        blob = wire.rows("SELECT decode(repeat('ab', 3000000), 'hex')", [])  # one message of 3 MB
        assert blob == [(bytes.fromhex("ab" * 3_000_000),)]

    _run(postgres_url, body)


def test_a_type_it_does_not_decode_is_left_to_asyncpg(postgres_url: str) -> None:
    async def body(reference: Any, wire: PgWire) -> None:
        assert wire.prepare(["SELECT 1.5::numeric"]) is False
        assert wire.prepare(["SELECT 1::int4", "SELECT now()::date"]) is False
        assert wire.rows("SELECT 1::int4", []) == [(1,)]  # the statements it takes are prepared
        conn = wire.release()  # asyncpg reads the connection again
        assert await conn.fetchval("SELECT 1.5::numeric") == pytest.approx(1.5)
        PgWire.take(conn)  # (closed by the fixture's wire)

    _run(postgres_url, body)


def test_a_connection_over_tls_stays_with_asyncpg() -> None:
    class Transport:
        def get_extra_info(self, name: str) -> Any:
            return object() if name == "sslcontext" else None

    class Conn:
        _transport = Transport()

    assert PgWire.take(Conn()) is None
