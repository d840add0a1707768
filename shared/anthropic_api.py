"""Request body of the Anthropic Messages API (``POST /v1/messages``).

Fields follow Anthropic's API. ``messages`` and ``system`` stay plain JSON here: the server translates
their content blocks into chat messages (``server/anthropic/translate.py``) and names the offending
block when one cannot be translated. Fields that do not change generation (``metadata``,
``service_tier``, ``thinking``, ``cache_control`` on blocks...) are accepted and ignored; fields that
would change it in ways tokentrail cannot honour are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.api import MAX_TOOLS
from shared.openai_api import MAX_MESSAGES, MAX_STOP_STRINGS, NonNegInt

# Anthropic's clients ask for large budgets (Claude Code: 32000 or more); tokentrail caps generation
# at MAX_NEW_TOKENS_LIMIT (and the model's context) as an upper bound, as ``max_tokens`` is one.
MAX_TOKENS_ACCEPTED = 1_000_000


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the conversation part of a Messages request."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: dict[str, Any] | None = None
    # extended thinking: the model reasons as its chat template makes it (accepted, not enforced)
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # tokentrail extension, as on /v1/chat/completions


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_ACCEPTED)]
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=100_000)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # tokentrail extensions (as on /v1/chat/completions)
    seed: int | None = None
    conversation_id: str | None = None  # continue this chat (otherwise the longest matching one)
    required_prefix_token_ids: list[NonNegInt] | None = None


class AnthropicErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, overloaded_error...
    message: str
    code: str | None = None  # tokentrail's ErrorCode
    param: str | None = None  # the offending request field


class AnthropicErrorBody(BaseModel):
    """Every error of ``/v1/messages``, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# Documented on /v1/messages (OpenAPI): Anthropic answers bad fields with 400, never 422.
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    s: {"model": AnthropicErrorBody} for s in (400, 401, 403, 404, 409, 413, 429, 503)
}
