"""Request bodies of the OpenAI-compatible API (``/v1/*``, ``/tokenize``, ``/detokenize``).

Fields follow OpenAI's API and vLLM's extensions of it (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``chat_template_kwargs``, ``return_token_ids``...). Fields an SDK may send that do
not change generation (``user``, ``metadata``, ``store``, ``parallel_tool_calls``...) are accepted and
ignored; fields that would change it in ways tokentrail cannot honour are refused with
``unsupported_parameter`` rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.api import MAX_NEW_TOKENS_LIMIT, MAX_TOOLS

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class SamplingKnobs(BaseModel):
    """Sampling fields as OpenAI and vLLM name them (request bodies and vLLM's ``sampling_params``)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=100_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[NonNegInt], Field(max_length=64)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    ignore_eos: bool = False  # vLLM: stop only on stop_token_ids and stop strings

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class SamplingFields(SamplingKnobs):
    """What chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # token ids are always returned; accepted for vLLM clients
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" (vLLM)
    # tokentrail: the fewest tokens a streamed chunk carries but the last (server default: stream_interval)
    stream_interval: Annotated[int, Field(ge=1, le=1024)] | None = None
    # tokentrail: continue this chat (otherwise the longest matching stored conversation)
    conversation_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # NeMo-RL: the prompt must start with these ids (checked against the stored chain)
    required_prefix_token_ids: list[NonNegInt] | None = None
    # OpenAI's cache routing key: tokentrail's session hint (routing, tie-breaker between identical paths)
    prompt_cache_key: str | None = None


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """verifiers' token client: a chat body plus the prompt token ids it built itself."""

    tokens: Annotated[list[NonNegInt], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # a text, token ids, or a batch of either
    prompt: str | list[NonNegInt] | list[str] | list[list[NonNegInt]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text ``prompt``, or chat ``messages`` rendered by the model's template."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    # tokentrail: also return which tokens the model generated (1) versus were given to it (0)
    return_assistant_mask: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    tokens: list[NonNegInt]


class VllmSamplingParams(SamplingKnobs):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them (``max_tokens`` defaults to 16
    as in vLLM). Fields that only shape output text are accepted; the rest must be supported."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    best_of: int | None = None


class GenerateRequest(BaseModel):
    """vLLM's tokens-in ``/inference/v1/generate``: token ids and sampling parameters."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    token_ids: Annotated[list[NonNegInt], Field(min_length=1)]
    sampling_params: VllmSamplingParams = Field(default_factory=VllmSamplingParams)
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    # "tokens" (vLLM's default): logprob entries by token id; "text": also the detokenized text, and
    # logprob entries with token strings and bytes, as OpenAI's chat route shapes them
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None  # answer with prompt_token_ids (in a stream: its first chunk)
    priority: int = 0  # only 0: tokentrail's queue is first come, first served
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None


ToolChoice = Literal["auto", "none"]
