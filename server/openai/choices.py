"""One choice of an OpenAI request, i.e. one generated assistant message: followed (``chats.follow``)
with what the stream delivered recorded in ``Progress`` (top logprobs ride only on the stream), then
``Finished`` with the stored record; or collected to that end for a response that does not stream.
When the stream is gone (expired, or the message finished before anyone read it) the stored record
alone answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from server.chats.finished import Finished
from server.chats.follow import Ended, load
from server.chats.follow import follow as follow_message
from server.errors import ApiError
from server.state import AppState
from server.streams.protocol import StreamReset, TokenBatch
from shared.errors import ErrorCode


@dataclass
class Progress:
    """What the stream has delivered so far, by token index."""

    prompt_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float, str]] | None] = field(default_factory=list)

    def rewind(self, index: int) -> None:
        del self.token_ids[index:]
        del self.top_logprobs[index:]

    def add(self, batch: TokenBatch) -> None:
        if batch.start == 0 and batch.prompt_ids is not None:
            self.prompt_ids = batch.prompt_ids
        self.token_ids += batch.token_ids
        tops = batch.top_logprobs
        self.top_logprobs += tops if tops is not None else [None] * len(batch.token_ids)


async def follow(
    state: AppState, message_id: str, progress: Progress, interval: int = 1
) -> AsyncIterator[TokenBatch | StreamReset | Finished]:
    """New token batches (also recorded in ``progress``; at least ``interval`` tokens each but the last,
    see ``chats.follow``), resets, and finally ``Finished`` (nothing when the message was deleted)."""
    async for item in follow_message(state, message_id, interval=interval):
        if isinstance(item, TokenBatch):
            progress.add(item)
            yield item
        elif isinstance(item, StreamReset):
            progress.rewind(item.from_index)
            yield item
        elif isinstance(item, Ended):
            done = await load(state, message_id)
            if done is not None:
                yield done


async def collect(state: AppState, message_id: str) -> tuple[Finished, Progress]:
    progress = Progress()
    done: Finished | None = None
    async for item in follow(state, message_id, progress):
        if isinstance(item, Finished):
            done = item
    if done is None:
        raise ApiError(ErrorCode.message_not_found, f"message {message_id} was deleted while generating")
    return done, progress
