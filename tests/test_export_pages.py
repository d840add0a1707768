"""A page's rollouts built at once (``page_rollouts``, then ``page_lines`` and ``page_batch``) are the
rollouts built one at a time (``rows_rollout_parts``, then ``rollout_line`` and ``RolloutColumns``),
byte for byte and value for value, on stored conversations read back through the export's own page
reader from SQLite and from PostgreSQL: the benchmark's 4-turn chats with regenerations, votes, closers
and -inf logprobs, and chats changed to hold what it lacks (rewards, version spans, tool calls, a turn
without a token record, a client-written assistant turn, a prompt that does not extend the one
before, a NaN logprob, a sibling reply, an empty reply, a closer past its prompt, a logprob missing),
under several filters."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.export import Ids, Rows, insert_rows, make_chats
from server.export import fastpage
from server.export.columnar import RolloutColumns, page_batch
from server.export.jsonl import rollout_line
from server.export.page_jsonl import page_lines
from server.export.page_rollouts import page_rollouts
from server.export.pages import connect, page_bounds, page_chats, page_queries
from server.export.query import ExportFilters, PolicyPaths
from server.export.rollouts import rows_rollout_parts
from tests import services

PATHS = PolicyPaths({"bench-model": {1: "/ckpt/v1", 2: "/ckpt/v2"}})


def _varied(rows: Rows) -> set[str]:
    """Changes the generated rows so that they hold what the benchmark's do not; returns the chats
    whose pages the page builder leaves to ``rows_rollout_parts`` (a logprob missing)."""
    rng = np.random.default_rng(7)
    assistants = [m for m in rows.messages if m["role"] == "assistant"]
    tokens = {t["message_id"]: t for t in rows.tokens}
    for i, m in enumerate(assistants):
        t = tokens[m["id"]]
        if i % 7 == 0:
            m["reward"], m["episode_done"] = float(rng.normal()), bool(i % 2)
        if i % 5 == 1:
            n = len(t["completion_ids"]) // 4
            m["policy_versions"] = [[0, 1], [n // 2, 2]] if n > 1 else [[0, 2]]
        if i % 11 == 2:
            call = f"call_{i}" + "0" * 20 * (i % 2)  # (a run of 20 digits: read by json, not orjson)
            m["tool_calls"] = [{"id": call, "type": "function", "function": {"name": "f", "arguments": "{}"}}]
            m["reasoning_content"] = 'thinking \u00e9 "quoted"\n'
        if i % 11 == 3:  # the characters JSON escapes (but NUL: PostgreSQL text has none), and some it does not
            m["content"] = "".join(map(chr, range(1, 0x20))) + '\x7f"\\/ \u00e9\u2028\U0001f600 end'
        if i % 29 == 7:  # sampling parameters: none at all, or a temperature (an int, a float) and a seed of their own
            work = dict(m["work_parameters"])
            if i % 2:
                del work["sampling_parameters"]
            else:
                work["sampling_parameters"] = dict(
                    work["sampling_parameters"], temperature=0.7 if i % 4 else 1, seed=11
                )
                work["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            m["work_parameters"] = work
        if i % 13 == 3:
            t["stop_reason"] = "s:</s>"
        if i % 17 == 4:
            lps = np.frombuffer(t["logprobs"], np.float32).copy()
            lps[0] = np.nan
            t["logprobs"] = lps.tobytes()
        if i % 19 == 5:
            m["created_at"] = m["created_at"].replace(microsecond=0)
        if i % 23 == 6 and t["reused_prefix_len"]:  # a prompt that does not extend the turns before
            prompt = np.frombuffer(t["prompt_ids"], np.int32).copy()
            prompt[0] += 1
            t["prompt_ids"] = prompt.tobytes()
    chats = sorted({m["chat_id"] for m in assistants})
    for m in assistants:  # every fourth chat all on recent versions (what min_version keeps)
        if chats.index(m["chat_id"]) % 4 == 0 and "policy_versions" not in m:
            m["policy_versions"] = [[0, 2]]
    # a reply with no tokens at all, and a closer said to run past its prompt's end
    empty = tokens[assistants[40]["id"]]
    empty["completion_ids"] = empty["logprobs"] = b""
    past = next(tokens[m["id"]] for m in assistants[41:] if tokens[m["id"]]["synthetic_token_count"])
    past["synthetic_token_count"] = len(past["prompt_ids"]) // 4 - past["reused_prefix_len"] + 5
    # a turn without its token record (the rollout is incomplete)
    rows.tokens.remove(tokens[assistants[9]["id"]])
    # an assistant message a client wrote (context, not a turn): the second reply of a chat becomes one
    manual = assistants[13]
    manual["state"] = "manual"
    rows.tokens.remove(tokens[manual["id"]])
    # a sibling reply to a chat's first prompt: a one-turn leaf beside a four-turn path
    first = assistants[20]
    sibling = dict(first, id=first["id"][:-4] + "ffff")
    rows.messages.append(sibling)
    rows.tokens.append(dict(tokens[first["id"]], message_id=sibling["id"]))
    # a logprob missing: that chat's page is built one rollout at a time
    # (in the last exported chat: the other cases above are in the first pages, built at once)
    exported = {c["id"] for c in rows.chats if c["allow_data_use"]}
    last = next(m for m in reversed(assistants) if m["chat_id"] in exported and m["state"] != "manual")
    short = tokens[last["id"]]
    short["logprobs"] = short["logprobs"][:-4]
    return {last["chat_id"]}


async def _store(url: str) -> set[str]:
    from server.db import create_engine

    rows = make_chats(np.random.default_rng(3), Ids(int(datetime(2026, 1, 1).timestamp() * 1000), 3), 0, 160, 4)
    odd = _varied(rows)
    for m in rows.messages:
        m.setdefault("reward", None)
        m.setdefault("episode_done", False)
        m.setdefault("policy_versions", None)
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await insert_rows(conn, rows)
            await _raw_work_texts(conn, rows, engine.dialect.name == "postgresql")
    finally:
        await engine.dispose()
    return odd


# Work parameters as texts that json.dumps does not write: the compiled builder reads the members it
# takes (sampling parameters, seed, system prompt, tools) from the text and leaves the rest undecoded,
# or decodes it all where its reader does not take the text (an escaped member name, deep nesting, a
# run of 19 digits, NaN): either way what the Python path decodes.
RAW_WORK_TEXTS = [
    '{"sampling_parameters":{"seed":null,"temperature":0.5,"top_p":0.9},"seed":7,"system_prompt":"compact"}',
    '{\n\t"seed" : -0 ,\r\n "sampling_parameters" : { "top_k" : 40 , "seed" : 3 } ,\n "system_prompt" : null }\n',
    '{"se\\u0065d": 5, "sampling_parameters": {"temperature": 2}, "system_prompt": "escaped name"}',
    '{"seed": 1, "sampling_parameters": {"temperature": 0.3}, "seed": 2, "system_prompt": "first"}',
    '{"system_prompt": "an id 1234567890123456789 \\u00e9 \u00e9\u2028", "seed": 1.5, "sampling_parameters": {}}',
    "{}",
    "null",
    '{"sampling_parameters": {"temperature": "0.25", "stop": ["\\n", "x"]}, "seed": 1e3, "tools": []}',
    '{"tools": ' + "[" * 70 + "]" * 70 + ', "sampling_parameters": null, "seed": 9}',
    '{"sampling_parameters": {"max_new_tokens": 120, "seed": 5}, "tools": [{"type": "function", "function": '
    '{"name": "f", "parameters": {"type": "object"}}}], "system_prompt": "tools", "seed": 123456789012345678}',
    '{"sampling_parameters": {"temperature": 0.1e1, "top_p": -0.5E-2}, "seed": 0, "extra": [true, false, null]}',
]
RAW_WORK_SQLITE = ['{"sampling_parameters": {"top_p": NaN}, "seed": 4}']  # (PostgreSQL's json refuses NaN)


async def _raw_work_texts(conn: Any, rows: Rows, postgres: bool) -> None:
    from sqlalchemy import text

    texts = RAW_WORK_TEXTS + ([] if postgres else RAW_WORK_SQLITE)
    assistants = [m for m in rows.messages if m["role"] == "assistant"]
    for i, raw in enumerate(texts):
        await conn.execute(
            text("UPDATE messages SET work_parameters = :raw WHERE id = :id"),
            {"raw": raw, "id": assistants[4 + 6 * i]["id"]},
        )


FILTERS = [
    ExportFilters(),
    ExportFilters(include_incomplete=True, reward_rule="mean"),
    ExportFilters(rated_only=True, reward_rule="min"),
    ExportFilters(min_version=1),
    ExportFilters(max_staleness=1, reward_rule="leaf"),
    ExportFilters(min_score=-0.5),
    ExportFilters(model="bench-model", since=datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)),
]


async def _compare(url: str, filters: ExportFilters, odd: set[str]) -> tuple[int, int, int]:
    """Compares both ways on each page; returns (pages built at once, rollouts compared, pages left to
    ``rows_rollout_parts``)."""
    from server.db import create_engine

    engine = create_engine(url)
    queries = page_queries(engine, filters)
    await engine.dispose()
    dec = queries.decoders
    conn = await connect(queries)
    wire = await connect(queries, blocking=True)  # PostgreSQL: the compiled reader (pg_wire)
    at_once = compared = left = 0
    try:
        for after, last in await page_bounds(conn, queries, 40):
            chats = [chat async for chat in page_chats(wire, queries, after, last)]
            _same_rows(chats, [chat async for chat in page_chats(conn, queries, after, last)])
            one_by_one = [r for chat in chats for r in rows_rollout_parts(*chat, filters, dec, PATHS)]
            lines = [rollout_line(r) for r in one_by_one]
            columns = RolloutColumns()
            for r in [r for chat in chats for r in rows_rollout_parts(*chat, filters, dec, PATHS)]:
                columns.add(r)
            page = page_rollouts(chats, filters, dec, PATHS)
            encoded = fastpage.encode_page(chats, filters, dec, PATHS)
            if page is None:
                assert odd & {c[0] for c in chats}, "only a page with a logprob missing is left to rows_rollout_parts"
                assert encoded is None and fastpage.arrow_batch(chats, filters, dec, PATHS) is None
                left += 1
                continue
            at_once += 1
            compared += len(lines)
            assert page_lines(page, dec, filters.reward_rule) == lines
            if fastpage.AVAILABLE:  # the compiled encoder: the same bytes
                assert encoded is not None
                assert encoded[1] == len(lines)
                _same_bytes(encoded[0], b"".join(lines))
            batch = page_batch(page, dec, filters.reward_rule)
            expected = columns.batch()
            for name in expected.schema.names:
                assert batch.column(name).equals(expected.column(name)), name
            if fastpage.AVAILABLE:  # the compiled encoder's columns: the same values
                native = fastpage.arrow_batch(chats, filters, dec, PATHS)
                assert native is not None and native.schema.equals(expected.schema)
                native.validate(full=True)
                for name in expected.schema.names:
                    assert native.column(name).equals(expected.column(name)), name
                _same_parquet(chats, filters, dec, expected)
    finally:
        await conn.close()
        await wire.close()
    return at_once, compared, left


def _same_parquet(chats: list[Any], filters: ExportFilters, dec: Any, expected: Any) -> None:
    """The compiled Parquet writer's row group, in a file as the export writes it, reads back as the
    expected batch, under 1 MiB pages and under pages of 100 bytes (a column chunk of many pages); its
    top-level columns' statistics are those pyarrow writes for the same batch."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from server.export.columnar import ROLLOUT_SCHEMA
    from server.export.parquet_pages import PageFile, RowGroupTemplate, page_file
    from server.export.writers import ZSTD_LEVEL, native_parquet_fields, rollout_parquet_options

    fields = native_parquet_fields()
    if not fastpage.AVAILABLE or fields is None:
        return
    theirs = pq.ParquetFile(io.BytesIO(_stitched(page_file(expected, ROLLOUT_SCHEMA, **rollout_parquet_options()))))
    for page_bytes in (1 << 20, 100):
        written = fastpage.parquet_page(chats, filters, dec, PATHS, ZSTD_LEVEL, page_bytes)
        assert written is not None, "libzstd not found"
        (chunks, parts, offsets, rows), rollouts = written
        assert rollouts == rows == expected.num_rows
        page = PageFile(memoryview(chunks), RowGroupTemplate(parts, offsets, rows), fields)
        ours = pq.ParquetFile(io.BytesIO(_stitched(page)))
        table = ours.read()
        assert table.schema.equals(ROLLOUT_SCHEMA)
        for name in expected.schema.names:
            want = pa.chunked_array([expected.column(name)]).combine_chunks()
            assert table.column(name).combine_chunks().equals(want), name
        if not rows:  # (no row group: the file is pyarrow's empty one)
            continue
        group, reference = ours.metadata.row_group(0), theirs.metadata.row_group(0)
        for i in range(group.num_columns):
            mine, pyarrows = group.column(i), reference.column(i)
            assert mine.path_in_schema == pyarrows.path_in_schema and mine.num_values == pyarrows.num_values
            assert mine.is_stats_set == pyarrows.is_stats_set, mine.path_in_schema
            if pyarrows.is_stats_set:
                a, b = mine.statistics, pyarrows.statistics
                assert (a.null_count, a.has_min_max) == (b.null_count, b.has_min_max), mine.path_in_schema
                if b.has_min_max:
                    assert (a.min, a.max) == (b.min, b.max), mine.path_in_schema


