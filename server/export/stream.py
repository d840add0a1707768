"""An export streamed over HTTP (``GET /admin/export``): the JSON lines ``tokentrail export`` writes, built
by the same page path (``pages``, ``LinesEncoder``: the compiled builder where it was built) in the
serving process, a few chats at a time so that each page holds the event loop for milliseconds only."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncEngine

from server.db import SessionFactory
from server.export.pages import connect, page_bounds, page_chats, page_queries
from server.export.query import ExportFilters, read_policy_paths
from server.export.writers import LinesEncoder

STREAM_PAGE = 50  # chats per page (tokentrail export's worker processes take 250)


async def export_lines(
    engine: AsyncEngine, sessions: SessionFactory, filters: ExportFilters, schema: str
) -> AsyncIterator[bytes]:
    """The export's records in ``schema`` as JSON lines, a page's at a time (no page: nothing)."""
    paths = await read_policy_paths(sessions)  # the registry as of the export's start (a few rows)
    queries = page_queries(engine, filters)
    conn = await connect(queries)
    try:
        for after, last in await page_bounds(conn, queries, STREAM_PAGE):
            chats = [chat async for chat in page_chats(conn, queries, after, last)]
            encoder = LinesEncoder(schema)
            encoder.add_chats(chats, filters, queries.decoders, paths)
            del chats
            if text := b"".join(encoder.payload()):
                yield text
    finally:
        await conn.close()
