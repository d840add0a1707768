"""The worker websocket's hub (DESIGN D3, D5, D10).

One session per connected worker runs four loops: receive frames, store them (``frame_queue.py``: the
receive loop never waits on Redis or SQL), dispatch queued work while the worker has credits, and send
heartbeats (which also keep the worker's directory entry and claimed queue items alive). When a
worker goes away, what it sent is stored first; then ``Recovery`` fences each message it held with a
new attempt and requeues it; tokens it already streamed stay in the message's token stream and the
next worker resumes after them, so readers see one continuous stream.

The database or Redis going away is not the worker going away (DESIGN D18): only a failed send on
the socket (``WorkerGone``) or a receive that ends does that. Work whose dispatch needs the database
waits for it, holding its credit; a finished record the database cannot take yet is held and stored
once it is back; a failure report is settled likewise. Tokens keep streaming through Redis meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from server.chats.finished import RecentlyFinished
from server.chats.path_cache import PathCache
from server.chats.work_store import WorkStore, reply_chain_hash
from server.db import SessionFactory
from server.hot_sql import HotSql
from server.metrics import Metrics, StreamTimer, seconds_since
from server.models import WorkerKey
from server.outages import is_unavailable, until_available
from server.queue.protocol import WorkerDirectory, WorkItem, WorkQueue
from server.settings import ServerSettings
from server.streams.protocol import StreamConflict, StreamDone, TokenBatch, TokenStreams, concatenated, joins
from server.weights.fleet import FleetWeights
from server.weights.push import WeightsPush
from server.weights.registry import PolicyRegistry
from server.workers.connection import (
    CLOSE_BAD_FRAME,
    CLOSE_INVALID_KEY,
    CLOSE_PROTOCOL,
    REVOKED,
    InFlight,
    WorkerConnection,
    WorkerGone,
    bearer,
    key_revoked,
    new_worker_id,
    worker_key,
)
from server.workers.engine_health import EngineHealth
from server.workers.frame_queue import FrameQueue
from server.workers.ingest import record_problem, record_without_nul, token_batch
from server.workers.links import LocalLink, SocketLink, WorkerLink
from server.workers.recovery import Recovery
from server.workers.routing import Router
from server.workers.rpc import RpcFailed, RpcUnavailable, WorkerRpc
from server.workers.work_source import WorkSource
from shared.api import MessageState
from shared.errors import ErrorCode
from shared.local_link import LinkClosed, ServerEnd, WorkerEnd, worker_link
from shared.protocol import (
    CHANNEL_HIDDEN,
    FEATURE_BATCH,
    FEATURE_DRAIN,
    FEATURE_ENGINE,
    FEATURE_UNSEEDED,
    PROTOCOL_VERSION,
    CreditFrame,
    DrainFrame,
    EngineFrame,
    FailedFrame,
    FinishedFrame,
    HeartbeatFrame,
    HelloFrame,
    ResumeState,
    RpcResultFrame,
    TokensFrame,
    WelcomeFrame,
    WorkerFrame,
)
from shared.step_frames import StepFrame, Tokens, TokensStep

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_TRY_AGAIN = 1013  # RFC 6455 "try again later": the database is away, the worker reconnects
KEY_WAIT_S = 20.0  # how long a connecting worker's key check waits for the database
_AT_ONCE = 8  # work items dispatched, or replies' ends stored, side by side by one connection (a
# database connection each: bounded well inside the pool)


async def _side_by_side(step: Callable[[T], Coroutine[Any, Any, None]], items: Sequence[T]) -> None:
    """``step`` on each item, ``_AT_ONCE`` at a time, each waiting only on its own round trips; a
    failure (the worker gone) cancels the rest."""
    for i in range(0, len(items), _AT_ONCE):
        chunk = items[i : i + _AT_ONCE]
        if len(chunk) == 1:
            await step(chunk[0])
            continue
        async with asyncio.TaskGroup() as tg:
            for item in chunk:
                tg.create_task(step(item))


class WorkerHub:
    def __init__(
        self,
        settings: ServerSettings,
        sessions: SessionFactory,
        queue: WorkQueue,
        directory: WorkerDirectory,
        streams: TokenStreams,
        metrics: Metrics,
        paths: PathCache,
        sql: HotSql | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.queue = queue
        self.directory = directory
        self.streams = streams
        self.metrics = metrics
        self.store = WorkStore(sessions, sql)
        self.source = WorkSource(self.store, paths)
        self.finished = RecentlyFinished()  # replies stored here a moment ago, for their readers
        self.connections: dict[str, WorkerConnection] = {}
        self.server_id = secrets.token_hex(4)
        self._local_sessions: set[asyncio.Task[None]] = set()  # sessions of in-process workers
        self.rpc = WorkerRpc(self.connections, directory, self.server_id)
        self.router = Router(directory, settings.routing)
        self.recovery = Recovery(
            settings, self.store, queue, directory, streams, self.metrics, self.connections, self.server_id
        )
        self.engines = EngineHealth(settings, self.recovery, directory, metrics, self.connections, self.server_id)
        self.registry = PolicyRegistry(sessions)
        self.weights = FleetWeights(settings, self.registry, self.connections, directory, self.recovery, self.server_id)
        self.rpc.weights = self.weights.relayed
        self.pushes = WeightsPush(
            settings, self.registry, self.weights, directory, metrics, self.server_id, lambda: self.rpc.relay
        )
        self._settling: set[asyncio.Task[None]] = set()  # ends of work waiting for the database
        self._known_keys: dict[str, WorkerKey] = {}  # worker keys seen valid here, for database outages

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.recovery.start()
        self.rpc.start()
        self.weights.start()

    async def stop(self) -> None:
        await self.weights.stop()
        await self.rpc.stop()
        await self.recovery.stop()
        for task in list(self._settling):  # their messages are requeued by the sweep of a live process
            task.cancel()
        for conn in list(self.connections.values()):
            with contextlib.suppress(Exception):
                await conn.link.close(1001)
        for task in list(self._local_sessions):  # their recovery (requeueing) runs to its end
            with contextlib.suppress(Exception):
                await task
        await self.recovery.leave()

    # ---- connection ------------------------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        """A worker's websocket: its key is checked, then the session runs over it."""
        await ws.accept()
        link = SocketLink(ws)
        key = bearer(ws.headers.get("authorization", ""))
        try:
            wkey = await self._admit_key(key) if key else None
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            msg = "the database is unavailable; reconnect shortly"
            await link.refuse(ErrorCode.not_ready, msg, CLOSE_TRY_AGAIN)
            return
        if wkey is None:
            await link.refuse(ErrorCode.invalid_worker_key, "unknown or revoked worker key", CLOSE_INVALID_KEY)
            return
        await self.session(link, wkey)

    def connect_local(self) -> WorkerEnd:
        """A new in-process link (``tokentrail serve --model``): the worker's end is returned, and the
        session runs over the server's end like any other, without a key (the worker is this process)."""
        server_end, worker_end = worker_link()
        task = asyncio.get_running_loop().create_task(self._local_session(server_end))
        self._local_sessions.add(task)
        task.add_done_callback(self._local_sessions.discard)
        return worker_end

    async def _local_session(self, end: ServerEnd) -> None:
        try:
            await self.session(LocalLink(end), None)
        finally:  # as a websocket is closed when its handler returns: the worker sees the session end
            end.close(1000, "session ended")

    async def session(self, link: WorkerLink, wkey: WorkerKey | None) -> None:
        """One worker's session, from its hello until it goes away (then its work is recovered)."""
        try:
            hello = await asyncio.wait_for(link.receive(), timeout=30)
        except (TimeoutError, ValidationError, LinkClosed) as exc:
            await link.refuse(ErrorCode.bad_frame, f"expected a hello frame: {exc}", CLOSE_BAD_FRAME)
            return
        if not isinstance(hello, HelloFrame):
            await link.refuse(ErrorCode.bad_frame, "the first frame must be hello", CLOSE_BAD_FRAME)
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            await link.refuse(
                ErrorCode.protocol_version_mismatch,
                f"server speaks protocol {PROTOCOL_VERSION}, worker {hello.protocol_version}",
                CLOSE_PROTOCOL,
            )
            return
        conn = WorkerConnection(
            id=new_worker_id(self.server_id),
            hello=hello,
            link=link,
            key=wkey,
            engine_deaths=hello.engine_deaths,
            engine_restarts=hello.engine_restarts,
        )
        if hello.released:
            await self._take_released(hello)
        self.connections[conn.id] = conn
        log.info("worker %s connected: model=%s capacity=%d", conn.id, hello.model_name, hello.capacity)
        try:
            try:
                await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
            except Exception as exc:  # Redis away: the first heartbeat registers it
                log.warning("could not register worker %s yet: %s", conn.id, exc)
            await conn.send(
                WelcomeFrame(
                    worker_id=conn.id,
                    heartbeat_interval_s=self.settings.worker_heartbeat_interval_s,
                    features=[FEATURE_BATCH, FEATURE_DRAIN, FEATURE_ENGINE],
                )
            )
            frames = FrameQueue()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.weights.on_connect(conn))  # opens its gate, or brings it up to the version
                recv = tg.create_task(self._receive(conn, frames))
                flush = tg.create_task(self._flush(conn, frames))
                disp = tg.create_task(self._dispatch_loop(conn))
                beat = tg.create_task(self._heartbeat(conn))
                await recv  # returns when the worker goes away
                disp.cancel()
                beat.cancel()
                frames.close()
                await flush  # what the worker sent before it went away is stored before recovery runs
        except* (WebSocketDisconnect, WorkerGone, LinkClosed, RuntimeError) as eg:
            log.info("worker %s disconnected: %s", conn.id, eg.exceptions[0])
        except* Exception as eg:  # a bug, not a transient fault (those are retried in the loops)
            log.error("worker %s session failed", conn.id, exc_info=eg.exceptions[0])
        finally:
            self.connections.pop(conn.id, None)
            self.weights.forget(conn)
            for call in conn.calls.values():
                if not call.done():
                    call.set_exception(RpcUnavailable(f"worker {conn.id} went away"))
            try:
                await self.directory.unregister(conn.id)
            except Exception as exc:  # the entry expires on its own
                log.warning("could not unregister worker %s: %s", conn.id, exc)
            await asyncio.shield(self.recovery.recover_all(conn))

    async def _admit_key(self, key: str) -> WorkerKey | None:
        """The worker key, if valid. While the database is away, a key this process saw valid is let in
        at once (its revocation is seen at the next heartbeat's key check); another waits for the
        database for up to ``KEY_WAIT_S`` (the worker waits 30 s for its welcome), so that a worker
        (re)started during an outage is serving within a second of the database's return, not after
        its reconnect backoff."""
        try:
            wkey = await worker_key(self.sessions, key)
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            if key in self._known_keys:
                return self._known_keys[key]
            step = functools.partial(worker_key, self.sessions, key)
            wkey = await until_available(step, "checking a worker's key", within_s=KEY_WAIT_S)
        if wkey is not None and len(self._known_keys) < 10_000:
            self._known_keys[key] = wkey
        return wkey

    async def _take_released(self, hello: HelloFrame) -> None:
        """Requeue work a reconnecting worker lost with its previous server (which may be dead and
        unable to). Fenced by attempt: work that server already requeued is left alone."""
        for message_id, attempt in hello.released:
            try:
                new = await self.store.next_attempt(message_id, attempt)
                if new is not None:
                    log.warning("worker reconnected without %s (attempt %d): requeueing", message_id, attempt)
                    await self.queue.enqueue(hello.model_name, message_id, new, retry=True)
            except Exception as exc:  # the sweep requeues it later
                log.warning("could not requeue released %s: %s", message_id, exc)

    async def disconnect_key(self, key_id: str) -> int:
        """Close this process's connections made with a key that was just revoked (other processes
        notice at their next heartbeat). Their work is requeued as for any lost worker."""
        closed = 0
        for conn in list(self.connections.values()):
            if conn.key is not None and conn.key.id == key_id:
                await conn.link.refuse(ErrorCode.invalid_worker_key, REVOKED, CLOSE_INVALID_KEY)
                closed += 1
        return closed

    def load(self) -> dict[str, tuple[int, int]]:
        """Per model: the workers connected to this process and their free slots (credits)."""
        local: dict[str, tuple[int, int]] = {}
        for conn in list(self.connections.values()):
            count, free = local.get(conn.hello.model_name, (0, 0))
            local[conn.hello.model_name] = (count + 1, free + max(conn.credits, 0))
        return local

    async def _receive(self, conn: WorkerConnection, frames: FrameQueue) -> None:
        """Read frames and queue them for ``_flush`` (``frame_queue.py`` says why); credits, drains and
        rpc answers, which need no storage, take effect at once."""
        while True:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the receive as a task of
                # its own, two more trips through the event loop for every engine step's frames
                async with asyncio.timeout(self.settings.worker_timeout_s):
                    got = await conn.link.receive()
            except TimeoutError:
                log.warning("worker %s silent for %.0fs: dropping it", conn.id, self.settings.worker_timeout_s)
                with contextlib.suppress(Exception):
                    await conn.link.close(1011)
                return
            except LinkClosed:
                return
            except ValidationError as exc:
                log.warning("worker %s sent a bad frame: %s", conn.id, exc)
                continue
            conn.last_seen = time.monotonic()
            got = got if isinstance(got, list) else [got]  # a list: the frames of one engine step (FEATURE_BATCH)
            stored: list[StepFrame] = []
            for frame in got:
                # A credit read after an engine frame that the flusher has not handled yet waits behind
                # it: a restarted engine's "ready" comes just before its credits, and a credit handled
                # first would find the engine still down and be dropped (the worker idle for good).
                if isinstance(frame, DrainFrame | RpcResultFrame) or (
                    isinstance(frame, CreditFrame) and not conn.engine_frames_queued
                ):
                    await self._on_frame(conn, frame)
                else:
                    if isinstance(frame, EngineFrame):
                        conn.engine_frames_queued += 1
                    stored.append(frame)
            if stored:
                await frames.put(stored)

    async def _flush(self, conn: WorkerConnection, frames: FrameQueue) -> None:
        """Store what the receive loop queued, everything at hand at once: the token frames in one
        append, then the ends they precede; another frame (an engine's state) after all before it."""
        while (taken := await frames.take()) is not None:
            tokens: list[Tokens] = []
            ends: list[FinishedFrame | FailedFrame] = []
            for frame in taken:
                if isinstance(frame, TokensFrame | TokensStep):
                    if any(end.message_id == frame.message_id for end in ends):  # a new attempt's tokens
                        await self._store(conn, tokens, ends)
                        tokens, ends = [], []
                    tokens.append(frame)
                elif isinstance(frame, FinishedFrame | FailedFrame):
                    ends.append(frame)
                else:
                    await self._store(conn, tokens, ends)
                    tokens, ends = [], []
                    try:
                        await self._on_frame(conn, frame)
                    finally:
                        if isinstance(frame, EngineFrame):
                            conn.engine_frames_queued -= 1
            await self._store(conn, tokens, ends)

    async def _store(
        self, conn: WorkerConnection, tokens: list[Tokens], ends: list[FinishedFrame | FailedFrame]
    ) -> None:
        if tokens:
            try:
                await self._on_tokens_many(conn, tokens)
            except Exception as exc:  # appended later from the finished records (positions did not advance)
                log.warning("worker %s: appending %d token frames failed: %s", conn.id, len(tokens), exc)
        await _side_by_side(functools.partial(self._on_end, conn), ends)  # replies that ended together

    async def _on_frame(self, conn: WorkerConnection, frame: WorkerFrame) -> None:
        if isinstance(frame, CreditFrame):
            if not conn.draining and conn.engine_state == "ready":
                conn.credits += frame.credits
                conn.credit_event.set()
        elif isinstance(frame, DrainFrame):
            log.info("worker %s is draining (%d messages in hand)", conn.id, len(conn.inflight))
            conn.draining = True
            conn.credits = 0
        elif isinstance(frame, EngineFrame):
            await self.engines.on_frame(conn, frame)
            if frame.state == "ready":  # a fresh engine: it loaded the version it served, or failed to
                conn.policy_version = frame.policy_version
                self.weights.gate(conn)
        elif isinstance(frame, RpcResultFrame):
            call = conn.calls.get(frame.id)
            if call is not None and not call.done():
                if frame.result is not None:
                    call.set_result(frame.result)
                else:
                    call.set_exception(RpcFailed(frame.code or "engine_error", frame.message or "rpc failed"))

    async def _on_end(self, conn: WorkerConnection, frame: FinishedFrame | FailedFrame) -> None:
        """A message's end. A transient failure (Redis or the database briefly away) never costs the
        session: the end waits for the database in the background (``_settle``); after any other
        failure the message is requeued. (Tokens not appended are appended from the finished record.)"""
        try:
            if isinstance(frame, FinishedFrame):
                await self._on_finished(conn, frame)
            else:
                await self._on_failed(conn, frame)
        except Exception as exc:
            if is_unavailable(exc):
                self._settle(conn, frame)
                return
            log.warning("worker %s: handling %s of %s failed: %s", conn.id, frame.type, frame.message_id, exc)
            await self._requeue_lost_end(conn, frame.message_id)

    async def _requeue_lost_end(self, conn: WorkerConnection, message_id: str) -> None:
        inflight = conn.inflight.pop(message_id, None)
        if inflight is not None:
            await self.recovery.requeue_when_back(inflight.item, failed=True)  # bounded: it may be the record

    def _settle(self, conn: WorkerConnection, frame: FinishedFrame | FailedFrame) -> None:
        """Handle a message's end again, until the database takes it (retried at least every second).
        The message stays in the connection's hand meanwhile: heartbeats keep its queue entry claimed,
        the sweep leaves it alone, and the session goes on serving."""
        inflight = conn.inflight.get(frame.message_id)
        if inflight is None or inflight.item.attempt != frame.attempt or inflight.storing:
            return
        inflight.storing = True  # recovery leaves it to this task if the worker goes away meanwhile
        log.warning("worker %s: the end of %s waits for the database", conn.id, frame.message_id)

        async def again() -> None:
            if isinstance(frame, FinishedFrame):
                await self._on_finished(conn, frame)
            else:
                await self._on_failed(conn, frame)

        async def settle() -> None:
            try:
                await until_available(again, f"storing the end of {frame.message_id}")
            except Exception as exc:
                log.warning("worker %s: handling %s of %s failed: %s", conn.id, frame.type, frame.message_id, exc)
                await self._requeue_lost_end(conn, frame.message_id)
            finally:
                inflight.storing = False

        task = asyncio.create_task(settle(), name=f"settle-{frame.message_id}")
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _heartbeat(self, conn: WorkerConnection) -> None:
        while True:
            await asyncio.sleep(self.settings.worker_heartbeat_interval_s)
            await conn.send(HeartbeatFrame())
            try:
                revoked = await key_revoked(self.sessions, conn)
            except Exception as exc:  # the database away: checked again at the next beat
                log.debug("worker %s: key check failed: %s", conn.id, exc)
                revoked = False
            if revoked:
                log.warning("worker %s: its key was revoked; closing", conn.id)
                await conn.link.refuse(ErrorCode.invalid_worker_key, REVOKED, CLOSE_INVALID_KEY)
                return
            try:  # apart from the key check: work in hand stays claimed while the database is away
                await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
                if conn.inflight:
                    await self.queue.touch([f.item for f in conn.inflight.values()], conn.id)
            except Exception as exc:  # refreshed at the next beat; entries outlive several beats
                log.warning("worker %s: heartbeat bookkeeping failed: %s", conn.id, exc)

    # ---- cancellation ------------------------------------------------------------------------
    async def cancel(self, message_id: str) -> bool:
        """Cancel an open message: a queued one is dropped when its queue entry comes up; a running
        one is aborted by its worker within one engine step, and the tokens generated until then are
        stored with the message (state ``cancelled``). False if the message had already ended."""
        before = await self.store.cancel(message_id)
        if before is None:
            return False
        state, attempt, worker_id = before
        self.metrics.finished.labels(MessageState.cancelled.value).inc()
        if (
            state == MessageState.in_progress.value
            and worker_id
            and await self.rpc.cancel_on_worker(worker_id, message_id, attempt)
        ):
            return True  # the worker's abort record ends the stream (_on_finished)
        await self.recovery.finish_cancelled(message_id)
        return True

    # ---- dispatch --------------------------------------------------------------------------
    async def _dispatch_loop(self, conn: WorkerConnection) -> None:
        model = conn.hello.model_name
        backoff = 0.0
        while True:
            if conn.credits <= 0 or not conn.weights_ready:  # no credits, or behind its model's weights
                conn.credit_event.clear()
                await conn.credit_event.wait()
                continue
            try:
                items = await self.queue.claim(
                    model, conn.id, conn.credits, timeout_s=1.0, capacity=conn.hello.capacity
                )
                backoff = 0.0
            except Exception as exc:  # a slow or restarting Redis: wait and claim again
                backoff = min(max(backoff * 2, 0.1), 2.0)
                log.warning("worker %s: claiming work failed (%s); retrying in %.1fs", conn.id, exc, backoff)
                await asyncio.sleep(backoff)
                continue
            for item in items:
                if item.message_id in conn.inflight:  # a duplicate delivery of work we hold
                    with contextlib.suppress(Exception):  # unacked, the reaper finds it held here
                        await self.queue.ack(item)
                    continue
                # Registered before any await, so that recovery sees it if the worker drops now.
                conn.inflight[item.message_id] = InFlight(item, next_index=0)
                conn.credits -= 1
            await _side_by_side(functools.partial(self._dispatch_item, conn), items)

    async def _dispatch_item(self, conn: WorkerConnection, item: WorkItem) -> None:
        inflight = conn.inflight.get(item.message_id)
        if inflight is None or inflight.item is not item:
            return
        try:
            # the database away: wait for it, holding the item (heartbeats keep it claimed)
            sent = await until_available(
                functools.partial(self._dispatch, conn, inflight),
                f"worker {conn.id}: dispatching {item.message_id}",
            )
        except WorkerGone:
            raise  # the worker is gone: recovery requeues what it held
        except Exception as exc:
            log.warning("worker %s: dispatching %s failed: %s", conn.id, item.message_id, exc)
            sent = False
            await self.recovery.requeue_when_back(item)
        if not sent:
            conn.inflight.pop(item.message_id, None)
            conn.credits += 1

    async def _dispatch(self, conn: WorkerConnection, inflight: InFlight) -> bool:
        """Send the work frame; False if the item needed no work (it has been acked)."""
        item = inflight.item
        work = await self.source.load(item)
        if work is None:
            await self.queue.ack(item)  # finished, deleted or superseded: nothing to do
            return False
        if work.failures >= self.settings.max_attempts or item.deliveries > self.settings.max_attempts:
            error = f"gave up after {work.failures} failed attempts (of {item.attempt})"
            await self.recovery.give_up(item, ErrorCode.too_many_attempts, error)
            return False
        if not await self.store.start(work.message_id, item.attempt, conn.id):
            await self.queue.ack(item)
            return False
        # only a retry can find tokens of an earlier attempt in the stream
        resume = await self._resume_state(work.message_id, conn) if item.attempt > 1 else None
        if item.attempt > 1 and resume is None:  # nothing to resume from: readers may hold lost tokens
            await self.streams.restart(work.message_id, 0, item.attempt)
        if item.attempt == 1:
            self.metrics.queue_wait.labels(item.model).observe(seconds_since(work.created_at))
            outcome = "unrouted" if not item.lane else "preferred" if item.lane == conn.id else "handed_over"
            self.metrics.routing.labels(item.model, outcome).inc()
        inflight.timer = StreamTimer(None if resume else work.created_at)
        seed = work.params.seed
        if seed is None and FEATURE_UNSEEDED not in conn.hello.features:
            seed = secrets.randbelow(2**63)  # a worker from before D17 needs one: any will do
        frame = work.frame(conn.hello.model_name, item.attempt, seed, resume)
        inflight.next_index = len(resume.token_ids) if resume else 0
        inflight.streamed = list(resume.token_ids) if resume else []
        inflight.work = work
        await conn.send(frame)
        return True

    async def _resume_state(self, message_id: str, conn: WorkerConnection) -> ResumeState | None:
        """Tokens an earlier attempt already streamed, to be continued rather than redone."""
        ids: list[int] = []
        lps: list[float | None] = []
        texts: list[str] = []
        spans: list[tuple[int, int]] = []  # the weights version of each token, as [start, version]
        entries = await self.streams.read(message_id, -1, timeout_s=0)
        for e in entries:
            if isinstance(e, TokenBatch):
                if e.start > len(ids):  # the stream lost its beginning (a Redis restart): start over
                    return None
                skip = len(ids) - e.start
                if skip < len(e.token_ids) and (not spans or spans[-1][1] != e.policy_version):
                    spans.append((len(ids), e.policy_version))
                ids += e.token_ids[skip:]
                lps += e.logprobs[skip:]
                texts += e.texts[skip:]
        if not ids:
            return None
        return ResumeState(
            compat_hash=conn.hello.compat_hash, token_ids=ids, logprobs=lps, texts=texts, policy_versions=spans
        )

    # ---- frames from the worker --------------------------------------------------------------
    def _current(self, conn: WorkerConnection, message_id: str, attempt: int) -> InFlight | None:
        inflight = conn.inflight.get(message_id)
        if inflight is None or inflight.item.attempt != attempt:
            log.info("dropping frame of stale attempt %d for %s", attempt, message_id)
            return None
        return inflight

    async def _on_tokens_many(self, conn: WorkerConnection, frames: list[Tokens]) -> None:
        """Append the frames' tokens in one round trip; a message's consecutive frames (engine steps
        queued while the previous append ran) become one batch, joined once."""
        items: list[tuple[Tokens, InFlight, list[TokenBatch]]] = []
        last: dict[str, int] = {}  # message id -> index in items of its latest run of batches
        for f in frames:
            inflight = self._current(conn, f.message_id, f.attempt)
            if inflight is None:
                continue
            k = last.get(f.message_id)
            run = items[k][2] if k is not None and items[k][1] is inflight else None  # this attempt's
            prev = run[-1] if run else None
            batch = token_batch(f, prev.end if prev is not None else len(inflight.streamed), conn.hello.vocab_size)
            if batch is None:
                continue
            if isinstance(batch, str):
                await self.recovery.reject_attempt(conn, inflight, batch)
            elif conn.inflight.get(f.message_id) is inflight:
                if run is not None and prev is not None and batch.start == prev.end and joins(prev, batch):
                    run.append(batch)
                else:
                    last[f.message_id] = len(items)
                    items.append((f, inflight, [batch]))
        if not items:
            return
        batches = [_joined(run) for _, _, run in items]
        appends = [(f.message_id, b) for (f, _, _), b in zip(items, batches, strict=True)]
        results = await self.streams.append_many(appends)
        now = time.monotonic()
        counted: dict[str, int] = {}  # tokens per model: one counter increment each
        for (frame, inflight, _), batch, conflict in zip(items, batches, results, strict=True):
            if conflict is None:
                inflight.next_index = batch.end
                del inflight.streamed[batch.start :]
                inflight.streamed += batch.token_ids
                if inflight.timer is not None:
                    model = inflight.item.model
                    inflight.timer.tokens(self.metrics.model_series(model), len(batch.token_ids), now)
                    counted[model] = counted.get(model, 0) + len(batch.token_ids)
            else:
                log.warning("rejected tokens %d.. of %s (%s)", frame.start, frame.message_id, conflict)
        for model, count in counted.items():
            self.metrics.model_series(model).tokens.inc(count)

    async def _on_finished(self, conn: WorkerConnection, frame: FinishedFrame) -> None:
        inflight = self._current(conn, frame.message_id, frame.attempt)
        if inflight is None:
            return
        record = record_without_nul(frame.record)
        problem = record_problem(record, inflight.streamed, conn.hello.vocab_size)
        if problem is not None:
            await self.recovery.reject_attempt(conn, inflight, problem)
            return
        # Readers must see every stored token: stream whatever the worker did not send as frames.
        work = inflight.work
        tail = inflight.next_index
        if tail < len(record.completion_ids):
            offsets = [0, *record.text_offsets]
            texts = [
                record.completion_text[offsets[i] : offsets[i + 1]] for i in range(tail, len(record.completion_ids))
            ]
            # The record keeps no per-token channels: a chat reply's readers take these tokens' text from
            # the stored content and reasoning when the message ends (ReplyStream.finish), rather than
            # streaming reasoning or tool-call markup as content.
            chat = work is not None and work.params.raw_prompt is None
            channels = CHANNEL_HIDDEN * len(texts) if chat else ""
            with contextlib.suppress(StreamConflict):
                await self.streams.append(
                    frame.message_id,
                    TokenBatch(tail, record.completion_ids[tail:], record.logprobs[tail:], texts, channels),
                )
        stored = await self.store.store(
            frame.message_id,
            frame.attempt,
            record,
            parent_chain=work.parent_chain if work is not None else None,
            chain_known=work is not None,
        )
        conn.inflight.pop(frame.message_id, None)
        if stored and record.finish_reason == "abort" and await self.store.is_cancelled_or_deleted(frame.message_id):
            await self.recovery.finish_cancelled(frame.message_id)
        elif stored:
            if work is not None and record.finish_reason != "abort":
                key = reply_chain_hash(work.parent_chain, record)
                self.source.finished(work, record, key, conn.id)
                self.finished.put(work.stored(record, stored, frame.attempt, conn.id, key))
            self.metrics.finished.labels(MessageState.complete.value).inc()
            if record.num_cached_tokens is not None:
                self.metrics.prompt_tokens.labels(conn.hello.model_name).inc(len(record.prompt_ids))
                self.metrics.cached_prompt_tokens.labels(conn.hello.model_name).inc(record.num_cached_tokens)
            conn.served += 1
            await self.streams.finish(frame.message_id, StreamDone("complete"))
        elif await self.store.is_cancelled_or_deleted(frame.message_id):  # cancelled, record refused: readers still end
            await self.recovery.finish_cancelled(frame.message_id)
        elif await self.store.completed_at(frame.message_id, frame.attempt):
            # stored by an earlier try whose answer was lost (the database or Redis went away after it)
            await self.streams.finish(frame.message_id, StreamDone("complete"))
        await self.queue.ack(inflight.item)

    async def _on_failed(self, conn: WorkerConnection, frame: FailedFrame) -> None:
        inflight = self._current(conn, frame.message_id, frame.attempt)
        if inflight is None:
            return
        conn.inflight.pop(frame.message_id, None)
        if frame.retryable:
            await self.recovery.requeue(inflight.item, failed=True)
        else:
            await self.recovery.give_up(inflight.item, frame.code, frame.message)


def _joined(run: list[TokenBatch]) -> TokenBatch:
    joined = concatenated(run)
    assert joined is not None  # a run holds batches that join
    return joined
