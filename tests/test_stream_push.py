"""The push path of a streamed chat completion (``_Choice``, ``MemoryTokenStreams.deliver``,
``eager_send``): a waiting reader's token chunks are written where the batch is appended, and a write
that cannot finish at once hands the stream back to the reader's loop, with nothing lost or reordered.

The ASGI ``send`` here is a stand-in for the HTTP server (the boundary: what it was given, in order);
the streams, the chunk building and the reader loop are the server's own."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from server.api.openai_chat import _ChatContext, _Choice
from server.openai.streaming import eager_send
from server.streams.memory import MemoryTokenStreams
from server.streams.protocol import TokenBatch
from shared.openai_api import ChatCompletionRequest


async def test_eager_send_returns_none_when_the_send_finishes_at_once() -> None:
    got: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        got.append(message["body"])

    assert eager_send(send, b"data: 1\n\n") is None  # type: ignore[arg-type]
    assert got == [b"data: 1\n\n"]


async def test_eager_send_finishes_a_send_that_waits_in_a_task() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    got: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        await gate  # the server waits for its write buffer to drain
        got.append(message["body"])

    pending = eager_send(send, b"x")  # type: ignore[arg-type]
    assert pending is not None and not pending.done() and got == []
    gate.set_result(None)
    await asyncio.wait_for(pending, 1)
    assert got == [b"x"]


async def test_eager_send_raises_what_the_send_raised() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def send(message: dict[str, Any]) -> None:
        await gate
        raise ConnectionResetError("gone")

    pending = eager_send(send, b"x")  # type: ignore[arg-type]
    assert pending is not None
    gate.set_result(None)
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(pending, 1)


class _Counted(_Choice):
    pushed = 0

    def __call__(self, batch: TokenBatch) -> bool:
        took = super().__call__(batch)
        self.pushed += took
        return took


def _reader(
    streams: MemoryTokenStreams, message_id: str, send: Callable[[dict[str, Any]], Awaitable[None]] | None
) -> tuple[_Counted, Callable[[], Awaitable[None]]]:
    state: Any = types.SimpleNamespace(
        streams=streams,
        settings=types.SimpleNamespace(pending_event_interval_s=1.0, stream_interval=1),
        hub=types.SimpleNamespace(finished={}),
    )
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    ctx = _ChatContext(req, "chatcmpl-1", 1, False, {})
    choice = _Counted(ctx, 0)
    choice.send = send  # type: ignore[assignment]

    async def run() -> None:
        async for chunk in ctx.choice_chunks(state, 0, message_id, choice=choice):
            assert send is not None
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    return choice, run


def _said(bodies: list[bytes]) -> tuple[str, list[int]]:
    text, ids = "", []
    for body in bodies:
        chunk = orjson.loads(body.removeprefix(b"data: "))
        [choice] = chunk["choices"]
        text += choice["delta"].get("content", "")
        ids += choice["token_ids"]
    return text, ids


@pytest.mark.parametrize("slow_every", [0, 3])
async def test_pushed_chunks_carry_every_token_once_in_order(slow_every: int) -> None:
    """Tokens appended one batch at a time reach the client exactly once and in order, whether every
    write finishes at once (all pushed after the first) or every ``slow_every``-th write waits (the loop
    takes over until it has finished)."""
    streams = MemoryTokenStreams()
    bodies: list[bytes] = []
    calls = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        if slow_every and calls % slow_every == 0:
            await asyncio.sleep(0.002)  # a slow client: the write waits
        bodies.append(message["body"])

    choice, run = _reader(streams, "m1", send)
    task = asyncio.create_task(run())
    texts = [f"t{k}," for k in range(60)]
    for k, text in enumerate(texts):
        await streams.append("m1", TokenBatch(k, [100 + k], [-0.5], [text], "c"))
        await asyncio.sleep(0)
        if k % 7 == 0:
            await asyncio.sleep(0.003)  # let the reader catch up now and then
    for _ in range(200):
        if _said(bodies)[1] == list(range(100, 160)):
            break
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _said(bodies) == ("".join(texts), list(range(100, 160)))
    assert choice.pushed > 0  # the push path carried tokens
    assert streams._streams["m1"].waiters == {}  # the cancelled read left no waiter behind


async def test_a_reader_without_send_takes_every_batch_itself() -> None:
    streams = MemoryTokenStreams()
    bodies: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        bodies.append(message["body"])

    choice, _ = _reader(streams, "m1", None)  # FastAPI's own streaming: no send to push with
    state: Any = types.SimpleNamespace(
        streams=streams,
        settings=types.SimpleNamespace(pending_event_interval_s=1.0, stream_interval=1),
        hub=types.SimpleNamespace(finished={}),
    )

    async def run() -> None:
        async for chunk in choice.ctx.choice_chunks(state, 0, "m1", choice=choice):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    task = asyncio.create_task(run())
    for k in range(10):
        await streams.append("m1", TokenBatch(k, [200 + k], [-0.5], ["a"], "c"))
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _said(bodies) == ("a" * 10, list(range(200, 210)))
    assert choice.pushed == 0


def test_reader_path_benchmark_runs_both_ways() -> None:
    """``benchmarks/reader_path.py`` runs (no timing asserted: the figures are for the docs)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "reader_path.py"
    out = subprocess.run(
        [sys.executable, str(script), "--readers", "4", "--steps", "50", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "round 1 pull" in out.stdout and "round 1 push" in out.stdout and "median" in out.stdout
