"""Getting work back on track (DESIGN D3, D10): the database is the source of truth, the queue only
delivers. A message whose worker failed or went away gets a new attempt (fenced: the old one can no
longer write) and goes back on the retry lane; one that failed too often, or whose model is gone, ends
as an error; a cancelled one ends its readers. Two background passes catch what no event reports: the
sweep (open messages that nothing will finish) and the reaper (queue entries claimed by server
processes that died). A third, the fail-over, moves a dead server process's work within seconds
(``server.workers.presence``): what its workers were generating, and what they had claimed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

from server.chats.work_store import WorkStore
from server.idempotency import purge_expired
from server.metrics import Metrics
from server.models import utcnow
from server.outages import is_unavailable, until_available
from server.queue.protocol import QueueFull, WorkerDirectory, WorkItem, WorkQueue
from server.settings import ServerSettings
from server.streams.protocol import StreamDone, TokenStreams
from server.workers.connection import InFlight, WorkerConnection, server_of
from server.workers.presence import MemoryPresence, Presence
from shared.api import MessageState
from shared.errors import ErrorCode
from shared.protocol import CancelFrame

log = logging.getLogger(__name__)

_WAIT_FOR_DATABASE_S = 600.0  # a background requeue waits this long for the database, then the sweep does


class Recovery:
    def __init__(
        self,
        settings: ServerSettings,
        store: WorkStore,
        queue: WorkQueue,
        directory: WorkerDirectory,
        streams: TokenStreams,
        metrics: Metrics,
        connections: dict[str, WorkerConnection],
        server_id: str,
    ) -> None:
        self.settings = settings
        self.store = store
        self.queue = queue
        self.directory = directory
        self.streams = streams
        self.metrics = metrics
        self.connections = connections  # the hub's: what they hold is in hand, not lost
        self.server_id = server_id
        self.presence: Presence = MemoryPresence(server_id)  # the app sets Redis's with Redis
        self._reaper: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._presence: asyncio.Task[None] | None = None
        self._fail_over: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="tokentrail-reaper")
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="tokentrail-sweeper")
        self._presence = asyncio.create_task(self._beat_forever(), name="tokentrail-presence")
        self._fail_over = asyncio.create_task(self._fail_over_forever(), name="tokentrail-fail-over")

    async def stop(self) -> None:
        for task in (self._reaper, self._sweeper, self._fail_over):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def leave(self) -> None:
        """Last of all at shutdown, once this process has handed back its work: its presence ends, so
        that what is left (replies' ends still waiting for the database) moves at once."""
        if self._presence is not None:
            self._presence.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._presence
        with contextlib.suppress(Exception):
            await self.presence.leave()

    # ---- one message ---------------------------------------------------------------------------
    async def requeue(self, item: WorkItem, *, failed: bool = False, engine_death: bool = False) -> None:
        """Hand the message to a new attempt (retry lane). ``failed``: its worker is to blame (a lost
        connection, a failure, bad frames), which counts toward ``max_attempts``; a dead server or a
        Redis restart does not. ``engine_death``: it was generating when its worker's engine died, which
        counts toward ``engine_poison_deaths`` (a message that keeps killing engines fails)."""
        attempt = await self.store.next_attempt(item.message_id, item.attempt, failed=failed, engine_death=engine_death)
        if attempt is None and await self.store.is_cancelled_or_deleted(item.message_id):
            await self.finish_cancelled(item.message_id)  # cancelled while its worker was lost
        if attempt is not None and engine_death:
            deaths = await self.store.engine_deaths(item.message_id)
            if deaths >= self.settings.engine_poison_deaths:
                error = f"the message was generating on {deaths} engines that died; it is not retried again"
                log.error("message %s: %s", item.message_id, error)
                await self.give_up(item, ErrorCode.engine_poison_message, error)
                return
        if attempt is not None:
            try:
                await self.queue.enqueue(item.model, item.message_id, attempt, retry=True)
            except Exception as exc:  # Redis away: pending in SQL, enqueued when it is back
                log.warning("could not requeue %s now (%s); retrying in the background", item.message_id, exc)
                self.enqueue_later(item.model, item.message_id, attempt, retry=True)
                return
        await self.queue.ack(item)

    async def requeue_when_back(self, item: WorkItem, *, failed: bool = False, engine_death: bool = False) -> None:
        """``requeue``, and while the database (or Redis) is away, again in the background until it is
        back (for up to ``_WAIT_FOR_DATABASE_S``; the sweep and the reaper are the backstop)."""
        try:
            await self.requeue(item, failed=failed, engine_death=engine_death)
        except Exception as exc:
            if not is_unavailable(exc):
                log.warning("could not requeue %s: %s", item.message_id, exc)  # the reaper reclaims it
                return
            step = functools.partial(self.requeue, item, failed=failed, engine_death=engine_death)
            self._spawn(until_available(step, f"requeueing {item.message_id}", within_s=_WAIT_FOR_DATABASE_S))

    def _spawn(self, job: Awaitable[object]) -> None:
        async def run() -> None:
            try:
                await job
            except Exception as exc:
                _log_pass_failure("background requeue", exc)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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

    async def give_up(self, item: WorkItem, code: ErrorCode | str, error: str) -> None:
        if await self.store.fail(item.message_id, None, code, error):
            self._count_failure(code)
            await self.streams.finish(item.message_id, StreamDone("error", error=error, code=str(code)))
        elif await self.store.is_cancelled_or_deleted(item.message_id):
            await self.finish_cancelled(item.message_id)
        await self.queue.ack(item)

    def _count_failure(self, code: ErrorCode | str) -> None:
        self.metrics.finished.labels(MessageState.aborted_by_worker.value).inc()
        self.metrics.errors.labels(str(code)).inc()

    async def finish_cancelled(self, message_id: str) -> None:
        await self.streams.finish(
            message_id, StreamDone("error", error="cancelled by the user", code=ErrorCode.cancelled.value)
        )

    # ---- one worker ----------------------------------------------------------------------------
    async def reject_attempt(self, conn: WorkerConnection, inflight: InFlight, problem: str) -> None:
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
            await self.requeue(item, failed=True)
        except Exception as exc:  # the reaper reclaims it
            log.warning("could not requeue %s: %s", item.message_id, exc)

    async def recover_all(self, conn: WorkerConnection) -> None:
        """Requeue everything a worker that went away held, but the records it finished that wait for
        the database (``WorkerHub._settle`` stores them once it is back)."""
        for inflight in list(conn.inflight.values()):
            if inflight.storing:
                continue
            log.warning("worker %s lost while generating %s: requeueing", conn.id, inflight.item.message_id)
            conn.inflight.pop(inflight.item.message_id, None)
            await self.requeue_when_back(inflight.item, failed=True)

    # ---- a dead server process -------------------------------------------------------------------
    async def _beat_forever(self) -> None:
        while True:
            try:
                if await self.presence.beat():
                    self._spawn(self.requeue_lost())
            except Exception as exc:
                _log_pass_failure("presence", exc)
            await asyncio.sleep(self.settings.replica_timeout_s / 4)

    async def requeue_lost(self) -> int:
        """Redis is new (started, or restarted empty): queue again, at once, the pending messages the
        queue no longer holds, rather than at the sweep (``sweep_grace_s`` later). In-progress ones stay
        with their workers."""
        count = 0
        for msg in await self.store.open_before(utcnow()):
            model = msg.model_config_name or ""
            if msg.state != MessageState.pending.value or await self.queue.holds(model, msg.id):
                continue
            attempt = await self.store.next_attempt(msg.id, msg.attempt)
            if attempt is None:
                continue
            await self.queue.enqueue(model, msg.id, attempt, retry=True)
            count += 1
        if count:
            log.warning("Redis is new: %d pending messages it had lost are queued again", count)
        return count

    async def _fail_over_forever(self) -> None:
        await _forever(self.settings.replica_timeout_s / 4, self.fail_over, "fail-over")

    async def fail_over(self) -> int:
        """Requeue at once the work of server processes presumed dead: the messages their workers were
        generating (from the database, which names each one's worker) and the queue items those workers
        had claimed. New attempts fence off the old ones; the next worker resumes after the tokens
        already streamed. Returns how many messages were requeued."""
        running = await self.store.running_workers()
        entries = await self.directory.workers()
        servers = {server_of(w) for w in running} | {e.server_id for e in entries}
        servers -= {"", self.server_id}
        if not servers:
            return 0
        dead = await self.presence.dead(servers)
        if not dead:
            return 0
        lost = [w for w in running if server_of(w) in dead]
        count = 0
        for message_id, attempt, model in await self.store.running_on(lost) if lost else []:
            new = await self.store.next_attempt(message_id, attempt)
            if new is None:
                continue  # it moved on meanwhile
            log.warning("server %s gone: requeueing %s (attempt %d)", "/".join(sorted(dead)), message_id, new)
            try:
                await self.queue.enqueue(model, message_id, new, retry=True)
            except Exception as exc:  # Redis away: in the background, the sweep as the backstop
                log.warning("could not requeue %s now (%s); retrying in the background", message_id, exc)
                self.enqueue_later(model, message_id, new, retry=True)
            count += 1
        prefixes = [p for sid in sorted(dead) for p in (f"w-{sid}-", f"reaper-{sid}")]
        for model in {e.model_name for e in entries}:
            for item in await self.queue.take_over(model, f"reaper-{self.server_id}", prefixes):
                await self.requeue(item)  # claimed, not started yet (or already requeued above: acked)
        for e in entries:
            if e.server_id in dead:
                await self.directory.unregister(e.worker_id)
        return count

    # ---- background passes -----------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        await _forever(self.settings.sweep_interval_s, self.sweep, "sweep")

    async def sweep(self) -> int:
        """Requeue open messages that nothing will finish: pending ones the queue no longer holds (a
        Redis restart, a restarted embedded server) and in-progress ones whose worker is gone. The
        database is the source of truth; the new attempt fences off any stale copy."""
        async with self.store.sessions() as session:  # Idempotency-Keys past their time
            await purge_expired(session, self.settings.idempotency_ttl_s)
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
                        await self.requeue(item)
            except Exception as exc:
                _log_pass_failure("reaper", exc)


async def _forever(interval: float, job: Callable[[], Awaitable[object]], name: str) -> None:
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
