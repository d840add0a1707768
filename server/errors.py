"""The server's exceptions and their mapping to HTTP error bodies.

What reaches a client, in OA's shape (OpenAI's, ``{"error": {...}}``, on the OpenAI paths; Anthropic's,
``{"type": "error", "error": {...}}``, on ``/v1/messages``):

ApiError(code, detail)            -> {"detail": ..., "code": ...} with HTTP_STATUS[code]
RequestValidationError (FastAPI)  -> 422 {"detail": [...], "code": "validation_error"} (OpenAI: 400)
is_unavailable(exc): DB or Redis  -> 503 {"code": "not_ready"} with Retry-After (server/outages.py)
anything else                     -> 500 {"detail": "internal error", "code": "internal_error"}

Every 429 and 503 carries Retry-After: an ApiError of either status without one gets the default.

The internal exceptions, each defined next to its use, and where each ends up:

* ApiError (here) - an answer to the client, raised anywhere below a route.
* QueueFull (queue/protocol.py) - a model's queue is full.
    chats/enqueue.py: the request's messages are discarded -> ApiError(queue_full), 503 + Retry-After.
    workers/recovery.py: a background enqueue gives up (the sweep takes the message over).
* StreamConflict (streams/protocol.py) - a token batch not at the stream's length, or after its end.
    workers/hub.py: the batch is dropped (logged); the finished record fills the stream.
* RpcUnavailable (workers/rpc.py) - no worker that answers tokenizer calls can be reached.
    openai/params.py: -> ApiError(no_worker), 503 + Retry-After.
* RpcFailed(code) (workers/rpc.py) - a worker answered a tokenizer call with an error.
    openai/params.py: -> ApiError(code), engine_error for a code the server does not know.
* RelayError(code) (workers/relay.py) - another server process answered a relayed call with an error.
    workers/rpc.py: no_worker -> RpcUnavailable, else -> RpcFailed(code); a relayed cancel -> not sent.
* RelayTimeout (workers/relay.py) - another server process did not answer a relayed call in time.
    workers/rpc.py: -> RpcUnavailable; a relayed cancel -> not sent (the hub ends the stream itself).
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.outages import RETRY_AFTER_S, is_unavailable
from shared.errors import HTTP_STATUS, ErrorCode

log = logging.getLogger(__name__)


RETRY_STATUSES = (429, 503)  # answers that always say when to retry (Retry-After)


class ApiError(Exception):
    def __init__(
        self,
        code: ErrorCode,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.status_code = status_code or HTTP_STATUS.get(code, 400)
        if self.status_code in RETRY_STATUSES and "Retry-After" not in (headers or {}):
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}  # a client must know when
        self.headers = headers
        self.param = param  # the offending request field (OpenAI error ``param``)


# Routes that answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
_OPENAI_PREFIXES = ("/v1/", "/inference/", "/tokenize", "/detokenize")
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def allowed_methods(request: Request) -> list[str]:
    """Every method served at this path, as the OpenAPI document lists them: a concrete path
    (``/chats/hide_all``) takes precedence over the templates it also matches (``/chats/{chat_id}``)."""
    paths: dict[str, dict[str, object]] = request.app.openapi().get("paths", {})
    if request.url.path in paths:
        return sorted(m.upper() for m in paths[request.url.path])
    methods: set[str] = set()
    for template, operations in paths.items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, request.url.path):
            methods |= {m.upper() for m in operations}
    return sorted(methods)


def is_openai_path(path: str) -> bool:
    return path.startswith(_OPENAI_PREFIXES)


def openai_error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, object]:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ``/v1/messages`` (Anthropic's Messages API) answers in Anthropic's shape instead:
# {"type": "error", "error": {"type", "message"}} (plus tokentrail's ``code`` and ``param``).
_ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, object]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code, "param": param}}


def v1_error_body(path: str, status: int, message: str, code: str, param: str | None = None) -> dict[str, object]:
    """The error body of an OpenAI-compatible path: Anthropic's shape on ``/v1/messages``."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message, code, param)
    return openai_error_body(status, message, code, param)


