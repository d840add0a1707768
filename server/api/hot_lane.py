"""The generation routes served past FastAPI's layers: one turn's request, auth and streamed answer.

Every agent turn is one POST to a generation route (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``, ``/v1/messages``). Through FastAPI each pays about a dozen ASGI layers (its middleware
stack, routing over every route, dependency solving), and each streamed chunk passes three ``send``
wrappers and an anyio task group. Here the same route functions are called with the same arguments,
worked out directly: the body checked as ``RequestGuard`` checks it and validated by the route's own
model, the key's user (``user_for_token``, cached), a session, the session hint and the
``Idempotency-Key``. The answer goes to the server's ``send`` as it is.

Anything off the common path goes through the full app instead, with the body it sent replayed, so its
answer is exactly what FastAPI gives: a body that does not parse or validate, one without a
Content-Length or over the size limit, a NUL anywhere, a non-JSON content type, a browser request when
CORS is on. An error raised by the route (or by auth) is answered by the app's own exception handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.deps import SESSION_HEADERS, idempotency_of, session_key, token_of, user_for_token
from server.idempotency import HEADER as IDEMPOTENCY_HEADER
from server.idempotency import IdempotencyKey
from server.openai.streaming import SseStream
from server.state import AppState

Endpoint = Callable[..., Awaitable[Response]]
_ARGUMENTS = frozenset({"body", "user", "session", "state", "hint", "idem"})


@dataclass(frozen=True)
class HotRoute:
    model: type[BaseModel]
    endpoint: Endpoint
    wants: frozenset[str]  # which of ``_ARGUMENTS`` the route function takes

    @classmethod
    def of(cls, endpoint: Endpoint) -> HotRoute:
        params = inspect.signature(endpoint).parameters
        unknown = set(params) - _ARGUMENTS
        if unknown or "body" not in params:
            raise TypeError(f"{endpoint.__name__}: a hot route takes a body and {sorted(_ARGUMENTS)}, not {unknown}")
        model = inspect.get_annotations(endpoint, eval_str=True)["body"]
        return cls(model, endpoint, frozenset(params))


class HotLane:
    """Serves ``routes`` (POST path -> route) for ``owner``, the FastAPI app, which answers all else."""

    def __init__(self, owner: Any, routes: dict[str, HotRoute], *, max_body_bytes: int, cors: bool) -> None:
        self.owner = owner  # its state, its exception handlers
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.cors = cors

    def route_for(self, scope: Scope) -> HotRoute | None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        route = self.routes.get(scope["path"])
        return route if route is not None and self._plain(scope) else None

    async def serve(self, route: HotRoute, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
        """The request answered here, or by ``app`` (the full stack) with its body replayed."""
        body = await _read_body(receive)
        if body is None:  # the client went away while sending it
            return
        parsed = self._parse(route, body)
        if parsed is None:
            await app(scope, _replaying(body, receive), send)
            return
        scope["app"] = self.owner
        try:
            response = await self._call(route, parsed, scope, body)
        except Exception as exc:  # answered as the app answers it (ApiError, not ready, internal)
            await self._answer_error(scope, receive, send, exc)
            return
        await _play(response, scope, receive, send)

    def _plain(self, scope: Scope) -> bool:
        """The request is one this lane answers exactly as the app would (module docstring)."""
        if b"%00" in scope.get("raw_path", b"") or b"%00" in scope.get("query_string", b""):
            return False
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                ctype = value.split(b";", 1)[0].strip().lower()
                if ctype != b"application/json":
                    return False
            elif (name == b"origin" and self.cors) or name == b"transfer-encoding":
                return False
        return length is not None and length.isdigit() and int(length) <= self.max_body_bytes

    @staticmethod
    def _parse(route: HotRoute, body: bytes) -> BaseModel | None:
        if b"\\u0000" in body or b"\x00" in body:
            return None
        try:
            return route.model.model_validate(orjson.loads(body))
        except (orjson.JSONDecodeError, ValidationError):
            return None

    async def _call(self, route: HotRoute, parsed: BaseModel, scope: Scope, raw: bytes) -> Response:
        state: AppState = self.owner.state.tt
        headers = _headers(scope)
        token = token_of(headers)
        async with state.sessions() as session:
            user = await user_for_token(token, state, session)
            args: dict[str, Any] = {"body": parsed, "user": user, "session": session, "state": state}
            if "hint" in route.wants:
                args["hint"] = next((k for name in SESSION_HEADERS if (k := session_key(headers.get(name)))), None)
            if "idem" in route.wants:
                args["idem"] = _idempotency(headers, scope, raw, user.id, state)
            return await route.endpoint(**{k: v for k, v in args.items() if k in route.wants})

    async def _answer_error(self, scope: Scope, receive: Receive, send: Send, exc: Exception) -> None:
        handlers = self.owner.exception_handlers
        handler = next(handlers[t] for t in type(exc).__mro__ if t in handlers)  # Exception's at the latest
        response = await handler(Request(scope, receive), exc)
        await response(scope, receive, send)


def _headers(scope: Scope) -> dict[str, str]:
    """Header name -> value; a repeated header's first value, as Starlette's ``Headers.get`` gives."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(scope["headers"])}


def _idempotency(
    headers: dict[str, str], scope: Scope, raw: bytes, user_id: str, state: AppState
) -> IdempotencyKey | None:
    value = headers.get(IDEMPOTENCY_HEADER.lower())
    if value is None:
        return None
    query = scope.get("query_string", b"").decode("latin-1")
    return idempotency_of(value, user_id, "POST", scope["path"], query, raw, state)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read given back first."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _play(response: Response, scope: Scope, receive: Receive, send: Send) -> None:
    """A route's response sent as Starlette would, without its per-send wrappers and task group: a
    stream's chunks are sent as they come until it ends or the client goes away."""
    if not isinstance(response, StreamingResponse) or response.background is not None:
        await response(scope, receive, send)
        return
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    if isinstance(response, SseStream):
        pump = asyncio.ensure_future(response.pump(send))
    else:
        pump = asyncio.ensure_future(_pump(cast(Any, response.body_iterator), send))
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((pump, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pump, watch):
            task.cancel()
        for task in (pump, watch):
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the stream's own exception, if it raised one, goes to the server


async def _pump(chunks: Any, send: Send) -> None:
    async for chunk in chunks:
        data = chunk if isinstance(chunk, bytes) else chunk.encode()
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class LaneApp(FastAPI):
    """FastAPI with a ``HotLane`` in front of its whole stack (its middleware included), once set."""

    hot_lane: HotLane | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.hot_lane
        if lane is not None and (route := lane.route_for(scope)) is not None:
            await lane.serve(route, scope, receive, send, super().__call__)
            return
        await super().__call__(scope, receive, send)
