"""OpenAI-compatible chat routes: ``/v1/models`` and ``/v1/chat/completions`` (and verifiers' ``/tokens``
form). Raw prompts are in ``openai_completions.py``, tokenizer calls in ``tokenizer.py``.

Every request is stored as a chat of the key's user: chat requests continue the longest stored path
their messages match (``server/openai/conversations.py``), so an unmodified client that sends only
messages gets prompts stitched from stored tokens. Errors use OpenAI's shape (``server/errors.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Response
from starlette.types import Send

from server.api.deps import CurrentUser, Idempotency, SessionDep, SessionHint, StateDep, session_key
from server.chats.admission import admit
from server.chats.finished import Finished
from server.chats.follow import Ended, load
from server.chats.follow import follow as follow_message
from server.errors import ApiError
from server.idempotency import IdempotencyKey
from server.openai.choices import Progress, collect
from server.openai.conversations import parse_messages
from server.openai.params import require_model, sampling_params, unsupported
from server.openai.render import (
    assistant_message,
    dumps,
    failure,
    finish_reason,
    logprob_entries,
    stop_reason,
    stored_logprobs,
    token_texts,
    tokentrail_info,
    usage,
)
from server.openai.streaming import SSE_DONE, eager_send, error_chunk, event_stream, merged, sse
from server.openai.turns import Turn, replayed_turn, start_turn
from server.state import AppState
from server.streams.protocol import StreamReset, TokenBatch
from shared.api import MessageState, check_tools
from shared.channels import Delta, ReplyStream
from shared.errors import ErrorCode
from shared.openai_api import (
    ChatCompletionRequest,
    ChatCompletionTokensRequest,
)
from shared.packing import unpack_ids

router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)


def _add_text(delta: dict[str, Any], text: Delta) -> None:
    if text.content:
        delta["content"] = text.content
    if text.reasoning:
        delta["reasoning_content"] = delta["reasoning"] = text.reasoning


@router.get("/v1/models")
async def list_models(state: StateDep, _user: CurrentUser) -> dict[str, Any]:
    models = sorted((await state.catalog.offered()).values(), key=lambda m: m.name)
    versions = await state.hub.registry.fresh()
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "tokentrail",
                "root": m.name,
                "max_model_len": m.max_context,
                "policy_version": versions.get(m.name, 0),  # tokentrail: its current weights version
            }
            for m in models
        ],
    }


# ---- chat completions -----------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest,
    user: CurrentUser,
    session: SessionDep,
    state: StateDep,
    hint: SessionHint,
    idem: Idempotency,
) -> Response:
    return await _chat(body, user.id, session, state, client_tokens=None, hint=hint, idem=idem)


@router.post("/v1/chat/completions/tokens")
async def chat_completions_tokens(
    body: ChatCompletionTokensRequest,
    user: CurrentUser,
    session: SessionDep,
    state: StateDep,
    hint: SessionHint,
    idem: Idempotency,
) -> Response:
    """A chat request plus the prompt ``tokens`` the client built (verifiers' token client): generation
    uses those tokens; ``tokentrail.prompt_check`` says whether they equal the stored chain's prompt."""
    return await _chat(body, user.id, session, state, client_tokens=body.tokens, hint=hint, idem=idem)


async def _chat(
    body: ChatCompletionRequest,
    user_id: str,
    session: Any,
    state: AppState,
    *,
    client_tokens: list[int] | None,
    hint: str | None,
    idem: IdempotencyKey | None,
) -> Response:
    turn = await replayed_turn(state, session, idem)
    if turn is None:
        turn = await _new_turn(body, user_id, session, state, client_tokens=client_tokens, hint=hint, idem=idem)
    else:
        await session.close()
    ids = turn.message_ids
    ctx = _ChatContext(body, f"chatcmpl-{ids[0]}", turn.created, turn.forked, turn.info())
    if body.stream:
        if len(ids) == 1:
            choice = _Choice(ctx, 0)
            chunks = ctx.choice_chunks(state, 0, ids[0], last=True, choice=choice)
            return event_stream(chunks, state.metrics, pusher=choice)
        chunks = merged([ctx.choice_chunks(state, i, mid) for i, mid in enumerate(ids)])
        return event_stream(ctx.stream(chunks), state.metrics)
    results = await asyncio.gather(*(collect(state, mid) for mid in ids))
    return Response(dumps(ctx.body(results)), media_type="application/json")


async def _new_turn(
    body: ChatCompletionRequest,
    user_id: str,
    session: Any,
    state: AppState,
    *,
    client_tokens: list[int] | None,
    hint: str | None,
    idem: IdempotencyKey | None,
) -> Turn:
    """The request checked, admitted and stored (its assistant messages queued)."""
    await require_model(state, body.model)
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", "structured output is not supported; omit it or use type text")
    choice = body.tool_choice
    if isinstance(choice, dict) or choice not in (None, "auto", "none"):
        raise unsupported("tool_choice", "tokentrail does not constrain decoding: use auto or none")
    if body.top_logprobs and not body.logprobs:
        raise ApiError(ErrorCode.validation_error, "top_logprobs needs logprobs: true", param="top_logprobs")
    try:
        tools = check_tools(body.tools) or None
    except ValueError as exc:
        raise ApiError(ErrorCode.validation_error, str(exc), param="tools", status_code=400) from exc
    conv = parse_messages(body.messages)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    sampling = sampling_params(body, body.max_completion_tokens or body.max_tokens, top)
    kwargs = body.chat_template_kwargs or None
    return await start_turn(
        state,
        session,
        user_id,
        idem=idem,
        admission=lambda: admit(state.settings, state.rate_limiter, state.sql, session, user_id, body.model, body.n),
        conv=conv,
        model=body.model,
        tools=tools,
        sampling=sampling,
        n=body.n,
        conversation_id=body.conversation_id,
        template_kwargs=kwargs,
        client_prompt_ids=client_tokens,
        required_prefix_ids=body.required_prefix_token_ids,
        session_key=session_key(body.prompt_cache_key) or hint,
    )


class _Choice:
    """One streamed choice: what its chunks have said so far, shared by its reader loop
    (``choice_chunks``) and its push path. Given the response's ``send`` (``SseStream.pump``), the push
    path writes each new batch's chunk where the batch is appended (``MemoryTokenStreams.deliver``)
    while the loop waits: no task woken, no generator resumed per engine step. A write that cannot
    finish at once (the client reads slowly) is finished by a task, and the loop takes over until it has."""

    __slots__ = ("after", "ctx", "first", "index", "pending", "prompt_sent", "reply", "send", "streamed")

    def __init__(self, ctx: _ChatContext, index: int) -> None:
        self.ctx = ctx
        self.index = index
        self.first = True
        # The deltas add up to the stored message (DESIGN D19): held text comes out when it is sure.
        self.reply = ReplyStream(ctx.req.stop_strings())
        self.prompt_sent = False
        self.streamed = 0  # tokens delivered so far
        self.after = -1  # the last token index delivered (``follow``'s position, for the push path)
        self.send: Send | None = None
        self.pending: asyncio.Future[None] | None = None  # a pushed chunk's write, not finished yet

    def chunk(self, item: TokenBatch) -> bytes:
        ctx = self.ctx
        delta: dict[str, Any] = {"role": "assistant"} if self.first else {}
        _add_text(delta, self.reply.feed(item.texts, item.channels))
        choice: dict[str, Any] = {
            "index": self.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": None,
            "token_ids": item.token_ids,
        }
        if ctx.req.logprobs:
            entries = logprob_entries(
                item.token_ids,
                item.logprobs,
                item.texts,
                item.top_logprobs,
                top_n=ctx.top,
                as_ids=ctx.req.return_tokens_as_token_ids,
            )
            choice["logprobs"] = {"content": entries}
        chunk = {**ctx._base(), "choices": [choice]}
        if self.first and item.start == 0 and item.prompt_ids is not None:
            chunk["prompt_token_ids"] = item.prompt_ids
            self.prompt_sent = True
        self.first = False
        self.streamed = item.end
        return sse(chunk)

    def __call__(self, batch: TokenBatch) -> bool:
        """The push path: write ``batch``'s chunk now, or False (the loop takes it)."""
        if self.send is None or batch.start != self.after + 1 or not batch.token_ids:
            return False
        if self.pending is not None:
            if not self.pending.done() or self.pending.cancelled() or self.pending.exception() is not None:
                return False  # the loop waits for it (and raises what it raised)
            self.pending = None
        try:
            data = self.chunk(batch)
        except Exception:
            log.exception("a pushed chunk failed; the reader takes the batch")
            return False
        self.after = batch.end - 1
        self.pending = eager_send(self.send, data)
        return True

    async def flushed(self) -> None:
        """Wait for the pushed chunk still being written (its error, if any, is raised)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            await pending

    def close(self) -> None:
        self.send = None
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()


class _ChatContext:
    def __init__(self, body: ChatCompletionRequest, cid: str, created: int, forked: bool, info: dict[str, Any]) -> None:
        self.req = body
        self.cid = cid
        self.created = created
        self.forked = forked
        self.info = info
        self.with_tools = body.tool_choice != "none"
        self.top = (body.top_logprobs or 0) if body.logprobs else 0
        self.usage = [0, 0, 0]  # prompt (first choice), completion (all), cached

    def _base(self) -> dict[str, Any]:
        return {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model}

    def _info(self, done: Finished) -> dict[str, Any]:
        info = tokentrail_info(done.message, done.tokens, forked=self.forked)
        return {**self.info, **info}

    def body(self, results: list[tuple[Finished, Progress]]) -> dict[str, Any]:
        choices = []
        for i, (done, progress) in enumerate(results):
            msg, tokens = done.message, done.tokens
            if msg.state != MessageState.complete.value or tokens is None:
                raise failure(msg)
            ids = unpack_ids(tokens.completion_ids)
            choice: dict[str, Any] = {
                "index": i,
                "message": assistant_message(msg, with_tools=self.with_tools),
                "logprobs": None,
                "finish_reason": finish_reason(msg) if self.with_tools else msg.finish_reason,
                "stop_reason": stop_reason(tokens),
                "token_ids": ids,
                "tokentrail": tokentrail_info(msg, tokens, forked=self.forked),
            }
            if self.req.logprobs:
                tops = progress.top_logprobs if len(progress.top_logprobs) == len(ids) else None
                entries = logprob_entries(
                    ids,
                    stored_logprobs(tokens),
                    token_texts(tokens),
                    tops,
                    top_n=self.top,
                    as_ids=self.req.return_tokens_as_token_ids,
                )
                choice["logprobs"] = {"content": entries}
            choices.append(choice)
        first = results[0][0]
        assert first.tokens is not None
        prompt = unpack_ids(first.tokens.prompt_ids)
        completion = sum(len(unpack_ids(d.tokens.completion_ids)) for d, _ in results if d.tokens)
        return {
            "id": self.cid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            "usage": usage(len(prompt), completion, first.tokens.num_cached_tokens),
            "prompt_token_ids": prompt,
            "tokentrail": self._info(first),
        }

    def trailer(self) -> list[bytes]:
        """What follows the choices' chunks: the usage chunk when asked for, and ``[DONE]``."""
        options = self.req.stream_options
        if options is not None and options.include_usage:
            prompt, completion, cached = self.usage
            return [sse({**self._base(), "choices": [], "usage": usage(prompt, completion, cached)}), SSE_DONE]
        return [SSE_DONE]

    async def stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            yield chunk
        for chunk in self.trailer():
            yield chunk

    async def choice_chunks(
        self, state: AppState, index: int, message_id: str, *, last: bool = False, choice: _Choice | None = None
    ) -> AsyncIterator[bytes]:
        """One choice's chunks; ``last``: the request's only choice, followed by the ``trailer`` (one
        generator layer fewer per token than ``stream`` around it). ``choice``: its state, when the
        response may push token chunks itself (``SseStream.pump`` gives it the ``send``)."""
        choice = choice or _Choice(self, index)
        interval = self.req.stream_interval or state.settings.stream_interval
        ending = b""  # the choice's last chunk (its end, or its error): the stream's last item
        try:
            async for item in follow_message(state, message_id, interval=interval, push=choice):
                if choice.pending is not None:  # a pushed chunk still being written goes out first
                    await choice.flushed()
                if type(item) is TokenBatch:
                    yield choice.chunk(item)
                elif isinstance(item, StreamReset):
                    choice.streamed = min(choice.streamed, item.from_index)
                    yield sse({**self._base(), "choices": [], "tokentrail": {"reset_from": item.from_index}})
                elif isinstance(item, Ended):
                    done = await load(state, message_id)
                    if done is None:  # deleted while generating: the stream just ends
                        break
                    msg, tokens = done.message, done.tokens
                    if msg.state != MessageState.complete.value or tokens is None:
                        ending = error_chunk(msg)
                        break
                    ending = self._final(choice, done)
            if choice.pending is not None:
                await choice.flushed()
        finally:
            choice.close()
        if last:  # the end, the usage chunk and [DONE] in one write (``SseStream.pump``)
            ending += b"".join(self.trailer())
        if ending:
            yield ending

    def _final(self, choice: _Choice, done: Finished) -> bytes:
        """The choice's last chunk, from the stored message: the text the stream held back, the tool
        calls, the finish and stop reasons, and the token ids the stream did not deliver."""
        msg, tokens = done.message, done.tokens
        assert tokens is not None
        index = choice.index
        delta: dict[str, Any] = {"role": "assistant"} if choice.first else {}
        calls = msg.tool_calls if self.with_tools else None
        if calls:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        reply = choice.reply
        _add_text(delta, reply.finish(msg.content, msg.reasoning_content))
        if reply.mismatch:
            log.warning("message %s: streamed %s differs from the stored one", msg.id, reply.mismatch)
        prompt = unpack_ids(tokens.prompt_ids)
        stored_ids = unpack_ids(tokens.completion_ids)
        # tokens the stream did not deliver (its Redis entries were lost with a restart) come here, so
        # that the streamed token ids add up to the stored ones as the text does
        missed = stored_ids[choice.streamed :]
        if index == 0:
            self.usage[0], self.usage[2] = len(prompt), tokens.num_cached_tokens or 0
        self.usage[1] += len(stored_ids)
        end: dict[str, Any] = {
            **self._base(),
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason(msg) if self.with_tools else msg.finish_reason,
                    "stop_reason": stop_reason(tokens),
                    "token_ids": missed,
                }
            ],
            "tokentrail": self._info(done),
        }
        if not choice.prompt_sent:
            end["prompt_token_ids"] = prompt
        return sse(end)
