"""Worker CPU per token, without a model or a server: ``python tests/worker_bench.py [--streams 32]``.

A scripted engine (the only fake, at the engine boundary) runs ``--streams`` concurrent requests and
gives each one token per engine step, as vLLM's output handler does; every message goes through the
worker's real path: ``WorkerClient._work`` -> ``Pipeline.frames`` (prompt build, detokenizer, channels,
stop strings, frames) -> the batching outbox -> one websocket message per step, sent to a socket that
only counts bytes. Prints the worker's CPU (process time) per token, best of ``--repeat`` runs.

``--agent TURNS``: each stream is an agent loop instead: TURNS turns of one conversation, each turn's
work frame (the whole path, the prior turn's stored tokens) encoded as the server sends it and parsed
as the worker receives it, its prompt stitched; per-request costs are then part of the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from shared.api import SamplingParameters
from shared.protocol import FinishedFrame, PriorChain, WorkFrame, WorkMessage, server_frame_adapter
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

    async def run(self, first_prompts: dict[str, list[int]], *, forever: bool = False) -> None:
        """Tick until every request finished (``forever``: wait for the next ones; cancel to stop)."""
        pos: dict[str, int] = {}
        await self.started.wait()
        while self.queues or forever:
            if not self.queues:
                self.started.clear()
                await self.started.wait()
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


async def agent_run(fmt: ChatFormat, streams: int, tokens: int, turns: int) -> tuple[float, int, CountingSocket]:
    """``streams`` conversations of ``turns`` turns each; a turn's reply is ``tokens`` tokens."""
    reply = fmt.tokenizer.encode(TEXT, add_special_tokens=False)
    engine = SteppedEngine(reply, tokens, fmt.stop_token_ids[0])
    client = WorkerClient(WorkerOptions(server_url="ws://unused", api_key="", model_name="tiny"), engine, fmt)
    sock = CountingSocket()
    client._ws = sock  # type: ignore[assignment]
    client._batching = True
    finished: dict[str, FinishedFrame] = {}
    send = client._send

    async def capture(frame: Any) -> None:
        if isinstance(frame, FinishedFrame):
            finished[frame.message_id] = frame
        await send(frame)

    client._send = capture  # type: ignore[method-assign]

    async def conversation(i: int) -> None:
        path = [WorkMessage(id="system", role="system", content="You are terse.")]
        prior: PriorChain | None = None
        for t in range(turns):
            words = " ".join(TEXT.split()[(i + t) % 9 :][:20])
            path.append(WorkMessage(id=f"u{i}.{t}", role="user", content=words))
            work = WorkFrame(
                message_id=f"a{i}.{t}",
                attempt=1,
                chat_id=f"c{i}",
                model_name="tiny",
                messages=path,
                sampling=SamplingParameters(max_new_tokens=tokens + 8),
                seed=None,
                prior=prior,
            )
            frame = server_frame_adapter.validate_json(work.model_dump_json())  # as the worker receives it
            assert isinstance(frame, WorkFrame)
            await client._work(frame)
            record = finished[work.message_id].record
            path.append(WorkMessage(id=work.message_id, role="assistant", content=record.content))
            prior = PriorChain(
                message_id=work.message_id,
                prompt_ids=record.prompt_ids,
                completion_ids=record.completion_ids,
                finish_reason=record.finish_reason,
                stop_reason=record.stop_reason,
                tokenizer_hash=record.tokenizer_hash,
                template_hash=record.template_hash,
                system_prompt="You are terse.",
            )

    t0 = time.process_time()
    ticker = asyncio.create_task(engine.run({}, forever=True))
    await asyncio.gather(*(conversation(i) for i in range(streams)))
    ticker.cancel()
    return time.process_time() - t0, engine.produced, sock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-chatml")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--top-logprobs", type=int, default=0)
    ap.add_argument("--agent", type=int, default=0, metavar="TURNS", help="agent loops of TURNS turns per stream")
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
            if args.agent:
                cpu, produced, sock = runner.run(agent_run(fmt, args.streams, args.tokens, args.agent))
            else:
                cpu, produced, sock = runner.run(one_run(fmt, args.streams, args.tokens, **sampling))
        best = min(best, cpu / produced)
    print(
        f"streams={args.streams} tokens/reply={args.tokens} stop={args.stop} top_logprobs={args.top_logprobs} "
        f"agent turns={args.agent}: "
        f"{best * 1e6:.1f} us CPU per token (best of {args.repeat}); "
        f"{sock.messages} websocket messages, {sock.bytes / produced:.0f} bytes per token"
    )


if __name__ == "__main__":
    main()
