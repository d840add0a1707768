"""Worker subcommands: ``worker`` (serve a model to a server) and ``model tiny`` (build a test model)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from worker import engine_options as opt
from worker.spec import DEFAULT_DTYPE

ENGINE_FAILED_EXIT = 3  # the engine could not be restarted (worker.engine_health)

model_app = typer.Typer(help="Local models for tests and demos.", no_args_is_help=True)


def worker(
    server_url: Annotated[
        str,
        typer.Option(
            envvar="TOKENTRAIL_SERVER_URL",
            help="e.g. http://127.0.0.1:8000; several replicas comma-separated (the next is tried when one fails)",
        ),
    ],
    api_key: Annotated[
        str, typer.Option(envvar="TOKENTRAIL_WORKER_KEY", help="From `tokentrail admin create-worker-key`.")
    ],
    model: Annotated[str, typer.Option(help=opt.MODEL_HELP)],
    engine: opt.Engine = "hf",
    max_parallel: opt.MaxParallel = 8,
    device: opt.Device = "cpu",
    threads: opt.Threads = None,
    drain_timeout: Annotated[
        float,
        typer.Option(min=0, help="On SIGTERM: seconds to finish messages in hand before handing them back."),
    ] = 60.0,
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
    log_level: opt.LogLevel = "info",
    log_format: opt.LogFormat = "text",
) -> None:
    """Connect to a server and generate for it until stopped."""
    from shared.logs import configure_logging
    from worker.engine_health import EngineUnrecoverable
    from worker.runner import run_worker

    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
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
    try:
        run_on_uvloop(run_worker(spec, server_url=server_url, api_key=api_key, drain_timeout_s=drain_timeout))
    except KeyboardInterrupt:
        pass
    except EngineUnrecoverable as exc:
        typer.echo(f"worker: {exc}", err=True)
        raise typer.Exit(code=ENGINE_FAILED_EXIT) from exc


def run_on_uvloop(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (cheaper wake-ups from the engine thread, faster sockets)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


@model_app.command("tiny")
def model_tiny(
    out: Annotated[Path, typer.Option(help="Directory to write the model to.")],
    template: Annotated[str, typer.Option(help="Built-in chat template.")] = "chatml",
    chat_template: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="A Jinja chat template file to use instead."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for the weights.")] = 0,
    train: Annotated[
        bool, typer.Option("--train/--no-train", help="Train briefly so it writes closers, reasoning, tool calls.")
    ] = True,
    train_steps: Annotated[int | None, typer.Option(min=1, help="Training steps (default 300).")] = None,
) -> None:
    """Build a tiny Llama-style model with a locally trained BPE tokenizer, offline and deterministically."""
    from worker.tiny import build_tiny_model
    from worker.tiny.layout import TINY_TEMPLATES

    if template not in TINY_TEMPLATES:
        raise typer.BadParameter(f"--template must be one of {', '.join(TINY_TEMPLATES)}")
    path = build_tiny_model(
        out, template=template, chat_template_file=chat_template, seed=seed, train=train, train_steps=train_steps
    )
    typer.echo(str(path))


def _weights_overrides(values: list[str] | None) -> dict[int, str]:
    """``--weights N=DIR`` values as version -> directory."""
    out: dict[int, str] = {}
    for value in values or []:
        version, sep, directory = value.partition("=")
        if not sep or not version.strip().isdigit() or not directory:
            raise typer.BadParameter(f"--weights takes N=DIR (a version, then a checkpoint directory), not {value!r}")
        if int(version) in out:
            raise typer.BadParameter(f"--weights names version {int(version)} twice")
        out[int(version)] = directory
    return out


def verify(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="An export (JSONL or Parquet).")],
    model: Annotated[
        str, typer.Option(help="The model that generated it (policy version 0): HF dir or id, or 'tiny'.")
    ],
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    schema: Annotated[
        str | None,
        typer.Option(
            help="The export's --schema (default: read from native records; preference pairs of either"
            " schema are recognised by their fields)."
        ),
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature for schemas that do not record it.")
    ] = None,
    weights: Annotated[
        list[str] | None,
        typer.Option(
            metavar="N=DIR",
            help="The checkpoint directory of policy version N (repeatable): overrides the path the export"
            " names for N, and --model for N=0.",
        ),
    ] = None,
) -> None:
    """Re-score every exported sample by teacher forcing (fp32) and check masks and prefixes. Each side
    of a preference pair (export --pairs) is a sample: the shared prompt, then that side's completion.

    Tokens are re-scored under the weights of the policy version that generated them: version 0 is
    --model, version N the checkpoint directory the export names for it or --weights N=DIR (loaded into
    --model by tensor name). A version whose weights are found nowhere, or cannot be loaded, fails."""
    from worker.tiny import resolve_model
    from worker.verify import verify_file

    overrides = _weights_overrides(weights)
    try:
        report = verify_file(
            file, resolve_model(model), device=device, schema=schema, temperature=temperature, weights=overrides
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(report.summary())
    if not report.ok:
        raise typer.Exit(code=1)
