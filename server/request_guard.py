"""Checks every HTTP request before a route reads it: body size and NUL characters.

- A body larger than ``max_body_bytes`` is refused with 413 ``request_too_large``: at once when
  Content-Length says so, else as soon as the streamed body passes the limit. Nothing beyond the
  limit is read into memory.
- A NUL character (U+0000) in the path, the query or any string of a JSON body is refused with 400
  ``bad_request``: PostgreSQL text cannot hold one (asyncpg fails the statement), SQLite would store
  what PostgreSQL refuses, and no chat content needs it.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so that SSE responses stream untouched.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import RETRY_STATUSES, is_openai_path, v1_error_body
from server.outages import RETRY_AFTER_S
from shared.errors import HTTP_STATUS, ErrorCode

_NUL_ESCAPES = (b"\\u0000", b"\x00")


def has_nul(value: Any) -> bool:
    """Whether a decoded JSON value holds U+0000 in any string, key or value."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return True
        elif isinstance(v, dict):
            for k, item in v.items():
                if "\x00" in k:
                    return True
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)
    return False


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("raw_path") or scope["path"].encode()
        target = path + b"?" + scope.get("query_string", b"")
        if b"%00" in target or b"\x00" in target:
            await self._refuse(scope, send, ErrorCode.bad_request, "the URL must not contain NUL (%00)")
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(scope, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and not declared:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        disconnect: Message | None = None
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnect = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if disconnect is not None:
            return  # the client left before sending its body
        body = b"".join(chunks)
        if any(e in body for e in _NUL_ESCAPES) and _json_has_nul(body):
            await self._refuse(scope, send, ErrorCode.bad_request, "strings must not contain NUL (U+0000)")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        await self._refuse(
            scope,
            send,
            ErrorCode.request_too_large,
            f"the request body is larger than {self.max_body_bytes} bytes",
            headers={"Connection": "close"},
        )

    @staticmethod
    async def _refuse(
        scope: Scope, send: Send, code: ErrorCode, detail: str, headers: dict[str, str] | None = None
    ) -> None:
        status = HTTP_STATUS[code]
        body: dict[str, object] = (
            v1_error_body(scope["path"], status, detail, code.value)
            if is_openai_path(scope["path"])
            else {"detail": detail, "code": code.value}
        )
        if status in RETRY_STATUSES:
            headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
        response = JSONResponse(body, status_code=status, headers=headers)
        await response(scope, _drain, send)


async def _drain() -> Message:
    return {"type": "http.disconnect"}


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _json_has_nul(body: bytes) -> bool:
    try:
        return has_nul(orjson.loads(body))
    except orjson.JSONDecodeError:
        return b"\x00" in body  # not JSON (the route reports that); a raw NUL byte is refused anyway
