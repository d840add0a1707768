"""OpenAI's server-sent events: chunks framed as ``data:`` lines ending with ``[DONE]``, the chunk
streams of n choices interleaved as they come, and the streaming response (counted as an SSE reader)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import StreamingResponse

from server.metrics import Metrics
from server.models import Message
from server.openai.render import failure

SSE_DONE = b"data: [DONE]\n\n"


def sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def error_chunk(msg: Message) -> bytes:
    exc = failure(msg)
    return sse({"error": {"message": exc.detail, "type": "server_error", "param": None, "code": exc.code.value}})


class Merge:
    """Interleaves the chunk streams of n choices as they come."""

    def __init__(self, sources: list[AsyncIterator[bytes]]) -> None:
        self.sources = sources

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if len(self.sources) == 1:
            async for chunk in self.sources[0]:
                yield chunk
            return
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(source: AsyncIterator[bytes]) -> None:
            try:
                async for chunk in source:
                    await queue.put(chunk)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(s)) for s in self.sources]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


def event_stream(chunks: AsyncIterator[bytes], metrics: Metrics) -> StreamingResponse:
    """Pre-encoded SSE chunks as a response that proxies must not buffer, counted as an SSE reader."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_counted(chunks, metrics), media_type="text/event-stream", headers=headers)


async def _counted(chunks: AsyncIterator[bytes], metrics: Metrics) -> AsyncIterator[bytes]:
    with metrics.sse_reader():
        async for chunk in chunks:
            yield chunk
