"""The server side of the worker websocket (DESIGN D3, D5, D10).

One ``WorkerConnection`` per connected worker runs three loops: receive frames, dispatch queued
work while the worker has credits, and send heartbeats (which also keep the worker's directory
entry and claimed queue items alive). When a worker goes away, each message it held is fenced
with a new attempt and re-queued; tokens it already streamed stay in the message's token stream
and the next worker resumes after them, so readers see one continuous stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from sqlalchemy import select

from server.auth import hash_key
from server.db import SessionFactory
from server.errors import is_unavailable
from server.metrics import Metrics, StreamTimer, seconds_since
from server.models import WorkerKey, utcnow
from server.queue.protocol import QueueFull, WorkerDirectory, WorkerEntry, WorkItem, WorkQueue
from server.queue.rpc_relay import RedisRpcRelay, RelayError, RelayTimeout
from server.settings import ServerSettings
from server.streams.protocol import StreamConflict, StreamDone, TokenBatch, TokenStreams
from server.work_store import WorkStore
from shared.api import MessageState
from shared.errors import ErrorCode
from shared.protocol import (
    FEATURE_BATCH,
    FEATURE_DRAIN,
    FEATURE_RPC,
    PROTOCOL_VERSION,
    CancelFrame,
    CreditFrame,
    DrainFrame,
    ErrorFrame,
    FailedFrame,
    FinishedFrame,
    GenerationRecord,
    HeartbeatFrame,
    HelloFrame,
    RawPrompt,
    ResumeState,
    RpcFrame,
    RpcMethod,
    RpcResultFrame,
    TokensFrame,
    WelcomeFrame,
    WorkerFrame,
    WorkFrame,
    worker_batch_adapter,
    worker_frame_adapter,
)

log = logging.getLogger(__name__)

CLOSE_INVALID_KEY = 4401
CLOSE_PROTOCOL = 4426
CLOSE_BAD_FRAME = 4400


class RpcUnavailable(Exception):
    """No worker connected to this server process can answer a tokenizer call for the model."""


class RpcFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class InFlight:
    item: WorkItem
    next_index: int  # index the next tokens frame must start at
    parent_chain: str | None = None  # the parent's chain hash (prefix index), known once dispatched
    chain_known: bool = False
    streamed: list[int] = field(default_factory=list)  # token ids readers have seen (resumed ones too)
    timer: StreamTimer | None = None  # latency metrics, from dispatch on


@dataclass
class WorkerConnection:
    id: str
    hello: HelloFrame
    ws: WebSocket
    credits: int = 0
    credit_event: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)  # rpc id -> answer
    draining: bool = False  # the worker is shutting down: no more work for it
    key: WorkerKey | None = None  # the key it connected with

    async def send(
        self, frame: WorkFrame | HeartbeatFrame | WelcomeFrame | ErrorFrame | RpcFrame | CancelFrame
    ) -> None:
        async with self.send_lock:
            await self.ws.send_text(frame.model_dump_json())

    def entry(self, server_id: str) -> WorkerEntry:
        h = self.hello
        return WorkerEntry(
            self.id,
            h.model_name,
            h.compat_hash,
            h.engine,
            h.max_context,
            h.capacity,
            server_id,
            self.rpc,
            inflight=len(self.inflight),
            last_seen=time.time() - (time.monotonic() - self.last_seen),
            key_id=self.key.id if self.key else "",
            key_name=self.key.name if self.key else "",
        )

    @property
    def rpc(self) -> bool:
        return FEATURE_RPC in self.hello.features


class WorkerHub:
    def __init__(
        self,
        settings: ServerSettings,
        sessions: SessionFactory,
        queue: WorkQueue,
        directory: WorkerDirectory,
        streams: TokenStreams,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.queue = queue
        self.directory = directory
        self.streams = streams
        self.store = WorkStore(sessions)
        self.connections: dict[str, WorkerConnection] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.swept = 0  # messages the sweep requeued (tests and logs)
        self.server_id = secrets.token_hex(4)
        self.relay: RedisRpcRelay | None = None  # tokenizer calls to workers of other server processes
        self.metrics = Metrics()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="tokentrail-reaper")
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="tokentrail-sweeper")
        if self.relay is not None:
            self.relay.start(self._relayed)

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.stop()
        for task in (self._reaper, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for conn in list(self.connections.values()):
            with contextlib.suppress(Exception):
                await conn.ws.close(code=1001)

    # ---- connection ------------------------------------------------------------------------
    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        key = _bearer(ws.headers.get("authorization", ""))
        worker_key = await self._key(key) if key else None
        if worker_key is None:
            await _refuse(ws, ErrorCode.invalid_worker_key, "unknown or revoked worker key", CLOSE_INVALID_KEY)
            return
        try:
            raw = await asyncio.wait_for(ws.receive_text(), timeout=30)
            hello = worker_frame_adapter.validate_json(raw)
        except (TimeoutError, ValidationError, WebSocketDisconnect) as exc:
            await _refuse(ws, ErrorCode.bad_frame, f"expected a hello frame: {exc}", CLOSE_BAD_FRAME)
            return
        if not isinstance(hello, HelloFrame):
            await _refuse(ws, ErrorCode.bad_frame, "the first frame must be hello", CLOSE_BAD_FRAME)
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            await _refuse(
                ws,
                ErrorCode.protocol_version_mismatch,
                f"server speaks protocol {PROTOCOL_VERSION}, worker {hello.protocol_version}",
                CLOSE_PROTOCOL,
            )
            return
        conn = WorkerConnection(id=f"w-{self.server_id}-{secrets.token_hex(6)}", hello=hello, ws=ws, key=worker_key)
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
            await asyncio.shield(self._recover_all(conn))

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

    async def _key(self, key: str) -> WorkerKey | None:
        """The unrevoked worker key, if it is one."""
        async with self.sessions() as s:
            return await s.scalar(
                select(WorkerKey).where(WorkerKey.key_hash == hash_key(key), WorkerKey.revoked_at.is_(None))
            )

    async def _key_revoked(self, conn: WorkerConnection) -> bool:
        if conn.key is None:
            return False
        async with self.sessions() as s:
            revoked_at = await s.scalar(select(WorkerKey.revoked_at).where(WorkerKey.id == conn.key.id))
        return revoked_at is not None

    async def disconnect_key(self, key_id: str) -> int:
        """Close this process's connections made with a key that was just revoked (other processes
        notice at their next heartbeat). Their work is requeued as for any lost worker."""
        closed = 0
        for conn in list(self.connections.values()):
            if conn.key is not None and conn.key.id == key_id:
                await _refuse(conn.ws, ErrorCode.invalid_worker_key, _REVOKED, CLOSE_INVALID_KEY)
                closed += 1
        return closed

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
                await self._on_tokens(conn, frame)
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
                        await self._requeue(inflight.item, failed=True)  # bounded: it may be the record

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
            and await self._cancel_on_worker(worker_id, message_id, attempt)
        ):
            return True  # the worker's abort record ends the stream (_on_finished)
        await self._finish_cancelled(message_id)
        return True

    async def _cancel_on_worker(self, worker_id: str, message_id: str, attempt: int) -> bool:
        if worker_id in self.connections:
            return await self._cancel_local(worker_id, message_id, attempt)
        server_id = worker_id.split("-")[1] if worker_id.count("-") >= 2 else ""
        if self.relay is None or not server_id:
            return False
        params = {"worker_id": worker_id, "message_id": message_id, "attempt": attempt}
        try:
            answer = await self.relay.request(server_id, "", "cancel", params, timeout_s=5.0)
        except (RelayError, RelayTimeout) as exc:
            log.warning("cancel of %s could not reach server %s: %s", message_id, server_id, exc)
            return False
        return bool(answer.get("sent"))

    async def _cancel_local(self, worker_id: str, message_id: str, attempt: int) -> bool:
        conn = self.connections.get(worker_id)
        inflight = conn.inflight.get(message_id) if conn is not None else None
        if conn is None or inflight is None or inflight.item.attempt != attempt:
            return False
        try:
            await conn.send(CancelFrame(message_id=message_id, attempt=attempt))
        except Exception:
            return False
        return True

    async def _finish_cancelled(self, message_id: str) -> None:
        await self.streams.finish(
            message_id, StreamDone("error", error="cancelled by the user", code=ErrorCode.cancelled.value)
        )

    # ---- tokenizer calls ---------------------------------------------------------------------
    async def call(
        self, model: str, method: RpcMethod, params: dict[str, Any], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Tokenizer work on a worker of ``model``: one connected here (the least busy), else through
        the relay on a server process that has one."""
        if any(c.rpc and c.hello.model_name == model for c in self.connections.values()):
            return await self._call_local(model, method, params, timeout_s)
        if self.relay is not None:
            servers = {
                e.server_id
                for e in await self.directory.workers()
                if e.model_name == model and e.rpc and e.server_id and e.server_id != self.server_id
            }
            if servers:
                try:
                    return await self.relay.request(secrets.choice(sorted(servers)), model, method, params, timeout_s)
                except RelayTimeout as exc:
                    raise RpcUnavailable(str(exc)) from exc
                except RelayError as exc:
                    if exc.code == ErrorCode.no_worker.value:
                        raise RpcUnavailable(str(exc)) from exc
                    raise RpcFailed(exc.code, str(exc)) from exc
        raise RpcUnavailable(f"no worker that answers tokenizer calls serves {model} now")

    async def _relayed(self, model: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A call another server process relayed here."""
        if method == "cancel":
            sent = await self._cancel_local(str(params["worker_id"]), str(params["message_id"]), int(params["attempt"]))
            return {"sent": sent}
        if method not in ("tokenize", "render_chat", "detokenize"):
            raise RelayError(ErrorCode.bad_request.value, f"unknown method {method!r}")
        try:
            return await self._call_local(model, method, params, 30.0)  # type: ignore[arg-type]
        except RpcUnavailable as exc:
            raise RelayError(ErrorCode.no_worker.value, str(exc)) from exc
        except RpcFailed as exc:
            raise RelayError(exc.code, str(exc)) from exc

    async def _call_local(
        self, model: str, method: RpcMethod, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        conns = [c for c in self.connections.values() if c.hello.model_name == model and c.rpc]
        if not conns:
            raise RpcUnavailable(f"no worker of {model} that answers tokenizer calls is connected here")
        conn = min(conns, key=lambda c: len(c.inflight) + len(c.calls))
        call_id = secrets.token_hex(8)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.calls[call_id] = answer
        try:
            await conn.send(RpcFrame(id=call_id, method=method, params=params))
            return await asyncio.wait_for(answer, timeout=timeout_s)
        except TimeoutError as exc:
            raise RpcUnavailable(f"worker {conn.id} did not answer within {timeout_s:.0f}s") from exc
        except (WebSocketDisconnect, RuntimeError, ConnectionError) as exc:
            raise RpcUnavailable(f"worker {conn.id} went away") from exc
        finally:
            conn.calls.pop(call_id, None)

    async def _heartbeat(self, conn: WorkerConnection) -> None:
        while True:
            await asyncio.sleep(self.settings.worker_heartbeat_interval_s)
            await conn.send(HeartbeatFrame())
            try:
                if await self._key_revoked(conn):
                    log.warning("worker %s: its key was revoked; closing", conn.id)
                    await _refuse(conn.ws, ErrorCode.invalid_worker_key, _REVOKED, CLOSE_INVALID_KEY)
                    return
                await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
                if conn.inflight:
                    await self.queue.touch([f.item for f in conn.inflight.values()], conn.id)
            except Exception as exc:  # refreshed at the next beat; entries outlive several beats
                log.warning("worker %s: heartbeat bookkeeping failed: %s", conn.id, exc)

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
                        await self._requeue(item)
                if not sent:
                    conn.inflight.pop(item.message_id, None)
                    conn.credits += 1

    async def _dispatch(self, conn: WorkerConnection, inflight: InFlight) -> bool:
        """Send the work frame; False if the item needed no work (it has been acked)."""
        item = inflight.item
        loaded = await self.store.load(item.message_id)
        if loaded is None or not self.store.is_open(loaded[0], item.attempt):
            await self.queue.ack(item)  # finished, deleted or superseded: nothing to do
            return False
        msg, path = loaded
        if msg.failures >= self.settings.max_attempts or item.deliveries > self.settings.max_attempts:
            error = f"gave up after {msg.failures} failed attempts (of {item.attempt})"
            await self._give_up(item, ErrorCode.too_many_attempts, error)
            return False
        if not await self.store.start(msg.id, item.attempt, conn.id):
            await self.queue.ack(item)
            return False
        resume = await self._resume_state(msg.id, conn)
        if item.attempt == 1:
            self.metrics.queue_wait.labels(item.model).observe(seconds_since(msg.created_at))
        inflight.timer = StreamTimer(None if resume else msg.created_at)
        params = self.store.work_parameters(msg)
        frame = WorkFrame(
            message_id=msg.id,
            attempt=item.attempt,
            chat_id=msg.chat_id,
            model_name=conn.hello.model_name,
            messages=self.store.work_messages(path, params),
            sampling=params.sampling_parameters,
            seed=params.seed,
            tools=params.tools,
            prior=None if params.raw_prompt else await self.store.prior_chain(path),
            resume=resume,
            template_kwargs=params.template_kwargs,
            raw=RawPrompt.model_validate(params.raw_prompt) if params.raw_prompt else None,
            client_prompt_ids=params.client_prompt_ids,
            required_prefix_ids=params.required_prefix_ids,
        )
        inflight.next_index = len(resume.token_ids) if resume else 0
        inflight.streamed = list(resume.token_ids) if resume else []
        inflight.parent_chain, inflight.chain_known = (path[-1].chain_hash if path else None), True
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

    def _token_batch(self, conn: WorkerConnection, frame: TokensFrame) -> tuple[InFlight, TokenBatch | str] | None:
        """The stream batch of a tokens frame of current work, or what is wrong with the frame;
        None for a stale or empty frame."""
        inflight = self._current(conn, frame.message_id, frame.attempt)
        if inflight is None or not frame.token_ids:
            return None
        n = len(frame.token_ids)
        channels = frame.channels or ""
        top = frame.top_logprobs
        if (
            len(frame.logprobs) != n
            or len(frame.texts) != n
            or (channels and len(channels) != n)
            or (top is not None and len(top) != n)
        ):
            return inflight, "a tokens frame with mismatched lengths"
        if frame.start > len(inflight.streamed):
            # an earlier frame was not appended (Redis briefly away): the finished record fills the gap
            log.info("tokens %d.. of %s follow a gap; left to the finished record", frame.start, frame.message_id)
            return None
        problem = token_problem(frame.token_ids, frame.logprobs, conn.hello.vocab_size)
        if problem is None and frame.prompt_ids is not None:
            problem = token_problem(frame.prompt_ids, [], conn.hello.vocab_size)
        if problem is not None:
            return inflight, problem
        prompt = frame.prompt_ids if frame.start == 0 else None
        texts = [without_nul(t) for t in frame.texts]
        return inflight, TokenBatch(frame.start, frame.token_ids, frame.logprobs, texts, channels, top, prompt)

    async def _on_tokens(self, conn: WorkerConnection, frame: TokensFrame) -> None:
        await self._on_tokens_many(conn, [frame])

    async def _on_tokens_many(self, conn: WorkerConnection, frames: list[TokensFrame]) -> None:
        """Append the frames' tokens in one round trip (one engine step of the worker)."""
        items: list[tuple[TokensFrame, InFlight, TokenBatch]] = []
        for f in frames:
            checked = self._token_batch(conn, f)
            if checked is None:
                continue
            inflight, batch = checked
            if isinstance(batch, str):
                await self._reject_attempt(conn, inflight, batch)
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
        problem = token_problem(record.completion_ids, record.logprobs, conn.hello.vocab_size) or token_problem(
            record.prompt_ids, [], conn.hello.vocab_size
        )
        if problem is None and record.completion_ids[: len(inflight.streamed)] != inflight.streamed:
            problem = "the finished record's tokens differ from the tokens it streamed"
        if problem is None and (
            len(record.logprobs) != len(record.completion_ids) or len(record.text_offsets) != len(record.completion_ids)
        ):
            problem = "the finished record's logprobs or text offsets do not match its tokens"
        if problem is not None:
            await self._reject_attempt(conn, inflight, problem)
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
        stored = await self.store.store(
            frame.message_id,
            frame.attempt,
            record,
            parent_chain=inflight.parent_chain,
            chain_known=inflight.chain_known,
        )
        conn.inflight.pop(frame.message_id, None)
        if stored and record.finish_reason == "abort" and await self.store.is_cancelled_or_deleted(frame.message_id):
            await self._finish_cancelled(frame.message_id)
        elif stored:
            self.metrics.finished.labels(MessageState.complete.value).inc()
            await self.streams.finish(frame.message_id, StreamDone("complete"))
        elif await self.store.is_cancelled_or_deleted(frame.message_id):  # cancelled, record refused: readers still end
            await self._finish_cancelled(frame.message_id)
        await self.queue.ack(inflight.item)

    async def _on_failed(self, conn: WorkerConnection, frame: FailedFrame) -> None:
        inflight = self._current(conn, frame.message_id, frame.attempt)
        if inflight is None:
            return
        conn.inflight.pop(frame.message_id, None)
        if frame.retryable:
            await self._requeue(inflight.item, failed=True)
        else:
            await self._give_up(inflight.item, frame.code, frame.message)

    # ---- recovery --------------------------------------------------------------------------
    async def _reject_attempt(self, conn: WorkerConnection, inflight: InFlight, problem: str) -> None:
        """A worker sent a bad frame for one message: end that attempt only (the worker is told to
        stop it) and requeue the message; the next attempt resumes after the tokens readers saw."""
        item = inflight.item
        log.warning("worker %s: bad frame for %s (attempt %d): %s", conn.id, item.message_id, item.attempt, problem)
        if conn.inflight.get(item.message_id) is not inflight:
            return
        conn.inflight.pop(item.message_id, None)
        with contextlib.suppress(Exception):
            await conn.send(CancelFrame(message_id=item.message_id, attempt=item.attempt))
        try:
            await self._requeue(item, failed=True)
        except Exception as exc:  # the reaper reclaims it
            log.warning("could not requeue %s: %s", item.message_id, exc)

    async def _requeue(self, item: WorkItem, *, failed: bool = False) -> None:
        """Hand the message to a new attempt (retry lane). ``failed``: its worker is to blame (a lost
        connection, a failure, bad frames), which counts toward ``max_attempts``; a dead server or a
        Redis restart does not."""
        attempt = await self.store.next_attempt(item.message_id, item.attempt, failed=failed)
        if attempt is None and await self.store.is_cancelled_or_deleted(item.message_id):
            await self._finish_cancelled(item.message_id)  # cancelled while its worker was lost
        if attempt is not None:
            try:
                await self.queue.enqueue(item.model, item.message_id, attempt, retry=True)
            except Exception as exc:  # Redis away: pending in SQL, enqueued when it is back
                log.warning("could not requeue %s now (%s); retrying in the background", item.message_id, exc)
                self.enqueue_later(item.model, item.message_id, attempt, retry=True)
                return
        await self.queue.ack(item)

    def enqueue_later(self, model: str, message_id: str, attempt: int, *, retry: bool = False) -> None:
        """Enqueue in the background, retrying while the queue (Redis) is away, for up to
        ``sweep_grace_s``; after that the sweep finds the message pending and not queued."""
        task = asyncio.create_task(self._enqueue_retrying(model, message_id, attempt, retry))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _enqueue_retrying(self, model: str, message_id: str, attempt: int, retry: bool) -> None:
        deadline = time.monotonic() + self.settings.sweep_grace_s
        delay = 0.2
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            try:
                await self.queue.enqueue(model, message_id, attempt, retry=retry)
                return
            except QueueFull:
                return  # the sweep fails it if the queue stays full
            except Exception:
                delay = min(delay * 2, 2.0)

    async def _give_up(self, item: WorkItem, code: ErrorCode | str, error: str) -> None:
        if await self.store.fail(item.message_id, None, code, error):
            self._count_failure(code)
            await self.streams.finish(item.message_id, StreamDone("error", error=error, code=str(code)))
        elif await self.store.is_cancelled_or_deleted(item.message_id):
            await self._finish_cancelled(item.message_id)
        await self.queue.ack(item)

    def _count_failure(self, code: ErrorCode | str) -> None:
        self.metrics.finished.labels(MessageState.aborted_by_worker.value).inc()
        self.metrics.errors.labels(str(code)).inc()

    async def _recover_all(self, conn: WorkerConnection) -> None:
        for inflight in list(conn.inflight.values()):
            log.warning("worker %s lost while generating %s: requeueing", conn.id, inflight.item.message_id)
            try:
                await self._requeue(inflight.item, failed=True)
            except Exception as exc:  # Redis or the database away: the reaper reclaims it later
                log.warning("could not requeue %s: %s", inflight.item.message_id, exc)
        conn.inflight.clear()

    async def _sweep_forever(self) -> None:
        await _forever(self.settings.sweep_interval_s, self.sweep, "sweep")

    async def sweep(self) -> int:
        """Requeue open messages that nothing will finish: pending ones the queue no longer holds (a
        Redis restart, a restarted embedded server) and in-progress ones whose worker is gone. The
        database is the source of truth; the new attempt fences off any stale copy."""
        cutoff = utcnow() - timedelta(seconds=self.settings.sweep_grace_s)
        stale = await self.store.open_before(cutoff)
        if not stale:
            return 0
        workers = await self.directory.workers()
        live = {w.worker_id for w in workers}
        models = {w.model_name for w in workers} | await self.directory.recent_models(self.settings.model_grace_s)
        here = {mid for c in self.connections.values() for mid in c.inflight}
        count = 0
        for msg in stale:
            model = msg.model_config_name or ""
            if msg.id in here:
                continue
            if msg.state == MessageState.pending.value and model not in models:
                error = f"no worker has offered {model!r} for {self.settings.model_grace_s:.0f}s"
                if await self.store.fail(msg.id, msg.attempt, ErrorCode.no_worker, error):
                    self._count_failure(ErrorCode.no_worker)
                    await self.streams.finish(msg.id, StreamDone("error", error=error, code=ErrorCode.no_worker.value))
                continue
            if msg.state == MessageState.in_progress.value and msg.worker_id in live:
                continue
            if msg.state == MessageState.pending.value and await self.queue.holds(model, msg.id):
                continue
            attempt = await self.store.next_attempt(msg.id, msg.attempt)
            if attempt is None:
                continue  # it moved on meanwhile
            log.warning("sweep: requeueing %s message %s (attempt %d)", msg.state, msg.id, attempt)
            try:
                await self.queue.enqueue(model, msg.id, attempt, retry=True)
            except Exception as exc:  # Redis away: the next pass tries again
                log.warning("sweep: could not requeue %s: %s", msg.id, exc)
                continue
            count += 1
        self.swept += count
        return count

    async def _reap_forever(self) -> None:
        """Requeue items claimed by server processes that died (their consumers never touch them)."""
        interval = max(self.settings.reclaim_idle_s / 2, 1.0)
        while True:
            await asyncio.sleep(interval)
            try:
                models = {w.model_name for w in await self.directory.workers()}
                for model in models:
                    for item in await self.queue.reclaim(
                        model, f"reaper-{self.server_id}", self.settings.reclaim_idle_s, 100
                    ):
                        if any(item.message_id in c.inflight for c in self.connections.values()):
                            continue
                        await self._requeue(item)
            except Exception as exc:
                _log_pass_failure("reaper", exc)


async def _forever(interval: float, job: Any, name: str) -> None:
    while True:
        try:
            await job()
        except Exception as exc:
            _log_pass_failure(name, exc)
        await asyncio.sleep(interval)


def _log_pass_failure(name: str, exc: Exception) -> None:
    if is_unavailable(exc):  # Redis or the database restarting: the next pass retries
        log.warning("%s pass skipped: %r", name, exc)
    else:
        log.error("%s pass failed", name, exc_info=exc)


def without_nul(text: str) -> str:
    """A generated NUL character becomes U+FFFD (same length, so text offsets hold): PostgreSQL text
    cannot store it, and readers must see what is stored. The token ids stay exact."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _json_without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return without_nul(value)
    if isinstance(value, list):
        return [_json_without_nul(v) for v in value]
    if isinstance(value, dict):
        return {without_nul(k): _json_without_nul(v) for k, v in value.items()}
    return value


def record_without_nul(record: GenerationRecord) -> GenerationRecord:
    """The record with every generated NUL character as U+FFFD (see ``without_nul``)."""
    texts = ("completion_text", "content", "reasoning_content")
    update: dict[str, Any] = {f: without_nul(v) for f in texts if (v := getattr(record, f)) and "\x00" in v}
    if record.tool_calls:
        cleaned = _json_without_nul(record.tool_calls)
        if cleaned != record.tool_calls:
            update["tool_calls"] = cleaned
    return record.model_copy(update=update) if update else record


def token_problem(ids: list[int], logprobs: list[float | None], vocab_size: int | None) -> str | None:
    """What is wrong with token ids (outside the announced vocabulary) or logprobs (not finite, or
    above 0: a log-probability), or None."""
    limit = vocab_size if vocab_size is not None else 2**31
    for t in ids:
        if not 0 <= t < limit:
            return f"token id {t} is outside the vocabulary [0, {limit})"
    for lp in logprobs:
        if lp is not None and not (math.isfinite(lp) and lp <= _LOGPROB_SLACK):
            return f"logprob {lp} is not a finite log-probability"
    return None


_LOGPROB_SLACK = 1e-3  # float error of a log-softmax near probability 1


def _bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


_REVOKED = "the worker key was revoked"


async def _refuse(ws: WebSocket, code: ErrorCode, message: str, close_code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(ErrorFrame(code=code.value, message=message).model_dump_json())
        await ws.close(code=close_code)
