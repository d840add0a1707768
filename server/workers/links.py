"""How the hub talks to one worker: over the websocket (``SocketLink``) or over an in-process link
(``LocalLink``, ``tokentrail serve --model``). The hub's session code is the same for both: it receives
frame objects, sends frame objects, closes, refuses; only the socket encodes and parses JSON."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, cast

from fastapi import WebSocket, WebSocketDisconnect

from shared.errors import ErrorCode
from shared.local_link import FromWorker, LinkClosed, ServerEnd, WorkerEnd
from shared.protocol import ErrorFrame, ServerFrame, worker_batch_adapter, worker_frame_adapter
from shared.step_frames import StepFrame, decode_step


class WorkerLink(Protocol):
    async def receive(self) -> FromWorker:
        """The next frame(s); ``LinkClosed`` when the worker is gone, ``ValidationError`` for a bad frame."""
        ...

    async def send(self, frame: ServerFrame) -> None: ...

    async def close(self, code: int) -> None: ...

    async def refuse(self, code: ErrorCode, message: str, close_code: int) -> None:
        """Tell the worker why (an error frame) and close; quietly, it may be gone already."""
        ...


class SocketLink:
    """A worker's websocket: frames as JSON text messages."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def receive(self) -> FromWorker:
        try:
            raw = await self.ws.receive_text()
        except WebSocketDisconnect as exc:
            raise LinkClosed(exc.code, exc.reason or "") from exc
        if raw.startswith("["):  # a JSON array: the frames of one engine step (FEATURE_BATCH)
            step = decode_step(raw)
            if step is not None:
                return cast("list[StepFrame]", step)  # a list of one kind of them
            return cast("list[StepFrame]", worker_batch_adapter.validate_json(raw))
        return worker_frame_adapter.validate_json(raw)

    async def send(self, frame: ServerFrame) -> None:
        await self.ws.send_text(frame.model_dump_json())

    async def close(self, code: int) -> None:
        await self.ws.close(code=code)

    async def refuse(self, code: ErrorCode, message: str, close_code: int) -> None:
        with contextlib.suppress(Exception):
            await self.ws.send_text(ErrorFrame(code=code.value, message=message).model_dump_json())
            await self.ws.close(code=close_code)


class LocalLink:
    """The server's end of an in-process link: the worker's frame objects as they were built."""

    def __init__(self, end: ServerEnd) -> None:
        self.end = end

    async def receive(self) -> FromWorker:
        return await self.end.receive()

    async def send(self, frame: ServerFrame) -> None:
        await self.end.send(frame)

    async def close(self, code: int) -> None:
        self.end.close(code)

    async def refuse(self, code: ErrorCode, message: str, close_code: int) -> None:
        with contextlib.suppress(LinkClosed):
            await self.end.send(ErrorFrame(code=code.value, message=message))
        self.end.close(close_code, message)


class LocalWorker(Protocol):
    """A worker in the server's process (``tokentrail serve --model``: ``worker.in_process.InProcessWorker``),
    started and drained by the app's lifespan."""

    async def start(self, dial: Callable[[], WorkerEnd]) -> None:
        """Load the model and connect over a link from ``dial`` (``WorkerHub.connect_local``)."""
        ...

    async def stop(self, drain_timeout_s: float) -> None:
        """Finish the work in hand for up to ``drain_timeout_s``, hand back the rest, stop the engine."""
        ...
