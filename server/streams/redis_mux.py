"""One blocking XREAD for all the token streams a server process's readers wait on.

A reader that keeps up would otherwise send one XREAD per batch, and every reader of every message
its own: per token, per reader. Here each watched stream keeps the entries read so far (a message's
batches, until no reader has asked for it for a while), a reader takes what is new from them, and
one task reads every watched stream at once, from where each was read up to. Adding a stream to a
blocked read wakes it with an entry on this process's wake stream.

Entry ids are the stream's own (``0-E``: a batch ending at token E; ``1-0``: the terminal entry), so
"entries after token index i" is "ids above ``0-(i+1)``", as for a plain XREAD.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.constants import STREAM_WAKE
from server.queue.redis import text

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

_IDLE_DROP_S = 5.0  # a stream no reader asked for in this long is no longer read
# A stream whose reader asked this recently stays in the XREAD while the reader handles what it got:
# dropped from it, the reader's next ask would have to wake the blocked XREAD (a wake entry and a new
# XREAD per engine step per stream).
_KEEP_READING_S = 1.0


def _end(entry_id: str) -> int:
    """Token index after the entry (the terminal entry: after everything)."""
    ms, _, seq = entry_id.partition("-")
    return 1 << 62 if ms != "0" else int(seq)


@dataclass
class _Watch:
    floor: int  # entries ending at or below this were never read here
    entries: list[tuple[str, Any]] = field(default_factory=list)  # (id, fields) in id order
    ends: list[int] = field(default_factory=list)  # _end of each entry (ascending)
    waiters: list[tuple[int, asyncio.Future[list[tuple[str, Any]]]]] = field(default_factory=list)
    last_asked: float = field(default_factory=time.monotonic)
    done: bool = False

    @property
    def read_to(self) -> int:
        return self.ends[-1] if self.ends else self.floor

    def after(self, index: int) -> list[tuple[str, Any]]:
        return self.entries[bisect.bisect_right(self.ends, index + 1) :]


class StreamMux:
    def __init__(self, redis: Redis, block_s: float) -> None:
        self.redis = redis
        self.block_s = block_s
        self.wake_key = STREAM_WAKE.format(mux_id=secrets.token_hex(8))
        self._wake_id = "0-0"
        self._watches: dict[str, _Watch] = {}
        self._reading: set[str] = set()  # streams of the XREAD in flight
        self._task: asyncio.Task[None] | None = None
        self._work = asyncio.Event()
        self._closing = False

    async def read(self, key: str, after: int, timeout_s: float) -> list[tuple[str, Any]] | None:
        """Raw entries of ``key`` holding tokens after ``after`` (waiting up to ``timeout_s``), or None
        when the watch cannot serve this position (it starts after it): read the stream directly."""
        watch = self._watches.get(key)
        if watch is not None and after + 1 < watch.floor:
            return None
        if watch is None:
            watch = self._watches[key] = _Watch(floor=after + 1)
        watch.last_asked = time.monotonic()
        ready = watch.after(after)
        if ready or watch.done:
            return ready
        waiter: asyncio.Future[list[tuple[str, Any]]] = asyncio.get_running_loop().create_future()
        watch.waiters.append((after, waiter))
        self._ensure_running()
        if key not in self._reading:
            await self._wake()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for wakes the reader through a second
            # future, one more trip through the event loop for every read
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            return []
        finally:
            with contextlib.suppress(ValueError):
                watch.waiters.remove((after, waiter))
            watch.last_asked = time.monotonic()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # End the loop through the wake stream rather than cancel a blocked XREAD mid-command
            # (redis-py can hang tearing that down).
            self._closing = True
            self._work.set()
            with contextlib.suppress(Exception):
                await self.redis.xadd(self.wake_key, {"w": 1}, maxlen=8, approximate=True)
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=self.block_s + 2)
            except (TimeoutError, Exception):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self.redis.delete(self.wake_key)

    def _ensure_running(self) -> None:
        self._work.set()
        if not self._closing and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="tokentrail-stream-mux")

    async def _wake(self) -> None:
        if self._reading:  # a blocked XREAD without this stream: make it return and re-read with it
            with contextlib.suppress(Exception):
                await self.redis.xadd(self.wake_key, {"w": 1}, maxlen=8, approximate=True)

    async def _run(self) -> None:
        dropped_at = time.monotonic()
        while not self._closing:
            now = time.monotonic()
            if now - dropped_at > 1.0:
                self._drop_idle()
                dropped_at = now
            wanted = {
                k: w
                for k, w in self._watches.items()
                if not w.done and (w.waiters or now - w.last_asked < _KEEP_READING_S)
            }
            if not wanted:
                self._work.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), timeout=_IDLE_DROP_S)
                continue
            streams: dict[Any, Any] = {k: f"0-{w.read_to}" for k, w in wanted.items()}
            streams[self.wake_key] = self._wake_id
            self._reading = set(wanted)
            try:
                reply = await self.redis.xread(streams, block=max(int(self.block_s * 1000), 1))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away or slow: readers time out and retry meanwhile
                log.warning("stream reader: XREAD failed: %s", exc)
                self._reading = set()
                await asyncio.sleep(0.2)
                continue
            finally:
                self._reading = set()
            for key, entries in _by_stream(reply).items():
                if key == self.wake_key:
                    self._wake_id = text(entries[-1][0]) if entries else self._wake_id
                    continue
                watch = self._watches.get(key)
                if watch is None:
                    continue
                for entry_id, fields in entries:
                    eid = text(entry_id)
                    if (end := _end(eid)) > watch.read_to:
                        watch.entries.append((eid, fields))
                        watch.ends.append(end)
                        watch.done = watch.done or not eid.startswith("0-")
                for after, waiter in list(watch.waiters):
                    ready = watch.after(after)
                    if (ready or watch.done) and not waiter.done():
                        waiter.set_result(ready)

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, w in self._watches.items() if not w.waiters and now - w.last_asked > _IDLE_DROP_S]:
            del self._watches[key]


def _by_stream(reply: Any) -> dict[str, list[Any]]:
    """XREAD's reply as {stream: entries}, whatever its shape (RESP2 list, RESP3 map)."""
    if not reply:
        return {}
    pairs = reply.items() if isinstance(reply, dict) else ((k, v) for k, v in reply)
    out: dict[str, list[Any]] = {}
    for key, value in pairs:
        entries = value
        if entries and isinstance(entries[0], list) and (not entries[0] or isinstance(entries[0][0], list | tuple)):
            entries = entries[0]
        out[text(key)] = list(entries or [])
    return out
