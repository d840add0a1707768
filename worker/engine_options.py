"""The options that say what a worker serves and how (engine, parallelism, device, vLLM's knobs...), as
typer parameter types shared by ``tokentrail worker`` and ``tokentrail serve --model``, and their
validation into a ``ModelSpec`` (the same checks in both commands)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from worker.spec import DEFAULT_DTYPE, ModelSpec, VLLMOptions

if TYPE_CHECKING:
    from worker.prompt_builder import CloserPolicy, PromptMode

MODEL_HELP = "Hugging Face model dir or id, or 'tiny' for the built-in test model."

Engine = Annotated[str, typer.Option(help="hf (transformers) or vllm.")]
MaxParallel = Annotated[int, typer.Option(min=1, max=4096, help="Messages generated at once.")]
Device = Annotated[str, typer.Option(help="cpu or cuda (hf engine).")]
Threads = Annotated[
    int | None,
    typer.Option(min=1, help="hf on CPU: torch threads (default: OMP_NUM_THREADS, else all cores but one)."),
]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16 or float16 (vllm also: auto).")]
ServedModelName = Annotated[str | None, typer.Option(help="Name clients use (model_config_name). Default: --model.")]
MaxModelLen = Annotated[int | None, typer.Option(help="vllm: context length (default: the model's).")]
GpuMemoryUtilization = Annotated[
    float,
    typer.Option(min=0.01, max=1.0, help="vllm: share of GPU memory (CPU build: KV cache via VLLM_CPU_KVCACHE_SPACE)."),
]
TensorParallelSize = Annotated[int, typer.Option(min=1, help="vllm: GPUs to shard the model over.")]
VllmLogStats = Annotated[
    bool, typer.Option(help="vllm: its periodic throughput log and stats (about 10% more worker CPU per token).")
]
VllmChunkedPrefill = Annotated[
    bool | None,
    typer.Option(
        "--vllm-chunked-prefill/--no-vllm-chunked-prefill",
        help="vllm: split long prompts over steps. Default: off on CPU (where vLLM cannot rewind a seeded "
        "request's generator after a partial prefill: it killed the engine), vLLM's default elsewhere.",
    ),
]
VllmEnforceEager = Annotated[
    bool,
    typer.Option(
        help="vllm: run the model eagerly, without torch.compile or CUDA graphs: the engine starts in seconds "
        "rather than a minute or more, and its steps are slower (for tests, debugging, short-lived workers)."
    ),
]
EngineMaxRestarts = Annotated[
    int,
    typer.Option(
        min=1,
        help="A dead engine is restarted with exponential backoff; after this many failed restarts in a row "
        "the worker exits with status 3 (for its supervisor to restart it).",
    ),
]
PromptModeOption = Annotated[
    str, typer.Option(help="stitch (token-exact, default) or naive (re-render history; for baselines only).")
]
CloserPolicyOption = Annotated[
    str,
    typer.Option(
        help="keep: next prompts keep the sampled closer (one training sample per chat); history: use the "
        "template's history closer where it differs from the sampled one (gpt-oss <|return|> -> <|end|>), "
        "recorded as a fork that export splits."
    ),
]
ChatTemplateKwargs = Annotated[
    str | None,
    typer.Option(help="JSON object of extra chat-template variables, e.g. '{\"enable_thinking\": false}'."),
]
LogLevel = Annotated[str, typer.Option(help="debug, info, warning")]
LogFormat = Annotated[str, typer.Option(help="text, or json: one JSON object per line")]


def model_spec(
    *,
    model: str,
    engine: str = "hf",
    max_parallel: int = 8,
    device: str = "cpu",
    threads: int | None = None,
    dtype: str = DEFAULT_DTYPE,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    vllm_log_stats: bool = False,
    vllm_chunked_prefill: bool | None = None,
    vllm_enforce_eager: bool = False,
    engine_max_restarts: int = 5,
    prompt_mode: str = "stitch",
    closer_policy: str = "keep",
    chat_template_kwargs: str | None = None,
) -> ModelSpec:
    """The options checked (``typer.BadParameter`` names the one at fault) and gathered."""
    from worker.engine_health import RestartPolicy

    if engine not in ("hf", "vllm"):
        raise typer.BadParameter("--engine must be hf or vllm")
    if prompt_mode not in ("stitch", "naive"):
        raise typer.BadParameter("--prompt-mode must be stitch or naive")
    if closer_policy not in ("keep", "history"):
        raise typer.BadParameter("--closer-policy must be keep or history")
    return ModelSpec(
        model=model,
        engine=engine,
        max_parallel=max_parallel,
        device=device,
        dtype=dtype,
        served_model_name=served_model_name,
        prompt_mode=cast("PromptMode", prompt_mode),
        closer_policy=cast("CloserPolicy", closer_policy),
        template_kwargs=_json_object(chat_template_kwargs) if chat_template_kwargs else {},
        vllm=VLLMOptions(
            max_model_len,
            gpu_memory_utilization,
            tensor_parallel_size,
            vllm_log_stats,
            vllm_chunked_prefill,
            vllm_enforce_eager,
        ),
        threads=threads,
        restart_policy=RestartPolicy(max_failed_restarts=engine_max_restarts),
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--chat-template-kwargs is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise typer.BadParameter("--chat-template-kwargs must be a JSON object")
    return value
