"""How the worker client talks to its server: a websocket (``SocketChannel``) or, in ``tokentrail serve
--model``, an in-process link (``LocalChannel``) that carries the frame objects without encoding them.
The client's session code is the same over both; only sockets reconnect (``WorkerClient.run_forever``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import websockets
from websockets.asyncio.client import ClientConnection

from shared.local_link import LinkClosed, WorkerEnd
from shared.protocol import (
    CreditFrame,
    DrainFrame,
    EngineFrame,
    FailedFrame,
    FinishedFrame,
    HeartbeatFrame,
    HelloFrame,
    RpcResultFrame,
    ServerFrame,
    TokensFrame,
    server_frame_adapter,
)
from shared.step_frames import StepFrame
from worker.frames import StepTokens

ToServer = (
    HelloFrame
    | CreditFrame
    | TokensFrame
    | FinishedFrame
    | FailedFrame
    | HeartbeatFrame
    | RpcResultFrame
    | DrainFrame
    | EngineFrame
    | StepTokens
)


class Channel(Protocol):
    async def send(self, frame: ToServer) -> None: ...

    async def send_step(self, frames: Sequence[ToServer]) -> None:
        """The frames of one engine step, as one message (the server takes them at once)."""
        ...

    async def receive(self) -> ServerFrame | None:
        """The next frame; None once the server closed the channel; ``ValidationError`` for a bad frame."""
        ...

    async def close(self, code: int = 1001, reason: str = "worker shutting down") -> None: ...


def _json(frame: ToServer) -> bytes:
    return frame.json() if isinstance(frame, StepTokens) else frame.model_dump_json().encode()


class SocketChannel:
    """A websocket: each frame a JSON text message, one engine step's frames a JSON array."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def send(self, frame: ToServer) -> None:
        await self.ws.send(_json(frame), text=True)

    async def send_step(self, frames: Sequence[ToServer]) -> None:
        data = [_json(f) for f in frames]
        # the UTF-8 JSON as a text message, as the server reads it (not decoded here to be encoded again)
        await self.ws.send(data[0] if len(data) == 1 else b"[" + b",".join(data) + b"]", text=True)

    async def receive(self) -> ServerFrame | None:
        try:
            raw = await self.ws.recv()
        except websockets.exceptions.ConnectionClosedOK:
            return None
        return server_frame_adapter.validate_json(raw)

    async def close(self, code: int = 1001, reason: str = "worker shutting down") -> None:
        await self.ws.close(code=code, reason=reason)


def _frame(frame: ToServer) -> StepFrame:
    # The step's tokens as the server's step decoder gives them, unvalidated: built by this process's own
    # pipeline, with the fields of TokensFrame (tests/test_frames.py checks they agree).
    return frame.step() if isinstance(frame, StepTokens) else frame


class LocalChannel:
    """The worker's end of an in-process link (``shared.local_link``): frame objects, not JSON."""

    def __init__(self, end: WorkerEnd) -> None:
        self.end = end

    async def send(self, frame: ToServer) -> None:
        await self.end.send(_frame(frame))

    async def send_step(self, frames: Sequence[ToServer]) -> None:
        await self.end.send([_frame(f) for f in frames])

    async def receive(self) -> ServerFrame | None:
        try:
            return await self.end.receive()
        except LinkClosed:
            return None

    async def close(self, code: int = 1001, reason: str = "worker shutting down") -> None:
        self.end.close(code, reason)
