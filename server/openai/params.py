"""The request side of the OpenAI-compatible routes: the model asked for, tokentrail's sampling
parameters from OpenAI's and vLLM's knobs, parameters refused as OpenAI refuses them, and tokenizer
calls answered by a worker."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.errors import ApiError
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
