"""An in-memory duplex link between a server and a worker in one process (``tokentrail serve --model``).

It carries the frame objects the websocket carries as JSON, as they are: nothing is encoded or parsed.
Each direction is a bounded queue, so that a producer waits for its consumer as it would for a socket's
buffer. Either end may close the link; the other then receives what was already sent and after that
``LinkClosed``, and its sends fail at once, as on a websocket whose peer went away. Single event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from shared.protocol import ServerFrame
from shared.step_frames import StepFrame

A = TypeVar("A")
B = TypeVar("B")

DEFAULT_DEPTH = 1024  # items in flight per direction before a sender waits (frames, or one step's batch)


class LinkClosed(ConnectionError):
    """The link was closed (by either end): nothing more can be sent, nothing more will arrive."""

    def __init__(self, code: int = 1000, reason: str = "") -> None:
        super().__init__(f"link closed ({code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class _Pipe(Generic[A]):
    """One direction of the link."""

    def __init__(self, depth: int) -> None:
        self.items: deque[A] = deque()
        self.depth = depth
        self.readable = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()


class _State:
    """What both ends share: whether and how the link was closed."""

    def __init__(self) -> None:
        self.closed: LinkClosed | None = None  # the first close's code and reason


class LocalEnd(Generic[A, B]):
    """One end of a link: sends ``A`` items, receives ``B`` items."""

    def __init__(self, out: _Pipe[A], inbox: _Pipe[B], state: _State) -> None:
        self._out = out
        self._in = inbox
        self._state = state

    @property
    def closed(self) -> bool:
        return self._state.closed is not None

    @property
    def close_code(self) -> int | None:
        return self._state.closed.code if self._state.closed is not None else None

    async def send(self, item: A) -> None:
        pipe = self._out
        while len(pipe.items) >= pipe.depth and self._state.closed is None:
            pipe.writable.clear()
            await pipe.writable.wait()
        self._raise_if_closed()
        pipe.items.append(item)
        pipe.readable.set()

    async def receive(self) -> B:
        """The next item; ``LinkClosed`` once the link is closed and every item sent before was taken."""
        pipe = self._in
        while not pipe.items:
            self._raise_if_closed()
            pipe.readable.clear()
            await pipe.readable.wait()
        item = pipe.items.popleft()
        if len(pipe.items) < pipe.depth:
            pipe.writable.set()
        return item

    def _raise_if_closed(self) -> None:
        closed = self._state.closed
        if closed is not None:
            raise LinkClosed(closed.code, closed.reason)

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Close both directions (idempotent: the first close's code and reason stay)."""
        if self._state.closed is None:
            self._state.closed = LinkClosed(code, reason)
        for pipe in (self._out, self._in):
            pipe.readable.set()
            pipe.writable.set()


def local_link(depth: int = DEFAULT_DEPTH) -> tuple[LocalEnd[A, B], LocalEnd[B, A]]:
    """A new link: (the end that sends ``A`` and receives ``B``, the end that sends ``B`` and receives ``A``)."""
    a_to_b: _Pipe[A] = _Pipe(depth)
    b_to_a: _Pipe[B] = _Pipe(depth)
    state = _State()
    return LocalEnd(a_to_b, b_to_a, state), LocalEnd(b_to_a, a_to_b, state)


# What travels between an in-process worker and its server: the worker sends one frame or the frames of
# one engine step (FEATURE_BATCH), the server one frame at a time.
FromWorker = StepFrame | list[StepFrame]
ServerEnd = LocalEnd[ServerFrame, FromWorker]
WorkerEnd = LocalEnd[FromWorker, ServerFrame]


def worker_link(depth: int = DEFAULT_DEPTH) -> tuple[ServerEnd, WorkerEnd]:
    """A new link between a server and a worker in this process: (the server's end, the worker's end)."""
    return local_link(depth)