def _stitched(page: Any) -> bytes:
    """A page's row group as the Parquet file the export writes of it."""
    import tempfile

    from server.export.columnar import ROLLOUT_SCHEMA
    from server.export.parquet_pages import StitchedParquetWriter
    from server.export.writers import rollout_parquet_options

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "page.parquet"
        writer = StitchedParquetWriter(path, ROLLOUT_SCHEMA, **rollout_parquet_options())
        writer.add(page)
        writer.close()
        return path.read_bytes()


def _same_bytes(got: bytes, expected: bytes) -> None:
    if got != expected:
        at = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        raise AssertionError(f"differ at byte {at}:\n{got[at - 200 : at + 100]!r}\n{expected[at - 200 : at + 100]!r}")


def _check(url: str) -> None:
    from server.migrate import upgrade

    upgrade(url)
    odd = asyncio.run(_store(url))
    for filters in FILTERS:
        at_once, compared, left = asyncio.run(_compare(url, filters, odd))
        assert at_once >= 3 and compared >= 10 and left <= 1, (filters, at_once, compared, left)
        # the page with a logprob missing is left to rows_rollout_parts (unless a filter drops its chat first)
        assert left == 1 or filters != FILTERS[0]


def test_page_rollouts_are_the_one_by_one_rollouts_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'pages.db'}"
    _check(url)
    asyncio.run(_no_cycles(url))
    _same_rows_as_sqlite3(tmp_path / "pages.db", url)


