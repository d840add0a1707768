"""The app factory: ``create_app(settings)``; its lifespan owns the DB engine, Redis, queue, hub."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, WebSocket
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from server import migrate
from server.api.admin import router as admin_router
from server.api.anthropic_messages import router as messages_router
from server.api.auth import router as auth_router
from server.api.chats import configs_router
from server.api.chats import router as chats_router
from server.api.deps import StateDep
from server.api.hot_lane import HotLane, HotRoute, LaneApp
from server.api.openai_chat import router as openai_router
from server.api.openai_completions import router as completions_router
from server.api.openai_responses import router as responses_router
from server.api.rewards import router as rewards_router
from server.api.rollout_feed import router as rollout_feed_router
from server.api.tokenizer import router as tokenizer_router
from server.api.weights import router as weights_router
from server.auth import TokenSigner
from server.chats.admission import RateLimiter
from server.chats.catalog import Catalog
from server.chats.path_cache import PathCache
from server.db import create_engine, create_session_factory, ping
from server.hot_sql import HotSql
from server.metrics import Metrics
from server.metrics_group import GroupMetrics, ProcessGroup
from server.outages import RETRY_AFTER_S
from server.queue.protocol import WorkerDirectory, WorkQueue
from server.request_guard import RequestGuard
from server.settings import ServerSettings
from server.state import AppState
from server.streams.protocol import TokenStreams
from server.workers.hub import WorkerHub
from server.workers.links import LocalWorker
from shared.errors import API_ERROR_RESPONSES, OPENAI_ERROR_RESPONSES, ErrorCode
from shared.gc_heap import freeze_startup_heap, unfreeze_heap

log = logging.getLogger(__name__)

health_router = APIRouter(tags=["health"])


@health_router.get("/metrics", include_in_schema=False)
async def metrics(state: StateDep) -> Response:
    """Prometheus text exposition of this process (server/metrics.py), merged with the other processes'
    of its ``serve --processes N`` (server/metrics_group.py)."""
    text = await _own_metrics(state)
    if state.group_metrics is not None:
        text = await state.group_metrics.collect(text, state.metrics.scrape_errors.labels("group").inc)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def _own_metrics(state: AppState) -> bytes:
    hub = state.hub
    return await state.metrics.render(
        hub.load(), hub.engines.down_by_model(), state.directory, state.queue, state.sessions
    )


@health_router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@health_router.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(ping(state.engine), timeout=5)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {exc}"
    if state.redis is not None:
        try:
            await asyncio.wait_for(state.redis.ping(), timeout=5)
            checks["redis"] = "ok"
        except Exception as exc:
            checks["redis"] = f"error: {exc}"
    ok = all(v == "ok" for v in checks.values())
    body: dict[str, object] = {"status": "ok" if ok else "unavailable", "checks": checks}
    # the engines of workers connected to this process, by state (informational: work for a worker whose
    # engine is restarting waits in the queue or goes to another worker; it does not make this process unready)
    body["worker_engines"] = state.hub.engines.states()
    body["server_id"] = state.hub.server_id  # which process answered (several share a port with --processes)
    if not ok:
        body["code"] = ErrorCode.not_ready.value
    if ok:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


def hot_routes() -> dict[str, HotRoute]:
    """The generation routes, one POST per agent turn: served by the hot lane (same functions)."""
    from server.api.anthropic_messages import create_message
    from server.api.openai_chat import chat_completions, chat_completions_tokens
    from server.api.openai_completions import completions
    from server.api.openai_responses import create_response

    return {
        "/v1/chat/completions": HotRoute.of(chat_completions),
        "/v1/chat/completions/tokens": HotRoute.of(chat_completions_tokens),
        "/v1/completions": HotRoute.of(completions),
        "/v1/responses": HotRoute.of(create_response),
        "/v1/messages": HotRoute.of(create_message),
    }


def create_app(
    settings: ServerSettings, local_worker: LocalWorker | None = None, group: ProcessGroup | None = None
) -> FastAPI:
    """The app; with ``local_worker`` (``tokentrail serve --model``) that worker runs in this process, on
    an in-memory link to the hub, next to any workers that connect by websocket; ``group``: this process
    is one of a ``serve --processes N`` (its metrics are answered merged with theirs)."""
    from server.errors import install_error_handlers

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.effective_database_url
        if settings.should_migrate_on_start:
            await asyncio.to_thread(migrate.upgrade, url, "head", settings.db_pooler)
        engine = create_engine(
            url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow, pooler=settings.db_pooler
        )
        sessions = create_session_factory(engine)
        sql = HotSql.for_engine(engine)
        redis = None
        queue: WorkQueue
        directory: WorkerDirectory
        streams: TokenStreams
        if settings.redis_url:
            from redis.asyncio import Redis
            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff

            from server.queue.redis import RedisWorkerDirectory, RedisWorkQueue
            from server.streams.redis import RedisTokenStreams

            # A pooled connection that Redis closed while idle (a restart, CLIENT KILL, a timeout) fails
            # its next command: try it again on a fresh connection, briefly, before calling Redis away.
            # (Redis.from_url's pool does not take the client's default retry policy.)
            retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2)
            redis = Redis.from_url(settings.redis_url, max_connections=settings.redis_pool_size, retry=retry)
            queue = RedisWorkQueue(redis, settings.max_queue_size, settings.route_wait_s)
            directory = RedisWorkerDirectory(redis)
            streams = RedisTokenStreams(redis, expire_after_s=settings.token_stream_expire_s)
        else:
            from server.queue.memory import MemoryWorkerDirectory, MemoryWorkQueue
            from server.streams.memory import MemoryTokenStreams

            queue = MemoryWorkQueue(settings.max_queue_size, settings.route_wait_s)
            directory = MemoryWorkerDirectory()
            streams = MemoryTokenStreams(expire_after_s=settings.token_stream_expire_s)
        signer = TokenSigner(
            settings.resolved_auth_secret(), settings.access_token_minutes, settings.refresh_token_days
        )
        metrics = Metrics()
        paths = PathCache()
        hub = WorkerHub(settings, sessions, queue, directory, streams, metrics, paths, sql)
        if redis is not None:
            from server.workers.presence import RedisPresence
            from server.workers.relay import RedisRpcRelay

            hub.rpc.relay = RedisRpcRelay(redis, hub.server_id)
            hub.recovery.presence = RedisPresence(redis, hub.server_id, settings.replica_timeout_s)
        limiter = RateLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst, redis)
        app.state.tt = AppState(
            settings=settings,
            engine=engine,
            sessions=sessions,
            queue=queue,
            directory=directory,
            streams=streams,
            signer=signer,
            hub=hub,
            redis=redis,
            rate_limiter=limiter,
            metrics=metrics,
            catalog=Catalog(directory, settings.model_grace_s),
            paths=paths,
            sql=sql,
        )
        state: AppState = app.state.tt
        if group is not None and redis is not None:
            state.group_metrics = GroupMetrics(redis, group, hub.server_id, lambda: _own_metrics(state))
            state.group_metrics.start()
        try:
            if local_worker is not None:
                # before the sweep's first pass, which fails pending messages of models no worker offers
                await local_worker.start(hub.connect_local)
            hub.start()
            freeze_startup_heap()
            metrics.watch_gc()
            yield
        finally:
            metrics.unwatch_gc()
            unfreeze_heap()
            if local_worker is not None:  # before the hub stops: work it hands back is requeued
                await local_worker.stop(settings.local_drain_timeout_s)
            if state.group_metrics is not None:
                await state.group_metrics.stop()
            await hub.stop()
            await streams.close()
            await directory.close()
            await queue.close()
            if redis is not None:
                await redis.aclose()
            sql.close()
            await engine.dispose()

    app = LaneApp(title="tokentrail", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes)
    if origins := settings.cors_origin_list:
        # Outermost: a preflight is answered before the guard and the routes see it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials="*" not in origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
            max_age=600,
        )
    # Routes are matched in order, and FastAPI's included routers cost 15-30 us each to pass over: the
    # hot routes come first (the OpenAI-style APIs, then OA's chats), the rarely called ones last.
    for router in (openai_router, completions_router, responses_router, messages_router):
        app.include_router(router, responses=OPENAI_ERROR_RESPONSES)
    for router in (chats_router, auth_router, configs_router, admin_router, weights_router):
        app.include_router(router, responses=API_ERROR_RESPONSES)
    app.include_router(tokenizer_router, responses=OPENAI_ERROR_RESPONSES)
    app.include_router(rewards_router, responses=OPENAI_ERROR_RESPONSES)  # once per episode: after the hot routes
    app.include_router(rollout_feed_router, responses=OPENAI_ERROR_RESPONSES)  # long-lived streams, opened rarely
    app.include_router(health_router)

    if settings.hot_lane:
        app.hot_lane = HotLane(
            app, hot_routes(), max_body_bytes=settings.max_body_bytes, cors=bool(settings.cors_origin_list)
        )

    web = Path(__file__).parent / "web"
    app.mount("/web", StaticFiles(directory=web), name="web")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        """The web chat (server/web: plain modules on the public API, no build step)."""
        return FileResponse(web / "index.html")

    @app.websocket("/workers/work")
    async def worker_socket(ws: WebSocket) -> None:
        state: AppState = ws.app.state.tt
        await state.hub.serve(ws)

    return app
