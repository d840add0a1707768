"""A worker connection's frames between its socket and where they are stored.

The receive loop only reads frames and queues them here; one flusher per connection stores them.
Before, the receive loop awaited each engine step's Redis append and each reply's SQL record itself:
on PostgreSQL + Redis under load it was busy 80% of the time, the worker's sends backed up behind it,
and its engine waited on them (small batches, first tokens late). Now a slow round trip delays only
the flusher, and what arrives meanwhile goes out together in the next flush: the token frames of
several engine steps in one append, consecutive frames of a message joined into one batch.

Order is kept where it matters: the flusher takes frames in arrival order, a message's end is stored
after the tokens queued before it, and any other frame (an engine's state) after everything before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from shared.step_frames import StepFrame

QUEUE_LIMIT = 4096  # frames held before the receive loop waits (memory bound when storage stalls)


class FrameQueue:
    def __init__(self, limit: int = QUEUE_LIMIT) -> None:
        self.limit = limit
        self._frames: list[StepFrame] = []
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._frames)

    async def put(self, frames: Iterable[StepFrame]) -> None:
        """Queue ``frames``; waits while the queue is full (the socket then backs up, as before)."""
        while len(self._frames) >= self.limit and not self._closed:
            self._room.clear()
            await self._room.wait()
        self._frames.extend(frames)
        self._wake.set()

    def close(self) -> None:
        """No more frames: ``take`` returns what is left, then None."""
        self._closed = True
        self._wake.set()
        self._room.set()

    async def take(self) -> list[StepFrame] | None:
        """Everything queued, in order (waiting for at least one frame); None once closed and empty."""
        while not self._frames:
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()
        frames, self._frames = self._frames, []
        self._room.set()
        return frames
