"""The worker websocket's hub (DESIGN D3, D5, D10).

One session per connected worker runs three loops: receive frames, dispatch queued work while the
worker has credits, and send heartbeats (which also keep the worker's directory entry and claimed
queue items alive). When a worker goes away, ``Recovery`` fences each message it held with a new
attempt and requeues it; tokens it already streamed stay in the message's token stream and the next
worker resumes after them, so readers see one continuous stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from server.chats.finished import RecentlyFinished
from server.chats.path_cache import PathCache
from server.chats.work_store import WorkStore, reply_chain_hash
from server.db import SessionFactory
from server.metrics import Metrics, StreamTimer, seconds_since
from server.queue.protocol import WorkerDirectory, WorkQueue
from server.settings import ServerSettings
from server.streams.protocol import StreamConflict, StreamDone, TokenBatch, TokenStreams
from server.workers.connection import (
    CLOSE_BAD_FRAME,
    CLOSE_INVALID_KEY,
    CLOSE_PROTOCOL,
    REVOKED,
    InFlight,
    WorkerConnection,
    bearer,
    key_revoked,
    new_worker_id,
    refuse,
    worker_key,
)
from server.workers.ingest import record_problem, record_without_nul, token_batch
from server.workers.recovery import Recovery
from server.workers.rpc import RpcFailed, RpcUnavailable, WorkerRpc
from server.workers.work_source import WorkSource
from shared.api import MessageState
from shared.errors import ErrorCode
from shared.protocol import (
    FEATURE_BATCH,
    FEATURE_DRAIN,
    FEATURE_UNSEEDED,
    PROTOCOL_VERSION,
    CreditFrame,
    DrainFrame,
    FailedFrame,
    FinishedFrame,
    HeartbeatFrame,
    HelloFrame,
    ResumeState,
    RpcResultFrame,
    TokensFrame,
    WelcomeFrame,
    WorkerFrame,
    worker_batch_adapter,
    worker_frame_adapter,
)

log = logging.getLogger(__name__)


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
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.queue = queue
        self.directory = directory
        self.streams = streams
        self.metrics = metrics
        self.store = WorkStore(sessions)
        self.source = WorkSource(self.store, paths)
        self.finished = RecentlyFinished()  # replies stored here a moment ago, for their readers
        self.connections: dict[str, WorkerConnection] = {}
        self.server_id = secrets.token_hex(4)
        self.rpc = WorkerRpc(self.connections, directory, self.server_id)
        self.recovery = Recovery(
            settings, self.store, queue, directory, streams, self.metrics, self.connections, self.server_id
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.recovery.start()
        self.rpc.start()

    async def stop(self) -> None:
        await self.rpc.stop()
        await self.recovery.stop()
        for conn in list(self.connections.values()):
            with contextlib.suppress(Exception):
                await conn.ws.close(code=1001)

    # ---- connection ------------------------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        key = bearer(ws.headers.get("authorization", ""))
        wkey = await worker_key(self.sessions, key) if key else None
        if wkey is None:
            await refuse(ws, ErrorCode.invalid_worker_key, "unknown or revoked worker key", CLOSE_INVALID_KEY)
            return
        try:
            raw = await asyncio.wait_for(ws.receive_text(), timeout=30)
            hello = worker_frame_adapter.validate_json(raw)
        except (TimeoutError, ValidationError, WebSocketDisconnect) as exc:
            await refuse(ws, ErrorCode.bad_frame, f"expected a hello frame: {exc}", CLOSE_BAD_FRAME)
            return
        if not isinstance(hello, HelloFrame):
            await refuse(ws, ErrorCode.bad_frame, "the first frame must be hello", CLOSE_BAD_FRAME)
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            await refuse(
                ws,
                ErrorCode.protocol_version_mismatch,
                f"server speaks protocol {PROTOCOL_VERSION}, worker {hello.protocol_version}",
                CLOSE_PROTOCOL,
            )
            return
        conn = WorkerConnection(id=new_worker_id(self.server_id), hello=hello, ws=ws, key=wkey)
        if hello.released:
            await self._take_released(hello)
        self.connections[conn.id] = conn
        await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
        log.info("worker %s connected: model=%s capacity=%d", conn.id, hello.model_name, hello.capacity)
        try:
            await conn.send(
                WelcomeFrame(
                    worker_id=conn.id,
                    heartbeat_interval_s=self.settings.worker_heartbeat_interval_s,
                    features=[FEATURE_BATCH, FEATURE_DRAIN],
                )
            )
            async with asyncio.TaskGroup() as tg:
                recv = tg.create_task(self._receive(conn))
                disp = tg.create_task(self._dispatch_loop(conn))
                beat = tg.create_task(self._heartbeat(conn))
                await recv  # returns when the worker goes away
                disp.cancel()
                beat.cancel()
        except* (WebSocketDisconnect, RuntimeError, ConnectionError) as eg:
            log.info("worker %s disconnected: %s", conn.id, eg.exceptions[0])
        except* Exception as eg:  # a bug, not a transient fault (those are retried in the loops)
            log.error("worker %s session failed", conn.id, exc_info=eg.exceptions[0])
        finally:
            self.connections.pop(conn.id, None)
            for call in conn.calls.values():
                if not call.done():
                    call.set_exception(RpcUnavailable(f"worker {conn.id} went away"))
            try:
                await self.directory.unregister(conn.id)
            except Exception as exc:  # the entry expires on its own
                log.warning("could not unregister worker %s: %s", conn.id, exc)
            await asyncio.shield(self.recovery.recover_all(conn))

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
                await refuse(conn.ws, ErrorCode.invalid_worker_key, REVOKED, CLOSE_INVALID_KEY)
                closed += 1
        return closed

    def load(self) -> dict[str, tuple[int, int]]:
        """Per model: the workers connected to this process and their free slots (credits)."""
        local: dict[str, tuple[int, int]] = {}
        for conn in list(self.connections.values()):
            count, free = local.get(conn.hello.model_name, (0, 0))
            local[conn.hello.model_name] = (count + 1, free + max(conn.credits, 0))
        return local

    async def _receive(self, conn: WorkerConnection) -> None:
        while True:
            try:
                raw = await asyncio.wait_for(conn.ws.receive_text(), timeout=self.settings.worker_timeout_s)
            except TimeoutError:
                log.warning("worker %s silent for %.0fs: dropping it", conn.id, self.settings.worker_timeout_s)
                with contextlib.suppress(Exception):
                    await conn.ws.close(code=1011)
                return
            except WebSocketDisconnect:
                return
            conn.last_seen = time.monotonic()
            try:
                # a JSON array: the frames of one engine step (FEATURE_BATCH), tokens appended at once
                frames = worker_batch_adapter.validate_json(raw) if raw.startswith("[") else None
                frame = worker_frame_adapter.validate_json(raw) if frames is None else None
            except ValidationError as exc:
                log.warning("worker %s sent a bad frame: %s", conn.id, exc)
                continue
            if frames is not None:
                await self._on_batch(conn, frames)
            elif frame is not None:
                await self._on_frame(conn, frame)

    async def _on_batch(self, conn: WorkerConnection, frames: list[WorkerFrame]) -> None:
        tokens = [f for f in frames if isinstance(f, TokensFrame)]
        if tokens:
            try:
                await self._on_tokens_many(conn, tokens)
            except Exception as exc:  # appended later from the finished records (positions did not advance)
                log.warning("worker %s: appending %d token frames failed: %s", conn.id, len(tokens), exc)
        for frame in frames:
            if not isinstance(frame, TokensFrame):
                await self._on_frame(conn, frame)

    async def _on_frame(self, conn: WorkerConnection, frame: WorkerFrame) -> None:
        if isinstance(frame, CreditFrame):
            if not conn.draining:
                conn.credits += frame.credits
                conn.credit_event.set()
        elif isinstance(frame, DrainFrame):
            log.info("worker %s is draining (%d messages in hand)", conn.id, len(conn.inflight))
            conn.draining = True
            conn.credits = 0
        elif isinstance(frame, TokensFrame | FinishedFrame | FailedFrame):
            await self._handle(conn, frame)
        elif isinstance(frame, RpcResultFrame):
            call = conn.calls.get(frame.id)
            if call is not None and not call.done():
                if frame.result is not None:
                    call.set_result(frame.result)
                else:
                    call.set_exception(RpcFailed(frame.code or "engine_error", frame.message or "rpc failed"))

    async def _handle(self, conn: WorkerConnection, frame: TokensFrame | FinishedFrame | FailedFrame) -> None:
        """One message frame. A transient failure (Redis or the database briefly away) costs that
        frame, never the session: tokens not appended are appended from the finished record (the
        stream position does not advance), and a message whose end could not be stored is requeued."""
        try:
            if isinstance(frame, TokensFrame):
                await self._on_tokens_many(conn, [frame])
            elif isinstance(frame, FinishedFrame):
                await self._on_finished(conn, frame)
            else:
                await self._on_failed(conn, frame)
        except Exception as exc:
            log.warning("worker %s: handling %s of %s failed: %s", conn.id, frame.type, frame.message_id, exc)
            if isinstance(frame, FinishedFrame | FailedFrame):
                inflight = conn.inflight.pop(frame.message_id, None)
                if inflight is not None:
                    with contextlib.suppress(Exception):  # else the reaper reclaims it
                        await self.recovery.requeue(inflight.item, failed=True)  # bounded: it may be the record

    async def _heartbeat(self, conn: WorkerConnection) -> None:
        while True:
            await asyncio.sleep(self.settings.worker_heartbeat_interval_s)
            await conn.send(HeartbeatFrame())
            try:
                if await key_revoked(self.sessions, conn):
                    log.warning("worker %s: its key was revoked; closing", conn.id)
                    await refuse(conn.ws, ErrorCode.invalid_worker_key, REVOKED, CLOSE_INVALID_KEY)
                    return
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
            if conn.credits <= 0:
                conn.credit_event.clear()
                await conn.credit_event.wait()
                continue
            try:
                items = await self.queue.claim(model, conn.id, conn.credits, timeout_s=1.0)
                backoff = 0.0
            except Exception as exc:  # a slow or restarting Redis: wait and claim again
                backoff = min(max(backoff * 2, 0.1), 2.0)
                log.warning("worker %s: claiming work failed (%s); retrying in %.1fs", conn.id, exc, backoff)
                await asyncio.sleep(backoff)
                continue
            for item in items:
                if item.message_id in conn.inflight:  # a duplicate delivery of work we hold
                    await self.queue.ack(item)
                    continue
                # Registered before any await, so that recovery sees it if the worker drops now.
                conn.inflight[item.message_id] = InFlight(item, next_index=0)
                conn.credits -= 1
            for item in items:
                inflight = conn.inflight.get(item.message_id)
                if inflight is None or inflight.item is not item:
                    continue
                try:
                    sent = await self._dispatch(conn, inflight)
                except (WebSocketDisconnect, RuntimeError, ConnectionError):
                    raise  # the worker is gone: recovery requeues what it held
                except Exception as exc:
                    log.warning("worker %s: dispatching %s failed: %s", conn.id, item.message_id, exc)
                    sent = False
                    with contextlib.suppress(Exception):  # else the reaper reclaims it
                        await self.recovery.requeue(item)
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
        if item.attempt == 1:
            self.metrics.queue_wait.labels(item.model).observe(seconds_since(work.created_at))
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
        entries = await self.streams.read(message_id, -1, timeout_s=0)
        for e in entries:
            if isinstance(e, TokenBatch):
                skip = len(ids) - e.start
                ids += e.token_ids[skip:]
                lps += e.logprobs[skip:]
                texts += e.texts[skip:]
        if not ids:
            return None
        return ResumeState(compat_hash=conn.hello.compat_hash, token_ids=ids, logprobs=lps, texts=texts)

    # ---- frames from the worker --------------------------------------------------------------
    def _current(self, conn: WorkerConnection, message_id: str, attempt: int) -> InFlight | None:
        inflight = conn.inflight.get(message_id)
        if inflight is None or inflight.item.attempt != attempt:
            log.info("dropping frame of stale attempt %d for %s", attempt, message_id)
            return None
        return inflight

    async def _on_tokens_many(self, conn: WorkerConnection, frames: list[TokensFrame]) -> None:
        """Append the frames' tokens in one round trip (one engine step of the worker)."""
        items: list[tuple[TokensFrame, InFlight, TokenBatch]] = []
        for f in frames:
            inflight = self._current(conn, f.message_id, f.attempt)
            batch = token_batch(f, len(inflight.streamed), conn.hello.vocab_size) if inflight is not None else None
            if inflight is None or batch is None:
                continue
            if isinstance(batch, str):
                await self.recovery.reject_attempt(conn, inflight, batch)
            elif conn.inflight.get(f.message_id) is inflight:
                items.append((f, inflight, batch))
        if not items:
            return
        results = await self.streams.append_many([(f.message_id, batch) for f, _, batch in items])
        for (frame, inflight, batch), conflict in zip(items, results, strict=True):
            if conflict is None:
                inflight.next_index = batch.end
                del inflight.streamed[batch.start :]
                inflight.streamed += batch.token_ids
                if inflight.timer is not None:
                    inflight.timer.tokens(self.metrics, inflight.item.model, len(batch.token_ids))
            else:
                log.warning("rejected tokens %d.. of %s (%s)", frame.start, frame.message_id, conflict)

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
        tail = inflight.next_index
        if tail < len(record.completion_ids):
            offsets = [0, *record.text_offsets]
            texts = [
                record.completion_text[offsets[i] : offsets[i + 1]] for i in range(tail, len(record.completion_ids))
            ]
            with contextlib.suppress(StreamConflict):
                await self.streams.append(
                    frame.message_id,
                    TokenBatch(tail, record.completion_ids[tail:], record.logprobs[tail:], texts),
                )
        work = inflight.work
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
                self.source.finished(work, record, key)
                self.finished.put(work.stored(record, stored, frame.attempt, conn.id, key))
            self.metrics.finished.labels(MessageState.complete.value).inc()
            await self.streams.finish(frame.message_id, StreamDone("complete"))
        elif await self.store.is_cancelled_or_deleted(frame.message_id):  # cancelled, record refused: readers still end
            await self.recovery.finish_cancelled(frame.message_id)
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
