"""A reply streamed as Anthropic's server-sent events.

``message_start`` (once the first tokens, which carry the prompt, arrive), ``ping``, then per content
block ``content_block_start``, its deltas (``thinking_delta``, ``text_delta``; a ``tool_use`` block gets
its whole input as one ``input_json_delta`` once the call parsed) and ``content_block_stop``; finally
``message_delta`` (stop reason, usage, and the token fields as extensions) and ``message_stop``.

Text comes through ``ReplyStream``, so the deltas add up exactly to the stored message (DESIGN D19).
A reply that failed, or a stream that breaks after its 200 went out, ends with an ``error`` event in
Anthropic's shape: ``overloaded_error`` when a backing service went away (the reply is generated and
stored all the same), ``api_error`` for a bug.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from server.anthropic.render import SIGNATURE, MessageContext, error_event, event, token_fields, tool_use_block, usage
from server.chats.finished import Finished
from server.errors import ApiError
from server.openai.choices import Progress, follow
from server.openai.render import failure
from server.openai.streaming import stream_failure
from server.state import AppState
from server.streams.protocol import StreamReset, TokenBatch
from shared.api import MessageState
from shared.channels import Delta, ReplyStream
from shared.errors import ErrorCode

log = logging.getLogger(__name__)

_DELTA = {"thinking": "thinking_delta", "text": "text_delta"}


class _Blocks:
    """The content blocks sent so far: their count, the open one, and reasoning held for the end.

    An echoed turn joins its text blocks (and its thinking blocks) with a separator, so each channel
    must stream as one block for the echo to be the stored message: a text block, once open, stays open
    until the end, and reasoning that comes after it (a ``<think>`` block after visible text) is held
    and sent as a thinking block after it."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None
        self.started: set[str] = set()  # the kinds of text block opened so far
        self.late_reasoning = ""

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.count += 1
        self.open = block["type"]
        out.append(
            event(
                "content_block_start", {"type": "content_block_start", "index": self.count - 1, "content_block": block}
            )
        )
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        if not text:
            return []
        out: list[bytes] = []
        if self.open != kind:
            block = (
                {"type": "thinking", "thinking": "", "signature": SIGNATURE}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            out += self.start(block)
            self.started.add(kind)
        delta = {"type": _DELTA[kind], kind: text}
        out.append(
            event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})
        )
        return out

    def add(self, delta: Delta) -> list[bytes]:
        if "text" in self.started:
            self.late_reasoning += delta.reasoning
            return self._text("text", delta.content)
        return self._text("thinking", delta.reasoning) + self._text("text", delta.content)

    def end_text(self) -> list[bytes]:
        """Close the text block and send the reasoning held behind it. Reasoning after a thinking
        block that already closed cannot join it: it goes in a second one, logged."""
        out = self.close()
        late, self.late_reasoning = self.late_reasoning, ""
        if late:
            if "thinking" in self.started:
                log.warning("reasoning after the text block: sent as a second thinking block")
            out += self._text("thinking", late)
            out += self.close()
        return out

    def tool_use(self, call: dict[str, Any]) -> list[bytes]:
        block = tool_use_block(call)
        out = self.start({**block, "input": {}})
        partial = json.dumps(block["input"], ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
        out.append(
            event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})
        )
        return out + self.close()


async def message_events(ctx: MessageContext, state: AppState, message_id: str) -> AsyncIterator[bytes]:
    """The reply's events; a failure after the first byte ends them with an ``error`` event."""
    try:
        async for chunk in _events(ctx, state, message_id):
            yield chunk
    except ApiError as exc:
        yield error_event(exc.status_code, exc.detail, exc.code.value)
    except Exception as exc:
        code, message = stream_failure(exc)
        yield error_event(503 if code == ErrorCode.not_ready else 500, message, code.value)


async def _events(ctx: MessageContext, state: AppState, message_id: str) -> AsyncIterator[bytes]:
    progress = Progress()
    reply = ReplyStream(ctx.stops)
    blocks = _Blocks()
    started = False
    reset = False  # the stream was rewound (a new attempt): hold the text until the stored message says
    async for item in follow(state, message_id, progress, state.settings.stream_interval):
        if not started:
            prompt = len(progress.prompt_ids or [])
            message = ctx.shell(message_id, usage(prompt, 0, 0))
            yield event("message_start", {"type": "message_start", "message": message})
            yield event("ping", {"type": "ping"})
            started = True
        if isinstance(item, TokenBatch):
            if not reset:
                for chunk in blocks.add(reply.feed(item.texts, item.channels)):
                    yield chunk
        elif isinstance(item, StreamReset):
            reset = True
        else:
            for chunk in _end(ctx, item, reply, blocks):
                yield chunk
            return
    if not started:
        raise ApiError(ErrorCode.message_not_found, f"message {message_id} was deleted while generating")


def _end(ctx: MessageContext, done: Finished, reply: ReplyStream, blocks: _Blocks) -> list[bytes]:
    msg, tokens = done.message, done.tokens
    if msg.state != MessageState.complete.value or tokens is None:
        exc = failure(msg)
        return [*blocks.close(), error_event(exc.status_code, exc.detail, exc.code.value)]
    out = blocks.add(reply.finish(msg.content, msg.reasoning_content))
    if reply.mismatch:
        log.warning("message %s: streamed %s differs from the stored one", msg.id, reply.mismatch)
    out += blocks.end_text()
    calls = ctx.calls(msg)
    if not msg.content and not calls:  # as in the body: a reply without text or calls has an empty text block
        out += blocks.start({"type": "text", "text": ""})
    for call in calls:
        out += blocks.tool_use(call)
    out += blocks.close()
    reason, sequence = ctx.stop(msg, tokens)
    fields = token_fields(tokens)
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": usage(len(fields["prompt_token_ids"]), len(fields["generation_token_ids"]), tokens.num_cached_tokens),
        **fields,
        "tokentrail": ctx.info(done),
    }
    out.append(event("message_delta", delta))
    out.append(event("message_stop", {"type": "message_stop"}))
    return out
