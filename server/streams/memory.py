"""In-process token streams: the embedded default for a single server process (DESIGN D4).

Each message has a list of batches plus an optional terminal entry; a reader blocked in ``read`` waits
on a future of its own that the stream's next append/finish resolves. Finished streams are dropped
``expire_after_s`` after ``finish`` by a lazy sweep that runs on every call.

Every connected reader waits once per engine step, so a wait is on the per-token path: it costs a future
and a list entry, and its timeout shares one timer with the other waits that end in the same tick
(``_Ticks``), rather than a timeout context and a timer of its own, plus a new event per append (issue 22).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from server.streams.protocol import StreamConflict, StreamDone, StreamEntry, TokenBatch, concatenated


class Pusher(Protocol):
    """A waiting reader's way to take a new batch where it is appended, without waking its task:
    True when it took the batch (the read goes on waiting), False to be woken as usual. Must not raise."""

    def __call__(self, batch: TokenBatch) -> bool: ...


@dataclass
class _Stream:
    batches: list[TokenBatch] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # batches[i].end, ascending, for bisect
    done: StreamDone | None = None
    readers: int = 0
    # resolved by the next change; a dict (ordered, O(1) removal), since a stream may have many readers;
    # the value: the reader's pusher, which may take a new batch in place of the wake
    waiters: dict[asyncio.Future[None], Pusher | None] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0

    def notify(self) -> None:
        waiters, self.waiters = self.waiters, {}
        _wake(waiters)

    def deliver(self, batch: TokenBatch) -> None:
        """A new batch: each waiting reader's pusher takes it if it can (the reader waits on, no task
        woken per token), the other waiters are woken."""
        waiters, self.waiters = self.waiters, {}
        for waiter, push in waiters.items():
            if waiter.done():
                continue
            if push is not None and push(batch):
                self.waiters[waiter] = push
            else:
                waiter.set_result(None)

    def compact(self) -> None:
        """One batch for a finished stream's tokens. A stream is kept ``expire_after_s`` after its end (for
        resuming readers), and one batch per engine step is five lists per token step: at 30 replies a
        second that is millions of objects for the garbage collector to walk, whose full collections
        took 0.2-0.27 s each, pausing every stream (issue 22). Readers take the part after their
        position (a batch may straddle it), so one batch reads the same."""
        if len(self.batches) < 2:
            return
        merged = concatenated(self.batches)
        if merged is None:
            return  # per-token fields not given for every batch
        self.batches = [merged]
        self.ends = [merged.end]

    def entries_after(self, after: int) -> list[StreamEntry]:
        # A batch ending at E holds indices < E: it has something new iff E > after + 1.
        entries: list[StreamEntry] = list(self.batches[bisect.bisect_right(self.ends, after + 1) :])
        if self.done is not None:
            entries.append(self.done)
        return entries


class _Ticks:
    """Wait timeouts rounded up to the next tick of ``tick_s``: one timer per tick wakes every wait that
    ends in it. A wait woken earlier by its stream stays listed, done, until its tick."""

    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        # keyed by loop too: a tick's timer runs in the loop that armed it
        self._due: dict[tuple[asyncio.AbstractEventLoop, int], list[asyncio.Future[None]]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, deadline: float, waiter: asyncio.Future[None]) -> None:
        key = (loop, math.ceil(deadline / self.tick_s))
        due = self._due.get(key)
        if due is None:
            due = self._due[key] = []
            loop.call_at(key[1] * self.tick_s, self._fire, key)
        due.append(waiter)

    def _fire(self, key: tuple[asyncio.AbstractEventLoop, int]) -> None:
        _wake(self._due.pop(key, ()))


def _wake(waiters: Iterable[asyncio.Future[None]]) -> None:
    """Resolve the waits still pending (one may be done: cancelled, or woken by the other of its
    stream's change and its tick)."""
    for w in waiters:
        if not w.done():
            w.set_result(None)


_MAX_RESTARTS = 100_000  # restart marks kept (they matter for as long as readers may resume)


class MemoryTokenStreams:
    """Token streams of one process; finished ones are forgotten ``expire_after_s`` later. A read's
    timeout ends up to ``tick_s`` late (see ``_Ticks``)."""

    def __init__(self, expire_after_s: float = 300, tick_s: float = 0.05) -> None:
        self.expire_after_s = expire_after_s
        self._ticks = _Ticks(tick_s)
        self._streams: dict[str, _Stream] = {}
        # (expires_at, message_id, stream) in finish order; a constant TTL keeps it sorted.
        self._expiry: deque[tuple[float, str, _Stream]] = deque()
        self._restarts: OrderedDict[str, tuple[int, int]] = OrderedDict()  # message -> (from, attempt)

    def _sweep(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            _, message_id, stream = self._expiry.popleft()
            if self._streams.get(message_id) is stream:
                del self._streams[message_id]

    def _live(self, message_id: str) -> _Stream | None:
        """The stream if it has any entry (placeholders made by waiting readers don't count)."""
        self._sweep()
        stream = self._streams.get(message_id)
        if stream is None or (not stream.batches and stream.done is None):
            return None
        return stream

    def _stream(self, message_id: str) -> _Stream:
        self._sweep()
        stream = self._streams.get(message_id)
        if stream is None:
            stream = self._streams[message_id] = _Stream()
        return stream

    async def append(self, message_id: str, batch: TokenBatch) -> None:
        self._sweep()
        self._append(message_id, batch)

    def _append(self, message_id: str, batch: TokenBatch) -> None:
        stream = self._streams.get(message_id)
        live = stream if stream is not None and (stream.batches or stream.done is not None) else None
        length = live.length if live is not None else 0
        if live is not None and live.done is not None:
            raise StreamConflict(f"stream {message_id} has finished")
        if batch.start != length:
            raise StreamConflict(f"batch starts at {batch.start}, stream {message_id} has {length}")
        if not batch.token_ids:
            return  # nothing to add; an entry would not advance the stream
        if stream is None:
            stream = self._streams[message_id] = _Stream()
        stream.batches.append(batch)
        stream.ends.append(batch.end)
        stream.deliver(batch)

    async def append_many(self, items: list[tuple[str, TokenBatch]]) -> list[StreamConflict | None]:
        self._sweep()  # once for the engine step, not per message
        out: list[StreamConflict | None] = []
        for message_id, batch in items:
            try:
                self._append(message_id, batch)
                out.append(None)
            except StreamConflict as exc:
                out.append(exc)
        return out

    async def finish(self, message_id: str, done: StreamDone) -> None:
        stream = self._stream(message_id)
        if stream.done is not None:
            return
        stream.done = done
        stream.compact()
        self._expiry.append((time.monotonic() + self.expire_after_s, message_id, stream))
        stream.notify()

    async def length(self, message_id: str) -> int:
        stream = self._live(message_id)
        return stream.length if stream is not None else 0

    async def read(
        self, message_id: str, after: int, timeout_s: float, push: Pusher | None = None
    ) -> list[StreamEntry]:
        """As ``TokenStreams.read``; ``push``: while this read waits, new batches go to it first (what it
        takes is not returned: the reader keeps its own position)."""
        stream = self._stream(message_id)
        entries = stream.entries_after(after)
        if entries or timeout_s <= 0:
            self._drop_if_placeholder(message_id, stream)
            return entries
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        stream.readers += 1
        try:
            while not entries and loop.time() < deadline:
                waiter: asyncio.Future[None] = loop.create_future()
                stream.waiters[waiter] = push
                self._ticks.add(loop, deadline, waiter)
                try:
                    await waiter
                finally:
                    stream.waiters.pop(waiter, None)  # still there if it timed out or was cancelled
                entries = stream.entries_after(after)
        finally:
            stream.readers -= 1
            self._drop_if_placeholder(message_id, stream)
        return entries

    def _drop_if_placeholder(self, message_id: str, stream: _Stream) -> None:
        # A read of a stream that never got an entry must not leave it behind.
        empty = not stream.batches and stream.done is None
        if empty and stream.readers == 0 and self._streams.get(message_id) is stream:
            del self._streams[message_id]

    async def restart(self, message_id: str, from_index: int, attempt: int) -> None:
        self._streams.pop(message_id, None)
        self._restarts[message_id] = (from_index, attempt)
        self._restarts.move_to_end(message_id)
        while len(self._restarts) > _MAX_RESTARTS:
            self._restarts.popitem(last=False)

    async def restarted_at(self, message_id: str) -> tuple[int, int] | None:
        return self._restarts.get(message_id)

    async def exists(self, message_id: str) -> bool:
        return self._live(message_id) is not None

    async def close(self) -> None:
        for stream in self._streams.values():
            stream.notify()
        self._streams.clear()
        self._expiry.clear()
