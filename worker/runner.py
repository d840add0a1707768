"""Wires a worker process together: resolve the model, load tokenizer and engine, run the client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from typing import Any

from worker.chat_format import ChatFormat
from worker.client import WorkerClient, WorkerOptions
from worker.engines.contract import Engine
from worker.prompt_builder import CloserPolicy, PromptMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMOptions:
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    log_stats: bool = False  # vLLM's periodic stats log and metrics


def make_engine(
    name: str,
    model_path: str,
    *,
    device: str,
    dtype: str,
    max_parallel: int,
    vllm: VLLMOptions | None = None,
    threads: int | None = None,
) -> Engine:
    if name == "hf":
        from worker.engines.hf import HFEngine

        return HFEngine(model_path, device=device, dtype=dtype, max_batch_size=max_parallel, threads=threads)
    if name == "vllm":
        from worker.engines.vllm import VLLMEngine

        opts = vllm or VLLMOptions()
        return VLLMEngine(
            model_path,
            dtype="auto" if dtype == "auto" else dtype,
            max_model_len=opts.max_model_len,
            tensor_parallel_size=opts.tensor_parallel_size,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            max_num_seqs=max_parallel,
            log_stats=opts.log_stats,
        )
    raise ValueError(f"unknown engine {name!r}: hf or vllm")


async def run_worker(
    *,
    server_url: str,
    api_key: str,
    model: str,
    engine_name: str,
    max_parallel: int,
    device: str,
    dtype: str,
    served_model_name: str | None,
    prompt_mode: PromptMode = "stitch",
    closer_policy: CloserPolicy = "keep",
    template_kwargs: dict[str, Any] | None = None,
    vllm: VLLMOptions | None = None,
    threads: int | None = None,
    drain_timeout_s: float = 60.0,
) -> None:
    from worker.tiny import resolve_model

    model_path = await asyncio.to_thread(resolve_model, model)
    fmt = await asyncio.to_thread(ChatFormat.load, model_path, template_kwargs=template_kwargs)
    engine = make_engine(
        engine_name, model_path, device=device, dtype=dtype, max_parallel=max_parallel, vllm=vllm, threads=threads
    )
    await engine.start()
    log.info("model %s loaded from %s (engine %s)", model, model_path, engine_name)
    options = WorkerOptions(
        server_url=server_url,
        api_key=api_key,
        model_name=served_model_name or model,
        max_parallel=max_parallel,
        prompt_mode=prompt_mode,
        closer_policy=closer_policy,
    )
    client = WorkerClient(options, engine, fmt)
    try:
        await _serve_until_sigterm(client, drain_timeout_s)
    finally:
        await engine.close()


async def _serve_until_sigterm(client: WorkerClient, drain_timeout_s: float) -> None:
    """Run the client; SIGTERM drains it (no new work, in-hand work finished or handed back)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows / outside the main thread
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    main = asyncio.create_task(client.run_forever())
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({main, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() and not main.done():
            log.info("SIGTERM: draining")
            await client.drain(drain_timeout_s)
            await asyncio.wait({main}, timeout=10)
        if main.done():
            main.result()
    finally:
        for task in (main, waiter):
            task.cancel()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGTERM)
