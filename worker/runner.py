"""Wires a worker together: resolve the model, load tokenizer and engine (``load_model``, shared with the
in-process worker of ``tokentrail serve --model``), run the client over the websocket (``run_worker``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

from shared.gc_heap import freeze_startup_heap
from worker import fault_injection
from worker.chat_format import ChatFormat
from worker.client import WorkerClient, WorkerOptions
from worker.engine_health import SupervisedEngine
from worker.engines.contract import Engine
from worker.spec import ModelSpec, VLLMOptions

log = logging.getLogger(__name__)


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
            enable_chunked_prefill=opts.chunked_prefill,
            enforce_eager=opts.enforce_eager,
        )
    raise ValueError(f"unknown engine {name!r}: hf or vllm")


@dataclass
class LoadedModel:
    spec: ModelSpec
    path: str
    fmt: ChatFormat
    engine: SupervisedEngine  # started

    def client(self, server_url: str = "", api_key: str = "") -> WorkerClient:
        """A client generating with this model (no server URL: it serves an in-process link)."""
        spec = self.spec
        options = WorkerOptions(
            server_url=server_url,
            api_key=api_key,
            model_name=spec.name,
            max_parallel=spec.max_parallel,
            prompt_mode=spec.prompt_mode,
            closer_policy=spec.closer_policy,
        )
        return WorkerClient(options, self.engine, self.fmt, self.path)


async def load_model(spec: ModelSpec) -> LoadedModel:
    """Resolve the model, load its tokenizer and chat template, and start its engine (supervised: a dead
    engine is restarted, ``worker.engine_health``)."""
    from worker.tiny import resolve_model

    model_path = await asyncio.to_thread(resolve_model, spec.model)
    fmt = await asyncio.to_thread(ChatFormat.load, model_path, template_kwargs=spec.template_kwargs or None)
    engine = SupervisedEngine(
        lambda: make_engine(
            spec.engine,
            model_path,
            device=spec.device,
            dtype=spec.dtype,
            max_parallel=spec.max_parallel,
            vllm=spec.vllm,
            threads=spec.threads,
        ),
        spec.restart_policy,
    )
    await engine.start()
    fault_injection.install(engine)
    log.info("model %s loaded from %s (engine %s)", spec.model, model_path, spec.engine)
    return LoadedModel(spec, model_path, fmt, engine)


async def run_worker(spec: ModelSpec, *, server_url: str, api_key: str, drain_timeout_s: float = 60.0) -> None:
    """``tokentrail worker``: serve ``spec`` to a server over its websocket until SIGTERM."""
    loaded = await load_model(spec)
    freeze_startup_heap()  # this process's own command: the model's objects stay for its life
    try:
        await _serve_until_sigterm(loaded.client(server_url, api_key), drain_timeout_s)
    finally:
        await loaded.engine.close()


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