def _same_rows_as_sqlite3(path: Path, url: str) -> None:
    """The compiled SQLite reader (what the export's pages read through where it was built) gives each
    page statement's rows as ``sqlite3`` does: the same values of the same types."""
    import sqlite3

    from server.db import create_engine
    from server.export.query import M_ID

    if not fastpage.AVAILABLE:
        return
    reader = fastpage.SqliteReader.open(str(path), pragmas=["busy_timeout=30000"])
    assert reader is not None, "SQLite's library not found through the sqlite3 extension"
    engine = create_engine(url)
    statements = page_queries(engine, ExportFilters()).statements
    asyncio.run(engine.dispose())
    conn = sqlite3.connect(path)

    def same(sql: str, params: list[Any]) -> list[Any]:
        ours, theirs = reader.rows(sql, params), conn.execute(sql, params).fetchall()
        assert ours == theirs
        assert [tuple(map(type, row)) for row in ours] == [tuple(map(type, row)) for row in theirs]
        return ours

    try:
        chats = same(statements["chats"].sql, statements["chats"].args(after="", last="\uffff"))
        ids = '["' + '","'.join(c[0] for c in chats) + '"]'
        messages = same(statements["messages"].sql, statements["messages"].args(after="", last="\uffff", ids=ids))
        replies = '["' + '","'.join(m[M_ID] for m in messages) + '"]'
        assert len(same(statements["tokens"].sql, statements["tokens"].args(ids=replies))) >= 100
        same("SELECT 1, -2.5, 'é' || char(0) || '😀', x'00ff', NULL, ?, ?, ?, ?", [None, -(2**63), 1e-300, "ü"])
        with pytest.raises(RuntimeError, match="no such column"):
            reader.rows("SELECT nope", [])
        with pytest.raises(ValueError, match="0 parameters for 1"):
            reader.rows("SELECT ?", [])
    finally:
        reader.close()
        conn.close()


