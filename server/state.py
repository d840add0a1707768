"""What the app's lifespan owns: database, queue, token streams, worker directory, signer, hub, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from server.admission import RateLimiter
from server.auth import TokenSigner
from server.db import SessionFactory
from server.metrics import Metrics
from server.queue.protocol import WorkerDirectory, WorkQueue
from server.settings import ServerSettings
from server.streams.protocol import TokenStreams
from server.workers.hub import WorkerHub

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from server.models import User


@dataclass
class AppState:
    settings: ServerSettings
    engine: AsyncEngine
    sessions: SessionFactory
    queue: WorkQueue
    directory: WorkerDirectory
    streams: TokenStreams
    signer: TokenSigner
    hub: WorkerHub
    redis: Redis | None
    rate_limiter: RateLimiter
    metrics: Metrics
    auth_cache: dict[str, tuple[float, User]] = field(default_factory=dict)  # token -> (expiry, user)
    offered_cache: tuple[float, frozenset[str]] = (0.0, frozenset())  # (when, models offered then)
    # model -> time.monotonic() this process last saw it offered: the grace period survives a Redis
    # restart, which empties the shared directory until the workers' next heartbeats
    models_seen: dict[str, float] = field(default_factory=dict)
