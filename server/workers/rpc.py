"""Calls on workers that are not work: tokenizer calls (``/tokenize``, ``/detokenize``, echo) and the
cancel of a running message. A call goes to a worker connected to this server process, else through
the relay to a process that holds one (the worker directory names each worker's server)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from server.queue.protocol import WorkerDirectory
from server.workers.connection import WorkerConnection, WorkerGone, server_of
from server.workers.relay import RedisRpcRelay, RelayError, RelayTimeout
from shared.errors import ErrorCode
from shared.protocol import CancelFrame, RpcFrame, RpcMethod

log = logging.getLogger(__name__)


class RpcUnavailable(Exception):
    """No worker connected to this server process can answer a tokenizer call for the model."""


class RpcFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


async def call_worker(
    conn: WorkerConnection, method: RpcMethod, params: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """One ``rpc`` on one connected worker: its result, ``RpcFailed`` with the code it answered, or
    ``RpcUnavailable`` if it went away or did not answer within ``timeout_s``."""
    call_id = secrets.token_hex(8)
    answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    conn.calls[call_id] = answer
    try:
        await conn.send(RpcFrame(id=call_id, method=method, params=params))
        return await asyncio.wait_for(answer, timeout=timeout_s)
    except TimeoutError as exc:
        raise RpcUnavailable(f"worker {conn.id} did not answer {method} within {timeout_s:.0f}s") from exc
    except WorkerGone as exc:
        raise RpcUnavailable(f"worker {conn.id} went away") from exc
    finally:
        conn.calls.pop(call_id, None)


class WorkerRpc:
    def __init__(self, connections: dict[str, WorkerConnection], directory: WorkerDirectory, server_id: str) -> None:
        self.connections = connections  # the hub's: workers connected to this process
        self.directory = directory
        self.server_id = server_id
        self.relay: RedisRpcRelay | None = None  # calls to workers of other server processes
        # a weights push's calls relayed from another process (server.weights.fleet.FleetWeights.relayed)
        self.weights: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None

    def start(self) -> None:
        if self.relay is not None:
            self.relay.start(self._relayed)

    async def stop(self) -> None:
        if self.relay is not None:
            await self.relay.stop()

    # ---- tokenizer calls ---------------------------------------------------------------------
    async def call(
        self, model: str, method: RpcMethod, params: dict[str, Any], timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Tokenizer work on a worker of ``model``: one connected here (the least busy), else through
        the relay on a server process that has one."""
        if any(c.rpc and c.hello.model_name == model for c in self.connections.values()):
            return await self._call_local(model, method, params, timeout_s)
        if self.relay is not None:
            servers = {
                e.server_id
                for e in await self.directory.workers()
                if e.model_name == model and e.rpc and e.server_id and e.server_id != self.server_id
            }
            if servers:
                try:
                    return await self.relay.request(secrets.choice(sorted(servers)), model, method, params, timeout_s)
                except RelayTimeout as exc:
                    raise RpcUnavailable(str(exc)) from exc
                except RelayError as exc:
                    if exc.code == ErrorCode.no_worker.value:
                        raise RpcUnavailable(str(exc)) from exc
                    raise RpcFailed(exc.code, str(exc)) from exc
        raise RpcUnavailable(f"no worker that answers tokenizer calls serves {model} now")

    async def _relayed(self, model: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A call another server process relayed here."""
        if method == "cancel":
            sent = await self._cancel_local(str(params["worker_id"]), str(params["message_id"]), int(params["attempt"]))
            return {"sent": sent}
        if method in ("weights_check", "weights_load") and self.weights is not None:
            return await self.weights(method, {**params, "model": model})
        if method not in ("tokenize", "render_chat", "detokenize"):
            raise RelayError(ErrorCode.bad_request.value, f"unknown method {method!r}")
        try:
            return await self._call_local(model, method, params, 30.0)  # type: ignore[arg-type]
        except RpcUnavailable as exc:
            raise RelayError(ErrorCode.no_worker.value, str(exc)) from exc
        except RpcFailed as exc:
            raise RelayError(exc.code, str(exc)) from exc

    async def _call_local(
        self, model: str, method: RpcMethod, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        conns = [c for c in self.connections.values() if c.hello.model_name == model and c.rpc]
        if not conns:
            raise RpcUnavailable(f"no worker of {model} that answers tokenizer calls is connected here")
        conn = min(conns, key=lambda c: len(c.inflight) + len(c.calls))
        return await call_worker(conn, method, params, timeout_s)

    # ---- cancellation ------------------------------------------------------------------------
    async def cancel_on_worker(self, worker_id: str, message_id: str, attempt: int) -> bool:
        """Tell the worker generating ``attempt`` of the message to abort it; False if no worker
        could be told (then nothing will end its stream but the caller)."""
        if worker_id in self.connections:
            return await self._cancel_local(worker_id, message_id, attempt)
        server_id = server_of(worker_id)
        if self.relay is None or not server_id:
            return False
        params = {"worker_id": worker_id, "message_id": message_id, "attempt": attempt}
        try:
            answer = await self.relay.request(server_id, "", "cancel", params, timeout_s=5.0)
        except (RelayError, RelayTimeout) as exc:
            log.warning("cancel of %s could not reach server %s: %s", message_id, server_id, exc)
            return False
        return bool(answer.get("sent"))

    async def _cancel_local(self, worker_id: str, message_id: str, attempt: int) -> bool:
        conn = self.connections.get(worker_id)
        inflight = conn.inflight.get(message_id) if conn is not None else None
        if conn is None or inflight is None or inflight.item.attempt != attempt:
            return False
        try:
            await conn.send(CancelFrame(message_id=message_id, attempt=attempt))
        except Exception:
            return False
        return True
