"""Server-sent events of one assistant message (DESIGN D4, D8): OA's framing of ``chats.follow``.

A reader follows the message's token stream from its read position (``Last-Event-ID`` = index of
the last token it has) and ends with a ``message`` or ``error`` event. While the message waits
in the queue it gets ``pending`` events. A finished message whose stream has expired is replayed
from SQL: the stored completion tokens, sliced by their stored text offsets, then ``message``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from pydantic import BaseModel
from sse_starlette import ServerSentEvent

from server.chats.follow import Waiting, follow, reset_for
from server.chats.repository import message_to_read
from server.models import Message, MessageTokens
from server.outages import is_unavailable
from server.state import AppState
from server.streams.protocol import StreamReset, TokenBatch
from shared.api import FINISHED_STATES, MessageState
from shared.events import ErrorEvent, MessageEvent, PendingEvent, ResetEvent
from shared.packing import unpack_floats, unpack_ids

log = logging.getLogger(__name__)


def _event(payload: BaseModel, event_id: int | None = None) -> ServerSentEvent:
    # orjson writes non-finite floats (a -inf logprob) as null instead of failing.
    data = orjson.dumps(payload.model_dump(mode="python"), default=_default).decode()
    return ServerSentEvent(data=data, id=str(event_id) if event_id is not None else None)


def _default(obj: Any) -> Any:
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _token_events(batch: TokenBatch, after: int) -> bytes:
    """The batch's token events after index ``after``, encoded once into one chunk (one write per
    engine step rather than per token). Same bytes as a ``TokenEvent`` through sse-starlette."""
    parts = []
    texts, lps, start = batch.texts, batch.logprobs, batch.start
    for i, tok in enumerate(batch.token_ids):
        index = start + i
        if index > after:
            body = {"event_type": "token", "text": texts[i], "index": index, "token_id": tok, "logprob": lps[i]}
            parts.append(b"id: %d\r\ndata: %b\r\n\r\n" % (index, orjson.dumps(body)))
    return b"".join(parts)


async def _final_events(
    state: AppState, message_id: str, after: int, *, replay: bool = True
) -> list[ServerSentEvent | bytes]:
    """From SQL: the tokens after ``after``, then the final message or error event. Without
    ``replay`` (the reader followed the stream to its end) the tokens are read only if the stored
    completion is longer than what the reader got: a stream that lost entries (Redis restarted
    mid-message) is completed from SQL."""
    recent = state.hub.finished.get(message_id)  # stored here a moment ago: no need to read it back
    msg: Message | None
    if recent is not None:
        msg, tokens = recent.message, recent.tokens
    else:
        async with state.sessions() as s:
            msg = await s.get(Message, message_id)
            behind = msg is not None and (msg.completion_token_count or 0) > after + 1
            tokens = await s.get(MessageTokens, message_id) if msg is not None and (replay or behind) else None
    if msg is None:
        return [_event(ErrorEvent(error="message was deleted", code="message_not_found"))]
    out: list[ServerSentEvent | bytes] = []
    if tokens is not None:
        ids = unpack_ids(tokens.completion_ids)
        lps = unpack_floats(tokens.logprobs)
        ends = unpack_ids(tokens.text_offsets)
        content = tokens.completion_text
        starts = [0, *ends[:-1]]
        texts = [content[a:b] for a, b in zip(starts, ends, strict=True)]
        lps_opt: list[float | None] = [None if lp != lp else lp for lp in lps]
        chunk = _token_events(TokenBatch(0, ids, lps_opt, texts), after)
        if chunk:
            out.append(chunk)
    read = message_to_read(msg)
    if msg.state == MessageState.complete:
        out.append(_event(MessageEvent(message=read)))
    else:
        out.append(_event(ErrorEvent(error=msg.error or f"message {msg.state}", code=msg.error_code, message=read)))
    return out


# Sent when Redis or the database goes away mid-stream: the client reconnects after a second with
# Last-Event-ID and continues where it was (EventSource does so by itself).
_RETRY_HINT = b": a backing service is unavailable; reconnect\r\nretry: 1000\r\n\r\n"


async def message_events(state: AppState, msg: Message, after: int) -> AsyncIterator[ServerSentEvent | bytes]:
    with state.metrics.sse_reader():
        try:
            async for event in _message_events(state, msg, after):
                yield event
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("events of %s: %r; the reader is told to reconnect", msg.id, exc)
            yield _RETRY_HINT


async def _message_events(state: AppState, msg: Message, after: int) -> AsyncIterator[ServerSentEvent | bytes]:
    if msg.state in FINISHED_STATES and not await state.streams.exists(msg.id):
        if (start := await reset_for(state, msg.id, after)) is not None:
            after = start - 1  # it holds tokens of a stream that was lost: all of the reply again
            yield _event(ResetEvent(from_index=start))
        for ev in await _final_events(state, msg.id, after):
            yield ev
        return
    seen_tokens = after >= 0
    model = msg.model_config_name or ""
    if not seen_tokens:
        pos, size = await state.queue.position(model, msg.id)
        yield _event(PendingEvent(queue_position=pos, queue_size=size))
    async for item in follow(state, msg.id, after):
        if isinstance(item, TokenBatch):
            yield _token_events(item, after)
            after = item.end - 1
            seen_tokens = True
        elif isinstance(item, StreamReset):
            after = item.from_index - 1
            yield _event(ResetEvent(from_index=item.from_index))
        elif isinstance(item, Waiting):
            if not seen_tokens:
                pos, size = await state.queue.position(model, msg.id)
                yield _event(PendingEvent(queue_position=pos, queue_size=size))
        else:
            for ev in await _final_events(state, msg.id, after, replay=item.replay):
                yield ev
