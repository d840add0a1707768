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
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from server.constants import RPC_REPLY, RPC_REQUESTS
from server.queue.redis import max_block_s

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)

_EXPIRE_S = 60
_STOP = b"stop"  # pushed onto a process's own request list to end its loop

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
        # redis-py applies its socket timeout to blocking commands too: block less than it, in a loop
        self._block_s = max(1, int(max_block_s(redis)))
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self._stopping = False

    def start(self, handler: Handler) -> None:
        self._task = asyncio.create_task(self._serve(handler), name="tokentrail-rpc-relay")

    async def stop(self) -> None:
        calls = list(self._calls)
        for t in calls:
            t.cancel()
        task, self._task = self._task, None
        if task is not None:
            # Let the loop leave its BLPOP (a stop entry makes it return at once) rather than
            # cancel it mid-command: redis-py can hang tearing down a cancelled blocking read.
            self._stopping = True
            with contextlib.suppress(Exception):
                await self.redis.rpush(RPC_REQUESTS.format(server_id=self.server_id), _STOP)
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=self._block_s + 2)
            except (TimeoutError, Exception):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await self.redis.delete(RPC_REQUESTS.format(server_id=self.server_id))
        for t in calls:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def request(
        self, server_id: str, model: str, method: str, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        call_id = secrets.token_hex(12)
        body = orjson.dumps({"id": call_id, "model": model, "method": method, "params": params})
        key = RPC_REQUESTS.format(server_id=server_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(key, body)
            pipe.expire(key, _EXPIRE_S)
            await pipe.execute()
        deadline = time.monotonic() + timeout_s
        reply = None
        while reply is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayTimeout(f"server {server_id} did not answer within {timeout_s:.0f}s")
            reply = await self.redis.blpop(
                [RPC_REPLY.format(call_id=call_id)], timeout=max(1, min(self._block_s, round(left)))
            )
        answer = orjson.loads(reply[1])
        if "result" in answer:
            return dict(answer["result"])
        raise RelayError(str(answer.get("code")), str(answer.get("message")))

    async def _serve(self, handler: Handler) -> None:
        key = RPC_REQUESTS.format(server_id=self.server_id)
        while not self._stopping:
            try:
                item = await self.redis.blpop([key], timeout=self._block_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis briefly away: keep serving once it is back
                log.warning("rpc relay: reading %s failed: %s", key, exc)
                await asyncio.sleep(1)
                continue
            if item is None or item[1] in (_STOP, _STOP.decode()):
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
        key = RPC_REPLY.format(call_id=call["id"])
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, orjson.dumps(answer))
                pipe.expire(key, _EXPIRE_S)
                await pipe.execute()
        except Exception as exc:
            log.warning("rpc relay: could not answer %s: %s", call.get("id"), exc)
