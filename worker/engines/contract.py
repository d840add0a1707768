"""The engine contract (DESIGN D6): token IDs in, streamed token steps out.

An engine never sees text or chat templates. ``generate`` yields one ``TokenStep`` per engine step
(usually one token, possibly several); the first step reports the prompt IDs the engine actually
consumed so that the caller can check them against what it sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]
# How a weights update treats running requests: ``drain`` lets them finish on the old weights while new
# ones wait; ``inflight`` switches between two steps and recomputes their context under the new weights.
WeightsMode = Literal["drain", "inflight"]


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # also return this many most likely tokens per position


@dataclass
class TokenStep:
    token_ids: list[int]
    # logprob of each sampled token under the distribution actually sampled from (DESIGN D7)
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None  # set on the last step only
    stop_reason: int | None = None  # the stop token id that ended generation, if any
    prompt_token_ids: list[int] | None = None  # set on the first step only
    num_cached_tokens: int | None = None  # prompt tokens served from a prefix cache, if known
    policy_version: int = 0  # the weights version that computed this step's tokens


@dataclass
class EngineInfo:
    name: str  # "hf" or "vllm"
    max_context: int
    extra: dict[str, str] = field(default_factory=dict)


class EngineError(Exception):
    """Generation failed for a reason the caller should report (code is an ErrorCode value)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDead(EngineError):
    """The whole engine is unusable (its process died, its model thread raised): every request on it
    is lost through no fault of its own, and the worker must restart the engine (worker.engine_health).
    A per-request failure is a plain ``EngineError``."""

    def __init__(self, message: str) -> None:
        super().__init__("engine_dead", message)


class WeightsError(EngineError):
    """A weights update refused before anything changed (code: ``weights_not_found``,
    ``weights_not_safetensors`` or ``weights_mismatch``): the engine serves the weights it had."""


class Engine(Protocol):
    info: EngineInfo

    @property
    def policy_version(self) -> int:
        """The weights version it serves: 0 as started, then each update's."""
        ...

    async def update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        """Load the safetensors checkpoint in directory ``path`` (checked by ``worker.checkpoint``
        against the model: a ``WeightsError`` changes nothing) in place and serve it as ``version``.
        ``drain``: running requests finish on the old weights, new ones wait, and their steps all carry
        the old version; ``inflight``: between two steps, running requests' context is recomputed under
        the new weights and their later steps carry the new version. Either way no KV computed with the
        old weights serves the new version (prefix caches are cleared). Returns once ``version``
        serves."""
        ...

    async def start(self) -> None: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: GenerationParams) -> AsyncIterator[TokenStep]:
        """Stream steps until a stop token, ``max_new_tokens`` or ``abort``; the last step has
        ``finish_reason``. A stop token is included in ``token_ids`` of the step that ends."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request within one step; its stream ends with finish_reason 'abort'."""
        ...

    async def close(self) -> None: ...


async def shielded(tasks: set[asyncio.Task[None]], job: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``job`` (a weights update) as a task its caller's cancellation does not stop: a swap half done
    would be worse than one finished late. ``tasks`` holds it while it runs; its error, if nobody waits
    for it any more, is retrieved rather than reported as never retrieved."""
    task = asyncio.create_task(job, name=name)
    tasks.add(task)

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled():
            t.exception()

    task.add_done_callback(done)
    await asyncio.shield(task)
