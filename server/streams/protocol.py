"""Token fan-out contract: one append-only stream of token batches per message (DESIGN D4).

Positions are token indices: a batch covers ``[start, start + len(token_ids))``. Appending a
batch that does not start exactly at the stream's current length is rejected, so a republished
or out-of-order batch can never duplicate tokens. ``finish`` appends the terminal entry; readers
stop after it. Streams of finished messages expire; finished messages are then served from SQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Literal, Protocol


class StreamConflict(Exception):
    """A batch does not start at the stream's current length, or the stream has finished."""


@dataclass(slots=True)  # not frozen: a frozen init costs ~1 us more, and one is made per message per step
class TokenBatch:
    """Never changed once made (readers share one): new batches are made instead."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    texts: list[str]
    channels: str = ""  # one shared.protocol CHANNEL_* character per token, when the worker sent them
    top_logprobs: list[list[tuple[int, float, str]]] | None = None
    prompt_ids: list[int] | None = None  # only on the batch at start 0: the prompt generated from
    policy_version: int = 0  # the weights version that computed these tokens

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def joins(first: TokenBatch, then: TokenBatch) -> bool:
    """Whether ``then``'s per-token fields can follow ``first``'s in one batch: channels and top logprobs
    on both or on neither, and the same weights version."""
    return (
        bool(first.channels) == bool(then.channels)
        and (first.top_logprobs is None) == (then.top_logprobs is None)
        and first.policy_version == then.policy_version
    )


def concatenated(batches: Sequence[TokenBatch]) -> TokenBatch | None:
    """Consecutive batches as one (the first one's start and prompt), or None when some carry channels
    or top logprobs and others do not, or they come from different weights versions: such per-token
    fields cannot be concatenated. Each list is joined in one pass (``chain``): callers gather a run of
    batches and join it once, never pairwise as they come (that copies the run again per batch)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if not all(joins(first, b) for b in batches):
        return None
    return TokenBatch(
        first.start,
        list(chain.from_iterable([b.token_ids for b in batches])),
        list(chain.from_iterable([b.logprobs for b in batches])),
        list(chain.from_iterable([b.texts for b in batches])),
        "".join([b.channels for b in batches]),
        list(chain.from_iterable([b.top_logprobs or () for b in batches])) if first.top_logprobs is not None else None,
        first.prompt_ids,
        first.policy_version,
    )


@dataclass(frozen=True)
class StreamDone:
    status: Literal["complete", "error"]
    error: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class StreamReset:
    """Tokens from ``from_index`` on were discarded; a new attempt streams them again."""

    from_index: int


StreamEntry = TokenBatch | StreamDone | StreamReset


class TokenStreams(Protocol):
    async def append(self, message_id: str, batch: TokenBatch) -> None:
        """Raise StreamConflict unless ``batch.start`` equals the current length."""
        ...

    async def append_many(self, items: list[tuple[str, TokenBatch]]) -> list[StreamConflict | None]:
        """``append`` of each (message id, batch) in order, in one round trip where the backend
        allows (one engine step of a worker); per item None or the conflict it raised."""
        ...

    async def finish(self, message_id: str, done: StreamDone) -> None:
        """Append the terminal entry (idempotent) and schedule the stream's expiry."""
        ...

    async def length(self, message_id: str) -> int:
        """Number of tokens appended so far (0 for a missing stream)."""
        ...

    async def read(self, message_id: str, after: int, timeout_s: float) -> list[StreamEntry]:
        """Entries holding tokens with index > ``after`` (a batch straddling ``after`` is
        returned whole; the reader skips what it has), plus the terminal entry once reached.
        Waits up to ``timeout_s`` when there is nothing new; returns [] on timeout."""
        ...

    async def exists(self, message_id: str) -> bool: ...

    async def restart(self, message_id: str, from_index: int, attempt: int) -> None:
        """Attempt ``attempt`` streams the message again from ``from_index`` (what is left of the stream
        is dropped): the tokens a reader may hold from there on were lost with the stream (a restarted
        embedded server, a Redis restart)."""
        ...

    async def restarted_at(self, message_id: str) -> tuple[int, int] | None:
        """The last ``restart``: ``(from_index, attempt)``; None if the stream was never restarted."""
        ...

    async def close(self) -> None: ...