def _loc(loc: tuple[object, ...] | list[object]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def count_error(request: Request, code: str) -> None:
    """Count an error answer in the process's metrics (once the app has started)."""
    state = getattr(request.app.state, "tt", None)
    if state is not None:
        state.metrics.errors.labels(code).inc()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count_error(request, exc.code.value)
        if is_openai_path(request.url.path):  # OpenAI answers every invalid field with 400, not 422
            # (a reused Idempotency-Key keeps the IETF draft's 422: it is not an invalid field)
            reused = exc.code == ErrorCode.idempotency_key_reused
            status = 400 if exc.status_code == 422 and not reused else exc.status_code
            body = v1_error_body(request.url.path, status, exc.detail, exc.code.value, exc.param)
            return JSONResponse(body, status_code=status, headers=exc.headers)
        return JSONResponse(
            {"detail": exc.detail, "code": exc.code.value}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        count_error(request, ErrorCode.validation_error.value)
        if is_openai_path(request.url.path):  # OpenAI and vLLM answer a malformed body with 400
            first = errors[0] if errors else {}
            message = "; ".join(f"{_loc(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5])
            body = v1_error_body(request.url.path, 400, message or "invalid request", ErrorCode.validation_error.value)
            body["error"]["param"] = _loc(first.get("loc", ()))  # type: ignore[index]
            return JSONResponse(body, status_code=400)
        # Oversized content is a size problem (413), not a shape problem.
        for err in errors:
            if err.get("type") == "string_too_long" and "content" in err.get("loc", ()):
                return JSONResponse(
                    {"detail": "content is too long", "code": ErrorCode.content_too_long.value},
                    status_code=413,
                )
        safe = [{k: v for k, v in e.items() if k in ("type", "loc", "msg")} for e in errors]
        return JSONResponse({"detail": safe, "code": ErrorCode.validation_error.value}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = getattr(exc, "headers", None)
        if exc.status_code in RETRY_STATUSES and "Retry-After" not in (headers or {}):
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            allow = ", ".join(allowed_methods(request))
            if request.method == "OPTIONS":
                return Response(status_code=204, headers={"Allow": allow})
            headers = {**(headers or {}), "Allow": allow}
        if is_openai_path(request.url.path):
            code = ErrorCode.not_found.value if exc.status_code == 404 else ErrorCode.bad_request.value
            return JSONResponse(
                v1_error_body(request.url.path, exc.status_code, str(exc.detail), code),
                status_code=exc.status_code,
                headers=headers,
            )
        code = {404: ErrorCode.bad_request, 405: ErrorCode.bad_request}.get(exc.status_code, ErrorCode.bad_request)
        return JSONResponse(
            {"detail": exc.detail, "code": ErrorCode.not_found.value if exc.status_code == 404 else code.value},
            status_code=exc.status_code,
            headers=headers,
        )

    # Starlette answers with this handler from its outermost middleware and then raises the exception
    # again, and uvicorn closes the connection: "Connection: close" keeps a pooling client from sending
    # its next request on that connection in the moment before it closes (which that request would
    # see as a reset, not as an answer).
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        count_error(request, (ErrorCode.not_ready if is_unavailable(exc) else ErrorCode.internal_error).value)
        if is_unavailable(exc):  # the database or Redis away or saturated: retry, not a bug
            log.warning("%s %s: a backing service is unavailable: %r", request.method, request.url.path, exc)
            detail = "a backing service (database or Redis) is unavailable; retry shortly"
            headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
            if is_openai_path(request.url.path):
                body = v1_error_body(request.url.path, 503, detail, ErrorCode.not_ready.value)
                return JSONResponse(body, status_code=503, headers=headers)
            return JSONResponse({"detail": detail, "code": ErrorCode.not_ready.value}, status_code=503, headers=headers)
        log.exception("unhandled error", exc_info=exc)
        closing = {"Connection": "close"}
        if is_openai_path(request.url.path):
            body = v1_error_body(request.url.path, 500, "internal error", ErrorCode.internal_error.value)
            return JSONResponse(body, status_code=500, headers=closing)
        return JSONResponse(
            {"detail": "internal error", "code": ErrorCode.internal_error.value}, status_code=500, headers=closing
        )
