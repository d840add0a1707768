"""Raw-prompt routes: OpenAI's ``POST /v1/completions`` (a text or token-id prompt, no chat template) and
vLLM's tokens-in ``POST /inference/v1/generate``.

Each prompt is stored as a chat of its own (``store_raw``): the worker generates from the prompt as
given, and the stored record, export and verify see exactly those prompt ids. Token ids ride on every
response (per choice ``prompt_token_ids`` and ``token_ids``; in streams the prompt ids in a choice's
first chunk and the new ids in every chunk).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy.ext.asyncio import AsyncSession

from server.api.deps import CurrentUser, Idempotency, SessionDep, StateDep
from server.chats.admission import admit
from server.chats.enqueue import enqueue, ensure_queued
from server.chats.finished import Finished
from server.errors import ApiError
from server.idempotency import IdempotencyKey, once
from server.models import Message
from server.openai.choices import Progress, collect, follow
from server.openai.conversations import store_raw
from server.openai.params import require_model, resolve_model, rpc_call, sampling_params, unsupported
from server.openai.render import (
    dumps,
    failure,
    finite,
    generate_logprob_entries,
    logprob_entries,
    stop_reason,
    stored_logprobs,
    token_texts,
    tokentrail_info,
    usage,
)
from server.openai.streaming import SSE_DONE, error_chunk, event_stream, merged, sse
from server.state import AppState
from server.streams.protocol import StreamReset, TokenBatch
from shared.api import MessageState
from shared.channels import ReplyStream
from shared.errors import ErrorCode
from shared.openai_api import MAX_N, CompletionRequest, GenerateRequest
from shared.packing import unpack_ids

router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)

_MAX_CHOICES = 64  # prompts x n in one request
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for text completions


@dataclass
class _Job:
    """One stored generation of a raw-prompt request."""

    index: int  # choice index: prompt index x n + sibling
    message_id: str
    echo: str  # text put before the completion (echo)


def _legacy_logprobs(
    ids: list[int],
    lps: list[float | None],
    texts: list[str],
    tops: list[list[tuple[int, float, str]] | None] | None,
    top_n: int,
    offset: int,
) -> dict[str, Any]:
    """The text-completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, (_tid, lp, text) in enumerate(zip(ids, lps, texts, strict=True)):
        out["tokens"].append(text)
        out["token_logprobs"].append(finite(lp))
        alts = (tops[k] if tops is not None and k < len(tops) else None) or []
        out["top_logprobs"].append({t: finite(v) for _i, v, t in alts[:top_n]} if top_n else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


async def _commit_raw(
    state: AppState,
    session: AsyncSession,
    idem: IdempotencyKey | None,
    prompts: list[Message],
    pending: list[Message],
) -> tuple[list[str], int]:
    """Commit a raw-prompt request's chats in one transaction (with its idempotency record) and queue
    its generations: their message ids, and the request's time."""
    ids, created = [m.id for m in pending], int(time.time())
    if idem is not None:
        model = pending[0].model_config_name
        await idem.record(session, {"message_ids": ids, "created": created, "model": model})
    await session.commit()
    state.paths.remember(prompts)
    await enqueue(state, pending)
    return ids, created


async def _replay_raw(state: AppState, result: dict[str, Any]) -> tuple[list[str], int]:
    ids: list[str] = result["message_ids"]
    await ensure_queued(state, ids)
    return ids, int(result["created"])


async def _replayed_raw(
    state: AppState, session: AsyncSession, idem: IdempotencyKey | None
) -> tuple[list[str], int, str] | None:
    """What a raw-prompt request with this key made already (a retry): message ids, time, model. Asked
    before the route's own checks, so that a retry is answered whatever changed meanwhile."""
    if idem is None or (found := await idem.find(session)) is None:
        return None
    ids, created = await _replay_raw(state, found)
    return ids, created, str(found["model"])


# ---- /v1/completions ------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, user: CurrentUser, session: SessionDep, state: StateDep, idem: Idempotency
) -> Response:
    replayed = await _replayed_raw(state, session, idem)
    if replayed is None:
        await require_model(state, body.model)
    if body.suffix:
        raise unsupported("suffix", "insertion (suffix) is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported("best_of", "best_of other than n is not supported; use n")
    if body.echo and body.logprobs is not None:
        raise unsupported("echo", "echo with logprobs needs prompt logprobs, which tokentrail does not compute")
    prompts = body.prompts()
    if not prompts:
        raise ApiError(ErrorCode.validation_error, "prompt must not be empty", param="prompt", status_code=400)
    if len(prompts) * body.n > _MAX_CHOICES:
        raise ApiError(
            ErrorCode.validation_error,
            f"{len(prompts)} prompts x n={body.n} is more than {_MAX_CHOICES} choices",
            param="prompt",
            status_code=400,
        )
    top = body.logprobs or 0
    sampling = sampling_params(body, body.max_tokens or _COMPLETIONS_DEFAULT_MAX_TOKENS, top)
    echoes: list[str] = []
    for k, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            echoes.append(prompt)
        elif not prompt:
            raise ApiError(ErrorCode.validation_error, "a token prompt must not be empty", param=f"prompt[{k}]")
        elif body.echo:
            echoes.append(str((await rpc_call(state, body.model, "detokenize", {"tokens": prompt}))["prompt"]))
        else:
            echoes.append("")

    async def create() -> tuple[list[str], int]:
        await admit(state.settings, state.rate_limiter, state.sql, session, user.id, body.model, len(prompts) * body.n)
        pending: list[Message] = []
        prompt_msgs: list[Message] = []
        for prompt in prompts:
            if isinstance(prompt, str):
                raw: dict[str, Any] = {"text": prompt, "add_special_tokens": body.add_special_tokens}
                text, title = prompt, prompt.strip()
            else:
                raw, text, title = {"token_ids": prompt}, "", f"token prompt ({len(prompt)} tokens)"
            _chat, prompt_msg, msgs = await store_raw(
                session, user.id, text=text, raw=raw, title=title, model=body.model, sampling=sampling, n=body.n
            )
            pending += msgs
            prompt_msgs.append(prompt_msg)
        return await _commit_raw(state, session, idem, prompt_msgs, pending)

    if replayed is None:
        ids, created = await once(idem, session, create, functools.partial(_replay_raw, state), looked=True)
    else:
        ids, created, _ = replayed
    await session.close()  # generation may take minutes; the followers open their own sessions
    jobs = [_Job(i, mid, echoes[i // body.n] if body.echo else "") for i, mid in enumerate(ids)]
    ctx = _CompletionContext(body, f"cmpl-{jobs[0].message_id}", created, top)
    if body.stream:
        chunks = merged([ctx.chunks(state, job) for job in jobs])
        return event_stream(ctx.stream(chunks), state.metrics)
    results = await asyncio.gather(*(collect(state, job.message_id) for job in jobs))
    return Response(dumps(ctx.body(jobs, results)), media_type="application/json")


class _CompletionContext:
    def __init__(self, body: CompletionRequest, cid: str, created: int, top: int) -> None:
        self.req = body
        self.cid = cid
        self.created = created
        self.top = top
        self.prompt_tokens: dict[str, int] = {}  # per prompt (first choice's message id)
        self.completion_tokens = 0

    def _base(self) -> dict[str, Any]:
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.req.model}

    def _logprobs(self, ids: list[int], lps: list[float | None], texts: list[str], tops: Any, offset: int) -> Any:
        if self.req.logprobs is None:
            return None
        return _legacy_logprobs(ids, lps, texts, tops, self.top, offset)

    def body(self, jobs: list[_Job], results: list[tuple[Finished, Progress]]) -> dict[str, Any]:
        choices = []
        prompt_total = completion_total = cached_total = 0
        for job, (done, progress) in zip(jobs, results, strict=True):
            msg, tokens = done.message, done.tokens
            if msg.state != MessageState.complete.value or tokens is None:
                raise failure(msg)
            ids = unpack_ids(tokens.completion_ids)
            prompt = unpack_ids(tokens.prompt_ids)
            tops = progress.top_logprobs if len(progress.top_logprobs) == len(ids) else None
            text = msg.content or ""
            choices.append(
                {
                    "index": job.index,
                    "text": job.echo + text,
                    "logprobs": self._logprobs(ids, stored_logprobs(tokens), token_texts(tokens), tops, len(job.echo)),
                    "finish_reason": msg.finish_reason,
                    "stop_reason": stop_reason(tokens),
                    "prompt_token_ids": prompt,
                    "token_ids": ids,
                    "tokentrail": tokentrail_info(msg, tokens, forked=False),
                }
            )
            if job.index % self.req.n == 0:  # each prompt counts once
                prompt_total += len(prompt)
                cached_total += tokens.num_cached_tokens or 0
            completion_total += len(ids)
        return {
            "id": self.cid,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": sorted(choices, key=lambda c: int(c["index"])),
            "usage": usage(prompt_total, completion_total, cached_total),
        }

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            yield chunk
        options = self.req.stream_options
        if options is not None and options.include_usage:
            prompt = sum(self.prompt_tokens.values())
            yield sse({**self._base(), "choices": [], "usage": usage(prompt, self.completion_tokens, None)})
        yield SSE_DONE

    async def chunks(self, state: AppState, job: _Job) -> AsyncIterator[bytes]:
        progress = Progress()
        first = True
        offset = len(job.echo)
        # The text deltas add up to the stored text (DESIGN D19): a stop string's start is held back.
        reply = ReplyStream(self.req.stop_strings(), strip=False)
        interval = self.req.stream_interval or state.settings.stream_interval
        async for item in follow(state, job.message_id, progress, interval):
            if isinstance(item, TokenBatch):
                text = "".join(item.texts)
                choice: dict[str, Any] = {
                    "index": job.index,
                    "text": (job.echo if first else "") + reply.feed(item.texts, "").content,
                    "logprobs": self._logprobs(item.token_ids, item.logprobs, item.texts, item.top_logprobs, offset),
                    "finish_reason": None,
                    "token_ids": item.token_ids,
                }
                offset += len(text)
                if first and progress.prompt_ids is not None:
                    choice["prompt_token_ids"] = progress.prompt_ids
                first = False
                yield sse({**self._base(), "choices": [choice]})
            elif isinstance(item, StreamReset):
                yield sse({**self._base(), "choices": [], "tokentrail": {"reset_from": item.from_index}})
            else:
                msg, tokens = item.message, item.tokens
                if msg.state != MessageState.complete.value or tokens is None:
                    yield error_chunk(msg)
                    return
                prompt = unpack_ids(tokens.prompt_ids)
                if job.index % self.req.n == 0:
                    self.prompt_tokens[job.message_id] = len(prompt)
                self.completion_tokens += len(unpack_ids(tokens.completion_ids))
                rest = reply.finish(msg.content, None).content
                if reply.mismatch:
                    log.warning("message %s: streamed text differs from the stored one", msg.id)
                end: dict[str, Any] = {
                    "index": job.index,
                    "text": (job.echo if first else "") + rest,
                    "logprobs": None,
                    "finish_reason": msg.finish_reason,
                    "stop_reason": stop_reason(tokens),
                    "token_ids": [],
                }
                if first:
                    end["prompt_token_ids"] = prompt
                yield sse({**self._base(), "choices": [end], "tokentrail": tokentrail_info(msg, tokens, forked=False)})


# ---- /inference/v1/generate -----------------------------------------------------------------------
_GENERATE_REFUSED = {
    "logits_processors": "custom logits processors",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "structured_outputs": "structured outputs",
    "guided_decoding": "guided decoding",
    "truncate_prompt_tokens": "prompt truncation",
}


@router.post("/inference/v1/generate")
async def generate(
    body: GenerateRequest, user: CurrentUser, session: SessionDep, state: StateDep, idem: Idempotency
) -> Response:
    """vLLM's tokens-in route: generation from the given token ids, with vLLM's ``sampling_params``,
    answered in vLLM's shape (``output_mode`` tokens or text)."""
    replayed = await _replayed_raw(state, session, idem)
    model = replayed[2] if replayed is not None else await resolve_model(state, body.model)
    sp = body.sampling_params
    extra = sp.model_extra or {}
    for name, what in _GENERATE_REFUSED.items():
        if extra.get(name) not in (None, [], {}):
            raise unsupported(f"sampling_params.{name}", f"{what} are not supported")
    if sp.prompt_logprobs is not None:
        raise unsupported("sampling_params.prompt_logprobs", "prompt logprobs are not computed")
    if sp.min_tokens:
        raise unsupported("sampling_params.min_tokens", "min_tokens is not supported")
    if sp.best_of is not None and sp.best_of != sp.n:
        raise unsupported("sampling_params.best_of", "best_of other than n is not supported; use n")
    if sp.n > MAX_N:
        raise ApiError(ErrorCode.validation_error, f"n is at most {MAX_N}", param="sampling_params.n")
    request_extra = body.model_extra or {}
    for name in ("content_parts", "features"):
        if request_extra.get(name):
            raise unsupported(name, "multimodal inputs are not supported")
    if body.priority != 0:
        raise unsupported("priority", "requests are served first come, first served; send priority 0")
    if body.output_mode == "text" and extra.get("detokenize") is False:
        raise ApiError(
            ErrorCode.validation_error,
            "output_mode 'text' requires sampling_params.detokenize to be true",
            param="output_mode",
        )
    sampling = sampling_params(sp, sp.max_tokens, sp.logprobs or 0, prefix="sampling_params.")

    async def create() -> tuple[list[str], int]:
        await admit(state.settings, state.rate_limiter, state.sql, session, user.id, model, sp.n)
        _chat, prompt_msg, msgs = await store_raw(
            session,
            user.id,
            text="",
            raw={"token_ids": body.token_ids},
            title=f"generate ({len(body.token_ids)} tokens)",
            model=model,
            sampling=sampling,
            n=sp.n,
        )
        return await _commit_raw(state, session, idem, [prompt_msg], msgs)

    if replayed is None:
        replay = functools.partial(_replay_raw, state)
        message_ids, created = await once(idem, session, create, replay, looked=True)
    else:
        message_ids, created, _ = replayed
    await session.close()
    shape = _GenerateShape(body, body.request_id or f"gen-{message_ids[0]}", model)
    if body.stream:
        return event_stream(_generate_stream(state, shape, message_ids), state.metrics)
    results = await asyncio.gather(*(collect(state, mid) for mid in message_ids))
    choices = []
    completion = 0
    for i, (done, progress) in enumerate(results):
        msg, tokens = done.message, done.tokens
        if msg.state != MessageState.complete.value or tokens is None:
            raise failure(msg)
        ids = unpack_ids(tokens.completion_ids)
        completion += len(ids)
        tops = progress.top_logprobs if len(progress.top_logprobs) == len(ids) else None
        choice = shape.choice(i, ids, stored_logprobs(tokens), token_texts(tokens), tops)
        choice["finish_reason"] = msg.finish_reason
        choice["stop_reason"] = stop_reason(tokens)
        if body.output_mode == "text":
            choice["text"] = msg.content or ""
        choice["tokentrail"] = tokentrail_info(msg, tokens, forked=False)
        choices.append(choice)
    first = results[0][0].tokens
    assert first is not None
    return Response(
        dumps(
            {
                **shape.head(),
                "created": created,
                "choices": choices,
                "usage": usage(len(body.token_ids), completion, first.num_cached_tokens),
                "prompt_logprobs": None,
                "prompt_token_ids": body.token_ids if body.return_token_ids else None,
                "mm_placeholders": None,
                "kv_transfer_params": None,
            }
        ),
        media_type="application/json",
    )


class _GenerateShape:
    """vLLM's generate response pieces for one request: the top fields and a choice's logprobs."""

    def __init__(self, body: GenerateRequest, request_id: str, model: str) -> None:
        self.body = body
        self.request_id = request_id
        self.model = model
        self.want_lps = body.sampling_params.logprobs is not None
        self.top = body.sampling_params.logprobs or 0

    def head(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "model": self.model, "output_mode": self.body.output_mode}

    def choice(
        self,
        index: int,
        ids: list[int],
        lps: list[float | None],
        texts: list[str],
        tops: Sequence[Sequence[tuple[int, float, str]] | None] | None,
    ) -> dict[str, Any]:
        logprobs: dict[str, Any] | None = None
        if self.want_lps:
            if self.body.output_mode == "text":
                entries = logprob_entries(ids, lps, texts, tops, top_n=self.top, as_ids=False)
            else:
                entries = generate_logprob_entries(ids, lps, tops, top_n=self.top)
            logprobs = {"content": entries}
        return {"index": index, "logprobs": logprobs, "finish_reason": None, "stop_reason": None, "token_ids": ids}


async def _generate_stream(state: AppState, shape: _GenerateShape, ids: list[str]) -> AsyncIterator[bytes]:
    body = shape.body
    totals = [0, 0]  # completion tokens, cached prompt tokens
    prompt_pending = [bool(body.return_token_ids)]

    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        out = {**shape.head(), "choices": choices, **more}
        if prompt_pending[0] and choices:  # vLLM sends the prompt ids in the first chunk only
            out["prompt_token_ids"] = body.token_ids
            prompt_pending[0] = False
        return sse(out)

    async def one(index: int, message_id: str) -> AsyncIterator[bytes]:
        reply = ReplyStream(body.sampling_params.stop_strings(), strip=False)
        async for item in follow(state, message_id, Progress(), state.settings.stream_interval):
            if isinstance(item, TokenBatch):
                choice = shape.choice(index, item.token_ids, item.logprobs, item.texts, item.top_logprobs)
                if body.output_mode == "text":
                    choice["text"] = reply.feed(item.texts, "").content
                yield chunk([choice])
            elif isinstance(item, StreamReset):
                yield chunk([], tokentrail={"reset_from": item.from_index})
            else:
                msg, tokens = item.message, item.tokens
                if msg.state != MessageState.complete.value or tokens is None:
                    yield error_chunk(msg)
                    return
                totals[0] += len(unpack_ids(tokens.completion_ids))
                if index == 0:
                    totals[1] = tokens.num_cached_tokens or 0
                end = shape.choice(index, [], [], [], None)
                end["finish_reason"] = msg.finish_reason
                end["stop_reason"] = stop_reason(tokens)
                if body.output_mode == "text":
                    end["text"] = reply.finish(msg.content, None).content
                yield chunk([end], tokentrail=tokentrail_info(msg, tokens, forked=False))

    async for piece in merged([one(i, mid) for i, mid in enumerate(ids)]):
        yield piece
    if body.stream_options is not None and body.stream_options.include_usage:
        yield chunk([], usage=usage(len(body.token_ids), totals[0], totals[1]))
    yield SSE_DONE
