"""Frames of the worker websocket ``/workers/work`` (DESIGN D5).

Every frame is a JSON object with a ``type`` discriminator. Flow control is by credits: the
server sends a ``work`` frame only while the worker has credits left; each ``credit`` frame from
the worker adds to them. ``attempt`` is a fencing token: frames of a stale attempt are dropped.

Worker -> server: hello, credit, tokens, finished, failed, heartbeat, rpc_result, drain, engine.
Server -> worker: welcome, work, cancel, heartbeat, rpc, error (fatal; the server closes after it).

``rpc`` asks a worker that announced the ``rpc`` feature for tokenizer work (tokenize, render a chat,
detokenize) so that the server stays model-agnostic; the worker answers with ``rpc_result``. A worker
that announced ``weights`` also takes the weights calls of a push (``server.weights``):
``check_weights`` {path} (checked, nothing loaded) and ``load_weights`` {path, version, mode}, answered
once that version serves. Tokens frames and records carry the weights version of their tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from shared.api import SamplingParameters

PROTOCOL_VERSION = 1

FinishReason = Literal["stop", "length", "abort"]
Role = Literal["system", "user", "assistant", "tool"]


class HelloFrame(BaseModel):
    type: Literal["hello"] = "hello"
    protocol_version: int
    model_name: str
    engine: str
    tokenizer_hash: str
    template_hash: str
    compat_hash: str
    capacity: int = Field(ge=1, le=4096)
    max_context: int | None = None
    worker_version: str = ""
    features: list[str] = Field(default_factory=list)  # optional frames the worker handles ("rpc")
    vocab_size: int | None = None  # token ids the tokenizer knows: 0 <= id < vocab_size
    # (message_id, attempt) of work this worker was generating when its last connection broke: if
    # that server died it cannot requeue them, so the server this hello reaches does (fenced)
    released: list[tuple[str, int]] = Field(default_factory=list, max_length=4096)
    engine_deaths: int = Field(default=0, ge=0)  # of the worker's engine since the worker started
    engine_restarts: int = Field(default=0, ge=0)
    policy_version: int = Field(default=0, ge=0)  # the weights version its engine serves (0: as started)


class CreditFrame(BaseModel):
    type: Literal["credit"] = "credit"
    credits: int = Field(ge=1)


# One alternative of a position's most likely tokens: (token id, logprob, token text).
TopLogprob = tuple[int, float, str]

# Per-token channel of a completion, for streaming parsed output (see worker.output_parser.ChannelTracker;
# shared.channels.ReplyStream reads them). Parsing is a view (DESIGN D19): held text is never dropped
# unless it parsed.
CHANNEL_CONTENT = "c"  # visible reply text
CHANNEL_REASONING = "r"  # inside the reasoning block
CHANNEL_TOOL = "t"  # held: tool-call markup, or text that may still parse as a call; dropped when a
# token of another channel follows (the call parsed), else released by CHANNEL_UNPARSED or at the end
CHANNEL_UNPARSED = "u"  # closes a tool-call block that did not parse: the held text and this token are content
CHANNEL_HIDDEN = "x"  # markers and special tokens that render as nothing


class TokensFrame(BaseModel):
    """One engine step's tokens for one message. ``start`` is the index of the first token."""

    type: Literal["tokens"] = "tokens"
    message_id: str
    attempt: int
    start: int = Field(ge=0)
    token_ids: list[int]
    logprobs: list[float | None]
    texts: list[str]  # text delta contributed by each token ("" while a character is incomplete)
    channels: str | None = None  # one CHANNEL_* character per token
    top_logprobs: list[list[TopLogprob]] | None = None  # per token, when the request asked for them
    prompt_ids: list[int] | None = None  # on an attempt's first frame: the prompt it generates from
    policy_version: int | None = None  # the weights version that computed these tokens (None: 0, an older worker)


# [start, version]: from completion index ``start`` on, the tokens were computed by weights ``version``
PolicySpan = tuple[int, int]


