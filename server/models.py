"""SQLAlchemy tables: users and keys, chats, the message tree, and per-message token records.

Token IDs and logprobs live in ``message_tokens`` as packed little-endian blobs, one row per
assistant message, written once when the message finishes (DESIGN D1). Keeping them out of
``messages`` keeps chat listings and tree reads free of large blobs.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.orm.attributes import manager_of_class


def new_id() -> str:
    """A UUIDv7-style id: time-ordered, so ids sort by creation (used by cursor pagination)."""
    ms = int(time.time() * 1000)
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | (0x7 << 76) | (rand & ((1 << 76) - 1))
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant bits
    return str(uuid.UUID(int=value))


def utcnow() -> datetime:
    return datetime.now(UTC)


_OPEN = text("state IN ('pending', 'in_progress')")
# The same test in queries, with literal values: only then can SQLite use the partial index
# ``ix_messages_open`` (bound parameters in the IN list make it scan every message).
MESSAGE_IS_OPEN = text("messages.state IN ('pending', 'in_progress')")


_B = TypeVar("_B", bound="Base")


def snapshot(cls: type[_B], values: dict[str, Any]) -> _B:
    """An instance holding ``values`` as a row read back and detached would, built without the ORM's
    per-attribute set events (the constructor costs about twenty times as much). For read-only copies
    of rows just written; never added to a session."""
    obj = manager_of_class(cls).new_instance()
    obj.__dict__.update(values)
    return obj


class Base(DeclarativeBase):
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: JSON}


class User(Base):
    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    display_name: Mapped[str] = mapped_column(String(256))
    provider: Mapped[str] = mapped_column(String(32))  # "debug" | "apikey"
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """A user's API key; only its SHA-256 is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class WorkerKey(Base):
    """A key that lets a worker connect to ``/workers/work``; only its SHA-256 is stored."""

    __tablename__ = "worker_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class Chat(Base):
    __tablename__ = "chats"
    __table_args__ = (Index("ix_chats_user_id_id", "user_id", "id"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    modified_at: Mapped[datetime] = mapped_column(default=utcnow)
    title: Mapped[str | None] = mapped_column(String(256), default=None)
    hidden: Mapped[bool] = mapped_column(Boolean, default=False)
    allow_data_use: Mapped[bool] = mapped_column(Boolean, default=True)
    active_thread_tail_message_id: Mapped[str | None] = mapped_column(String(36), default=None)
    # Snapshotted into each assistant message's work parameters; a change forks later turns.
    system_prompt: Mapped[str | None] = mapped_column(Text, default=None)
    tools: Mapped[list[Any] | None] = mapped_column(JSON, default=None)


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (
        Index("ix_messages_chat_id_id", "chat_id", "id"),
        # non-terminal messages only: what the sweep and the per-user queue share look for
        Index("ix_messages_open", "state", "modified_at", sqlite_where=_OPEN, postgresql_where=_OPEN),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"))
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("messages.id"), default=None, index=True)
    role: Mapped[str] = mapped_column(String(16))  # "prompter" | "assistant" | "tool"
    content: Mapped[str | None] = mapped_column(Text, default=None)
    tool_call_id: Mapped[str | None] = mapped_column(String(128), default=None)  # tool results
    # parsed from an assistant message's tokens, for clients only (never re-rendered)
    reasoning_content: Mapped[str | None] = mapped_column(Text, default=None)
    tool_calls: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    state: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    modified_at: Mapped[datetime] = mapped_column(default=utcnow)
    score: Mapped[int] = mapped_column(Integer, default=0)
    voted_at: Mapped[datetime | None] = mapped_column(default=None)  # set by a vote: score 0 is then a rating
    # assistant messages only
    model_config_name: Mapped[str | None] = mapped_column(String(256), default=None)
    work_parameters: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # fencing token, bumped per (re)delivery
    # attempts that ended by the worker's fault (lost connection, failure, bad frames); a requeue for
    # a dead server or a Redis restart is not counted. max_attempts of these and the message fails.
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # engine deaths (worker.engine_health) while this message was generating: requeued, not counted in
    # failures; engine_poison_deaths of these and the message fails as a suspected poison message
    engine_deaths: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker_id: Mapped[str | None] = mapped_column(String(64), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    finish_reason: Mapped[str | None] = mapped_column(String(16), default=None)
    prompt_token_count: Mapped[int | None] = mapped_column(Integer, default=None)
    completion_token_count: Mapped[int | None] = mapped_column(Integer, default=None)
    # OpenAI API conversations: hash of the normalized path root..this message (shared/chain.py)
    chain_hash: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    # the client's session hint when it sent one (X-Session-ID, prompt_cache_key): routing and the
    # tie-breaker between identical stored paths of different sessions
    session_key: Mapped[str | None] = mapped_column(String(128), default=None)
    # [[start, version], ...]: the weights version of each completion token (server.weights); None
    # for messages stored before versions were recorded, whose tokens all came from version 0
    policy_versions: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    # POST /v1/rewards: the environment's reward for this turn; episode_done: the episode ended here, so
    # the path root..this message is a finished rollout with that reward
    reward: Mapped[float | None] = mapped_column(Float, default=None)
    episode_done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    rewarded_at: Mapped[datetime | None] = mapped_column(default=None)
    # the rollout feed's position (GET /v1/rollouts): given when the episode first ends here, one above
    # the highest, under a lock held to commit, so a reader that sees N has seen every position below N
    feed_seq: Mapped[int | None] = mapped_column(BigInteger, default=None, index=True, unique=True)


class MessageTokens(Base):
    """The exact tokens of one finished assistant message (DESIGN section 5)."""

    __tablename__ = "message_tokens"

    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), primary_key=True)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    completion_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    text_offsets: Mapped[bytes] = mapped_column(LargeBinary)  # into completion_text
    completion_text: Mapped[str] = mapped_column(Text, default="", server_default="")
    finish_reason: Mapped[str] = mapped_column(String(16))
    stop_reason: Mapped[str | None] = mapped_column(String(256), default=None)
    engine: Mapped[str] = mapped_column(String(32))
    tokenizer_hash: Mapped[str] = mapped_column(String(64))
    template_hash: Mapped[str] = mapped_column(String(64))
    prior_message_id: Mapped[str | None] = mapped_column(String(36), default=None)
    reused_prefix_len: Mapped[int] = mapped_column(Integer, default=0)
    synthetic_token_count: Mapped[int] = mapped_column(Integer, default=0)
    fork: Mapped[bool] = mapped_column(Boolean, default=False)
    num_cached_tokens: Mapped[int | None] = mapped_column(Integer, default=None)
    prompt_method: Mapped[str | None] = mapped_column(String(32), default=None)
    resumed_at: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    prompt_check: Mapped[str | None] = mapped_column(String(32), default=None)  # GenerationRecord.prompt_check
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MessageReport(Base):
    """A user's report on a message (OA's ``POST .../reports``): kept for moderation and exports."""

    __tablename__ = "message_reports"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    report_type: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class MessageEval(Base):
    """OA's ``POST .../message_evals``: the user preferred ``message_id`` over its siblings
    ``inferior_message_ids`` (a preference pair for training)."""

    __tablename__ = "message_evals"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    chat_id: Mapped[str] = mapped_column(ForeignKey("chats.id", ondelete="CASCADE"), index=True)
    message_id: Mapped[str] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    inferior_message_ids: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class IdempotencyRecord(Base):
    """A request made with an ``Idempotency-Key`` (``server/idempotency.py``): stored in the transaction
    that created what the request made, with the ids a retry needs to answer as the first request did."""

    __tablename__ = "idempotency_keys"

    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))  # method, path and body of the first request
    result: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class PolicyVersion(Base):
    """A weights version pushed to a model's workers (``server.weights``): the registry that stored
    messages' ``policy_versions`` name. A model's current version is its highest; 0 (the weights its
    workers start with) has no row."""

    __tablename__ = "policy_versions"

    model_name: Mapped[str] = mapped_column(String(256), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(Text)  # the checkpoint directory, as the workers read it
    mode: Mapped[str] = mapped_column(String(16))  # drain | inflight
    pushed_at: Mapped[datetime] = mapped_column(default=utcnow)
    pushed_by: Mapped[str | None] = mapped_column(String(128), default=None)  # the admin user's id


# The tables themselves, typed, for the Core statements of the hot paths (no ORM objects per row).
MESSAGES = cast(Table, Message.__table__)
CHATS = cast(Table, Chat.__table__)
MESSAGE_TOKENS = cast(Table, MessageTokens.__table__)
IDEMPOTENCY_KEYS = cast(Table, IdempotencyRecord.__table__)


class ServerSecret(Base):
    """Random secrets every replica of a deployment shares because they share its database (e.g. the key
    that signs rollout-feed cursors); created on first use."""

    __tablename__ = "server_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))
