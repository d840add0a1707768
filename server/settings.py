"""Server settings: one object per process, from flags or ``TOKENTRAIL_*`` variables (DESIGN D11)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PLACEHOLDER_SECRETS = frozenset({"", "changeme", "change-me", "secret", "placeholder"})


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "tokentrail"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENTRAIL_", extra="ignore", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address the HTTP server binds."""
    port: int = 8000
    """Port the HTTP server binds."""
    data_dir: Path = Field(default_factory=default_data_dir)
    """Embedded mode's SQLite file and token-signing secret live here."""
    database_url: str | None = None
    """SQLAlchemy URL (``postgresql+asyncpg://...`` in production); unset: a SQLite file in data_dir."""
    db_pool_size: int = Field(default=32, ge=1)
    """PostgreSQL connections a server process keeps open. Size max_connections above replicas x (pool + overflow)."""
    db_max_overflow: int = Field(default=8, ge=0)
    """PostgreSQL connections opened beyond the pool under a burst (closed again after use)."""
    db_pooler: Literal["none", "transaction"] = "none"
    """What database_url points at: PostgreSQL itself or a session-mode pooler (none), or a pooler in transaction
    mode such as PgBouncer's pool_mode = transaction (transaction: no statement stays prepared between transactions)."""
    redis_url: str | None = None
    """Redis URL: the work queue, token streams and rate limits shared by every server process; unset: in-process
    queue and token fan-out (one server process)."""
    allow_debug_auth: bool | None = None
    """OA's debug login (any user name, no password); unset: on in embedded mode, off with Redis."""
    auth_secret: str | None = None
    """Signs access tokens. Required (16+ characters, no placeholder) with Redis; embedded mode keeps one in
    data_dir."""
    access_token_minutes: int = 60 * 24
    """Lifetime of an access token from the debug login."""
    refresh_token_days: int = 30
    """Lifetime of a refresh token."""
    migrate_on_start: bool | None = None
    """Apply the Alembic migrations at start; unset: only on SQLite (run ``tokentrail db upgrade`` for PostgreSQL)."""

    max_queue_size: int = 1000
    """Queued generations per model; beyond it requests get 503 queue_full with Retry-After."""
    rate_limit_per_minute: int = 600
    """Generations a user may ask for per minute, counted across server processes (0: no limit)."""
    rate_limit_burst: int = 60
    """Generations a user may ask for at once before the per-minute rate applies."""
    user_queue_share: float = Field(default=0.5, gt=0.0, le=1.0)
    """Share of a model's queue one user's open (pending or running) generations may take (429 beyond it)."""
    max_attempts: int = 3
    """Attempts failed by a worker's fault after which a message fails with too_many_attempts."""
    routing: Literal["auto", "on", "off"] = "auto"
    """Cache-aware routing: auto for engines with a prefix cache (vLLM), on for every engine, off: any worker."""
    route_wait_s: float = Field(default=0.5, ge=0.0)
    """How long a turn waits for the worker that holds its prefix before any worker of the model takes it."""
    engine_poison_deaths: int = Field(default=3, ge=1)
    """A message that was in this many engines when they died fails with engine_poison_message."""
    pending_event_interval_s: float = 1.0
    """Seconds between SSE ``pending`` events (queue position) while a message waits."""
    worker_heartbeat_interval_s: float = 5.0
    """Seconds between heartbeats the server sends each worker."""
    worker_timeout_s: float = 20.0
    """A worker silent this long is dropped and its work requeued."""
    replica_timeout_s: float = Field(default=2.0, gt=0.0)
    """A server process that has not refreshed its presence in Redis this long is presumed dead: another takes
    over the messages its workers were generating at once (fenced, resumed after the streamed tokens)."""
    weights_load_timeout_s: float = Field(default=600.0, gt=0.0)
    """How long a worker may take to load pushed weights (a ``drain`` push waits for its running replies first)."""
    reclaim_idle_s: float = 20.0
    """A claimed work item untouched this long belongs to a dead server process and is reclaimed."""
    sweep_interval_s: float = 10.0
    """Seconds between sweeps: open messages whose queue entry or worker is gone are requeued (the database is the
    source of truth)."""
    model_grace_s: float = 60.0
    """A model whose workers all went away is still accepted (queued) this long; then its waiting messages fail
    with no_worker and new requests get unknown_model."""
    sweep_grace_s: float = 30.0
    """Age an open message must reach before the sweep may requeue it."""
    idempotency_ttl_s: float = Field(default=86400.0, gt=0.0)
    """Seconds an ``Idempotency-Key`` and what its request created are kept: a retry with the key within this
    long is answered as the first request was; after it the key is free again."""
    stream_interval: int = Field(default=1, ge=1, le=1024)
    """The fewest tokens a streamed OpenAI-style chunk (chat completions, completions, Responses, Messages)
    carries, but the last: tokens are held until that many arrived (fewer chunks, later first token). A
    request's ``stream_interval`` overrides it. A reader that falls behind gets what it missed in one
    chunk whatever this is."""
    rollout_feed_poll_s: float = Field(default=0.25, gt=0.0)
    """How often a rollout-feed stream (``GET /v1/rollouts``) looks for episodes finished on other server
    processes (those finished on its own wake it at once)."""
    token_stream_expire_s: float = 300.0
    """Seconds a finished message's token stream is kept for resuming readers (then it is served from SQL)."""
    shutdown_grace_s: int = Field(default=10, ge=0)
    """Seconds a stopping server process (SIGINT, SIGTERM) waits for its open requests and streams to end
    before it cuts them. A reader cut this way resumes on another replica or after a restart (its message
    stays queued or in progress); an OpenAI-style client retries, with its ``Idempotency-Key`` if it sent
    one. Without a bound, one stream whose reply waits for a worker that is gone would keep the process
    from stopping."""
    local_drain_timeout_s: float = 30.0
    """``tokentrail serve --model``: seconds the in-process worker has at shutdown to finish the messages in hand
    before they are requeued (the next worker resumes after the streamed tokens)."""
    redis_pool_size: int = 512
    """Redis connections a server process may open."""
    max_body_bytes: int = 8 * 2**20
    """Largest request body in bytes, refused before it is read (413 request_too_large)."""
    cors_origins: str = ""
    """Web origins allowed to call the API from a browser (CORS), comma-separated; ``*`` for any."""
    hot_lane: bool = True
    """Serve the generation routes (chat completions, completions, Responses, Messages) past FastAPI's
    middleware, routing and dependency layers (``server/api/hot_lane.py``): the same answers for less CPU
    per turn. ``false`` sends every request through the full FastAPI stack."""

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip().rstrip("/") for o in self.cors_origins.split(",") if o.strip()]

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'tokentrail.db'}"

    @property
    def debug_auth_allowed(self) -> bool:
        return self.embedded if self.allow_debug_auth is None else self.allow_debug_auth

    @property
    def should_migrate_on_start(self) -> bool:
        if self.migrate_on_start is not None:
            return self.migrate_on_start
        return self.database_url is None or self.database_url.startswith("sqlite")

    @model_validator(mode="after")
    def _refuse_placeholder_secret(self) -> ServerSettings:
        if self.auth_secret is not None and self.auth_secret.strip().lower() in PLACEHOLDER_SECRETS:
            raise ValueError("TOKENTRAIL_AUTH_SECRET is a placeholder; set a long random value")
        if self.auth_secret is not None and len(self.auth_secret) < 16:
            raise ValueError("TOKENTRAIL_AUTH_SECRET must be at least 16 characters")
        return self

    def resolved_auth_secret(self) -> str:
        """The signing secret; in embedded mode one is created once and kept in data_dir."""
        if self.auth_secret:
            return self.auth_secret
        if not self.embedded:
            raise ValueError(
                "TOKENTRAIL_AUTH_SECRET (or --auth-secret) is required when running with Redis, "
                "so that all server processes sign and check tokens alike"
            )
        path = self.data_dir / "auth_secret"
        if path.exists():
            return path.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        secret = secrets.token_urlsafe(48)
        path.write_text(secret)
        path.chmod(0o600)
        return secret
