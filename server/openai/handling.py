"""Request handling the OpenAI-compatible routes share: model checks, sampling parameters, queueing,
following generations to their stored end, and errors as OpenAI shapes them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from server.chats.follow import Finished
from server.errors import ApiError
from server.metrics import Metrics
from server.models import Message
from server.openai.follow import Progress, follow
from server.openai.responses import sse
from server.state import AppState
from server.workers.rpc import RpcFailed, RpcUnavailable
from shared.api import MAX_NEW_TOKENS_LIMIT, SamplingParameters
from shared.errors import ErrorCode
from shared.openai_api import SamplingKnobs
from shared.protocol import RpcMethod


async def require_model(state: AppState, model: str) -> None:
    if not await state.catalog.is_offered(model):
        raise ApiError(
            ErrorCode.model_not_found,
            f"The model `{model}` does not exist or no worker serves it now; see GET /v1/models",
            param="model",
        )


async def resolve_model(state: AppState, model: str | None) -> str:
    """The named model, or the only one served when the request names none (vLLM serves one)."""
    if model is not None:
        await require_model(state, model)
        return model
    offered = sorted(await state.catalog.offered())
    if len(offered) == 1:
        return offered[0]
    raise ApiError(
        ErrorCode.model_not_found if not offered else ErrorCode.validation_error,
        "no model is served now" if not offered else f"name the model: several are served ({', '.join(offered)})",
        param="model",
        status_code=404 if not offered else 400,
    )


async def rpc_call(state: AppState, model: str, method: RpcMethod, params: dict[str, Any]) -> dict[str, Any]:
    """Tokenizer work on a worker of ``model`` (the server never loads a tokenizer)."""
    try:
        return await state.hub.rpc.call(model, method, params)
    except RpcUnavailable as exc:
        raise ApiError(ErrorCode.no_worker, str(exc), headers={"Retry-After": "1"}) from exc
    except RpcFailed as exc:
        try:
            code = ErrorCode(exc.code)
        except ValueError:
            code = ErrorCode.engine_error
        raise ApiError(code, str(exc)) from exc


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(ErrorCode.unsupported_parameter, f"{param}: {why}", param=param)


def sampling_params(
    body: SamplingKnobs, max_tokens: int | None, top_logprobs: int, *, prefix: str = ""
) -> SamplingParameters:
    """tokentrail's sampling parameters; ``prefix`` is where the fields sit in the request body."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise unsupported(prefix + name, "not supported by tokentrail's engines; use repetition_penalty")
    if body.logit_bias:
        raise unsupported(prefix + "logit_bias", "not supported")
    try:
        return SamplingParameters(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=None if body.top_k in (None, -1, 0) else body.top_k,
            min_p=body.min_p or None,
            repetition_penalty=body.repetition_penalty,
            max_new_tokens=max_tokens or MAX_NEW_TOKENS_LIMIT,
            seed=None if body.seed is None else body.seed % 2**63,
            stop_token_ids=body.stop_token_ids or [],
            top_logprobs=top_logprobs,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        param = prefix + ".".join(str(p) for p in err.get("loc", ())) or None
        raise ApiError(ErrorCode.validation_error, f"{param}: {err.get('msg')}", param=param, status_code=400) from exc


async def collect(state: AppState, message_id: str) -> tuple[Finished, Progress]:
    progress = Progress()
    done: Finished | None = None
    async for item in follow(state, message_id, progress):
        if isinstance(item, Finished):
            done = item
    if done is None:
        raise ApiError(ErrorCode.message_not_found, f"message {message_id} was deleted while generating")
    return done, progress


def failure(msg: Message) -> ApiError:
    try:
        code = ErrorCode(msg.error_code or ErrorCode.engine_error.value)
    except ValueError:
        code = ErrorCode.engine_error
    status = 400 if code in (ErrorCode.context_overflow, ErrorCode.bad_request) else None
    return ApiError(code, msg.error or f"generation ended {msg.state}", status_code=status)


def error_chunk(msg: Message) -> bytes:
    exc = failure(msg)
    return sse({"error": {"message": exc.detail, "type": "server_error", "param": None, "code": exc.code.value}})


class Merge:
    """Interleaves the chunk streams of n choices as they come."""

    def __init__(self, sources: list[AsyncIterator[bytes]]) -> None:
        self.sources = sources

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if len(self.sources) == 1:
            async for chunk in self.sources[0]:
                yield chunk
            return
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def pump(source: AsyncIterator[bytes]) -> None:
            try:
                async for chunk in source:
                    await queue.put(chunk)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(s)) for s in self.sources]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t


def event_stream(chunks: AsyncIterator[bytes], metrics: Metrics) -> StreamingResponse:
    """Pre-encoded SSE chunks as a response that proxies must not buffer, counted as an SSE reader."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_counted(chunks, metrics), media_type="text/event-stream", headers=headers)


async def _counted(chunks: AsyncIterator[bytes], metrics: Metrics) -> AsyncIterator[bytes]:
    with metrics.sse_reader():
        async for chunk in chunks:
            yield chunk
