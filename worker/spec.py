"""What a worker serves and how (``tokentrail worker`` and ``tokentrail serve --model`` alike). Light on
purpose: the CLIs build it before anything heavy (torch, transformers) is imported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine_health import RestartPolicy
    from worker.prompt_builder import CloserPolicy, PromptMode

# both engines' dtype when none is given (vllm serve's default is auto: see README's vLLM section)
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True)
class VLLMOptions:
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    log_stats: bool = False  # vLLM's periodic stats log and metrics
    chunked_prefill: bool | None = None  # None: off on CPU (seeded requests), vLLM's default elsewhere
    enforce_eager: bool = False  # no torch.compile / CUDA graphs: starts in seconds, steps slower


@dataclass(frozen=True)
class ModelSpec:
    """A model, its engine and the engine's options."""

    model: str  # an HF model dir or id, or 'tiny'
    engine: str = "hf"
    max_parallel: int = 8
    device: str = "cpu"
    dtype: str = DEFAULT_DTYPE
    served_model_name: str | None = None
    prompt_mode: PromptMode = "stitch"
    closer_policy: CloserPolicy = "keep"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    threads: int | None = None
    restart_policy: RestartPolicy | None = None  # a dead engine's restarts (None: the default policy)

    @property
    def name(self) -> str:
        """The name clients use (model_config_name)."""
        return self.served_model_name or self.model
