"""Follow one assistant message's generation: its token stream, then its stored record.

``follow`` yields the new tokens of each stream entry once (a retry's ``StreamReset`` rewinds), then
``Finished`` with the message and its token row as stored. When the stream is gone (expired, or the
message finished before anyone read it) the stored record alone answers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from server.models import Message, MessageTokens
from server.state import AppState
from server.streams.protocol import StreamDone, StreamReset, TokenBatch
from shared.api import FINISHED_STATES

_DB_RECHECK_EVERY = 5  # empty waits between checks that the message has not finished unseen


@dataclass
class Finished:
    message: Message
    tokens: MessageTokens | None


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
        self.token_ids += batch.token_ids
        tops = batch.top_logprobs
        self.top_logprobs += tops if tops is not None else [None] * len(batch.token_ids)


async def load(state: AppState, message_id: str) -> Finished | None:
    async with state.sessions() as s:
        msg = await s.get(Message, message_id)
        if msg is None:
            return None
        tokens = await s.get(MessageTokens, message_id)
        s.expunge_all()
    return Finished(msg, tokens)


def _new_part(batch: TokenBatch, after: int) -> TokenBatch | None:
    """The tokens of ``batch`` after index ``after`` (a redelivered batch straddles it)."""
    skip = max(0, after + 1 - batch.start)
    if skip >= len(batch.token_ids):
        return None
    if skip == 0:
        return batch
    top = batch.top_logprobs[skip:] if batch.top_logprobs is not None else None
    return TokenBatch(
        batch.start + skip,
        batch.token_ids[skip:],
        batch.logprobs[skip:],
        batch.texts[skip:],
        batch.channels[skip:],
        top,
        None,
    )


async def follow(
    state: AppState, message_id: str, progress: Progress
) -> AsyncIterator[TokenBatch | StreamReset | Finished]:
    """New token batches (also recorded in ``progress``), resets, and finally ``Finished``."""
    after = -1
    empty = 0
    while True:
        entries = await state.streams.read(message_id, after, timeout_s=state.settings.pending_event_interval_s)
        if not entries:
            empty += 1
            if empty % _DB_RECHECK_EVERY == 0 or not await state.streams.exists(message_id):
                done = await load(state, message_id)
                if done is None or (
                    done.message.state in FINISHED_STATES and not await state.streams.exists(message_id)
                ):
                    if done is not None:
                        yield done
                    return
            continue
        for entry in entries:
            if isinstance(entry, TokenBatch):
                if entry.start == 0 and entry.prompt_ids is not None:
                    progress.prompt_ids = entry.prompt_ids
                part = _new_part(entry, after)
                if part is None:
                    continue
                progress.add(part)
                after = part.end - 1
                yield part
            elif isinstance(entry, StreamReset):
                after = entry.from_index - 1
                progress.rewind(entry.from_index)
                yield entry
            elif isinstance(entry, StreamDone):
                done = await load(state, message_id)
                if done is not None:
                    yield done
                return
