"""The server's CPU per token on a streamed chat completion's reader path, in one process, no HTTP:
``--readers`` replies share in-process token streams (``MemoryTokenStreams``), every step appends one
token to each, and each reply's chunks are built by the chat completion route's own code
(``_ChatContext.choice_chunks``) and handed to an ASGI ``send`` that only keeps them (the stand-in for
uvicorn: its write to the socket is not measured). Two ways, alternated ``--rounds`` times:

- ``pull``: each reader's loop is woken per step (a future per wait), reads the stream and yields the
  chunk, as every reader did before the push path and as readers on Redis streams do;
- ``push``: the reader waits with its push path, which builds and sends the chunk where the batch is
  appended (``MemoryTokenStreams.deliver``), as the generation routes' lane runs a one-choice stream.

    python benchmarks/reader_path.py --readers 32 --steps 2000 --rounds 3

Prints CPU microseconds per token for each round and way, then the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.api.openai_chat import _ChatContext, _Choice
from server.streams.memory import MemoryTokenStreams
from server.streams.protocol import TokenBatch
from shared.openai_api import ChatCompletionRequest


async def per_token_us(readers: int, steps: int, push: bool) -> float:
    """CPU microseconds per token delivered to ``readers`` readers over ``steps`` engine steps."""
    streams = MemoryTokenStreams()
    state: Any = types.SimpleNamespace(
        streams=streams,
        settings=types.SimpleNamespace(pending_event_interval_s=1.0, stream_interval=1),
        hub=types.SimpleNamespace(finished={}),
    )
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    delivered = 0

    async def send(message: Any) -> None:
        nonlocal delivered
        delivered += 1

    async def read(k: int) -> None:
        ctx = _ChatContext(request, f"chatcmpl-{k}", 0, False, {})
        choice = _Choice(ctx, 0)
        if push:
            choice.send = send  # as SseStream.pump gives it
        async for chunk in ctx.choice_chunks(state, 0, f"m{k}", choice=choice):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    tasks = [asyncio.create_task(read(k)) for k in range(readers)]
    await asyncio.sleep(0.01)  # every reader waits on its stream
    start = time.process_time()
    for step in range(steps):
        for k in range(readers):
            await streams.append(f"m{k}", TokenBatch(step, [300 + step % 50], [-0.5], [f"w{step % 7}"], "c"))
        await asyncio.sleep(0)  # the woken readers run
        await asyncio.sleep(0)
    spent = time.process_time() - start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if delivered != readers * steps:
        raise RuntimeError(f"{delivered} chunks delivered, expected {readers * steps}")
    return spent / (readers * steps) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    got: dict[str, list[float]] = {"pull": [], "push": []}
    for r in range(args.rounds):
        for way in ("pull", "push"):
            us = run(per_token_us(args.readers, args.steps, way == "push"))
            got[way].append(us)
            print(f"round {r + 1} {way}: {us:.1f} us per token", flush=True)
    pull, push = statistics.median(got["pull"]), statistics.median(got["push"])
    print(f"median: pull {pull:.1f} us, push {push:.1f} us per token ({push / pull:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
