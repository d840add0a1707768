"""HTTP request and response bodies of the chat API.

Field names and shapes follow Open-Assistant's inference server so that its clients work
unchanged; everything tokentrail adds is additive (new optional fields, new endpoints).
"""

from __future__ import annotations

import json
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Largest prompter message accepted, in characters (413 above it).
MAX_CONTENT_CHARS = 64_000
# Hard ceiling on generated tokens per message; workers also cap at their context length.
MAX_NEW_TOKENS_LIMIT = 32_768
MAX_SYSTEM_PROMPT_CHARS = 64_000
MAX_TOOLS = 128
# Tool schemas of a chat or request, as JSON (the model sees them in every prompt).
MAX_TOOLS_JSON_CHARS = 256_000
# One tool call's arguments, as JSON text.
MAX_TOOL_ARGUMENTS_CHARS = 64_000
# Messages in one chat (all branches): a chat is rendered and exported as a whole.
MAX_MESSAGES_PER_CHAT = 10_000

# A function tool, OpenAI style: {"type": "function", "function": {"name", "description", "parameters"}}.
ToolSchema = dict[str, Any]


class MessageState(StrEnum):
    manual = "manual"  # a prompter message: written by a person, never generated
    pending = "pending"  # queued, no worker yet
    in_progress = "in_progress"  # a worker is generating it
    complete = "complete"
    aborted_by_worker = "aborted_by_worker"  # failed; see MessageRead.error
    cancelled = "cancelled"
    timeout = "timeout"


FINISHED_STATES = frozenset(
    {MessageState.complete, MessageState.aborted_by_worker, MessageState.cancelled, MessageState.timeout}
)


class SamplingParameters(BaseModel):
    """OA's sampling parameters, validated, plus tokentrail's additive ones."""

    model_config = ConfigDict(extra="forbid")

    top_k: Annotated[int, Field(ge=1, le=100_000)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] = 1024
    # tokentrail additions
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = Field(default_factory=list)
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    # generation stops after the token that completes one of these (kept in the tokens, cut from content)
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)] = Field(
        default_factory=list
    )
    ignore_eos: bool = False  # stop only on stop_token_ids and stop strings, not the model's end tokens

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: object) -> object:
        """OA's clients send null for "the default" (``max_new_tokens: null``)."""
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
        return data


class ModelConfigRead(BaseModel):
    """A model offered by at least one connected worker (``GET /configs/model_configs``)."""

    name: str
    compat_hash: str
    engine: str
    max_context: int | None = None
    workers: int = 1
    policy_version: int = 0  # the newest weights version pushed (0: the weights the workers started with)


