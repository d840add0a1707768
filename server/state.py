"""What the app's lifespan owns: database, queue, token streams, worker directory, signer, hub, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy.ext.asyncio import AsyncEngine

from server.auth import TokenSigner
from server.chats.admission import RateLimiter
from server.chats.catalog import Catalog
from server.chats.path_cache import PathCache
from server.db import SessionFactory
from server.export.feed import Cursors, FeedSignal
from server.hot_sql import HotSql
from server.metrics import Metrics
from server.metrics_group import GroupMetrics
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
    catalog: Catalog
    paths: PathCache  # recently used chat paths: turns dispatched without reading them back
    sql: HotSql  # where the per-turn statements run (SQLite: a raw connection)
    auth_cache: dict[str, tuple[float, User]] = field(default_factory=dict)  # token -> (expiry, user)
    feed: FeedSignal = field(default_factory=FeedSignal)  # wakes rollout-feed readers (GET /v1/rollouts)
    cursors: Cursors = field(init=False)  # signs and checks their cursors
    group_metrics: GroupMetrics | None = None  # one of a ``serve --processes N``: /metrics merges theirs

    def __post_init__(self) -> None:
        self.cursors = Cursors(self.sessions)
