"""The ``hf`` engine: continuous batching over a transformers causal LM (CPU or CUDA).

Design. One scheduler task owns the batch and runs every model call on a single dedicated thread, one
call per *step*, so the event loop stays responsive and all torch state is touched by one thread.
At each step boundary the scheduler drops finished/aborted rows and admits waiting requests (up to
``max_batch_size``). A step then

1. runs one batched decode forward for all rows already running (each feeds its last sampled token),
2. prefills each newly admitted prompt on its own (batch of 1, no padding, so prompt numerics are
   exactly those of an unbatched run) and samples its first token,
3. merges the new rows' KV caches into the batch cache.

The batch cache is a plain ``DynamicCache`` (one full layer per model layer, even for sliding-window
models: masks compare cache indices, which stay consistent) kept *right-aligned*: every row's newest
cached token sits in the last column, shorter rows are left-padded with zero keys/values that the 2-D
attention mask hides, and RoPE positions are passed per row. Merging pads and concatenates along
batch; leaving rows are index-selected and all-padding columns trimmed. Nothing is recomputed when
membership changes, and padding never enters a real token's attention, so batched logprobs match a
teacher-forced fp32 pass to ~1e-6. Sampling is per row (own params, own seeded ``torch.Generator``),
so a request's tokens do not depend on which other requests share its batch.

A step that raises leaves the batch cache in an unknown state: the engine is dead from then on (every
request on it ends with ``EngineDead``, new ones are refused, ``failure`` says why) and the worker
restarts it with a fresh engine (worker.engine_health).

Weights updates (``update_weights``). The checkpoint is checked (``worker.checkpoint``, headers only)
and read with ``safetensors`` into CPU memory off the model thread, while requests keep running; every
tensor is matched to a model parameter by name and shape before anything changes, so a bad checkpoint
leaves the engine as it was. The swap itself is one call on the model thread at a step boundary, posted
to the scheduler: it copies the tensors into the parameters in place (``copy_`` casts to their dtype and
device; a tied ``lm_head`` is the embedding's parameter, filled through the name the checkpoint keeps).
``drain`` stops admitting when the update starts (waiting requests stay queued), lets the running rows
finish on the old weights, then swaps with an empty batch. ``inflight`` swaps at the next step boundary
and then rebuilds the batch cache from scratch: each running row's ``tokens[:-1]`` is prefilled alone
under the new weights and merged, exactly as at admission (its last token is fed by the next decode
step), so no key or value computed by the old weights survives. Every ``TokenStep`` carries the version
of the weights that computed its logits. Updates run one at a time, shielded from their caller's
cancellation (a swap half done would be worse than one finished late).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import secrets
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from shared.errors import ErrorCode
from worker.checkpoint import check_checkpoint, matched_tensors
from worker.engines.contract import (
    EngineDead,
    EngineError,
    EngineInfo,
    GenerationParams,
    TokenStep,
    WeightsMode,
    shielded,
)
from worker.sampling import is_greedy, param_error, presence_mask, process_logits, top_logprobs

__all__ = ["HFEngine", "HFEngineStats"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_threads(requested: int | None) -> int:
    """Intra-op threads for CPU inference: as requested, else ``OMP_NUM_THREADS``, else all cores but
    one. The worker's event loop (frames, detokenizing, prompt builds) needs a core of its own: when
    torch's threads take every core they spin at their barriers against it, and on 2 cores that cost
    40% of end-to-end throughput (benchmarks/pipeline.py)."""
    if requested is not None:
        return max(1, requested)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass
class HFEngineStats:
    forward_passes: int = 0  # prefills + decode steps
    prefills: int = 0
    decode_steps: int = 0  # batched decode forwards
    tokens_generated: int = 0
    max_batch_size_seen: int = 0  # largest number of rows advanced by one decode forward
    weight_updates: int = 0  # weights swaps applied
    recomputed_rows: int = 0  # running rows re-prefilled under new weights (inflight updates)


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: GenerationParams
    limit: int  # max_new_tokens capped so that prompt + completion fits max_context
    queue: asyncio.Queue[TokenStep | EngineError] = field(default_factory=asyncio.Queue)
    done: bool = False  # final step queued or consumer gone: the scheduler drops it at the next step


@dataclass(eq=False)
class _Row:
    """Worker-thread state of one running request; ``tokens[-1]`` is not in the KV cache yet."""

    req: _Request
    tokens: list[int]
    generator: torch.Generator
    presence: torch.Tensor | None = None  # [1, vocab] bool, only with a repetition penalty
    generated: int = 0


@dataclass(eq=False)
class _Swap:
    """A weights update waiting for the scheduler: ``(parameter, new value)`` pairs, checked."""

    copies: list[tuple[torch.Tensor, torch.Tensor]]
    version: int
    mode: WeightsMode
    done: asyncio.Future[None]


class HFEngine:
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 16,
        max_context: int | None = None,
        threads: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self._path = model_path
        self._threads = threads
        self._device = torch.device(device)
        self._dtype = _DTYPES[dtype]
        self._max_batch = max_batch_size
        config = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
        limit = max_context or getattr(config, "max_position_embeddings", None)
        if not isinstance(limit, int) or limit < 1:
            raise ValueError("max_context not given and the model config has no max_position_embeddings")
        self.info = EngineInfo(
            name="hf", max_context=limit, extra={"model_path": model_path, "device": device, "dtype": dtype}
        )
        self.stats = HFEngineStats()
        self._model: PreTrainedModel | None = None
        self._cache_arg = "cache"  # the forward argument that takes the KV cache (set by _load)
        self._vocab = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._requests: dict[str, _Request] = {}
        self._pending: deque[_Request] = deque()
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._closing = False
        self._dead: str | None = None  # why the engine died
        self._fault = False  # fault injection: the next step raises
        self.policy_version = 0  # the weights version served (read by the model thread at sampling)
        self._weights_lock = asyncio.Lock()  # one update at a time
        self._drains = 0  # drain updates asked for and not over: while any, nothing is admitted
        self._swap: _Swap | None = None  # posted to the scheduler, applied at the next step boundary
        self._updates: set[asyncio.Task[None]] = set()  # running updates (shielded from cancellation)
        # Batch state, touched only by the model thread (or by the loop while no step runs).
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)

    @property
    def batch_size(self) -> int:
        """Rows currently in the decode batch (finished/aborted rows leave at the next step)."""
        return len(self._rows)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._scheduler is not None:
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self._scheduler = asyncio.create_task(self._run(), name="hf-engine-scheduler")

    def _load(self) -> None:
        if self._device.type == "cpu":
            torch.set_num_threads(cpu_threads(self._threads))
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(self._path, dtype=self._dtype)
        # Plain nn.Module methods: transformers' wrappers of `to`/`eval` are opaque to type checkers.
        torch.nn.Module.to(model, self._device)
        torch.nn.Module.eval(model)
        self._cache_arg = _cache_argument(model.forward)
        # Fail at start, not on the first request, if the model's cache is not plain attention KV, or if
        # the model ignored the cache it was given (it would then attend to nothing but the new token).
        with torch.inference_mode():
            cache = DynamicCache()
            probe = torch.zeros((1, 1), dtype=torch.long, device=self._device)
            model(input_ids=probe, use_cache=True, **{self._cache_arg: cache})
            _kv_layers(cache)
            if cache.get_seq_length() != 1:
                raise RuntimeError(f"the model did not fill the KV cache passed as {self._cache_arg!r}")
        self._model = model
        self._vocab = int(model.config.get_text_config(decoder=True).vocab_size)

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._scheduler is not None:
            await self._scheduler  # finishes the step in flight, if any
        self._fail_swap(EngineError(ErrorCode.not_ready, "the engine closed before the weights update applied"))
        for req in list(self._requests.values()):
            self._finish(req, TokenStep(token_ids=[], logprobs=[], finish_reason="abort"))
        self._rows, self._cache, self._model = [], None, None
        self._executor.shutdown(wait=True)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[TokenStep, None]:
        req = self._admit(request_id, prompt_ids, params)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Also reached when the consumer stops iterating: the row leaves the batch next step.
            req.done = True
            if self._requests.get(request_id) is req:
                del self._requests[request_id]
            self._wake.set()

    def _admit(self, request_id: str, prompt_ids: list[int], params: GenerationParams) -> _Request:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._scheduler is None or self._closing:
            raise EngineError(ErrorCode.not_ready, "engine is not running")
        if request_id in self._requests:
            raise EngineError(ErrorCode.bad_request, f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise EngineError(ErrorCode.bad_request, "empty prompt")
        if any(not 0 <= t < self._vocab for t in prompt_ids):
            raise EngineError(ErrorCode.bad_request, f"prompt token ids must be in [0, {self._vocab})")
        if problem := param_error(params):
            raise EngineError(ErrorCode.bad_request, problem)
        room = self.info.max_context - len(prompt_ids)
        if room <= 0:
            raise EngineError(
                ErrorCode.context_overflow,
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.info.max_context}",
            )
        req = _Request(request_id, list(prompt_ids), params, min(params.max_new_tokens, room))
        self._requests[request_id] = req
        self._pending.append(req)
        self._wake.set()
        return req

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, TokenStep(token_ids=[], logprobs=[], finish_reason="abort"))
            self._wake.set()

    def failure(self) -> str | None:
        """Why the engine is unusable (a step raised), or None."""
        return self._dead

    def inject_fault(self) -> None:
        """Fault injection (tests, benchmarks/chaos_engine.py): the next model step raises on the model
        thread, as a real failure would, and the engine dies."""
        self._fault = True
        self._wake.set()

    def _finish(self, req: _Request, last: TokenStep | EngineError) -> None:
        if not req.done:
            req.done = True
            req.queue.put_nowait(last)
        # A finished id may be reused at once, even before its consumer has drained the queue.
        if self._requests.get(req.request_id) is req:
            del self._requests[req.request_id]

    # ---- scheduler (event loop side) -------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            swap = self._swap
            if (
                swap is not None
                and not self._fault
                and (swap.mode == "inflight" or all(row.req.done for row in self._rows))
            ):
                # A step boundary: no step runs, and (drain) no row is left running on the old weights.
                self._swap = None
                try:
                    await loop.run_in_executor(self._executor, self._apply_swap, swap)
                except Exception as exc:
                    log.exception("hf engine weights swap failed: the engine is dead")
                    self._die(f"hf engine weights swap failed: {exc!r}", [])
                    return
                self.policy_version = swap.version
                self.stats.weight_updates += 1
                if not swap.done.done():
                    swap.done.set_result(None)
                continue
            admitting = self._drains == 0
            if not (self._pending and admitting) and not self._rows and not self._fault:
                self._wake.clear()
                await self._wake.wait()
                continue
            admit: list[_Request] = []
            while admitting and self._pending and len(self._rows) + len(admit) < self._max_batch:
                req = self._pending.popleft()
                if not req.done:
                    admit.append(req)
            try:
                outputs = await loop.run_in_executor(self._executor, self._step, admit)
            except Exception as exc:
                log.exception("hf engine step failed: the engine is dead")
                self._die(f"hf engine step failed: {exc!r}", admit)
                return
            for req, step in outputs:
                if req.done:  # aborted while the step ran
                    continue
                if step.finish_reason is None:
                    req.queue.put_nowait(step)
                else:
                    self._finish(req, step)

    def _die(self, reason: str, admit: list[_Request]) -> None:
        self._dead = reason
        for req in [*(row.req for row in self._rows), *admit, *self._pending]:
            self._finish(req, EngineDead(reason))
        self._rows, self._cache = [], None
        self._pending.clear()
        self._fail_swap(EngineDead(reason))

    def _fail_swap(self, error: EngineError) -> None:
        swap, self._swap = self._swap, None
        if swap is not None and not swap.done.done():
            swap.done.set_exception(error)

    # ---- weights updates (event loop side) -------------------------------------------------------

    async def update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        """See ``Engine.update_weights`` and the module docstring. Shielded: a caller that goes away
        does not stop an update half-way (it still completes, or fails, on its own)."""
        if mode not in ("drain", "inflight"):
            raise EngineError(ErrorCode.bad_request, f"weights update mode must be drain or inflight, not {mode!r}")
        self._check_running()
        if mode == "drain":
            # From this call on nothing is admitted (new requests wait in the queue) while the checkpoint
            # is checked and read and the running rows finish; a refused checkpoint reopens admission.
            self._drains += 1
        await shielded(self._updates, self._update_weights(path, version, mode), f"hf-weights-{version}")

    async def _update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        try:
            async with self._weights_lock:  # one update at a time
                self._check_running()
                await asyncio.to_thread(check_checkpoint, path, self._path)
                copies = await asyncio.to_thread(self._read_checkpoint, path)
                self._check_running()
                swap = _Swap(copies, version, mode, asyncio.get_running_loop().create_future())
                self._swap = swap
                self._wake.set()
                await swap.done
        finally:
            if mode == "drain":
                self._drains -= 1
                self._wake.set()

    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._scheduler is None or self._closing or self._model is None:
            raise EngineError(ErrorCode.not_ready, "engine is not running")

    def _read_checkpoint(self, path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Read checkpoint ``path`` (already checked) and pair its tensors with the parameters they
        replace (``worker.checkpoint.matched_tensors``). Runs off the model thread and touches no
        parameter: a failure here changes nothing."""
        model = self._model
        if model is None:
            raise EngineError(ErrorCode.not_ready, "engine is not running")
        return matched_tensors(model, path)

    # ---- model thread ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _step(self, admit: list[_Request]) -> list[tuple[_Request, TokenStep]]:
        if self._fault:
            self._fault = False
            raise RuntimeError("fault injection: the engine was made to fail")
        outputs: list[tuple[_Request, TokenStep]] = []
        self._keep([not row.req.done for row in self._rows])
        if self._rows:
            batch = len(self._rows)
            self._mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
            logits = self._forward(
                torch.tensor([[row.tokens[-1]] for row in self._rows], device=self._device),
                torch.tensor([[len(row.tokens) - 1] for row in self._rows], device=self._device),
                self._cache,
                self._mask,
            )
            self.stats.decode_steps += 1
            self.stats.max_batch_size_seen = max(self.stats.max_batch_size_seen, batch)
            outputs += [(row.req, self._sample(row, logits[i : i + 1])) for i, row in enumerate(self._rows)]
            self._keep([step.finish_reason is None for _, step in outputs])
        for req in admit:
            if req.done:
                continue
            seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
            row = _Row(req, list(req.prompt), torch.Generator(device=self._device).manual_seed(seed))
            cache = DynamicCache()
            prompt = torch.tensor([req.prompt], device=self._device)
            logits = self._forward(prompt, None, cache, None)
            self.stats.prefills += 1
            step = self._sample(row, logits)
            step.prompt_token_ids = list(req.prompt)
            outputs.append((req, step))
            if step.finish_reason is None:
                self._merge(row, cache)
        return outputs

    @torch.no_grad()
    def _apply_swap(self, swap: _Swap) -> None:
        """Model thread, between steps: copy the new weights in, then (inflight) rebuild the batch cache
        under them. Rows are re-prefilled one by one, alone, as at admission, so their numerics are
        those of a request that ran on the new weights from the start."""
        rows = [row for row in self._rows if not row.req.done]
        self._rows, self._cache = [], None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        for param, value in swap.copies:
            param.copy_(value)  # casts to the parameter's dtype and device
        swap.copies.clear()  # the CPU copies are not needed any more
        with torch.inference_mode():
            for row in rows:  # empty for drain: the swap waited for the batch to empty
                cache = DynamicCache()
                self._forward(torch.tensor([row.tokens[:-1]], device=self._device), None, cache, None)
                self.stats.prefills += 1
                self.stats.recomputed_rows += 1
                self._merge(row, cache)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: DynamicCache | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        assert self._model is not None
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,  # only the next-token logits: no [batch, seq, vocab] tensor at prefill
            **{self._cache_arg: cache},
        )
        self.stats.forward_passes += 1
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits

    def _sample(self, row: _Row, logits: torch.Tensor) -> TokenStep:
        params = row.req.params
        if params.repetition_penalty not in (None, 1.0) and row.presence is None:
            row.presence = presence_mask([row.tokens], logits.shape[-1], logits.device)
        logprobs = process_logits(logits, params, row.presence)
        if is_greedy(params):
            token = int(logprobs.argmax(dim=-1).item())
        else:
            token = int(torch.multinomial(logprobs.exp(), 1, generator=row.generator).item())
        step = TokenStep(
            token_ids=[token], logprobs=[float(logprobs[0, token].item())], policy_version=self.policy_version
        )
        if params.top_logprobs > 0:
            step.top_logprobs = top_logprobs(logprobs, params.top_logprobs)
        row.tokens.append(token)
        row.generated += 1
        self.stats.tokens_generated += 1
        if row.presence is not None:
            row.presence[0, token] = True
        if token in params.stop_token_ids:
            step.finish_reason, step.stop_reason = "stop", token
        elif row.generated >= row.req.limit:
            step.finish_reason = "length"
        return step

    def _keep(self, keep: list[bool]) -> None:
        """Select the kept rows from the batch cache, then trim columns that are padding in every row."""
        if all(keep):
            return
        self._rows = [row for row, k in zip(self._rows, keep, strict=True) if k]
        if not self._rows or self._cache is None:
            self._rows, self._cache = [], None
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], device=self._device)
        mask = self._mask[index]
        start = int(mask.any(dim=0).to(torch.uint8).argmax().item())  # first column any row uses
        self._mask = mask[:, start:]
        for layer, keys, values in _kv_layers(self._cache):
            layer.keys, layer.values = keys[index, :, start:], values[index, :, start:]

    def _merge(self, row: _Row, cache: DynamicCache) -> None:
        """Append a freshly prefilled row, left-padding whichever side is shorter (zeros, masked out)."""
        new_len = cache.get_seq_length()
        new_mask = torch.ones((1, new_len), dtype=torch.long, device=self._device)
        if self._cache is None:
            self._rows, self._cache, self._mask = [row], cache, new_mask
            return
        old_len = self._mask.shape[1]
        width = max(old_len, new_len)
        self._mask = torch.cat([F.pad(self._mask, (width - old_len, 0)), F.pad(new_mask, (width - new_len, 0))])
        for (layer, keys, values), (_, new_keys, new_values) in zip(
            _kv_layers(self._cache), _kv_layers(cache), strict=True
        ):
            layer.keys = _cat_left_padded(keys, new_keys, width)
            layer.values = _cat_left_padded(values, new_values, width)
        self._rows.append(row)


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    # transformers 5 draws a "Loading weights" tqdm bar on stderr; a worker should stay quiet.
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _cache_argument(forward: Callable[..., object]) -> str:
    """The name under which a model's forward takes the KV cache: ``cache`` since transformers renamed
    ``past_key_values`` (passing the old name warns ``FutureWarning`` on every step, and it goes away in
    5.40), ``past_key_values`` in earlier releases and in remote-code models that still use it."""
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise RuntimeError(f"{forward.__qualname__} takes neither `cache` nor `past_key_values`")


def _kv_layers(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """The cache's layers with their key/value tensors, which must be plain full-attention layers."""
    result = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise RuntimeError(f"unsupported KV cache layer {layer!r}: the hf engine needs attention KV caches")
        result.append((layer, layer.keys, layer.values))
    return result


def _cat_left_padded(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    # [batch, heads, seq, head_dim]: pad seq on the left to `width`, then stack along batch
    return torch.cat([F.pad(a, (0, 0, width - a.shape[2], 0)), F.pad(b, (0, 0, width - b.shape[2], 0))])
