"""One connected worker as the hub sees it: its hello, its link, credits, the work it holds, its pending
tokenizer calls; how its id is minted; and how its key is checked."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import WebSocketDisconnect
from sqlalchemy import select

from server.auth import hash_key
from server.db import SessionFactory
from server.metrics import StreamTimer
from server.models import WorkerKey
from server.queue.protocol import WorkerEntry, WorkItem
from server.workers.links import WorkerLink
from server.workers.work_source import Work
from shared.local_link import LinkClosed
from shared.protocol import FEATURE_RPC, HelloFrame, ServerFrame

CLOSE_INVALID_KEY = 4401
CLOSE_PROTOCOL = 4426
CLOSE_BAD_FRAME = 4400

REVOKED = "the worker key was revoked"


class WorkerGone(Exception):
    """The worker's socket failed: its session ends and recovery requeues what it held. Raised only
    by ``WorkerConnection.send``, so that no other fault (the database's own ``ConnectionError``s)
    can pass for a worker going away."""


@dataclass
class InFlight:
    item: WorkItem
    next_index: int  # index the next tokens frame must start at
    work: Work | None = None  # what was sent, once dispatched
    streamed: list[int] = field(default_factory=list)  # token ids readers have seen (resumed ones too)
    timer: StreamTimer | None = None  # latency metrics, from dispatch on
    storing: bool = False  # its finished record is held until the database takes it


@dataclass
class WorkerConnection:
    id: str
    hello: HelloFrame
    link: WorkerLink  # its websocket, or the in-process link of ``tokentrail serve --model``
    credits: int = 0
    credit_event: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)  # rpc id -> answer
    draining: bool = False  # the worker is shutting down: no more work for it
    key: WorkerKey | None = None  # the key it connected with
    engine_state: str = "ready"  # its engine's, from engine frames: no work while not "ready"
    engine_deaths: int = 0
    engine_restarts: int = 0
    # engine frames read but not yet handled by the flusher: credits read meanwhile wait behind them
    engine_frames_queued: int = 0
    served: int = 0  # replies finished and stored
    policy_version: int = 0  # the weights version its engine serves (hello, engine frames, loads)
    # not below the model's current version, nor loading one: it may take work (server.weights)
    weights_ready: bool = False
    weights_error: str = ""  # why it could not load the current version

    async def send(self, frame: ServerFrame) -> None:
        async with self.send_lock:
            try:
                await self.link.send(frame)
            except (LinkClosed, WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise WorkerGone(f"worker {self.id}: {exc!r}") from exc

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
            engine_state=self.engine_state,
            engine_deaths=self.engine_deaths,
            engine_restarts=self.engine_restarts,
            served=self.served,
            policy_version=self.policy_version,
            weights_error=self.weights_error,
        )

    @property
    def rpc(self) -> bool:
        return FEATURE_RPC in self.hello.features


def new_worker_id(server_id: str) -> str:
    """A connection's id, ``w-<server id>-<random>``: it names the server process that holds the
    connection, which is how other processes route a cancel to it (``server_of``)."""
    return f"w-{server_id}-{secrets.token_hex(6)}"


def server_of(worker_id: str) -> str:
    """The server process a worker id was minted by (``new_worker_id``); "" for a foreign id."""
    return worker_id.split("-")[1] if worker_id.count("-") >= 2 else ""


def bearer(header: str) -> str | None:
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def worker_key(sessions: SessionFactory, key: str) -> WorkerKey | None:
    """The unrevoked worker key, if it is one."""
    async with sessions() as s:
        return await s.scalar(
            select(WorkerKey).where(WorkerKey.key_hash == hash_key(key), WorkerKey.revoked_at.is_(None))
        )


async def key_revoked(sessions: SessionFactory, conn: WorkerConnection) -> bool:
    if conn.key is None:
        return False
    async with sessions() as s:
        revoked_at = await s.scalar(select(WorkerKey.revoked_at).where(WorkerKey.id == conn.key.id))
    return revoked_at is not None
