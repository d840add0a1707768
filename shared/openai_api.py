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


class SamplingFields(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
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
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # token ids are always returned; accepted for vLLM clients
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>" (vLLM)
    # tokentrail: continue this chat (otherwise the longest matching stored conversation)
    conversation_id: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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


class ChatCompletionTokensRequest(ChatCompletionRequest):
    """verifiers' token client: a chat body plus the prompt token ids it built itself."""

    tokens: Annotated[list[NonNegInt], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # a text, a list of token ids, or a list with one of either (OpenAI's batch form with one prompt)
    prompt: str | list[NonNegInt] | list[str] | list[list[NonNegInt]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    add_special_tokens: bool = True


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


class GenerateRequest(BaseModel):
    """vLLM's tokens-in ``/inference/v1/generate``: token ids and sampling parameters."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    token_ids: Annotated[list[NonNegInt], Field(min_length=1)]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    request_id: str | None = None


ToolChoice = Literal["auto", "none"]