class WorkParameters(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    model_config_name: str
    sampling_parameters: SamplingParameters = Field(default_factory=SamplingParameters)
    do_sample: bool = True
    seed: int | None  # None: the client asked for no seed (DESIGN D17)
    # the chat's system prompt and tools when this message was requested
    system_prompt: str | None = None
    tools: list[ToolSchema] | None = None
    # OpenAI API requests: chat-template arguments, a raw prompt, client-supplied prompt tokens
    template_kwargs: dict[str, Any] | None = None
    raw_prompt: dict[str, Any] | None = None
    client_prompt_ids: list[int] | None = None
    required_prefix_ids: list[int] | None = None


class MessageRead(BaseModel):
    id: str
    parent_id: str | None
    content: str | None
    chat_id: str
    created_at: datetime
    role: Literal["prompter", "assistant", "tool"]
    state: MessageState
    score: int = 0
    reports: list[object] = Field(default_factory=list)
    work_parameters: WorkParameters | None = None
    safe_content: str | None = None
    safety_level: int | None = None
    safety_label: str | None = None
    safety_rots: str | None = None
    used_plugin: object | None = None
    # tokentrail additions
    tool_call_id: str | None = None  # tool results: the call they answer
    reasoning_content: str | None = None  # assistant: parsed from its tokens
    tool_calls: list[dict[str, Any]] | None = None  # assistant: parsed from its tokens
    error: str | None = None
    error_code: str | None = None
    finish_reason: str | None = None
    prompt_token_count: int | None = None
    completion_token_count: int | None = None
    attempt: int | None = None  # assistant: generation attempts (2+ when a lost worker's reply was continued)
    worker_id: str | None = None  # assistant: the worker (connection) that generated it
    session_key: str | None = None  # the client's session hint it was stored under (OpenAI-style routes)
    # finished assistant messages: [start, version] spans, the weights version of each completion token
    policy_versions: list[tuple[int, int]] | None = None
    reward: float | None = None  # assistant: the environment's reward (POST /v1/rewards)
    episode_done: bool | None = None  # assistant: the episode ended at this turn
    # only with ?include=tokens
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    stop_reason: int | str | None = None
    prior_message_id: str | None = None  # the assistant message whose tokens this prompt extends
    reused_prefix_len: int | None = None
    synthetic_token_count: int | None = None
    fork: bool | None = None  # the prompt was a full render after a history edit
    prompt_method: str | None = None  # how the prompt was built (see worker.prompt_builder)
    num_cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache, if reported


def check_tools(tools: list[ToolSchema] | None) -> list[ToolSchema] | None:
    if tools is None:
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools")
    size = len(json.dumps(tools, ensure_ascii=False))
    if size > MAX_TOOLS_JSON_CHARS:
        raise ValueError(f"the tools are {size} characters of JSON; the limit is {MAX_TOOLS_JSON_CHARS}")
    for tool in tools:
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError("each tool needs a function name: {'type': 'function', 'function': {'name': ...}}")
    return tools


class CreateChatRequest(BaseModel):
    """OA's body is empty; tokentrail adds an optional system prompt and tool schemas."""

    model_config = ConfigDict(extra="ignore")

    system_prompt: Annotated[str, Field(max_length=MAX_SYSTEM_PROMPT_CHARS)] | None = None
    tools: list[ToolSchema] | None = None

    _tools = field_validator("tools")(check_tools)


class ChatListRead(BaseModel):
    id: str
    created_at: datetime
    modified_at: datetime
    title: str | None = None
    hidden: bool = False
    allow_data_use: bool = True
    active_thread_tail_message_id: str | None = None
    system_prompt: str | None = None
    tools: list[ToolSchema] | None = None


class ChatRead(ChatListRead):
    messages: list[MessageRead]


class ListChatsResponse(BaseModel):
    chats: list[ChatListRead]
    next: str | None = None
    prev: str | None = None


class CreatePrompterMessageRequest(BaseModel):
    parent_id: str | None = None
    content: str = Field(..., repr=False)


class CreateToolMessageRequest(BaseModel):
    """A tool's result, answering one call of the assistant message it follows (tokentrail)."""

    parent_id: str
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)]
    content: str = Field(..., repr=False)


