"""Machine-readable error codes, the HTTP status each maps to, and the error body.

Every error the server returns has the body ``{"detail": <human text>, "code": <ErrorCode>}``.
Validation errors keep FastAPI's list of problems in ``detail`` and add ``code``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel


class ErrorCode(StrEnum):
    # 400
    bad_request = "bad_request"
    not_assistant_message = "not_assistant_message"
    unsupported_parameter = "unsupported_parameter"  # OpenAI API: a field tokentrail cannot honour
    invalid_messages = "invalid_messages"  # OpenAI API: messages that cannot form a conversation
    invalid_idempotency_key = "invalid_idempotency_key"  # not 1-255 printable ASCII characters
    invalid_cursor = "invalid_cursor"  # a rollout-feed cursor this deployment did not issue
    unknown_schema = "unknown_schema"  # an export or feed schema that does not exist
    # 401 / 403
    not_authenticated = "not_authenticated"
    invalid_credentials = "invalid_credentials"
    debug_auth_disabled = "debug_auth_disabled"
    forbidden = "forbidden"
    # 404
    chat_not_found = "chat_not_found"
    message_not_found = "message_not_found"
    not_found = "not_found"  # no such route
    model_not_found = "model_not_found"  # OpenAI API: no connected worker offers the model
    # 409
    parent_wrong_role = "parent_wrong_role"
    parent_not_complete = "parent_not_complete"
    parent_required = "parent_required"
    message_finished = "message_finished"  # cancel: the message already ended
    unknown_tool_call = "unknown_tool_call"
    version_not_newer = "version_not_newer"  # a weights push whose version is not above the model's current one
    push_in_progress = "push_in_progress"  # another weights push of the model is running
    message_not_complete = "message_not_complete"  # a reward for a reply that has not completed
    # 413
    content_too_long = "content_too_long"
    request_too_large = "request_too_large"  # the whole body, checked before it is read
    chat_too_long = "chat_too_long"  # a chat holds MAX_MESSAGES_PER_CHAT messages
    # 422
    validation_error = "validation_error"
    unknown_model = "unknown_model"
    idempotency_key_reused = "idempotency_key_reused"  # the key was used with another request
    weights_not_found = "weights_not_found"  # a weights push's directory is missing or unreadable
    weights_not_safetensors = "weights_not_safetensors"  # it holds no safetensors (pickles are never loaded)
    weights_mismatch = "weights_mismatch"  # its tensors or architecture are not the model's
    # 429
    rate_limited = "rate_limited"  # per-user rate of generations
    queue_share_exceeded = "queue_share_exceeded"  # a user's share of a model's queue is used up
    # 503
    queue_full = "queue_full"
    not_ready = "not_ready"
    no_worker = "no_worker"  # nothing connected can serve a tokenizer request
    # worker / generation
    invalid_worker_key = "invalid_worker_key"
    protocol_version_mismatch = "protocol_version_mismatch"
    bad_frame = "bad_frame"
    context_overflow = "context_overflow"
    template_rejected = "template_rejected"  # the chat template refused the conversation (its own message)
    engine_error = "engine_error"
    engine_dead = "engine_dead"  # the worker's whole engine died (its work is requeued, not failed)
    engine_poison_message = "engine_poison_message"  # the message was in flight at repeated engine deaths
    worker_lost = "worker_lost"
    too_many_attempts = "too_many_attempts"
    internal_error = "internal_error"
    weights_load_failed = "weights_load_failed"  # a worker could not load pushed weights that passed the checks
    cancelled = "cancelled"  # the message's final event after POST .../cancel


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.bad_request: 400,
    ErrorCode.not_assistant_message: 400,
    ErrorCode.unsupported_parameter: 400,
    ErrorCode.invalid_messages: 400,
    ErrorCode.invalid_idempotency_key: 400,
    ErrorCode.invalid_cursor: 400,
    ErrorCode.unknown_schema: 400,
    ErrorCode.idempotency_key_reused: 422,
    ErrorCode.model_not_found: 404,
    ErrorCode.not_found: 404,
    ErrorCode.no_worker: 503,
    ErrorCode.template_rejected: 400,
    ErrorCode.engine_error: 500,
    ErrorCode.engine_dead: 503,
    ErrorCode.engine_poison_message: 503,
    ErrorCode.worker_lost: 503,
    ErrorCode.too_many_attempts: 503,
    ErrorCode.internal_error: 500,
    ErrorCode.not_authenticated: 401,
    ErrorCode.invalid_credentials: 401,
    ErrorCode.debug_auth_disabled: 403,
    ErrorCode.forbidden: 403,
    ErrorCode.chat_not_found: 404,
    ErrorCode.message_not_found: 404,
    ErrorCode.parent_wrong_role: 409,
    ErrorCode.parent_not_complete: 409,
    ErrorCode.parent_required: 422,
    ErrorCode.message_finished: 409,
    ErrorCode.cancelled: 409,
    ErrorCode.unknown_tool_call: 422,
    ErrorCode.content_too_long: 413,
    ErrorCode.request_too_large: 413,
    ErrorCode.chat_too_long: 409,
    ErrorCode.validation_error: 422,
    ErrorCode.unknown_model: 422,
    ErrorCode.queue_full: 503,
    ErrorCode.rate_limited: 429,
    ErrorCode.queue_share_exceeded: 429,
    ErrorCode.not_ready: 503,
    ErrorCode.context_overflow: 422,
    ErrorCode.version_not_newer: 409,
    ErrorCode.push_in_progress: 409,
    ErrorCode.message_not_complete: 409,
    ErrorCode.weights_not_found: 422,
    ErrorCode.weights_not_safetensors: 422,
    ErrorCode.weights_mismatch: 422,
    ErrorCode.weights_load_failed: 502,
}


class ErrorBody(BaseModel):
    """Every error of the chat API (``detail``: text, or FastAPI's list of validation problems)."""

    detail: str | list[object]
    code: ErrorCode


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class OpenAIErrorBody(BaseModel):
    """Every error of the OpenAI-compatible routes, in OpenAI's shape."""

    error: OpenAIErrorDetail


_STATUSES = (400, 401, 403, 404, 409, 413, 422, 429, 503)
# Documented on every route (OpenAPI): the statuses an error can have, and its body.
API_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {s: {"model": ErrorBody} for s in _STATUSES}
OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    s: {"model": OpenAIErrorBody}
    for s in _STATUSES
    if s != 422  # OpenAI answers bad fields with 400
}
