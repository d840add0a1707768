"""A streamed response (``/v1/responses`` with ``stream: true``) in OpenAI's event sequence.

``response.created`` and ``response.in_progress``; then each output item as its text comes:
``response.output_item.added``, for reasoning ``response.reasoning_summary_part.added`` and
``response.reasoning_summary_text.delta``..., for the message ``response.content_part.added`` and
``response.output_text.delta``...; at the end the ``.done`` events of each open item (its full text),
the function calls (``output_item.added``, ``function_call_arguments.delta``/``.done``,
``output_item.done``: the worker parses calls from the finished reply), and ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it) with the whole response. A reply that
fails ends with ``response.failed``; a stream that breaks after its 200 went out (the database or
Redis went away, a bug) ends with an ``error`` event.

The text deltas come from ``ReplyStream`` as on ``/v1/chat/completions``: held text comes out when it
is sure, so the deltas of each item add up exactly to the stored content and reasoning.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from server.chats.finished import Finished
from server.openai.choices import Progress, follow
from server.openai.responses_render import (
    function_call_item,
    item_status,
    message_item,
    output_text,
    reasoning_item,
    token_fields,
)
from server.openai.streaming import stream_failure
from server.state import AppState
from server.streams.protocol import TokenBatch
from shared.api import MessageState
from shared.channels import Delta, ReplyStream
from shared.errors import ErrorCode

log = logging.getLogger(__name__)

# the response object at a point of the stream: (status, output, the finished message or None)
BodyOf = Callable[[str, list[dict[str, Any]], Finished | None], dict[str, Any]]


class _Item:
    def __init__(self, index: int, item: dict[str, Any]) -> None:
        self.index = index
        self.item = item
        self.text = ""


class ResponseEvents:
    """The events of one streamed response, numbered by ``sequence_number``."""

    def __init__(self, message_id: str, stops: list[str], body_of: BodyOf, *, with_tools: bool) -> None:
        self.mid = message_id
        self.stops = stops
        self.body_of = body_of
        self.with_tools = with_tools
        self.seq = 0
        self.items: list[_Item] = []
        self.reasoning: _Item | None = None
        self.message: _Item | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    async def stream(self, state: AppState) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._events(state):
                yield chunk
        except Exception as exc:  # after the 200: end with an error event, never a broken connection
            code, message = stream_failure(exc)
            yield self.event("error", code=code.value, message=message, param=None)

    async def _events(self, state: AppState) -> AsyncIterator[bytes]:
        yield self.event("response.created", response=self.body_of("in_progress", [], None))
        yield self.event("response.in_progress", response=self.body_of("in_progress", [], None))
        reply = ReplyStream(self.stops)
        async for item in follow(state, self.mid, Progress(), state.settings.stream_interval):
            if isinstance(item, TokenBatch):
                for chunk in self._text(reply.feed(item.texts, item.channels)):
                    yield chunk
            elif isinstance(item, Finished):
                for chunk in self._finish(item, reply):
                    yield chunk
                return
        message = f"message {self.mid} was deleted while generating"
        yield self.event("error", code=ErrorCode.message_not_found.value, message=message, param=None)

    def _open(self, item: dict[str, Any]) -> tuple[_Item, bytes]:
        opened = _Item(len(self.items), item)
        self.items.append(opened)
        return opened, self.event("response.output_item.added", output_index=opened.index, item=item)

    def _text(self, delta: Delta) -> list[bytes]:
        out = []
        if delta.reasoning:
            if self.reasoning is None:
                self.reasoning, added = self._open(
                    {**reasoning_item(self.mid, ""), "summary": [], "status": "in_progress"}
                )
                part = {"type": "summary_text", "text": ""}
                out += [added, self._at(self.reasoning, "response.reasoning_summary_part.added", part=part)]
            self.reasoning.text += delta.reasoning
            out.append(self._at(self.reasoning, "response.reasoning_summary_text.delta", delta=delta.reasoning))
        if delta.content:
            out += self._open_message()
            assert self.message is not None
            self.message.text += delta.content
            out.append(self._at(self.message, "response.output_text.delta", delta=delta.content, logprobs=[]))
        return out

    def _open_message(self) -> list[bytes]:
        if self.message is not None:
            return []
        item = {**message_item(self.mid, "", "in_progress"), "content": []}
        self.message, added = self._open(item)
        return [added, self._at(self.message, "response.content_part.added", part=output_text(""))]

    def _at(self, item: _Item, kind: str, **fields: Any) -> bytes:
        place: dict[str, Any] = {"item_id": item.item["id"], "output_index": item.index}
        place["summary_index" if item is self.reasoning else "content_index"] = 0
        return self.event(kind, **place, **fields)

    def _finish(self, done: Finished, reply: ReplyStream) -> list[bytes]:
        msg, tokens = done.message, done.tokens
        if msg.state != MessageState.complete.value or tokens is None:
            output = [i.item for i in self.items]
            return [self.event("response.failed", response=self.body_of("failed", output, done))]
        out = self._text(reply.finish(msg.content, msg.reasoning_content))
        if reply.mismatch:
            log.warning("message %s: streamed %s differs from the stored one", msg.id, reply.mismatch)
        calls = (msg.tool_calls or []) if self.with_tools else []
        if self.message is None and (msg.content or not calls):
            out += self._open_message()
        call_items = [function_call_item(msg.id, k, c) for k, c in enumerate(calls)]
        last = len(self.items) + len(call_items) - 1
        final: list[dict[str, Any]] = []
        for opened in self.items:
            extra = token_fields(tokens) if opened.index == last else {}
            if opened is self.reasoning:
                text = msg.reasoning_content or ""
                item = {**reasoning_item(msg.id, text), **extra}
                part = {"type": "summary_text", "text": text}
                out.append(self._at(opened, "response.reasoning_summary_text.done", text=text))
                out.append(self._at(opened, "response.reasoning_summary_part.done", part=part))
            else:
                text = msg.content or ""
                item = {**message_item(msg.id, text, item_status(msg)), **extra}
                out.append(self._at(opened, "response.output_text.done", text=text, logprobs=[]))
                out.append(self._at(opened, "response.content_part.done", part=output_text(text)))
            out.append(self.event("response.output_item.done", output_index=opened.index, item=item))
            final.append(item)
        for call in call_items:
            index = len(final)
            extra = token_fields(tokens) if index == last else {}
            added = {**call, "arguments": "", "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            place = {"item_id": call["id"], "output_index": index}
            out.append(self.event("response.function_call_arguments.delta", **place, delta=call["arguments"]))
            out.append(self.event("response.function_call_arguments.done", **place, arguments=call["arguments"]))
            item = {**call, **extra}
            out.append(self.event("response.output_item.done", output_index=index, item=item))
            final.append(item)
        status = item_status(msg)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self.event(kind, response=self.body_of(status, final, done)))
        return out
