"""In-process work queue and worker directory: the embedded default for a single server process.

Same semantics as the Redis backends (DESIGN D3): claimed items stay pending, owned by a consumer,
until ``ack``; ``reclaim`` takes over items whose owner has not touched them for ``min_idle_s``
(like XAUTOCLAIM), and every hand-out increments ``deliveries``. Plain asyncio, no threads.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace

from server.queue.protocol import QueueFull, WorkerEntry, WorkItem


@dataclass
class _Pending:
    item: WorkItem
    consumer: str
    touched: float  # time.monotonic() of the last hand-out or touch


@dataclass
class _ModelQueue:
    waiting: deque[WorkItem] = field(default_factory=deque)
    retry: deque[WorkItem] = field(default_factory=deque)  # served before ``waiting``, uncapped
    # preferred worker -> its lane: (item, time.monotonic() it was enqueued), oldest first
    lanes: dict[str, deque[tuple[WorkItem, float]]] = field(default_factory=dict)
    capacity: dict[str, tuple[int, float]] = field(default_factory=dict)  # claimer -> (slots, last claim)
    pending: dict[str, _Pending] = field(default_factory=dict)  # delivery_id -> claim, FIFO
    # Set whenever a lane gains items; claimers wait on it.
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def queued(self) -> int:
        return len(self.waiting) + sum(len(lane) for lane in self.lanes.values())

    def owner_slots(self, owner: str, now: float, live_s: float) -> int:
        """The lane owner's capacity; 0 when it has not claimed within ``live_s`` (gone)."""
        slots, seen = self.capacity.get(owner, (0, 0.0))
        return slots if now - seen <= live_s else 0


