"""``--engine synthetic``: tokentrail's arms with a benchmark-only stand-in for the model, so that the CPU
each process spends per token is tokentrail's own (no engine sharing the cores, no engine-core spin).

``StepClockEngine`` paces every running request on one clock, as vLLM's engine steps do: each
``step_ms`` every request gets its next token, all of them in the same turn of the event loop (one
engine output per step, as tokentrail's worker receives vLLM's). With the model's stop tokens in the
request (``--stop natural``) a reply ends on the chat template's end token after a length drawn per
request between a quarter of ``max_new_tokens`` and all of it; without (``--stop fixed``) it runs to
``max_new_tokens``. Token ids are ordinary vocabulary entries, so that detokenizing, channel tracking
and stop-string checks run as for a real reply.

The arms' processes are tokentrail's own commands (``tokentrail serve``, ``tokentrail worker``,
``tokentrail serve --model``) started by this script with ``--synthetic-tokentrail``: the model's loader
(``worker.runner.load_model``) is replaced in that process by one that keeps the tokenizer and chat
template of ``--model`` and generates with the step clock. Nothing of this is part of tokentrail.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

STEP_MS_ENV = "TOKENTRAIL_BENCH_STEP_MS"
DEFAULT_STEP_MS = 8.0  # about vLLM's inter-token gap at c=8 on the tiny model on this 2-core machine


class _Request:
    __slots__ = ("end", "prompt", "queue", "remaining", "rng")

    def __init__(self, prompt: list[int], length: int, end: int | None, seed: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.remaining = length
        self.end = end  # the token that ends a natural stop, None: runs to its length
        self.prompt: list[int] | None = prompt  # sent with the first step
        self.rng = random.Random(seed)


class StepClockEngine:
    """Benchmark-only engine: every ``step_s`` seconds, each running request's next token."""

    def __init__(self, vocab_ids: Sequence[int], step_s: float, max_context: int = 1 << 20) -> None:
        from worker.engines.contract import EngineInfo

        self.info = EngineInfo(name="synthetic", max_context=max_context)
        self.ids = list(vocab_ids)
        self.step_s = step_s
        self._running: dict[str, _Request] = {}
        self._clock: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        self._clock = asyncio.create_task(self._run(), name="step-clock")

    async def close(self) -> None:
        if self._clock is not None:
            self._clock.cancel()

    def failure(self) -> str | None:
        return None

    async def abort(self, request_id: str) -> None:
        req = self._running.pop(request_id, None)
        if req is not None:
            req.queue.put_nowait(None)

    async def _run(self) -> None:
        from worker.engines.contract import TokenStep

        loop = asyncio.get_running_loop()
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            started = loop.time()
            for rid, req in list(self._running.items()):
                req.remaining -= 1
                last = req.remaining <= 0
                token = req.end if last and req.end is not None else req.rng.choice(self.ids)
                step = TokenStep(token_ids=[token], logprobs=[-1.0 - req.rng.random()])
                if req.prompt is not None:
                    step.prompt_token_ids, step.num_cached_tokens, req.prompt = req.prompt, 0, None
                if last:
                    step.finish_reason = "stop" if req.end is not None else "length"
                    step.stop_reason = req.end
                    del self._running[rid]
                req.queue.put_nowait(step)
                if last:
                    req.queue.put_nowait(None)
            await asyncio.sleep(max(0.0, self.step_s - (loop.time() - started)))

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any) -> AsyncIterator[Any]:
        n = max(1, int(params.max_new_tokens))
        stops = list(params.stop_token_ids)
        seed = zlib.crc32(request_id.encode())  # the same lengths for the same request ids, run to run
        length = random.Random(seed).randint(max(1, n // 4), n) if stops else n
        req = _Request(list(prompt_ids), length, stops[0] if stops else None, seed)
        self._running[request_id] = req
        self._wake.set()
        try:
            while (step := await req.queue.get()) is not None:
                yield step
        finally:
            self._running.pop(request_id, None)


def run_tokentrail(argv: list[str]) -> None:
    """A tokentrail command (``serve``, ``worker``, ``serve --model``) whose model generates with the step
    clock: its loader keeps the tokenizer and chat template of ``--model``."""
    import worker.in_process as in_process
    import worker.runner as runner
    from worker.chat_format import ChatFormat
    from worker.engine_health import SupervisedEngine
    from worker.spec import ModelSpec

    step_s = float(os.environ.get(STEP_MS_ENV, DEFAULT_STEP_MS)) / 1000

    async def load_model(spec: ModelSpec) -> runner.LoadedModel:
        fmt = ChatFormat.load(spec.model)
        specials = fmt.special_ids
        vocab = [i for i in range(200, min(2000, len(fmt.tokenizer))) if i not in specials]
        engine = SupervisedEngine(lambda: StepClockEngine(vocab, step_s))  # type: ignore[arg-type,return-value]
        await engine.start()
        return runner.LoadedModel(spec, spec.model, fmt, engine)

    runner.load_model = load_model  # type: ignore[assignment]
    in_process.load_model = load_model  # type: ignore[assignment]
    from tokentrail.cli import app

    sys.argv = ["tokentrail", *argv]
    app()
