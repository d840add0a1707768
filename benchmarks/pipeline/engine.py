"""The engine alone, in a process of its own (the vLLM environment's python for vLLM): ``c`` tasks run
conversations straight against ``engine.generate``, no server, no HTTP.

Prompts are the chat template's rendering of the conversation (single-turn: rendered once; agent
loops: the whole history each turn, the assistant turns as the decoded text of the sampled tokens,
the way a client sees them). CPU: ``engine`` is this process (the driver, and the whole hf engine),
``engine_core`` its descendants (vLLM's engine core and model runner).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from benchmarks.pipeline.conversation import Dialogue, Workload, closed_loop
from benchmarks.pipeline.measure import Arrivals, CpuMeter, Point, Role, Window
from benchmarks.pipeline.stack import engine_dtype


async def engine_points(
    engine_name: str,
    model_dir: str,
    workloads: list[Workload],
    levels: list[int],
    duration: float,
    device: str = "cpu",
    dtype: str | None = None,
) -> list[Point]:
    from shared.protocol import WorkMessage
    from worker.chat_format import ChatFormat
    from worker.engines.contract import GenerationParams

    engine: Any
    if engine_name == "vllm":
        from worker.engines.vllm import VLLMEngine

        engine = VLLMEngine(
            model_dir,
            max_model_len=2048,
            gpu_memory_utilization=0.2,
            max_num_seqs=max(levels),
            dtype=engine_dtype(dtype),
        )
    else:
        from worker.engines.hf import HFEngine

        engine = HFEngine(model_dir, max_batch_size=max(levels), device=device, dtype=engine_dtype(dtype))
    fmt = ChatFormat.load(model_dir)
    stops = set(fmt.stop_token_ids)
    rendered: dict[str, list[int]] = {}  # single-turn prompts, rendered once
    requests = itertools.count()
    seeds = itertools.count()

    def prompt_ids(d: Dialogue) -> list[int]:
        msgs = [WorkMessage(id=f"m{k}", role=m["role"], content=m["content"] or "") for k, m in enumerate(d.messages)]
        if d.workload.kind == "single":
            text = d.messages[-1]["content"]
            if text not in rendered:
                rendered[text] = fmt.render(msgs)
            return rendered[text]
        return fmt.render(msgs)

    def bound(point: Point, window: Window, workload: Workload) -> Any:
        async def turn(d: Dialogue, slot: int) -> None:
            index, _ = d.start_turn()
            prompt = prompt_ids(d)
            params = GenerationParams(
                max_new_tokens=workload.tokens,
                temperature=1.0,
                seed=next(seeds) if workload.seed_requests else None,
                stop_token_ids=() if workload.ignore_eos else fmt.stop_token_ids,
            )
            arrivals = Arrivals(point, window, index)
            ids: list[int] = []
            cached = None
            async for step in engine.generate(f"bench-{next(requests)}", prompt, params):
                arrivals.tokens(len(step.token_ids))
                ids += step.token_ids
                cached = step.num_cached_tokens if step.num_cached_tokens is not None else cached
            if window.open:
                point.requests += 1
                point.usage(index, len(prompt), cached)
            if workload.kind != "single":
                text = fmt.tokenizer.decode([i for i in ids if i not in stops], skip_special_tokens=True)
                d.finish_turn({"role": "assistant", "content": text})
            else:
                d.finish_turn({"role": "assistant", "content": ""})

        return turn

    await engine.start()
    points = []
    meter = CpuMeter([Role("engine", os.getpid(), "engine_core")])
    try:
        for workload in workloads:
            top = max(levels)  # warm-up: the highest concurrency, about two turns per client
            warm, forever = Point("engine", "-", workload.kind, workload.stop, top), Window(1e9)
            turn = bound(warm, forever, workload)
            await closed_loop(warm, forever, top, workload, turn, key="warm-engine", max_turns=2 * top)
            for c in levels:
                point = Point("engine", "-", workload.kind, workload.stop, c, turns=workload.turns_per_conversation)
                window = Window(duration)
                # the same conversations as the OpenAI front doors of this run
                turn = bound(point, window, workload)
                await closed_loop(point, window, c, workload, turn, key="openai", meter=meter)
                points.append(point)
    finally:
        await engine.close()
    return points
