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
    model_config = SettingsConfigDict(env_prefix="TOKENTRAIL_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Field(default_factory=default_data_dir)
    # None: a SQLite file in data_dir (the embedded default).
    database_url: str | None = None
    # PostgreSQL connections a server process keeps open, and how many more it opens under a burst
    # (closed again after use). Size max_connections above replicas x (pool + overflow).
    db_pool_size: int = Field(default=32, ge=1)
    db_max_overflow: int = Field(default=8, ge=0)
    # None: in-process queue and token fan-out (one server process).
    redis_url: str | None = None
    # None: on in embedded mode (no Redis), off otherwise.
    allow_debug_auth: bool | None = None
    # Signs access tokens. Required (and no placeholder) with Redis; embedded mode keeps one in data_dir.
    auth_secret: str | None = None
    access_token_minutes: int = 60 * 24
    refresh_token_days: int = 30
    migrate_on_start: bool | None = None  # None: only in embedded mode

    max_queue_size: int = 1000
    # Fair load (server/chats/admission.py): generations per user per minute (0: no limit) and burst, and
    # the share of a model's queue one user's open generations may take.
    rate_limit_per_minute: int = 600
    rate_limit_burst: int = 60
    user_queue_share: float = Field(default=0.5, gt=0.0, le=1.0)
    max_attempts: int = 3
    # Cache-aware routing (server/workers/routing.py): a turn waits up to route_wait_s in the lane of the
    # worker that holds its prefix before any worker of the model takes it. auto: for engines with a
    # prefix cache (vLLM); on: for every engine; off: every turn to any worker.
    routing: Literal["auto", "on", "off"] = "auto"
    route_wait_s: float = Field(default=0.5, ge=0.0)
    # a message generating on engine_poison_deaths engines that died fails (engine_poison_message)
    engine_poison_deaths: int = Field(default=3, ge=1)
    pending_event_interval_s: float = 1.0
    worker_heartbeat_interval_s: float = 5.0
    worker_timeout_s: float = 20.0
    # A claimed work item untouched this long belongs to a dead server process and is reclaimed.
    reclaim_idle_s: float = 20.0
    # The sweep (DESIGN D3: the database is the source of truth): every sweep_interval_s, open
    # messages older than sweep_grace_s whose queue entry or worker is gone are requeued.
    sweep_interval_s: float = 10.0
    # A model whose workers all went away is still accepted (queued) for this long; after it, its
    # waiting messages fail with no_worker and new requests get unknown_model.
    model_grace_s: float = 60.0
    sweep_grace_s: float = 30.0
    token_stream_expire_s: float = 300.0
    # ``tokentrail serve --model``: on shutdown, seconds the in-process worker has to finish the messages
    # in hand before handing them back (requeued; the next worker resumes after the streamed tokens).
    local_drain_timeout_s: float = 30.0
    redis_pool_size: int = 512
    # Largest request body (bytes), refused before it is read (413 request_too_large).
    max_body_bytes: int = 8 * 2**20
    # Web origins allowed to call the API from a browser (CORS), comma-separated; "*" for any.
    cors_origins: str = ""

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
