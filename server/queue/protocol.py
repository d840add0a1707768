"""Work queue and worker directory contracts, shared by the in-process and Redis backends.

The database is the source of truth for messages; the queue only delivers ``(message_id, attempt)``
to workers (DESIGN D3). A claimed item stays pending until ``ack``; items whose claimer died are
handed out again by ``reclaim``; ``deliveries`` counts how often an item was handed out.

Each model has two lanes: new work, in arrival order, and a retry lane for work that was already
started or accepted and then lost (a dead worker, a dead replica, a Redis restart). ``claim``
serves the retry lane first, and the retry lane is not capped (its items were admitted once
already), so a reader waiting mid-stream is resumed before new work starts.

Routing (DESIGN D5, ``server.workers.routing``): new work may name a preferred worker, the one whose
engine holds the turn's prefix in its cache. Such an item waits in that worker's lane, which its
worker claims before the shared lane. Any other worker of the model takes it once it has waited
``route_wait_s`` or once the lane holds more items than its worker's capacity (a busy preferred worker
delays a turn by a bounded time, never starves it, and no worker idles while another's lane
overflows). A lane whose worker is gone is taken from at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class QueueFull(Exception):
    """The model's queue holds ``max_queue_size`` items already."""


@dataclass(frozen=True)
class WorkItem:
    model: str
    message_id: str
    attempt: int
    delivery_id: str  # backend-specific id of this queue entry (the stream entry id in Redis)
    deliveries: int = 1
    retry: bool = False  # in the retry lane
    lane: str = ""  # the preferred worker whose lane held it ("" for the shared lanes)


@dataclass(frozen=True)
class WorkerEntry:
    """One connected worker, as published in the directory."""

    worker_id: str
    model_name: str
    compat_hash: str
    engine: str
    max_context: int | None
    capacity: int
    server_id: str = ""  # the server process the worker is connected to
    rpc: bool = False  # answers tokenizer calls (rpc frames)
    inflight: int = 0  # messages it is generating (as of its last heartbeat)
    last_seen: float = 0.0  # wall-clock time of its last frame (as of its last heartbeat)
    key_id: str = ""  # the worker key it connected with (revoking that key disconnects it)
    key_name: str = ""
    engine_state: str = "ready"  # ready | restarting | failed (worker.engine_health)
    engine_deaths: int = 0  # since the worker started
    engine_restarts: int = 0
    served: int = 0  # replies this connection finished and stored (as of its last heartbeat)
    policy_version: int = 0  # the weights version it serves (server.weights)
    weights_error: str = ""  # why it could not load the model's current version (it takes no work then)


class WorkQueue(Protocol):
    async def enqueue(
        self, model: str, message_id: str, attempt: int, *, retry: bool = False, prefer: str = ""
    ) -> None:
        """Append an item to the model's new-work lane (QueueFull when that is full), with ``prefer``
        to that worker's lane (counted in the same bound), or, with ``retry``, to its retry lane,
        which is served first and never full."""
        ...

    async def claim(self, model: str, consumer: str, count: int, timeout_s: float, capacity: int = 0) -> list[WorkItem]:
        """Up to ``count`` items for ``consumer`` (a worker of ``capacity`` slots): the retry lane,
        its own lane, the shared lane, then what other lanes hand over; waiting at most ``timeout_s``
        for the first."""
        ...

    async def ack(self, item: WorkItem) -> None:
        """The item is done with (stored, failed for good, or superseded by a new attempt)."""
        ...

    async def touch(self, items: list[WorkItem], consumer: str) -> None:
        """Keep claimed items owned by a live consumer so that ``reclaim`` leaves them alone."""
        ...

    async def reclaim(self, model: str, consumer: str, min_idle_s: float, count: int) -> list[WorkItem]:
        """Take over items claimed by consumers that have not touched them for ``min_idle_s``."""
        ...

    async def take_over(self, model: str, consumer: str, prefixes: list[str]) -> list[WorkItem]:
        """Take over, at once, every item claimed by a consumer whose name starts with one of
        ``prefixes`` (the workers of server processes presumed dead)."""
        ...

    async def holds(self, model: str, message_id: str) -> bool:
        """Whether the queue knows the message: waiting, claimed, or (Redis) enqueued within a day.
        False after the queue lost it (a Redis restart without persistence, a restarted process)."""
        ...

    async def position(self, model: str, message_id: str) -> tuple[int, int]:
        """``(queue_position, queue_size)`` of a queued message; ``(0, size)`` once dequeued."""
        ...

    async def close(self) -> None: ...


class WorkerDirectory(Protocol):
    async def register(self, entry: WorkerEntry, ttl_s: float) -> None:
        """Publish or refresh a worker; it disappears ``ttl_s`` after its last refresh."""
        ...

    async def unregister(self, worker_id: str) -> None: ...

    async def workers(self) -> list[WorkerEntry]: ...

    async def recent_models(self, within_s: float) -> set[str]:
        """Models some worker offered within the last ``within_s`` seconds (connected or not)."""
        ...

    async def close(self) -> None: ...