def _same_rows(got: list[Any], expected: list[Any]) -> None:
    """The chats of a page as two connections read them: the same rows, values of the same types."""
    assert [c[:2] for c in got] == [c[:2] for c in expected]
    for (_, _, msgs, tokens), (_, _, want_msgs, want_tokens) in zip(got, expected, strict=True):
        assert [tuple(m) for m in msgs] == [tuple(m) for m in want_msgs]
        assert {k: tuple(v) for k, v in tokens.items()} == {k: tuple(v) for k, v in want_tokens.items()}
        rows = [*msgs, *tokens.values()]
        want = [*want_msgs, *want_tokens.values()]
        assert [[type(v) for v in r] for r in rows] == [[type(v) for v in r] for r in want]


async def _no_cycles(url: str) -> None:
    """Encoding a page leaves no reference cycle: export workers run without the cycle collector
    (``gc.disable``), so a cycle would keep each page's buffers to the end of the export."""
    from server.db import create_engine
    from server.export.writers import ArrowEncoder, LinesEncoder

    engine = create_engine(url)
    filters = ExportFilters()
    queries = page_queries(engine, filters)
    await engine.dispose()
    conn = await connect(queries)
    gc.collect()
    gc.disable()
    try:
        for after, last in (await page_bounds(conn, queries, 40))[:2]:
            chats = [chat async for chat in page_chats(conn, queries, after, last)]
            for encoder in (ArrowEncoder(), LinesEncoder("tokentrail")):
                encoder.add_chats(chats, filters, queries.decoders, PATHS)
                encoder.payload()
            del chats, encoder
            assert gc.collect() == 0, "encoding a page made a reference cycle"
    finally:
        gc.enable()
        await conn.close()


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[str]:
    try:
        with services.postgres_service() as url:
            yield url
    except services.ServiceUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.postgres
def test_page_rollouts_are_the_one_by_one_rollouts_on_postgres(own_postgres: str) -> None:
    _check(own_postgres)


def test_the_compiled_encoder_is_built() -> None:
    """pip install builds server/export/fastpage_c/ (setup.py); without it exports run ~2x slower, so a
    build that silently failed shows here (unless the Python path is asked for)."""
    if os.environ.get("TOKENTRAIL_EXPORT_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("TOKENTRAIL_EXPORT_PURE_PYTHON is set")
    assert fastpage.AVAILABLE, "server/export/fastpage_c/ was not built: pip install -e . (needs a C compiler)"
