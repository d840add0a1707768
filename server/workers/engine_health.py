"""Workers' engines as the hub sees them (``engine`` frames, FEATURE_ENGINE; worker.engine_health).

A worker whose engine died says so at once and takes no work until it says the engine is back: every
message the server sent it is requeued, to be resumed after the tokens already streamed; the ones that
were generating in the engine when it died count an engine death each (``Recovery.requeue``), and a
message at ``engine_poison_deaths`` fails with ``engine_poison_message`` instead of killing more engines.
Deaths and restarts are counted in /metrics and shown per worker in /admin/workers and /ready.
"""

from __future__ import annotations

import logging
from collections import Counter

from server.metrics import Metrics
from server.queue.protocol import WorkerDirectory
from server.settings import ServerSettings
from server.workers.connection import WorkerConnection
from server.workers.recovery import Recovery
from shared.protocol import EngineFrame

log = logging.getLogger(__name__)

READY = "ready"


class EngineHealth:
    def __init__(
        self,
        settings: ServerSettings,
        recovery: Recovery,
        directory: WorkerDirectory,
        metrics: Metrics,
        connections: dict[str, WorkerConnection],
        server_id: str,
    ) -> None:
        self.settings = settings
        self.recovery = recovery
        self.directory = directory
        self.metrics = metrics
        self.connections = connections  # the hub's
        self.server_id = server_id

    async def on_frame(self, conn: WorkerConnection, frame: EngineFrame) -> None:
        model = conn.hello.model_name
        if frame.state != READY:
            conn.credits = 0  # before any await: the dispatch loop sends it nothing more
        died = frame.deaths - conn.engine_deaths
        restarted = frame.restarts - conn.engine_restarts
        conn.engine_state = frame.state
        conn.engine_deaths, conn.engine_restarts = (
            max(frame.deaths, conn.engine_deaths),
            max(frame.restarts, conn.engine_restarts),
        )
        if died > 0:
            self.metrics.engine_deaths.labels(model).inc(died)
            log.warning(
                "worker %s: engine died (%s); requeueing its %d messages", conn.id, frame.error, len(conn.inflight)
            )
        if restarted > 0:
            self.metrics.engine_restarts.labels(model).inc(restarted)
            log.info("worker %s: engine restarted (%d restarts)", conn.id, conn.engine_restarts)
        if frame.state != READY:
            running = {(message_id, attempt) for message_id, attempt in frame.running}
            for inflight in list(conn.inflight.values()):
                if inflight.storing:
                    continue  # finished before the engine died; stored once the database is back
                item = inflight.item
                conn.inflight.pop(item.message_id, None)
                death = (item.message_id, item.attempt) in running
                await self.recovery.requeue_when_back(item, engine_death=death)
        try:  # shown in /admin/workers now, not at the next heartbeat
            await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
        except Exception as exc:
            log.warning("worker %s: could not update its directory entry: %s", conn.id, exc)

    def states(self) -> dict[str, int]:
        """Engine states of the workers connected to this process: state -> workers."""
        return dict(Counter(c.engine_state for c in list(self.connections.values())))

    def down_by_model(self) -> dict[str, int]:
        """Per model: workers connected to this process whose engine is not ready."""
        down: Counter[str] = Counter()
        for conn in list(self.connections.values()):
            down[conn.hello.model_name] += conn.engine_state != READY
        return dict(down)
