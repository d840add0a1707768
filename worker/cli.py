"""Worker subcommands: ``worker`` (serve a model to a server) and ``model tiny`` (build a test model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

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
    model: Annotated[str, typer.Option(help="Hugging Face model dir or id, or 'tiny' for the built-in test model.")],
    engine: Annotated[str, typer.Option(help="hf (transformers) or vllm.")] = "hf",
    max_parallel: Annotated[int, typer.Option(min=1, max=4096, help="Messages generated at once.")] = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda (hf engine).")] = "cpu",
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="hf on CPU: torch threads (default: OMP_NUM_THREADS, else all cores but one)."),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(min=0, help="On SIGTERM: seconds to finish messages in hand before handing them back."),
    ] = 60.0,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16 (vllm also: auto).")] = "float32",
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients use (model_config_name). Default: --model.")
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(help="vllm: context length (default: the model's).")] = None,
    gpu_memory_utilization: Annotated[
        float,
        typer.Option(
            min=0.01, max=1.0, help="vllm: share of GPU memory (CPU build: KV cache via VLLM_CPU_KVCACHE_SPACE)."
        ),
    ] = 0.9,
    tensor_parallel_size: Annotated[int, typer.Option(min=1, help="vllm: GPUs to shard the model over.")] = 1,
    vllm_log_stats: Annotated[
        bool, typer.Option(help="vllm: its periodic throughput log and stats (about 10% more worker CPU per token).")
    ] = False,
    prompt_mode: Annotated[
        str, typer.Option(help="stitch (token-exact, default) or naive (re-render history; for baselines only).")
    ] = "stitch",
    closer_policy: Annotated[
        str,
        typer.Option(
            help="keep: next prompts keep the sampled closer (one training sample per chat); history: use the "
            "template's history closer where it differs from the sampled one (gpt-oss <|return|> -> <|end|>), "
            "recorded as a fork that export splits."
        ),
    ] = "keep",
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(help="JSON object of extra chat-template variables, e.g. '{\"enable_thinking\": false}'."),
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
    log_format: Annotated[str, typer.Option(help="text, or json: one JSON object per line")] = "text",
) -> None:
    """Connect to a server and generate for it until stopped."""
    from shared.logs import configure_logging
    from worker.runner import VLLMOptions, run_worker

    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if engine not in ("hf", "vllm"):
        raise typer.BadParameter("--engine must be hf or vllm")
    if prompt_mode not in ("stitch", "naive"):
        raise typer.BadParameter("--prompt-mode must be stitch or naive")
    if closer_policy not in ("keep", "history"):
        raise typer.BadParameter("--closer-policy must be keep or history")
    kwargs = _json_object(chat_template_kwargs) if chat_template_kwargs else {}
    with contextlib.suppress(KeyboardInterrupt):
        _run(
            run_worker(
                server_url=server_url,
                api_key=api_key,
                model=model,
                engine_name=engine,
                max_parallel=max_parallel,
                device=device,
                dtype=dtype,
                served_model_name=served_model_name,
                prompt_mode=prompt_mode,  # type: ignore[arg-type]
                closer_policy=closer_policy,  # type: ignore[arg-type]
                template_kwargs=kwargs,
                vllm=VLLMOptions(max_model_len, gpu_memory_utilization, tensor_parallel_size, vllm_log_stats),
                threads=threads,
                drain_timeout_s=drain_timeout,
            )
        )


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed (cheaper wake-ups from the engine thread, faster sockets)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--chat-template-kwargs is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise typer.BadParameter("--chat-template-kwargs must be a JSON object")
    return value


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


def verify(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="An export (JSONL or Parquet).")],
    model: Annotated[str, typer.Option(help="The model that generated it: HF dir or id, or 'tiny'.")],
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    schema: Annotated[
        str | None, typer.Option(help="The export's --schema (default: read from native records).")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature for schemas that do not record it.")
    ] = None,
) -> None:
    """Re-score every exported sample by teacher forcing (fp32) and check masks and prefixes."""
    from worker.tiny import resolve_model
    from worker.verify import verify_file

    try:
        report = verify_file(file, resolve_model(model), device=device, schema=schema, temperature=temperature)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(report.summary())
    if not report.ok:
        raise typer.Exit(code=1)
