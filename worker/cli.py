"""Worker subcommands: ``worker`` (serve a model to a server) and ``model tiny`` (build a test model)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Annotated

import typer

model_app = typer.Typer(help="Local models for tests and demos.", no_args_is_help=True)


def worker(
    server_url: Annotated[
        str, typer.Option(envvar="TOKENTRAIL_SERVER_URL", help="e.g. http://127.0.0.1:8000")
    ],
    api_key: Annotated[
        str, typer.Option(envvar="TOKENTRAIL_WORKER_KEY", help="From `tokentrail admin create-worker-key`.")
    ],
    model: Annotated[
        str, typer.Option(help="Hugging Face model dir or id, or 'tiny' for the built-in test model.")
    ],
    engine: Annotated[str, typer.Option(help="hf (transformers) or vllm.")] = "hf",
    max_parallel: Annotated[int, typer.Option(min=1, max=4096, help="Messages generated at once.")] = 8,
    device: Annotated[str, typer.Option(help="cpu or cuda (hf engine).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients use (model_config_name). Default: --model.")
    ] = None,
    log_level: Annotated[str, typer.Option()] = "info",
) -> None:
    """Connect to a server and generate for it until stopped."""
    from worker.runner import run_worker

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine not in ("hf", "vllm"):
        raise typer.BadParameter("--engine must be hf or vllm")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            run_worker(
                server_url=server_url,
                api_key=api_key,
                model=model,
                engine_name=engine,
                max_parallel=max_parallel,
                device=device,
                dtype=dtype,
                served_model_name=served_model_name,
            )
        )


@model_app.command("tiny")
def model_tiny(
    out: Annotated[Path, typer.Option(help="Directory to write the model to.")],
    template: Annotated[str, typer.Option(help="Built-in chat template.")] = "chatml",
    chat_template: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="A Jinja chat template file to use instead."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for the weights.")] = 0,
) -> None:
    """Build a tiny Llama-style model with a locally trained BPE tokenizer, offline and deterministically."""
    from worker.tiny_model import TINY_TEMPLATES, build_tiny_model

    if template not in TINY_TEMPLATES:
        raise typer.BadParameter(f"--template must be one of {', '.join(TINY_TEMPLATES)}")
    path = build_tiny_model(out, template=template, chat_template_file=chat_template, seed=seed)
    typer.echo(str(path))
