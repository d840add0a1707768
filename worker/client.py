"""The worker's client: connect, say hello, take work while credits last, send the frames that each
message's generation (``worker.generation``) yields, answer tokenizer calls, drain.

It talks to the server over a channel (``worker.channels``): a websocket, on which it reconnects with
capped exponential backoff and jitter (a refused key or protocol version is fatal), or the in-process
link of ``tokentrail serve --model``. Generation runs as one task per message; losing the connection
aborts them all (the server re-queues and a worker resumes from the tokens already streamed).

With a ``SupervisedEngine`` (worker.engine_health), an engine death stops the worker taking work at
once: the messages in hand are aborted and handed back with an ``engine`` frame (or, to a server that
does not take those, by disconnecting), none is failed; credits are granted again once the engine has
been restarted. An engine that cannot be restarted ends ``run_forever`` with ``EngineUnrecoverable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import websockets
from pydantic import ValidationError

from shared.errors import ErrorCode
from shared.local_link import WorkerEnd
from shared.protocol import (
    FEATURE_BATCH,
    FEATURE_DRAIN,
    FEATURE_ENGINE,
    FEATURE_RPC,
    FEATURE_UNSEEDED,
    FEATURE_WEIGHTS,
    PROTOCOL_VERSION,
    WEIGHTS_METHODS,
    CancelFrame,
    CreditFrame,
    DrainFrame,
    EngineFrame,
    ErrorFrame,
    FailedFrame,
    HeartbeatFrame,
    HelloFrame,
    RpcFrame,
    RpcResultFrame,
    WelcomeFrame,
    WorkFrame,
)
from worker.channels import Channel, LocalChannel, SocketChannel, ToServer
from worker.chat_format import ChatFormat, RenderError
from worker.engine_health import HealthState, SupervisedEngine
from worker.engines.contract import Engine, EngineDead, EngineError
from worker.frames import merged_steps
from worker.generation import Pipeline, engine_request_id
from worker.prompt_builder import CloserPolicy, PromptMode, template_error
from worker.reconnect import ReconnectPolicy
from worker.rpc import RpcError, handle_rpc, vocab_size
from worker.weights import policy_version, serves_weights, weights_call

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
    reconnect_max_s: float = 5.0
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
    def __init__(self, options: WorkerOptions, engine: Engine, fmt: ChatFormat, model_path: str | None = None) -> None:
        self.options = options
        self.engine = engine
        self.fmt = fmt
        self.model_path = model_path  # the checkpoint it started from: pushed weights are checked against it
        self.pipeline = Pipeline(engine, fmt, prompt_mode=options.prompt_mode, closer_policy=options.closer_policy)
        self._channel: Channel | None = None
        self._send_lock = asyncio.Lock()
        self._batching = False  # the server takes the frames of one engine step as one message
        self._outbox: _Outbox | None = None
        self._failed_channel: Channel | None = None  # a send on it failed: posts to it raise
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
        self._engine_frames = False  # the server takes engine frames
        self.completed = 0
        # the engine died and is being restarted: no work is taken (nor credits granted) until it is back
        self.health = engine if isinstance(engine, SupervisedEngine) else None
        self.engine_down = False
        self._health_tasks: set[asyncio.Task[None]] = set()
        if self.health is not None:
            self.health.on_change(self._engine_changed)

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
            features=[FEATURE_RPC, FEATURE_UNSEEDED, *([FEATURE_WEIGHTS] if serves_weights(self.engine) else [])],
            vocab_size=vocab_size(self.fmt),
            released=list(self._released.items()),
            engine_deaths=self.health.deaths if self.health else 0,
            engine_restarts=self.health.restarts if self.health else 0,
            policy_version=policy_version(self.engine),
        )

    async def drain(self, timeout_s: float) -> None:
        """Graceful shutdown: ask the server for no more work, finish what is in hand for up to
        ``timeout_s``, then disconnect. Whatever is still running then is handed back: the server
        requeues it and the next worker continues after the tokens already streamed."""
        self.draining = True
        log.info("draining: %d messages in hand, up to %.0fs to finish them", len(self._tasks), timeout_s)
        if self._channel is not None and self._drain_frames:
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._send(DrainFrame())
        deadline = time.monotonic() + timeout_s
        while self._tasks and (left := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(self._tasks.values()), timeout=left)
        if self._tasks:
            log.warning("drain timed out: handing back %d messages", len(self._tasks))
        channel = self._channel
        if channel is not None:
            with contextlib.suppress(Exception):
                await self._sent()  # the finished messages' last posted frames
            with contextlib.suppress(Exception):
                await channel.close()

    @property
    def server_urls(self) -> list[str]:
        """``server_url`` may list several server replicas, comma-separated."""
        return [u.strip() for u in self.options.server_url.split(",") if u.strip()]

    async def run_forever(self) -> None:
        """Serve until drained, reconnecting as ``worker.reconnect.ReconnectPolicy`` says: the next
        listed replica at once, a jittered backoff capped at ``reconnect_max_s`` only once every
        replica failed, and afresh after a session that had been healthy."""
        urls = self.server_urls
        policy = ReconnectPolicy(replicas=len(urls), max_s=self.options.reconnect_max_s)
        while not self.draining:
            url = urls[self._url_index % len(urls)]
            if self.health is not None:
                await self.health.wait_ready()  # EngineUnrecoverable ends the worker
            failed = False
            started = time.monotonic()
            try:
                await self._session(url)
            except FatalWorkerError:
                raise
            except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as exc:
                log.warning("connection to %s failed: %s", url, exc)
                failed = True
            finally:
                connected_s = time.monotonic() - started if self.connected.is_set() else None
                self.connected.clear()
                await self._abort_all()
            if self.draining:
                return
            self._url_index += 1
            wait = policy.wait_s(failed=failed, connected_s=connected_s)
            if wait:
                log.info("reconnecting in %.1fs", wait)
                await asyncio.sleep(wait)

    async def _session(self, server_url: str) -> None:
        url = websocket_url(server_url)
        headers = {"Authorization": f"Bearer {self.options.api_key}"}
        # No per-message compression: frames are small and sent per engine step, and deflating them
        # costs both ends more CPU than the bytes it saves on a datacenter link.
        async with websockets.connect(url, additional_headers=headers, max_size=64 * 2**20, compression=None) as ws:
            await self._serve(SocketChannel(ws), url)

    async def run_local(self, end: WorkerEnd) -> None:
        """Serve over an in-process link (``tokentrail serve --model``) until it closes. No reconnection
        here: the server holds the other end, and ``worker.in_process`` decides whether to dial again."""
        try:
            await self._serve(LocalChannel(end), "this process's server")
        finally:
            end.close(1001 if self.draining else 1000)  # as leaving ``websockets.connect`` closes a socket
            self.connected.clear()
            await self._abort_all()

    async def _serve(self, channel: Channel, where: str) -> None:
        """One session over a connected channel: hello, welcome, then frames until the server closes it."""
        self._channel = channel
        # Until the welcome, this session has no features: the hello goes alone (unbatched), and the
        # engine-health frames and credits of a background task wait (``connected``) for the welcome.
        self._batching = self._drain_frames = self._engine_frames = False
        try:
            await self._send(self.hello())
            first = await asyncio.wait_for(channel.receive(), timeout=30)
            if first is None:
                raise ConnectionError("the server closed the connection before its welcome")
            if isinstance(first, ErrorFrame):
                self._raise_error(first)
            if not isinstance(first, WelcomeFrame):
                raise FatalWorkerError(f"expected welcome, got {first.type}")
            log.info("connected as %s to %s", first.worker_id, where)
            self._released.clear()  # this server has them now
            self._batching = FEATURE_BATCH in first.features
            self._drain_frames = FEATURE_DRAIN in first.features
            self._engine_frames = FEATURE_ENGINE in first.features
            if not self.engine_down:  # else the credits come with the engine's "ready"
                await self._send(CreditFrame(credits=self.options.max_parallel - len(self._tasks)))
            self.connected.set()
            beat = asyncio.create_task(self._heartbeat(first.heartbeat_interval_s))
            try:
                while True:
                    try:
                        frame = await channel.receive()
                    except ValidationError as exc:
                        log.warning("ignoring a bad frame from the server: %s", exc)
                        continue
                    if frame is None:
                        return
                    if isinstance(frame, WorkFrame) and self.engine_down:
                        # sent before the server saw the engine die: hand it back too (a server without
                        # engine frames requeues it when this worker disconnects, which it is doing)
                        if self._engine_frames:
                            await self._send(self._engine_frame("restarting", []))
                    elif isinstance(frame, WorkFrame):
                        key = frame.message_id
                        self._attempts[key] = frame.attempt
                        self._tasks[key] = asyncio.create_task(self._work(frame), name=f"work-{key}")
                    elif isinstance(frame, CancelFrame):
                        await self.pipeline.cancel(frame.message_id, frame.attempt)
                    elif isinstance(frame, RpcFrame) and frame.method in WEIGHTS_METHODS:
                        self._in_background(self._weights(frame, channel))  # a drain waits for running work
                    elif isinstance(frame, RpcFrame):
                        await self._send(self._rpc(frame))
                    elif isinstance(frame, ErrorFrame):
                        self._raise_error(frame)
            finally:
                beat.cancel()
        finally:
            self._channel = None

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

    async def _weights(self, frame: RpcFrame, channel: Channel) -> None:
        answer = await weights_call(self.engine, self.model_path, frame)
        if self._channel is channel:  # else the server that asked is gone: its push ends without this worker
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._send(answer)

    def _raise_error(self, frame: ErrorFrame) -> None:
        if frame.code in FATAL_CODES:
            raise FatalWorkerError(f"{frame.code}: {frame.message}")
        raise ConnectionError(f"server error {frame.code}: {frame.message}")

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(min(interval, self.options.heartbeat_interval_s))
            await self._send(HeartbeatFrame())

    async def _send(self, frame: ToServer) -> None:
        """Send a frame and return once it is out (its send's error raised here)."""
        await self._post(frame)
        if self._batching:
            await self._sent()

    async def _post(self, frame: ToServer) -> None:
        """Queue a frame for this engine step's message and go on without waiting for the send: a
        message's task then sleeps once per engine step (waiting for the engine), not twice. It waits
        only while the queued frames pile up behind a slow send; a failed send is raised by the next
        post on that channel (the connection is gone, and the session's end aborts the rest)."""
        channel = self._channel
        if channel is None:
            raise ConnectionError("not connected")
        if channel is self._failed_channel:
            raise ConnectionError("the connection to the server failed")
        if not self._batching:
            async with self._send_lock:
                await channel.send(frame)
            return
        box = self._box(channel)
        box.frames.append(frame)
        if len(box.frames) >= _POST_BACKLOG:
            await box.sent()

    async def _sent(self) -> None:
        """Return once every frame posted so far is out (raising its send's error)."""
        if self._outbox is not None:
            await self._outbox.sent()
        async with self._send_lock:  # a flush already under way
            pass

    def _box(self, channel: Channel) -> _Outbox:
        # Frames queued while the loop runs one engine step's consumers go out as one message: the
        # first schedules the flush, the rest join it.
        box = self._outbox
        if box is None or box.channel is not channel:
            box = self._outbox = _Outbox(channel)
            asyncio.get_running_loop().create_task(self._flush(box))
        return box

    async def _flush(self, box: _Outbox) -> None:
        await asyncio.sleep(0)  # let the rest of this step's senders add their frames
        if self._outbox is box:
            self._outbox = None
        try:
            async with self._send_lock:
                await box.channel.send_step(merged_steps(box.frames))
            box.settle(None)
        except Exception as exc:
            self._failed_channel = box.channel
            box.settle(exc)
        except BaseException:
            self._failed_channel = box.channel
            box.settle(ConnectionError("the send was cancelled"))
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
                    await self._post(out)
            self.completed += 1
        except EngineDead as exc:
            if self.health is not None:
                return  # handed back with everything else the engine held (_engine_changed); no credit
            log.warning("message %s: the engine died: %s", frame.message_id, exc)
            await self._send_quietly(
                FailedFrame(
                    message_id=frame.message_id, attempt=frame.attempt, code=exc.code, message=str(exc), retryable=True
                )
            )
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
        if not self.draining and not self.engine_down:
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._post(CreditFrame(credits=1))

    # ---- engine health ---------------------------------------------------------------------------
    def _engine_changed(self, state: HealthState, running: frozenset[str]) -> None:
        """Called by the SupervisedEngine as its state changes (synchronously: ``running``, the request
        ids in the engine when it died, still match the tasks in hand)."""
        if state == "restarting":
            self.engine_down = True
            died_with = [(mid, att) for mid, att in self._attempts.items() if engine_request_id(mid, att) in running]
            self._in_background(self._engine_died(died_with))
        elif state == "ready" and self.engine_down:
            self.engine_down = False
            self._in_background(self._engine_back())
        elif state == "failed":
            self._in_background(self._engine_failed())

    def _in_background(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    def _engine_frame(self, state: HealthState, running: list[tuple[str, int]]) -> EngineFrame:
        health = self.health
        assert health is not None and state != "starting"
        return EngineFrame(
            state=state,
            deaths=health.deaths,
            restarts=health.restarts,
            error=health.error,
            running=running,
            policy_version=health.policy_version,
        )

    async def _engine_died(self, running: list[tuple[str, int]]) -> None:
        """Stop the work in hand (its streams are dead) and hand it back: the server requeues it, to be
        resumed after the tokens already streamed."""
        channel = self._channel if self.connected.is_set() else None
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if channel is None or channel is not self._channel:
            return  # the next session's server hears of it in the hello's released work
        if self._engine_frames:
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._send(self._engine_frame("restarting", running))
                return
        # A server without engine frames: disconnect, and reconnect once the engine is back.
        with contextlib.suppress(Exception):
            await channel.close(1011, "engine restarting")

    async def _engine_back(self) -> None:
        if self._channel is None or not self.connected.is_set() or self.draining:
            return  # a session being opened grants credits after its welcome
        if not self._engine_frames:  # this server was told by a disconnect; credits are all it needs
            await self._send_quietly(CreditFrame(credits=self.options.max_parallel - len(self._tasks)))
            return
        with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
            await self._send(self._engine_frame("ready", []))
            await self._send(CreditFrame(credits=self.options.max_parallel - len(self._tasks)))

    async def _engine_failed(self) -> None:
        channel = self._channel if self.connected.is_set() else None
        if channel is None:
            return
        if self._engine_frames:
            with contextlib.suppress(ConnectionError, websockets.exceptions.WebSocketException):
                await self._send(self._engine_frame("failed", []))
        with contextlib.suppress(Exception):
            await channel.close(1011, "engine failed")

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
    """The frames of one engine step, sent as one message, and each sender's wait for that send."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.frames: list[ToServer] = []
        self.senders: list[asyncio.Future[None]] = []

    async def sent(self) -> None:
        """Wait for this message's send (its error raised). A future per waiter, not one shared future
        behind asyncio.shield: a cancelled waiter cancels only its own, and the flush wakes each directly."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.senders.append(done)
        await done

    def settle(self, error: BaseException | None) -> None:
        """Wake every sender still waiting (a cancelled one's future is done already): with the send's
        error, if any."""
        for sent in self.senders:
            if not sent.done():
                if error is None:
                    sent.set_result(None)
                else:
                    sent.set_exception(error)
                    sent.exception()  # retrieved: no warning if its sender is cancelled before it wakes


# Queued frames past which a post waits for their send (a server that stopped reading).
_POST_BACKLOG = 4096

# How long after its last frame a message is still named in ``released`` when the connection
# fails: frames in flight or unprocessed when a server dies are lost with it.
_UNSTORED_S = 10.0
