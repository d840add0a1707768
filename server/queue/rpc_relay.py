"""Tokenizer calls across server processes (PostgreSQL + Redis deployments).

A ``/tokenize`` request may reach a server process that holds no worker of the model. That process
pushes the call onto the Redis list of a process that does (the worker directory names each worker's
server), which runs it on its worker and pushes the answer onto a reply list the caller waits on.
Lists, not pub/sub: a call waits for a process that is briefly busy instead of being lost, and both
lists expire, so calls to a process that died go nowhere for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

_REQUESTS = "tokentrail:rpc:{}"  # one list per server process
_REPLY = "tokentrail:rpc-reply:{}"  # one list per call
_EXPIRE_S = 60

# (model, method, params) -> result; raises RelayError for an answer that is an error
Handler = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


class RelayError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RelayTimeout(Exception):
    """The other process did not answer in time (busy, or gone)."""


class RedisRpcRelay:
    def __init__(self, redis: Redis, server_id: str) -> None:
        self.redis = redis
        self.server_id = server_id
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()

    def start(self, handler: Handler) -> None:
        self._task = asyncio.create_task(self._serve(handler), name="tokentrail-rpc-relay")

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._calls] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def request(
        self, server_id: str, model: str, method: str, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        call_id = secrets.token_hex(12)
        body = orjson.dumps({"id": call_id, "model": model, "method": method, "params": params})
        key = _REQUESTS.format(server_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, body)
            pipe.expire(key, _EXPIRE_S)
            await pipe.execute()
        reply = await self.redis.blpop([_REPLY.format(call_id)], timeout=max(1, round(timeout_s)))
        if reply is None:
            raise RelayTimeout(f"server {server_id} did not answer within {timeout_s:.0f}s")
        answer = orjson.loads(reply[1])
        if "result" in answer:
            return dict(answer["result"])
        raise RelayError(str(answer.get("code")), str(answer.get("message")))

    async def _serve(self, handler: Handler) -> None:
        key = _REQUESTS.format(self.server_id)
        while True:
            try:
                item = await self.redis.blpop([key], timeout=5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis briefly away: keep serving once it is back
                log.warning("rpc relay: reading %s failed: %s", key, exc)
                await asyncio.sleep(1)
                continue
            if item is None:
                continue
            task = asyncio.create_task(self._answer(handler, orjson.loads(item[1])))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _answer(self, handler: Handler, call: dict[str, Any]) -> None:
        try:
            answer: dict[str, Any] = {"result": await handler(call["model"], call["method"], call["params"])}
        except RelayError as exc:
            answer = {"code": exc.code, "message": str(exc)}
        except Exception as exc:
            answer = {"code": "engine_error", "message": f"{type(exc).__name__}: {exc}"}
        key = _REPLY.format(call["id"])
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, orjson.dumps(answer))
                pipe.expire(key, _EXPIRE_S)
                await pipe.execute()
        except Exception as exc:
            log.warning("rpc relay: could not answer %s: %s", call.get("id"), exc)
