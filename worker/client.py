"""The worker's websocket client: connect, say hello, take work while credits last, send the frames
that each message's generation (``worker.generation``) yields, answer tokenizer calls, drain.

Reconnects with capped exponential backoff and jitter; a refused key or protocol version is
fatal. Generation runs as one task per message; losing the connection aborts them all (the
server re-queues and a worker resumes from the tokens already streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection

from shared.errors import ErrorCode
from shared.protocol import (
    FEATURE_BATCH,
    FEATURE_DRAIN,
    FEATURE_RPC,
    FEATURE_UNSEEDED,
    PROTOCOL_VERSION,
    CancelFrame,
    CreditFrame,
    DrainFrame,
    ErrorFrame,
    FailedFrame,
    FinishedFrame,
    HeartbeatFrame,
    HelloFrame,
    RpcFrame,
    RpcResultFrame,
    TokensFrame,
    WelcomeFrame,
    WorkFrame,
    server_frame_adapter,
)
from worker.chat_format import ChatFormat, RenderError
from worker.engines.contract import Engine, EngineError
from worker.frames import StepTokens
from worker.generation import Pipeline
from worker.prompt_builder import CloserPolicy, PromptMode, template_error
from worker.rpc import RpcError, handle_rpc, vocab_size

log = logging.getLogger(__name__)

FATAL_CODES = {ErrorCode.invalid_worker_key.value, ErrorCode.protocol_version_mismatch.value}


class FatalWorkerError(Exception):
    """The server refused this worker for a reason retrying cannot fix."""


@dataclass
class WorkerOptions:
    server_url: str
    api_key: str
    model_name: str
    max_parallel: int = 4
    reconnect_max_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    # "naive" re-renders the whole history each turn: only for baselines in benchmarks
    prompt_mode: PromptMode = "stitch"
    closer_policy: CloserPolicy = "keep"


def websocket_url(server_url: str) -> str:
    base = server_url.rstrip("/")
    if base.startswith("http://"):
        base = "ws://" + base[len("http://") :]
    elif base.startswith("https://"):
        base = "wss://" + base[len("https://") :]
    elif not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base + "/workers/work"


class WorkerClient:
    def __init__(self, options: WorkerOptions, engine: Engine, fmt: ChatFormat) -> None:
        self.options = options
        self.engine = engine
        self.fmt = fmt
        self.pipeline = Pipeline(engine, fmt, prompt_mode=options.prompt_mode, closer_policy=options.closer_policy)
        self._ws: ClientConnection | None = None
        self._send_lock = asyncio.Lock()
        self._batching = False  # the server takes the frames of one engine step as one message
        self._outbox: _Outbox | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.connected = asyncio.Event()
        self.draining = False  # shutting down: no new work, no more credits
        self._url_index = 0
        self._attempts: dict[str, int] = {}  # message id -> attempt of the work in hand
        self._released: dict[str, int] = {}  # work lost with the last connection, told to the next server
        # Work ended here moments ago (message id -> (attempt, when)): its last frames may have died
        # with the server before being stored, so it is named in ``released`` too (fenced by attempt).
        self._recent: OrderedDict[str, tuple[int, float]] = OrderedDict()  # oldest first
        self._drain_frames = False  # the server takes a drain frame
        self.completed = 0

    def hello(self) -> HelloFrame:
        return HelloFrame(
            protocol_version=PROTOCOL_VERSION,
            model_name=self.options.model_name,
            engine=self.engine.info.name,
            tokenizer_hash=self.fmt.tokenizer_hash,
            template_hash=self.fmt.template_hash,
            compat_hash=self.fmt.compat_hash,
            capacity=self.options.max_parallel,
            max_context=self.engine.info.max_context,
            features=[FEATURE_RPC, FEATURE_UNSEEDED],
            vocab_size=vocab_size(self.fmt),
            released=list(self._released.items()),
        )

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: ask the server for no more work, finish what is in hand for up to
        ``timeout_s``, then disconnect. Whatever is still running then is handed back: the server
        requeues it and the next worker continues after the tokens already streamed."""
        self.draining = True
        log.info("draining: %d messages in hand, up to %.0fs to finish them", len(self._tasks), timeout_s)
        if self._ws is not None and self._drain_frames:
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._send(DrainFrame())
        deadline = time.monotonic() + timeout_s
        while self._tasks and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(self._tasks.values()), timeout=left)
        if self._tasks:
            log.warning("drain timed out: handing back %d messages", len(self._tasks))
        ws = self._ws
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close(code=1001, reason="worker shutting down")

    @property
    def server_urls(self) -> list[str]:
        """``server_url`` may list several server replicas, comma-separated."""
        return [u.strip() for u in self.options.server_url.split(",") if u.strip()]

    async def run_forever(self) -> None:
        """Serve until drained. When the connection fails the worker moves to the next listed
        replica at once; it backs off (doubling, jittered) only after every replica failed."""
        delay = 0.5
        urls = self.server_urls
        failures = 0
        while not self.draining:
            url = urls[self._url_index % len(urls)]
            try:
                await self._session(url)
                delay, failures = 0.5, 0
            except FatalWorkerError:
                raise
            except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as exc:
                log.warning("connection to %s failed: %s", url, exc)
                failures += 1
            finally:
                self.connected.clear()
                await self._abort_all()
            if self.draining:
                return
            self._url_index += 1
            if failures and failures % len(urls):
                continue  # try the next replica now
            sleep = delay * (0.5 + random.random())
            log.info("reconnecting in %.1fs", sleep)
            await asyncio.sleep(sleep)
            if failures:
                delay = min(delay * 2, self.options.reconnect_max_s)

    async def _session(self, server_url: str) -> None:
        url = websocket_url(server_url)
        headers = {"Authorization": f"Bearer {self.options.api_key}"}
        # No per-message compression: frames are small and sent per engine step, and deflating them
        # costs both ends more CPU than the bytes it saves on a datacenter link.
        async with websockets.connect(url, additional_headers=headers, max_size=64 * 2**20, compression=None) as ws:
            self._ws = ws
            await self._send(self.hello())
            first = server_frame_adapter.validate_json(await asyncio.wait_for(ws.recv(), timeout=30))
            if isinstance(first, ErrorFrame):
                self._raise_error(first)
            if not isinstance(first, WelcomeFrame):
                raise FatalWorkerError(f"expected welcome, got {first.type}")
            log.info("connected as %s to %s", first.worker_id, url)
            self._released.clear()  # this server has them now
            self._batching = FEATURE_BATCH in first.features
            self._drain_frames = FEATURE_DRAIN in first.features
            await self._send(CreditFrame(credits=self.options.max_parallel - len(self._tasks)))
            self.connected.set()
            beat = asyncio.create_task(self._heartbeat(first.heartbeat_interval_s))
            try:
                async for raw in ws:
                    try:
                        frame = server_frame_adapter.validate_json(raw)
                    except ValidationError as exc:
                        log.warning("ignoring a bad frame from the server: %s", exc)
                        continue
                    if isinstance(frame, WorkFrame):
                        key = frame.message_id
                        self._attempts[key] = frame.attempt
                        self._tasks[key] = asyncio.create_task(self._work(frame), name=f"work-{key}")
                    elif isinstance(frame, CancelFrame):
                        await self.pipeline.cancel(frame.message_id, frame.attempt)
                    elif isinstance(frame, RpcFrame):
                        await self._send(self._rpc(frame))
                    elif isinstance(frame, ErrorFrame):
                        self._raise_error(frame)
            finally:
                beat.cancel()
                self._ws = None

    def _rpc(self, frame: RpcFrame) -> RpcResultFrame:
        # Run in the event loop, not a thread: prompt builds share the tokenizer, and transformers
        # toggles state on it (split_special_tokens) while encoding. Tokenizer calls take milliseconds.
        try:
            return RpcResultFrame(id=frame.id, result=handle_rpc(self.fmt, frame.method, frame.params))
        except RpcError as exc:
            return RpcResultFrame(id=frame.id, code=exc.code.value, message=str(exc))
        except Exception as exc:
            log.exception("rpc %s failed", frame.method)
            return RpcResultFrame(
                id=frame.id, code=ErrorCode.engine_error.value, message=f"{type(exc).__name__}: {exc}"
            )

    def _raise_error(self, frame: ErrorFrame) -> None:
        if frame.code in FATAL_CODES:
            raise FatalWorkerError(f"{frame.code}: {frame.message}")
        raise ConnectionError(f"server error {frame.code}: {frame.message}")

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(min(interval, self.options.heartbeat_interval_s))
            await self._send(HeartbeatFrame())

    async def _send(
        self,
        frame: HelloFrame
        | CreditFrame
        | TokensFrame
        | FinishedFrame
        | FailedFrame
        | HeartbeatFrame
        | RpcResultFrame
        | DrainFrame
        | StepTokens,
    ) -> None:
        ws = self._ws
        if ws is None:
            raise ConnectionError("not connected")
        data = frame.json() if isinstance(frame, StepTokens) else frame.model_dump_json().encode()
        if not self._batching:
            async with self._send_lock:
                await ws.send(data.decode())
            return
        # Frames sent while the loop runs one engine step's consumers go out as one message: the
        # first schedules the flush, the rest join it; each sender waits for (and sees errors of) it.
        box = self._outbox
        if box is None or box.ws is not ws:
            box = self._outbox = _Outbox(ws)
            asyncio.get_running_loop().create_task(self._flush(box))
        box.frames.append(data)
        await asyncio.shield(box.sent)

    async def _flush(self, box: _Outbox) -> None:
        await asyncio.sleep(0)  # let the rest of this step's senders add their frames
        if self._outbox is box:
            self._outbox = None
        frames = box.frames
        try:
            async with self._send_lock:
                # a text message, as the server reads it
                await box.ws.send((frames[0] if len(frames) == 1 else b"[" + b",".join(frames) + b"]").decode())
            box.sent.set_result(None)
        except Exception as exc:
            box.sent.set_exception(exc)
        except BaseException:
            box.sent.set_exception(ConnectionError("the send was cancelled"))
            raise

    async def _abort_all(self) -> None:
        for key in self._tasks:
            if key in self._attempts:
                self._released[key] = self._attempts[key]
        since = time.monotonic() - _UNSTORED_S
        for key, (attempt, ended) in self._recent.items():
            if ended >= since:
                self._released.setdefault(key, attempt)
        self._recent.clear()
        self._attempts.clear()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    # ---- one message ---------------------------------------------------------------------
    async def _work(self, frame: WorkFrame) -> None:
        try:
            # When a send fails or the task is cancelled, the pipeline (and the engine stream it holds)
            # is closed right then, not whenever the garbage collector finds it.
            async with contextlib.aclosing(self.pipeline.frames(frame)) as frames:
                async for out in frames:
                    await self._send(out)
            self.completed += 1
        except (RenderError, EngineError) as exc:
            code = exc.code if isinstance(exc, EngineError) else template_error(exc).code
            log.warning("message %s failed: %s", frame.message_id, exc)
            await self._send_quietly(
                FailedFrame(message_id=frame.message_id, attempt=frame.attempt, code=code, message=str(exc))
            )
        except asyncio.CancelledError:
            raise
        except (ConnectionError, websockets.exceptions.WebSocketException):
            return  # the connection is gone; the server re-queues the message
        except Exception as exc:
            log.exception("message %s failed unexpectedly", frame.message_id)
            await self._send_quietly(
                FailedFrame(
                    message_id=frame.message_id,
                    attempt=frame.attempt,
                    code=ErrorCode.engine_error.value,
                    message=f"{type(exc).__name__}: {exc}",
                    retryable=True,
                )
            )
        finally:
            self._tasks.pop(frame.message_id, None)
            self._attempts.pop(frame.message_id, None)
            self._ended(frame.message_id, frame.attempt)
        if not self.draining:
            await self._send_quietly(CreditFrame(credits=1))

    def _ended(self, message_id: str, attempt: int) -> None:
        now = time.monotonic()
        recent = self._recent
        recent[message_id] = (attempt, now)
        recent.move_to_end(message_id)
        # keep what a reconnect could still need: drop the oldest, one at a time (not a rebuild per
        # message once more than 256 ended within the window)
        while len(recent) > 256 and next(iter(recent.values()))[1] < now - _UNSTORED_S:
            recent.popitem(last=False)

    async def _send_quietly(self, frame: FailedFrame | CreditFrame) -> None:
        with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
            await self._send(frame)


class _Outbox:
    """Frames queued for one websocket message, and the future of its send."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.frames: list[bytes] = []  # each frame's JSON
        self.sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # mark a failure retrieved even when every sender has gone (their tasks were cancelled)
        self.sent.add_done_callback(lambda f: None if f.cancelled() else f.exception())


# How long after its last frame a message is still named in ``released`` when the connection
# fails: frames in flight or unprocessed when a server dies are lost with it.
_UNSTORED_S = 10.0