class GenerationRecord(BaseModel):
    """Everything stored with a finished assistant message (DESIGN section 5)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float | None]
    text_offsets: list[int]  # end offset in ``completion_text`` of each completion token's text
    completion_text: str  # the decoded completion, as streamed (reasoning and tool-call markup included)
    content: str  # the visible reply: completion_text without reasoning and tool calls
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    engine: str
    tokenizer_hash: str
    template_hash: str
    prior_message_id: str | None = None  # the assistant ancestor whose tokens were reused
    reused_prefix_len: int = 0
    synthetic_token_count: int = 0
    fork: bool = False
    prompt_method: str | None = None  # how the worker built the prompt: full|stitch|stitch-history / masked|escaped
    num_cached_tokens: int | None = None
    # parsed from completion_ids for clients; never re-rendered into later prompts
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    resumed_at: list[int] = Field(default_factory=list)  # completion indices where a retry resumed
    # client-supplied prompt tokens, checked against the prompt built from the stored chain:
    # "match", "mismatch@<index>", "prefix-match" or "prefix-mismatch@<index>"
    prompt_check: str | None = None
    # the weights version of every completion token, as [start, version] spans ([] from an older worker)
    policy_versions: list[PolicySpan] = Field(default_factory=list)


class FinishedFrame(BaseModel):
    type: Literal["finished"] = "finished"
    message_id: str
    attempt: int
    record: GenerationRecord


class FailedFrame(BaseModel):
    type: Literal["failed"] = "failed"
    message_id: str
    attempt: int
    code: str
    message: str
    retryable: bool = False


class HeartbeatFrame(BaseModel):
    type: Literal["heartbeat"] = "heartbeat"


class WelcomeFrame(BaseModel):
    type: Literal["welcome"] = "welcome"
    worker_id: str
    heartbeat_interval_s: float
    features: list[str] = Field(default_factory=list)  # what the server accepts beyond single frames


# The server accepts a JSON array of worker frames in one websocket message: a worker sends the
# frames of one engine step together, and the server appends their tokens in one round trip.
FEATURE_BATCH = "batch"
# Welcome feature: the server takes a ``drain`` frame (the worker is shutting down: no more work).
FEATURE_DRAIN = "drain"
# Hello feature: the worker takes ``seed: null`` in a work frame (no seed: the engine's own randomness,
# DESIGN D17). A server sends null only to workers that say so; older workers get a seed every time.
FEATURE_UNSEEDED = "unseeded"


# Welcome feature: the server takes ``engine`` frames (worker.engine_health). A worker whose engine dies
# while connected to a server without it disconnects instead (the server requeues what it held).
FEATURE_ENGINE = "engine"

EngineState = Literal["ready", "restarting", "failed"]


class EngineFrame(BaseModel):
    """The worker's engine changed state. ``restarting``: it died; send this worker no work until
    ``ready`` (after which it grants credits again) and requeue everything it was sent, resuming from
    the tokens already streamed; ``running`` names the work that was in the engine when it died (poison
    protection counts those). ``failed``: it could not be restarted; the worker exits.

    A worker sends ``restarting`` again (with ``running`` empty) for work that reaches it meanwhile."""

    type: Literal["engine"] = "engine"
    state: EngineState
    deaths: int = Field(default=0, ge=0)  # since the worker started
    restarts: int = Field(default=0, ge=0)  # successful restarts since the worker started
    error: str | None = None  # why the engine died
    running: list[tuple[str, int]] = Field(default_factory=list, max_length=4096)  # (message id, attempt)
    policy_version: int = Field(default=0, ge=0)  # the weights version the engine serves (with "ready")


class DrainFrame(BaseModel):
    """The worker is shutting down: send it no more work. It finishes what it holds (or hands it back
    by disconnecting) and grants no further credits."""

    type: Literal["drain"] = "drain"


class WorkMessage(BaseModel):
    """One message on the path root -> parent, as the worker renders it."""

    id: str
    role: Role
    content: str
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class PriorChain(BaseModel):
    """The stored tokens of the nearest assistant ancestor: the next prompt extends them."""

    message_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    tokenizer_hash: str
    template_hash: str
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    has_tool_calls: bool = False


class ResumeState(BaseModel):
    """Tokens already streamed by an earlier attempt; generation continues after them.

    Only a worker with the same ``compat_hash`` (tokenizer and template) may continue them.
    """

    compat_hash: str
    token_ids: list[int]
    logprobs: list[float | None]
    texts: list[str]
    policy_versions: list[PolicySpan] = Field(default_factory=list)  # of token_ids, as in GenerationRecord


class RawPrompt(BaseModel):
    """A prompt given as it is (text completions, tokens in): no chat template is applied."""

    token_ids: list[int] | None = None
    text: str | None = None  # encoded by the worker's tokenizer
    add_special_tokens: bool = True


class WorkFrame(BaseModel):
    type: Literal["work"] = "work"
    message_id: str
    attempt: int
    chat_id: str
    model_name: str
    messages: list[WorkMessage]
    sampling: SamplingParameters
    # the sampling seed, or None: the client asked for none and the engine samples with its own
    # randomness (DESIGN D17). Sent as null only to workers that advertise FEATURE_UNSEEDED.
    seed: int | None
    tools: list[dict[str, Any]] | None = None
    prior: PriorChain | None = None
    resume: ResumeState | None = None
    template_kwargs: dict[str, Any] | None = None  # chat-template arguments of this request
    raw: RawPrompt | None = None  # generate from this prompt instead of building one from messages
    # tokens a client built for this prompt: generation uses them; the record says if they matched
    client_prompt_ids: list[int] | None = None
    required_prefix_ids: list[int] | None = None  # the built prompt must start with these (checked)


class CancelFrame(BaseModel):
    type: Literal["cancel"] = "cancel"
    message_id: str
    attempt: int


FEATURE_RPC = "rpc"
# Hello feature: the worker takes ``check_weights`` and ``load_weights`` calls (live weight updates).
FEATURE_WEIGHTS = "weights"
RpcMethod = Literal["tokenize", "render_chat", "detokenize", "check_weights", "load_weights"]
WEIGHTS_METHODS = ("check_weights", "load_weights")


class RpcFrame(BaseModel):
    """A call on the worker that is not work: tokenizer calls (``/tokenize``, ``/detokenize``, text
    completions' echo) and, with ``weights``, a push's ``check_weights`` and ``load_weights``."""

    type: Literal["rpc"] = "rpc"
    id: str
    method: RpcMethod
    params: dict[str, Any] = Field(default_factory=dict)


class RpcResultFrame(BaseModel):
    """The answer to one ``rpc``: ``result``, or an error ``code`` and ``message``."""

    type: Literal["rpc_result"] = "rpc_result"
    id: str
    result: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None


class ErrorFrame(BaseModel):
    type: Literal["error"] = "error"
    code: str
    message: str


WorkerFrame = Annotated[
    HelloFrame
    | CreditFrame
    | TokensFrame
    | FinishedFrame
    | FailedFrame
    | HeartbeatFrame
    | RpcResultFrame
    | DrainFrame
    | EngineFrame,
    Field(discriminator="type"),
]
ServerFrame = Annotated[
    WelcomeFrame | WorkFrame | CancelFrame | HeartbeatFrame | RpcFrame | ErrorFrame, Field(discriminator="type")
]

worker_frame_adapter: TypeAdapter[WorkerFrame] = TypeAdapter(WorkerFrame)
worker_batch_adapter: TypeAdapter[list[WorkerFrame]] = TypeAdapter(list[WorkerFrame])
server_frame_adapter: TypeAdapter[ServerFrame] = TypeAdapter(ServerFrame)
