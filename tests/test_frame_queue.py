"""The hub's per-connection frame queue (``server/workers/frame_queue.py``) and the joining of a
message's consecutive token batches (``server/workers/ingest.py``)."""

from __future__ import annotations

import asyncio

from server.streams.protocol import TokenBatch
from server.workers.frame_queue import FrameQueue
from server.workers.ingest import joined_batch
from shared.protocol import CreditFrame, WorkerFrame


def _credits(n: int) -> list[WorkerFrame]:
    return [CreditFrame(credits=i + 1) for i in range(n)]


def test_take_returns_everything_queued_in_order_then_none_once_closed() -> None:
    async def scenario() -> list[list[int] | None]:
        q = FrameQueue()
        await q.put(_credits(2))
        await q.put(_credits(3))
        first = await q.take()
        waiting = asyncio.create_task(q.take())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing queued: take waits
        await q.put(_credits(1))
        second = await waiting
        q.close()
        return [
            [f.credits for f in first if isinstance(f, CreditFrame)] if first else None,
            [f.credits for f in second if isinstance(f, CreditFrame)] if second else None,
            await q.take(),  # type: ignore[list-item]
        ]

    assert asyncio.run(scenario()) == [[1, 2, 1, 2, 3], [1], None]


def test_a_full_queue_holds_the_sender_until_the_flusher_takes() -> None:
    async def scenario() -> tuple[bool, bool, int]:
        q = FrameQueue(limit=3)
        await q.put(_credits(3))
        sender = asyncio.create_task(q.put(_credits(2)))
        await asyncio.sleep(0.01)
        held = not sender.done()
        taken = await q.take()
        await asyncio.wait_for(sender, timeout=1)
        return held, sender.done(), len(taken or []) + len(q)

    assert asyncio.run(scenario()) == (True, True, 5)


def test_closing_releases_a_held_sender_and_keeps_what_is_queued() -> None:
    async def scenario() -> int:
        q = FrameQueue(limit=1)
        await q.put(_credits(1))
        sender = asyncio.create_task(q.put(_credits(1)))
        await asyncio.sleep(0.01)
        q.close()
        await asyncio.wait_for(sender, timeout=1)
        return len(await q.take() or [])

    assert asyncio.run(scenario()) == 2


def _batch(
    start: int, ids: list[int], channels: str = "", top: bool = False, prompt: list[int] | None = None
) -> TokenBatch:
    tops = [[(i, -0.1, "x")] for i in ids] if top else None
    return TokenBatch(start, ids, [-0.5] * len(ids), [str(i) for i in ids], channels, tops, prompt)


def test_consecutive_batches_join_with_every_field_in_order() -> None:
    joined = joined_batch(_batch(0, [1, 2], "cc", True, [9, 9]), _batch(2, [3], "r", True))
    assert joined == TokenBatch(
        0, [1, 2, 3], [-0.5] * 3, ["1", "2", "3"], "ccr", [[(1, -0.1, "x")], [(2, -0.1, "x")], [(3, -0.1, "x")]], [9, 9]
    )


def test_batches_that_do_not_follow_each_other_or_differ_in_shape_stay_apart() -> None:
    assert joined_batch(_batch(0, [1, 2]), _batch(3, [4])) is None  # a gap
    assert joined_batch(_batch(0, [1, 2]), _batch(1, [2, 3])) is None  # an overlap
    assert joined_batch(_batch(0, [1], "c"), _batch(1, [2])) is None  # channels on one only
    assert joined_batch(_batch(0, [1], top=True), _batch(1, [2])) is None  # top logprobs on one only
