"""Request body of OpenAI's Responses API (``POST /v1/responses``).

Fields follow OpenAI's API; the sampling knobs vLLM adds (``top_k``, ``min_p``, ``repetition_penalty``,
``stop``, ``stop_token_ids``, ``seed``...) and tokentrail's ``conversation_id``,
``chat_template_kwargs`` and NeMo-RL's ``required_prefix_token_ids`` are accepted as extensions, as on
``/v1/chat/completions``. Input items and tools stay plain dicts: the server translates them into
chat messages and names the offending item in its errors (``server/openai/responses.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from shared.api import MAX_NEW_TOKENS_LIMIT, MAX_TOOLS
from shared.openai_api import MAX_MESSAGES, NonNegInt, SamplingKnobs

# a turn may take several items (reasoning, message, function calls)
MAX_INPUT_ITEMS = 4 * MAX_MESSAGES


class ResponsesRequest(SamplingKnobs):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = None
    prompt_cache_key: str | None = None  # the session hint (routing, tie-breaker), as on chat completions
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None  # everything is stored (tokentrail keeps every token for export)
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # tokentrail and vLLM extensions
    conversation_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    required_prefix_token_ids: list[NonNegInt] | None = None
