"""``tokentrail serve``: the chat server; with ``--model``, also a worker for that model in the same process.

The in-process worker is the ``tokentrail worker`` code (``worker.in_process``) connected to the hub over
an in-memory link rather than a websocket: one process fewer on the machine and no frame encoded, sent
and parsed between them. Other workers can still connect by websocket (other models, other machines).
"""

from __future__ import annotations

from typing import Annotated

import typer

from server import cli as srv
from worker import engine_options as opt
from worker.spec import DEFAULT_DTYPE

LocalDrainTimeout = Annotated[
    float | None,
    typer.Option(
        min=0,
        help="--model: on shutdown, seconds to finish messages in hand before handing them back "
        "(default 30). Env: TOKENTRAIL_LOCAL_DRAIN_TIMEOUT_S",
    ),
]


def serve(
    host: srv.Host = None,
    port: srv.Port = None,
    database_url: srv.DatabaseUrl = None,
    redis_url: srv.RedisUrl = None,
    data_dir: srv.DataDir = None,
    allow_debug_auth: srv.AllowDebugAuth = None,
    auth_secret: srv.AuthSecret = None,
    log_level: srv.LogLevel = "info",
    log_format: srv.LogFormat = "text",
    model: Annotated[
        str | None, typer.Option(help=f"Also serve this model from this process: {opt.MODEL_HELP}")
    ] = None,
    engine: opt.Engine = "hf",
    max_parallel: opt.MaxParallel = 8,
    device: opt.Device = "cpu",
    threads: opt.Threads = None,
    dtype: opt.Dtype = DEFAULT_DTYPE,
    served_model_name: opt.ServedModelName = None,
    max_model_len: opt.MaxModelLen = None,
    gpu_memory_utilization: opt.GpuMemoryUtilization = 0.9,
    tensor_parallel_size: opt.TensorParallelSize = 1,
    vllm_log_stats: opt.VllmLogStats = False,
    vllm_chunked_prefill: opt.VllmChunkedPrefill = None,
    vllm_enforce_eager: opt.VllmEnforceEager = False,
    engine_max_restarts: opt.EngineMaxRestarts = 5,
    prompt_mode: opt.PromptModeOption = "stitch",
    closer_policy: opt.CloserPolicyOption = "keep",
    chat_template_kwargs: opt.ChatTemplateKwargs = None,
    local_drain_timeout: LocalDrainTimeout = None,
    processes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Server processes answering on the port (each a replica: Redis is required above 1; not with"
            " --model). Env: TOKENTRAIL_PROCESSES",
            envvar="TOKENTRAIL_PROCESSES",
        ),
    ] = 1,
) -> None:
    """Run the chat server; with --model, also generate for that model in this process (one machine, one
    model: no separate worker process). The engine options apply only with --model."""
    settings = srv.server_settings(
        host=host,
        port=port,
        database_url=database_url,
        redis_url=redis_url,
        data_dir=data_dir,
        allow_debug_auth=allow_debug_auth,
        auth_secret=auth_secret,
        local_drain_timeout_s=local_drain_timeout,
    )
    if processes > 1:
        from server.processes import check, run_processes

        if model is not None:
            raise typer.BadParameter("--processes above 1 cannot take --model: run workers beside the server")
        try:
            check(settings, processes)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        run_processes(settings, processes, log_level, log_format)
        return
    if model is None:
        srv.run_server(settings, log_level, log_format)
        return
    from worker.in_process import InProcessWorker

    spec = opt.model_spec(
        model=model,
        engine=engine,
        max_parallel=max_parallel,
        device=device,
        threads=threads,
        dtype=dtype,
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        vllm_log_stats=vllm_log_stats,
        vllm_chunked_prefill=vllm_chunked_prefill,
        vllm_enforce_eager=vllm_enforce_eager,
        engine_max_restarts=engine_max_restarts,
        prompt_mode=prompt_mode,
        closer_policy=closer_policy,
        chat_template_kwargs=chat_template_kwargs,
    )
    srv.run_server(settings, log_level, log_format, InProcessWorker(spec))
