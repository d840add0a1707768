"""This server process's workers and their weights versions.

The gate: a worker takes work only while it serves its model's current version (``weights_ready``). A
worker that connects, reconnects or restarts its engine behind that version is brought up to it
(``load_weights`` in ``drain`` mode) before its first work; one that cannot load it takes none, says
why in the directory (``weights_error``), hands back the work it held, and is tried again later. A
push loads every worker here through ``load`` (in the push's mode); pushes from other processes arrive
through the relay (``relayed``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from server.outages import is_unavailable
from server.queue.protocol import WorkerDirectory
from server.settings import ServerSettings
from server.weights.registry import PolicyRegistry
from server.workers.connection import WorkerConnection
from server.workers.recovery import Recovery
from server.workers.rpc import RpcFailed, RpcUnavailable, call_worker
from shared.errors import ErrorCode
from shared.protocol import FEATURE_WEIGHTS, CancelFrame, RpcMethod

log = logging.getLogger(__name__)

_REFRESH_S = 2.0  # how often the registry is read again (a push elsewhere that did not reach here)
_RETRY_S = 30.0  # a worker that failed to load the current version is asked again after this long
_CHECK_TIMEOUT_S = 60.0


@dataclass
class WorkerWeights:
    """One worker's answer to a push: the version it serves, or why it could not load (``code``)."""

    id: str
    version: int
    seconds: float | None = None
    code: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class FleetWeights:
    def __init__(
        self,
        settings: ServerSettings,
        registry: PolicyRegistry,
        connections: dict[str, WorkerConnection],
        directory: WorkerDirectory,
        recovery: Recovery,
        server_id: str,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.connections = connections  # the hub's
        self.directory = directory
        self.recovery = recovery
        self.server_id = server_id
        self._locks: dict[str, asyncio.Lock] = {}  # worker id -> one load at a time
        self._failed_at: dict[str, float] = {}  # worker id -> when its last load failed
        self._tasks: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._refresher = asyncio.create_task(self._refresh_forever(), name="tokentrail-weights-refresh")

    async def stop(self) -> None:
        tasks = [t for t in (self._refresher, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- the gate --------------------------------------------------------------------------------
    async def on_connect(self, conn: WorkerConnection) -> None:
        """A worker just connected (and is in the directory): read its model's current version, then
        let it work or bring it up to that version. Reading after registering means a push either sees
        this worker or is seen by this read."""
        conn.policy_version = conn.hello.policy_version
        model = conn.hello.model_name
        try:
            await self.registry.refresh(model)
        except Exception as exc:  # the database away: this process's cache, and the refresh loop
            if not is_unavailable(exc):
                raise
            log.warning("worker %s: could not read %s's weights version (%s); using %d", conn.id, model, exc,
                        self.registry.current(model))  # fmt: skip
        self.gate(conn)

    def gate(self, conn: WorkerConnection) -> None:
        """Open the gate if the worker serves its model's current version, else close it and (unless a
        load is under way or failed a moment ago) bring it up."""
        current = self.registry.current(conn.hello.model_name)
        if conn.policy_version >= current and not self._loading(conn):
            if not conn.weights_ready:
                conn.weights_ready = True
                conn.weights_error = ""
                conn.credit_event.set()
            return
        conn.weights_ready = False
        failed = self._failed_at.get(conn.id)
        if self._loading(conn) or (failed is not None and time.monotonic() - failed < _RETRY_S):
            return
        self._spawn(self._bring_up(conn))

    def _loading(self, conn: WorkerConnection) -> bool:
        lock = self._locks.get(conn.id)
        return lock is not None and lock.locked()

    async def _bring_up(self, conn: WorkerConnection) -> None:
        try:
            info = await self.registry.latest(conn.hello.model_name)
        except Exception as exc:
            log.warning("worker %s: could not read the current weights (%s); trying again", conn.id, exc)
            return
        if info is None or conn.policy_version >= info.version:
            self.gate(conn)
            return
        log.info("worker %s serves version %d of %s: loading %d", conn.id, conn.policy_version,
                 conn.hello.model_name, info.version)  # fmt: skip
        await self.load(conn, info.version, info.path, "drain")

    def forget(self, conn: WorkerConnection) -> None:
        self._locks.pop(conn.id, None)
        self._failed_at.pop(conn.id, None)

    # ---- calls on one worker -------------------------------------------------------------------
    async def check(self, conn: WorkerConnection, path: str) -> WorkerWeights:
        """Whether the worker could load checkpoint ``path`` (nothing is loaded)."""
        try:
            await self._call(conn, "check_weights", {"path": path}, _CHECK_TIMEOUT_S)
        except RpcFailed as exc:
            return WorkerWeights(conn.id, conn.policy_version, code=exc.code, error=str(exc))
        except RpcUnavailable as exc:
            return WorkerWeights(conn.id, conn.policy_version, code=ErrorCode.no_worker.value, error=str(exc))
        return WorkerWeights(conn.id, conn.policy_version)

    async def load(self, conn: WorkerConnection, version: int, path: str, mode: str) -> WorkerWeights:
        """Load ``version`` into the worker (one load at a time per worker; a version it already serves
        is not loaded again). A failure closes its gate and hands back its work."""
        started = time.monotonic()
        lock = self._locks.setdefault(conn.id, asyncio.Lock())
        async with lock:
            if conn.policy_version >= version:
                result = WorkerWeights(conn.id, conn.policy_version, seconds=0.0)
            else:
                params = {"path": path, "version": version, "mode": mode}
                try:
                    answer = await self._call(conn, "load_weights", params, self.settings.weights_load_timeout_s)
                    conn.policy_version = int(answer.get("version", version))
                    result = WorkerWeights(conn.id, conn.policy_version, seconds=round(time.monotonic() - started, 3))
                except (RpcFailed, RpcUnavailable) as exc:
                    code = exc.code if isinstance(exc, RpcFailed) else ErrorCode.no_worker.value
                    result = WorkerWeights(conn.id, conn.policy_version, code=code, error=str(exc))
        if result.code is None:
            self._failed_at.pop(conn.id, None)
            conn.weights_error = ""
        elif conn.id in self.connections:
            log.error("worker %s could not load %s version %d: %s", conn.id, conn.hello.model_name, version,
                      result.error)  # fmt: skip
            self._failed_at[conn.id] = time.monotonic()
            conn.weights_error = f"{result.code}: {result.error}"
            await self._hand_back(conn)
        self.gate(conn)
        await self._publish(conn)
        return result

    async def _call(
        self, conn: WorkerConnection, method: RpcMethod, params: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        if FEATURE_WEIGHTS not in conn.hello.features:
            raise RpcFailed(ErrorCode.weights_load_failed.value, "this worker cannot update weights (an older worker)")
        return await call_worker(conn, method, params, timeout_s)

    async def _hand_back(self, conn: WorkerConnection) -> None:
        """Requeue the work of a worker that cannot serve the current version (stopped on the worker;
        the next attempt resumes after the tokens already streamed)."""
        for inflight in list(conn.inflight.values()):
            if inflight.storing:
                continue
            item = inflight.item
            conn.inflight.pop(item.message_id, None)
            with contextlib.suppress(Exception):
                await conn.send(CancelFrame(message_id=item.message_id, attempt=item.attempt))
            await self.recovery.requeue_when_back(item)

    async def _publish(self, conn: WorkerConnection) -> None:
        if conn.id not in self.connections:
            return
        try:
            await self.directory.register(conn.entry(self.server_id), ttl_s=self.settings.worker_timeout_s)
        except Exception as exc:  # the next heartbeat publishes it
            log.debug("worker %s: publishing its weights version failed: %s", conn.id, exc)

    # ---- a push, on this process's workers --------------------------------------------------------
    def workers_of(self, model: str) -> list[WorkerConnection]:
        return [c for c in self.connections.values() if c.hello.model_name == model]

    async def check_here(self, model: str, path: str) -> list[WorkerWeights]:
        return list(await asyncio.gather(*(self.check(c, path) for c in self.workers_of(model))))

    async def load_here(self, model: str, version: int, path: str, mode: str) -> list[WorkerWeights]:
        """Close the gate of this process's workers of ``model`` (no new work on an older version from
        now on), then load ``version`` into each."""
        self.registry.advance(model, version)
        conns = self.workers_of(model)
        for conn in conns:
            conn.weights_ready = conn.weights_ready and conn.policy_version >= version
        return list(await asyncio.gather(*(self.load(c, version, path, mode) for c in conns)))

    async def relayed(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """A push's call from another server process (``server.weights.push``)."""
        model, path = str(params["model"]), str(params["path"])
        if method == "weights_check":
            results = await self.check_here(model, path)
        else:
            results = await self.load_here(model, int(params["version"]), path, str(params["mode"]))
        return {"workers": [r.as_dict() for r in results]}

    # ---- background ----------------------------------------------------------------------------
    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(_REFRESH_S)
            try:
                await self.registry.refresh()
            except Exception as exc:
                if not is_unavailable(exc):
                    log.warning("reading the weights registry failed: %s", exc)
                continue
            for conn in list(self.connections.values()):
                self.gate(conn)

    def _spawn(self, job: Any) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