class MemoryWorkQueue:
    """Work queue of one process. ``max_queue_size`` bounds waiting plus claimed-unacked items.

    A live worker claims at least once a ``claim`` timeout (its dispatch loop) or holds no free slot;
    one that has claimed nothing for ``owner_live_s`` is taken for gone and its lane handed over."""

    def __init__(self, max_queue_size: int = 1000, route_wait_s: float = 0.5, owner_live_s: float = 30.0) -> None:
        self.max_queue_size = max_queue_size
        self.route_wait_s = route_wait_s
        self.owner_live_s = owner_live_s
        self._queues: dict[str, _ModelQueue] = {}
        self._ids = itertools.count(1)

    def _queue(self, model: str) -> _ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = _ModelQueue()
        return queue

    async def enqueue(
        self, model: str, message_id: str, attempt: int, *, retry: bool = False, prefer: str = ""
    ) -> None:
        queue = self._queue(model)
        if not retry and queue.queued() + len(queue.pending) >= self.max_queue_size:
            raise QueueFull(model)
        delivery_id = f"m-{next(self._ids)}"
        lane = "" if retry else prefer
        item = WorkItem(model, message_id, attempt, delivery_id, deliveries=0, retry=retry, lane=lane)
        if lane:
            queue.lanes.setdefault(lane, deque()).append((item, time.monotonic()))
        else:
            (queue.retry if retry else queue.waiting).append(item)
        queue.ready.set()

    async def claim(self, model: str, consumer: str, count: int, timeout_s: float, capacity: int = 0) -> list[WorkItem]:
        queue = self._queue(model)
        if count <= 0:
            return []
        queue.capacity[consumer] = (max(capacity, count), time.monotonic())
        if len(queue.capacity) > 1024:  # connections come and go: forget the long gone
            horizon = time.monotonic() - 10 * self.owner_live_s
            queue.capacity = {c: e for c, e in queue.capacity.items() if e[1] >= horizon}
        deadline = time.monotonic() + timeout_s
        while True:
            items = self._take(queue, consumer, count)
            if items or (remaining := deadline - time.monotonic()) <= 0:
                return items
            wake = self._next_handover(queue, consumer)
            queue.ready.clear()
            try:
                async with asyncio.timeout(min(remaining, wake)):
                    await queue.ready.wait()
            except TimeoutError:
                pass

    def _take(self, queue: _ModelQueue, consumer: str, count: int) -> list[WorkItem]:
        """Retry lane, own lane, shared lane, then other lanes' items due for hand-over."""
        now = time.monotonic()
        taken: list[WorkItem] = []
        while queue.retry and len(taken) < count:
            taken.append(queue.retry.popleft())
        own = queue.lanes.get(consumer)
        while own and len(taken) < count:
            taken.append(own.popleft()[0])
        while queue.waiting and len(taken) < count:
            taken.append(queue.waiting.popleft())
        for owner, lane in list(queue.lanes.items()):
            if owner == consumer:
                continue
            slots = queue.owner_slots(owner, now, self.owner_live_s)
            while lane and len(taken) < count and (len(lane) > slots or now - lane[0][1] >= self.route_wait_s):
                taken.append(lane.popleft()[0])
        for owner in [o for o, lane in queue.lanes.items() if not lane]:
            del queue.lanes[owner]
        items = []
        for item in taken:
            item = replace(item, deliveries=item.deliveries + 1)
            queue.pending[item.delivery_id] = _Pending(item, consumer, now)
            items.append(item)
        return items

    def _next_handover(self, queue: _ModelQueue, consumer: str) -> float:
        """Seconds until another lane's oldest item is due for hand-over (inf: none waits)."""
        now = time.monotonic()
        heads = [lane[0][1] for owner, lane in queue.lanes.items() if owner != consumer and lane]
        return max(min(heads) + self.route_wait_s - now, 0.001) if heads else float("inf")

    async def holds(self, model: str, message_id: str) -> bool:
        queue = self._queues.get(model)
        if queue is None:
            return False
        waiting = (*queue.retry, *queue.waiting, *(i for lane in queue.lanes.values() for i, _ in lane))
        return any(i.message_id == message_id for i in waiting) or any(
            p.item.message_id == message_id for p in queue.pending.values()
        )

    async def ack(self, item: WorkItem) -> None:
        queue = self._queues.get(item.model)
        if queue is not None:
            queue.pending.pop(item.delivery_id, None)

    async def touch(self, items: list[WorkItem], consumer: str) -> None:
        now = time.monotonic()
        for item in items:
            queue = self._queues.get(item.model)
            pending = queue.pending.get(item.delivery_id) if queue is not None else None
            # Only the current owner may refresh: a reclaimed item stays with its new owner.
            if pending is not None and pending.consumer == consumer:
                pending.touched = now

    async def reclaim(self, model: str, consumer: str, min_idle_s: float, count: int) -> list[WorkItem]:
        queue = self._queues.get(model)
        if queue is None:
            return []
        now = time.monotonic()
        items: list[WorkItem] = []
        for pending in queue.pending.values():
            if len(items) >= count:
                break
            if now - pending.touched >= min_idle_s:
                pending.item = replace(pending.item, deliveries=pending.item.deliveries + 1)
                pending.consumer = consumer
                pending.touched = now
                items.append(pending.item)
        return items

    async def take_over(self, model: str, consumer: str, prefixes: list[str]) -> list[WorkItem]:
        queue = self._queues.get(model)
        if queue is None or not prefixes:
            return []
        items: list[WorkItem] = []
        for pending in queue.pending.values():
            if pending.consumer.startswith(tuple(prefixes)):
                pending.item = replace(pending.item, deliveries=pending.item.deliveries + 1)
                pending.consumer = consumer
                pending.touched = time.monotonic()
                items.append(pending.item)
        return items

    async def position(self, model: str, message_id: str) -> tuple[int, int]:
        queue = self._queues.get(model)
        if queue is None:
            return 0, 0
        lanes = sorted((entry for lane in queue.lanes.values() for entry in lane), key=lambda e: e[1])
        waiting = (*queue.retry, *(i for i, _ in lanes), *queue.waiting)
        for ahead, item in enumerate(waiting):
            if item.message_id == message_id:
                return ahead, len(waiting)
        return 0, len(waiting)

    async def close(self) -> None:
        self._queues.clear()


class MemoryWorkerDirectory:
    """Connected workers of one process; entries vanish ``ttl_s`` after their last refresh."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[WorkerEntry, float]] = {}  # worker_id -> (entry, expires_at)
        self._seen: dict[str, float] = {}  # model -> time.monotonic() of its last registration

    async def register(self, entry: WorkerEntry, ttl_s: float) -> None:
        self._entries[entry.worker_id] = (entry, time.monotonic() + ttl_s)
        self._seen[entry.model_name] = time.monotonic()

    async def unregister(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)

    async def workers(self) -> list[WorkerEntry]:
        now = time.monotonic()
        expired = [worker_id for worker_id, (_, expires) in self._entries.items() if expires <= now]
        for worker_id in expired:
            del self._entries[worker_id]
        return [entry for entry, _ in self._entries.values()]

    async def recent_models(self, within_s: float) -> set[str]:
        since = time.monotonic() - within_s
        return {model for model, seen in self._seen.items() if seen >= since}

    async def close(self) -> None:
        self._entries.clear()
