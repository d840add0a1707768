"""OpenAI's server-sent events: chunks framed as ``data:`` lines ending with ``[DONE]``, the chunk
streams of n choices interleaved as they come, and the streaming response (counted as an SSE reader).

A stream that fails after its 200 went out ends with an error chunk in OpenAI's shape and ``[DONE]``,
never a broken connection: ``not_ready`` when the database or Redis went away (the request may be
retried; its message is generated and stored all the same), ``internal_error`` for a bug."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol

import orjson
from fastapi.responses import StreamingResponse
from starlette.types import Send

from server.metrics import Metrics
from server.models import Message
from server.openai.render import failure
from server.outages import is_unavailable
from shared.errors import ErrorCode

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse(body: Any) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def error_chunk(msg: Message) -> bytes:
    exc = failure(msg)
    return sse({"error": {"message": exc.detail, "type": "server_error", "param": None, "code": exc.code.value}})


def merged(sources: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The chunk streams of n choices, interleaved as they come; one choice's stream as it is (no
    generator around it: a layer per chunk costs, and most requests have one choice)."""
    return sources[0] if len(sources) == 1 else _interleaved(sources)


async def _interleaved(sources: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()

    async def pump(source: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in source:
                await queue.put(chunk)
        except Exception as exc:  # the response ends with it (``event_stream``), as with one choice
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


class ChunkWriter(Protocol):
    """A stream source that can also write chunks itself, given the response's ``send`` (the chat
    route's push path; ``server.streams.memory.Pusher`` is how it is handed the batches)."""

    send: Send | None


def eager_send(send: Send, data: bytes) -> asyncio.Future[None] | None:
    """Send a body chunk from plain (non-async) code: the ASGI ``send`` is run at once, and normally
    returns without suspending (the server writes to its transport). If it suspends (the client reads
    slowly: the server waits for its buffer to drain), a task finishes it: the returned future, which the
    caller must await before sending anything else. None: sent."""
    coro = send({"type": "http.response.body", "body": data, "more_body": True})
    if not isinstance(coro, Coroutine):  # some other awaitable: run as a task
        return asyncio.ensure_future(coro)
    try:
        waiting = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_finish(coro, waiting))


async def _finish(coro: Coroutine[Any, Any, None], waiting: Any) -> None:
    """Run ``coro`` on from where it suspended, waiting on ``waiting`` (an asyncio future, or None for a
    bare yield) as a task would."""
    try:
        while True:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait([waiting])  # its outcome reaches the coroutine as it resumes
            waiting = coro.send(None)
    except StopIteration:
        return
    finally:
        coro.close()


class SseStream(StreamingResponse):
    """Pre-encoded SSE chunks, counted as an SSE reader while they are sent, ending with an error chunk
    and ``[DONE]`` if they fail. Starlette sends ``body_iterator`` (the chunks wrapped to do that); the
    generation routes' lane sends ``chunks`` itself (``pump``), one generator layer fewer per token."""

    def __init__(self, chunks: AsyncIterator[bytes], metrics: Metrics, pusher: ChunkWriter | None = None) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(_counted(chunks, metrics), media_type="text/event-stream", headers=headers)
        self.chunks = chunks
        self.metrics = metrics
        self.pusher = pusher  # given ``send`` by ``pump``: it may write token chunks between the chunks

    async def pump(self, send: Send) -> None:
        """Send every chunk as an ASGI body message, as ``body_iterator`` gives them, then the end. A
        chunk that ends with ``[DONE]`` goes out with the end of the body: one write, not two."""
        if self.pusher is not None:
            self.pusher.send = send
        last = b""
        with self.metrics.sse_reader():
            try:
                async for chunk in self.chunks:
                    if last:
                        await send({"type": "http.response.body", "body": last, "more_body": True})
                        last = b""
                    if chunk.endswith(SSE_DONE):
                        last = chunk
                    else:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as exc:
                last += failure_chunk(exc) + SSE_DONE
        await send({"type": "http.response.body", "body": last, "more_body": False})


def event_stream(chunks: AsyncIterator[bytes], metrics: Metrics, pusher: ChunkWriter | None = None) -> SseStream:
    """Pre-encoded SSE chunks as a response that proxies must not buffer, counted as an SSE reader."""
    return SseStream(chunks, metrics, pusher)


async def _counted(chunks: AsyncIterator[bytes], metrics: Metrics) -> AsyncIterator[bytes]:
    with metrics.sse_reader():
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:
            yield failure_chunk(exc)
            yield SSE_DONE


def stream_failure(exc: Exception) -> tuple[ErrorCode, str]:
    """Logs a stream that failed after its 200 went out, in any dialect; the (code, message) it ends with:
    ``not_ready`` when a backing service is away, else ``internal_error``."""
    if is_unavailable(exc):
        log.warning("a stream ends early: a backing service is unavailable: %r", exc)
        return ErrorCode.not_ready, "a backing service (database or Redis) is unavailable; retry shortly"
    log.exception("a stream failed", exc_info=exc)
    return ErrorCode.internal_error, "internal error"


def failure_chunk(exc: Exception) -> bytes:
    """The error chunk that ends a stream which failed after its 200 went out."""
    code, message = stream_failure(exc)
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code.value}})
