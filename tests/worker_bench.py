"""Worker CPU per token, without a model or a server: ``python tests/worker_bench.py [--streams 32]``.

A scripted engine (the only fake, at the engine boundary) runs ``--streams`` concurrent requests and
gives each one token per engine step, as vLLM's output handler does; every message goes through the
worker's real path: ``WorkerClient._work`` -> ``Pipeline.frames`` (prompt build, detokenizer, channels,
stop strings, frames) -> the batching outbox -> one websocket message per step, sent to a socket that
only counts bytes. Prints the worker's CPU (process time) per token, best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from shared.api import SamplingParameters
from shared.protocol import WorkFrame, WorkMessage
from worker.chat_format import ChatFormat
from worker.client import WorkerClient, WorkerOptions
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep

TEXT = (
    "The keeper climbed the stairs again, counted 112 steps, trimmed the wick and wrote the hour in the log; "
    "outside the wind turned east — naïve café, 你好 🙂 — and the boats came in with their lamps low. "
)


class SteppedEngine:
    """Every ``step`` hands each running request its next token (one shared tick, like an engine step)."""

    def __init__(self, reply_ids: list[int], tokens_per_reply: int, stop_id: int) -> None:
        self.info = EngineInfo(name="scripted", max_context=1 << 20)
        self.reply = reply_ids
        self.n = tokens_per_reply
        self.stop_id = stop_id
        self.queues: dict[str, asyncio.Queue[TokenStep]] = {}
        self.produced = 0
        self.started = asyncio.Event()
        self.top = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        queue: asyncio.Queue[TokenStep] = asyncio.Queue()
        self.top = params.top_logprobs
        self.queues[request_id] = queue
        self.started.set()
        try:
            while True:
                step = await queue.get()
                yield step
                if step.finish_reason is not None:
                    return
        finally:
            del self.queues[request_id]

    async def run(self, first_prompts: dict[str, list[int]]) -> None:
        """Tick until every request finished."""
        pos: dict[str, int] = {}
        await self.started.wait()
        while self.queues:
            for rid, queue in list(self.queues.items()):
                k = pos.get(rid, 0)
                pos[rid] = k + 1
                last = k + 1 >= self.n
                tid = self.stop_id if last else self.reply[k % len(self.reply)]
                step = TokenStep([tid], [-0.5 - 0.001 * k])
                if self.top:
                    step.top_logprobs = [[(self.reply[(k + j) % len(self.reply)], -1.0 - j) for j in range(self.top)]]
                if k == 0:
                    step.prompt_token_ids = first_prompts.get(rid)
                    step.num_cached_tokens = 0
                if last:
                    step.finish_reason, step.stop_reason = "stop", tid
                queue.put_nowait(step)
                self.produced += 1
            for _ in range(4):  # let every consumer take its token and send its frame
                await asyncio.sleep(0)


class CountingSocket:
    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    async def send(self, data: str | bytes) -> None:
        self.messages += 1
        self.bytes += len(data)


def work_frame(i: int, max_new_tokens: int, **sampling: Any) -> WorkFrame:
    return WorkFrame(
        message_id=f"m{i}",
        attempt=1,
        chat_id=f"c{i}",
        model_name="tiny",
        messages=[
            WorkMessage(id="s", role="system", content="You are terse."),
            WorkMessage(id=f"u{i}", role="user", content=f"question number {i}: how many steps?"),
        ],
        sampling=SamplingParameters(max_new_tokens=max_new_tokens, **sampling),
        seed=None,
    )


async def one_run(fmt: ChatFormat, streams: int, tokens: int, **sampling: Any) -> tuple[float, int, CountingSocket]:
    reply = fmt.tokenizer.encode(TEXT, add_special_tokens=False)
    engine = SteppedEngine(reply, tokens, fmt.stop_token_ids[0])
    client = WorkerClient(WorkerOptions(server_url="ws://unused", api_key="", model_name="tiny"), engine, fmt)
    sock = CountingSocket()
    client._ws = sock  # type: ignore[assignment]
    client._batching = True
    frames = [work_frame(i, tokens + 8, **sampling) for i in range(streams)]
    prompts = {f"m{i}:1": client.pipeline.prompts.build(f)[0].prompt_ids for i, f in enumerate(frames)}
    t0 = time.process_time()
    ticker = asyncio.create_task(engine.run(prompts))
    await asyncio.gather(*(client._work(f) for f in frames))
    await ticker
    return time.process_time() - t0, engine.produced, sock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-chatml")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--top-logprobs", type=int, default=0)
    args = ap.parse_args()
    from worker.tiny import resolve_model

    fmt = ChatFormat.load(resolve_model(args.model))
    sampling: dict[str, Any] = {"stop": args.stop, "top_logprobs": args.top_logprobs}
    best = float("inf")
    try:
        import uvloop  # the worker runs on uvloop where it is installed

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    for _ in range(args.repeat):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            cpu, produced, sock = runner.run(one_run(fmt, args.streams, args.tokens, **sampling))
        best = min(best, cpu / produced)
    print(
        f"streams={args.streams} tokens/reply={args.tokens} stop={args.stop} top_logprobs={args.top_logprobs}: "
        f"{best * 1e6:.1f} us CPU per token (best of {args.repeat}); "
        f"{sock.messages} websocket messages, {sock.bytes / produced:.0f} bytes per token"
    )


if __name__ == "__main__":
    main()
