"""Following one assistant message's generation (DESIGN D4): the one loop every front door frames its
events on (OA's SSE events, OpenAI's chunks).

``follow`` reads the message's token stream from a read position and yields each new token batch once
(only the part after the position: a redelivered batch straddles it), a ``StreamReset`` when a retry
rewound the stream, ``Waiting`` after each empty wait, and ``Ended`` last: the stream reached its done
entry, or the message ended in SQL (or was deleted) while its stream is absent (expired, lost with a
Redis restart, or never written). The reader then finishes from SQL, which holds every stored token
(``load``, or a dialect's own replay).

The database going away does not end a follower (DESIGN D18): its occasional check is skipped while
the database is unavailable, and the stream goes on from Redis. The message cannot end before the
database is back (its record is stored first), and ``load`` waits a few seconds for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from server.chats.finished import Finished
from server.models import Message, MessageTokens
from server.outages import is_unavailable, until_available
from server.state import AppState
from server.streams.memory import MemoryTokenStreams, Pusher
from server.streams.protocol import StreamDone, StreamReset, TokenBatch, concatenated, joins
from shared.api import FINISHED_STATES

# Empty waits between checks that the message has not ended unseen (a safety net for streams that
# never end); rare enough that a long queue of readers costs SQL little.
_DB_RECHECK_EVERY = 5
_LOAD_WAIT_S = 10.0  # how long a finished message's read waits for the database that stored it


@dataclass(frozen=True)
class Waiting:
    """Nothing new arrived within ``pending_event_interval_s``."""


@dataclass(frozen=True)
class Ended:
    """The generation is over. ``replay``: the stream did not reach its done entry, so tokens after the
    read position may exist in SQL only."""

    replay: bool


class Pushing(Pusher, Protocol):
    """A reader's push path (``MemoryTokenStreams.read``'s ``push``): it takes new batches while the
    reader waits and delivers them itself; ``after`` is the last index it delivered (``follow`` sets it
    before each wait and reads it after)."""

    after: int


async def follow(
    state: AppState, message_id: str, after: int = -1, interval: int = 1, push: Pushing | None = None
) -> AsyncIterator[TokenBatch | StreamReset | Waiting | Ended]:
    """The new token batches after index ``after``, resets and empty waits, then ``Ended``.

    Batches a reader has not yet taken come joined into one (a reader that fell behind gets one event
    per read, not one per engine step), and held until they hold ``interval`` tokens: the stream's end,
    a reset or an empty wait lets a shorter one out.

    A reader may hold tokens of a stream that was lost and restarted by a new attempt (a restarted
    embedded server, a Redis restart): it is told to drop them (a ``StreamReset``) when it resumes
    after the restart, and, when the restart comes while it follows, before the first entries it
    takes after starting or after an empty wait (an entry straight after a restart always follows one
    of those: the reader's connection broke, or it waited for the new attempt).

    ``push``: with in-process streams, a reader that holds nothing waits with its push path, which takes
    each new batch as it is appended (no wake per engine step); what it took is skipped here. Anything
    else (the end, a batch it declines) wakes this loop as usual. A restart replaces the stream: the push
    path only ever gets batches of the stream the read waits on, appended before the restart (a new
    attempt's batch that does not continue the reader's position is declined), and the check for a
    restart after the read sees the position the pushes reached."""
    seen = await state.streams.restarted_at(message_id)
    if after >= 0 and seen is not None and seen[0] <= after:
        yield StreamReset(seen[0])
        after = seen[0] - 1
    check = True  # look for a restart (since ``seen``) before taking the next entries
    empty = 0
    held = _Held()  # tokens taken but not yet given out (fewer than ``interval``)
    streams = state.streams
    pushes = push is not None and interval <= 1 and isinstance(streams, MemoryTokenStreams)
    wait_s = state.settings.pending_event_interval_s
    while True:
        if pushes and not held:
            assert push is not None and isinstance(streams, MemoryTokenStreams)
            push.after = after
            entries = await streams.read(message_id, after, timeout_s=wait_s, push=push)
            # what it delivered meanwhile is skipped below (the entries from ``after`` on hold it too)
            after = max(after, push.after)
        else:
            entries = await streams.read(message_id, after, timeout_s=wait_s)
        if check:
            check = False
            mark = await state.streams.restarted_at(message_id)
            if mark != seen:
                seen = mark
                if mark is not None and mark[0] <= after:
                    if held:
                        yield held.take()  # before the reset, which tells the reader to drop what it covers
                    yield StreamReset(mark[0])
                    after = mark[0] - 1
                    continue
        if not entries:
            if held:
                yield held.take()
            empty += 1
            check = True
            if (
                empty % _DB_RECHECK_EVERY == 0
                and await _ended_in_db(state, message_id)
                and not await state.streams.exists(message_id)
            ):
                mark = await state.streams.restarted_at(message_id)
                if mark != seen and mark is not None and mark[0] <= after:
                    yield StreamReset(mark[0])  # the reader finishes from SQL: all of the new attempt
                yield Ended(replay=True)
                return
            yield Waiting()
            continue
        for entry in entries:
            if isinstance(entry, TokenBatch):
                part = _new_part(entry, after)
                if part is None:
                    continue
                after = part.end - 1
                if held and not joins(held.parts[-1], part):  # e.g. another weights version
                    yield held.take()
                held.add(part)
                continue
            if held:
                yield held.take()
            if isinstance(entry, StreamReset):
                after = entry.from_index - 1
                yield entry
            elif isinstance(entry, StreamDone):
                yield Ended(replay=False)
                return
        if held and held.tokens >= interval:
            yield held.take()


class _Held:
    """Batches a reader took but has not yet been given, joined once when given (``concatenated``)."""

    __slots__ = ("parts", "tokens")

    def __init__(self) -> None:
        self.parts: list[TokenBatch] = []
        self.tokens = 0

    def __bool__(self) -> bool:
        return bool(self.parts)

    def add(self, part: TokenBatch) -> None:
        self.parts.append(part)
        self.tokens += len(part.token_ids)

    def take(self) -> TokenBatch:
        joined = concatenated(self.parts)
        assert joined is not None  # only parts that join are added together
        self.parts, self.tokens = [], 0
        return joined


async def reset_for(state: AppState, message_id: str, after: int) -> int | None:
    """Where a reader resuming after index ``after`` must be reset to (the stream it read from was
    lost and restarted), or None."""
    if after < 0:
        return None
    mark = await state.streams.restarted_at(message_id)
    return mark[0] if mark is not None and mark[0] <= after else None


async def load(state: AppState, message_id: str) -> Finished | None:
    """The message as stored, detached from its session; None if it was deleted. Waits a few seconds
    for a database that went away right after storing it."""
    recent = state.hub.finished.get(message_id)
    if recent is not None:
        return recent
    return await until_available(lambda: _read(state, message_id), f"reading {message_id}", within_s=_LOAD_WAIT_S)


async def _read(state: AppState, message_id: str) -> Finished | None:
    async with state.sessions() as s:
        msg = await s.get(Message, message_id)
        if msg is None:
            return None
        tokens = await s.get(MessageTokens, message_id)
        s.expunge_all()
    return Finished(msg, tokens)


async def _ended_in_db(state: AppState, message_id: str) -> bool:
    """Whether SQL has the message ended (or deleted); False while the database is unavailable."""
    try:
        async with state.sessions() as s:
            msg = await s.get(Message, message_id)
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        return False
    return msg is None or msg.state in FINISHED_STATES


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
        batch.policy_version,
    )