class WrittenFunctionCall(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: Annotated[str, Field(max_length=MAX_TOOL_ARGUMENTS_CHARS)] = "{}"  # JSON text, as OpenAI sends it


class WrittenToolCall(BaseModel):
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: WrittenFunctionCall


class CreateWrittenAssistantMessageRequest(BaseModel):
    """An assistant message the client wrote itself (a tool call it made, a reply it typed; tokentrail):
    context for later turns, never a completion. The next prompt keeps the stored tokens before it."""

    parent_id: str
    content: str = Field("", repr=False)
    tool_calls: Annotated[list[WrittenToolCall], Field(max_length=128)] | None = None
    reasoning_content: str | None = Field(None, repr=False)


class ChatUpdateRequest(BaseModel):
    title: Annotated[str, Field(max_length=256)] | None = None
    hidden: bool | None = None
    allow_data_use: bool | None = None
    system_prompt: Annotated[str, Field(max_length=MAX_SYSTEM_PROMPT_CHARS)] | None = None
    tools: list[ToolSchema] | None = None

    _tools = field_validator("tools")(check_tools)


class CreateAssistantMessageRequest(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    parent_id: str
    model_config_name: str
    sampling_parameters: SamplingParameters = Field(default_factory=SamplingParameters)

    @model_validator(mode="before")
    @classmethod
    def _null_sampling_is_default(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("sampling_parameters") is None:
            data = {k: v for k, v in data.items() if k != "sampling_parameters"}
        return data


class VoteRequest(BaseModel):
    """OA's vote on a message; on assistant messages it becomes the turn's reward in exports."""

    score: Literal[-1, 0, 1]


class ReportRequest(BaseModel):
    """OA's report on a message."""

    report_type: Literal["spam", "offensive", "feedback"]
    reason: Annotated[str, Field(max_length=10_000)] = ""


class MessageEvalRequest(BaseModel):
    """OA's choice between drafts: the message in the path was preferred over these siblings."""

    inferior_message_ids: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=64)]


class Token(BaseModel):
    access_token: str
    token_type: str


class TokenPair(BaseModel):
    access_token: Token
    refresh_token: Token


class WorkerRead(BaseModel):
    """A connected worker (``GET /admin/workers``), as of its last heartbeat."""

    worker_id: str
    model_name: str
    compat_hash: str
    engine: str
    max_context: int | None
    capacity: int
    inflight: int
    last_seen: datetime | None
    server_id: str
    key_id: str
    key_name: str
    engine_state: str = "ready"  # ready, restarting (it died: the worker takes no work) or failed
    engine_deaths: int = 0  # since the worker started
    engine_restarts: int = 0
    served: int = 0  # replies this connection finished and stored
    policy_version: int = 0  # the weights version it serves
    weights_error: str = ""  # why it cannot load the model's current version (it takes no work until it does)


class ApiKeyRead(BaseModel):
    id: str
    created_at: datetime
    revoked_at: datetime | None


class UserRead(BaseModel):
    """A user (``GET /admin/users``) with its API keys (never the keys themselves)."""

    id: str
    display_name: str
    provider: str
    is_admin: bool
    created_at: datetime
    api_keys: list[ApiKeyRead]


class WorkerKeyRead(BaseModel):
    id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    connected_workers: int = 0  # on any server process, as the worker directory lists them


# ---- weights pushes (POST /admin/models/{model}/weights) ---------------------------------------------
class PushWeightsRequest(BaseModel):
    """New weights for every worker of a model: a safetensors checkpoint directory in the model's own
    layout, readable by the workers."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, max_length=4096)
    version: int = Field(ge=1, le=2**31 - 1)  # above the model's current version
    mode: Literal["drain", "inflight"] = "drain"


class WorkerWeightsRead(BaseModel):
    id: str
    version: int
    seconds: float | None = None  # how long it took this worker to serve the version


class PushWeightsResponse(BaseModel):
    """Every connected worker of ``model`` serves ``version``."""

    model_config = ConfigDict(protected_namespaces=())

    model: str
    version: int
    mode: Literal["drain", "inflight"]
    seconds: float  # from the request until the last worker served the version
    workers: list[WorkerWeightsRead]


class PolicyVersionRead(BaseModel):
    """A weights version pushed to a model (``GET /admin/models/{model}/weights``)."""

    model_config = ConfigDict(protected_namespaces=())

    model: str
    version: int
    path: str
    mode: str
    pushed_at: datetime
    pushed_by: str | None = None


# ---- rewards from an environment (POST /v1/rewards) -------------------------------------------------
class RewardRequest(BaseModel):
    """An environment's reward for an assistant turn. ``done``: the episode ended with this turn, so the
    path root -> this message is a finished rollout with this reward; else a turn reward."""

    model_config = ConfigDict(extra="forbid")

    message_id: str = Field(min_length=1, max_length=64)
    reward: float = Field(allow_inf_nan=False)
    done: bool = False


class RewardRead(BaseModel):
    message_id: str
    chat_id: str
    reward: float
    done: bool
    rewarded_at: datetime
