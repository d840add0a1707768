"""A weights push (``POST /admin/models/{model}/weights``): bring every worker of a model, on every
server process, to a new weights version.

The order (after NeMo-RL's in-flight refit and vLLM's weight-transfer phases): check the checkpoint on
every worker (nothing loaded: a bad checkpoint changes nothing), record the version (from then on it is
the model's current version: no process gives work to a worker behind it), then load it everywhere —
this process's workers directly, other processes' through the relay — and answer once every worker
serves it, or name the ones that could not."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from server.errors import ApiError
from server.metrics import Metrics
from server.queue.protocol import WorkerDirectory
from server.settings import ServerSettings
from server.weights.fleet import FleetWeights, WorkerWeights
from server.weights.registry import PolicyRegistry, VersionTaken
from server.workers.relay import RedisRpcRelay, RelayError, RelayTimeout
from shared.errors import ErrorCode

log = logging.getLogger(__name__)

# what a worker's check of the checkpoint answers for bad input (anything else: it could not be asked)
_CHECK_CODES = {
    c.value for c in (ErrorCode.weights_not_found, ErrorCode.weights_not_safetensors, ErrorCode.weights_mismatch)
}


class WeightsPush:
    def __init__(
        self,
        settings: ServerSettings,
        registry: PolicyRegistry,
        fleet: FleetWeights,
        directory: WorkerDirectory,
        metrics: Metrics,
        server_id: str,
        relay: Callable[[], RedisRpcRelay | None],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.fleet = fleet
        self.directory = directory
        self.metrics = metrics
        self.server_id = server_id
        self._relay = relay  # the hub's relay, once the app has set it (None: one process, no Redis)
        self._locks: dict[str, asyncio.Lock] = {}  # model -> one push at a time in this process

    async def push(self, model: str, version: int, path: str, mode: str, pushed_by: str | None) -> dict[str, Any]:
        started = time.monotonic()
        lock = self._locks.setdefault(model, asyncio.Lock())
        if lock.locked():
            raise ApiError(ErrorCode.push_in_progress, f"a weights push to {model} is running; try again after it")
        async with lock:
            current = (await self.registry.refresh(model)).get(model, 0)
            if version <= current:
                raise ApiError(ErrorCode.version_not_newer, f"{model} is at version {current}; push a version above it")
            servers = await self._servers(model)
            if not servers:
                raise ApiError(ErrorCode.model_not_found, f"no worker of {model!r} is connected")
            checked = await self._everywhere(servers, "weights_check", model, {"path": path})
            refused = [r for r in checked if r.code is not None]
            if refused:
                codes = {r.code for r in refused if r.code is not None} & _CHECK_CODES
                code = ErrorCode(sorted(codes)[0]) if codes else ErrorCode.no_worker
                raise ApiError(code, _describe(refused))
            try:
                await self.registry.record(model, version, path, mode, pushed_by)
            except VersionTaken as exc:
                raise ApiError(ErrorCode.version_not_newer, str(exc)) from exc
            log.info("pushing %s version %d (%s) from %s to %d workers", model, version, mode, path, len(checked))
            loaded = await self._everywhere(servers, "weights_load", model, {"path": path, "version": version,
                                                                             "mode": mode})  # fmt: skip
            seconds = round(time.monotonic() - started, 3)
            self.metrics.weights_push_seconds.labels(model, mode).observe(seconds)
            self.metrics.policy_version.labels(model).set(version)
            failed = [r for r in loaded if r.code is not None]
            if failed:
                self.metrics.weights_pushes.labels(model, "failed").inc()
                raise ApiError(
                    ErrorCode.weights_load_failed,
                    f"version {version} is {model}'s current version, but {_describe(failed)}; they take no "
                    f"work until they load it (GET /admin/workers)",
                )
            self.metrics.weights_pushes.labels(model, "done").inc()
            return {
                "model": model,
                "version": version,
                "mode": mode,
                "seconds": seconds,
                "workers": [{"id": r.id, "version": r.version, "seconds": r.seconds} for r in loaded],
            }

    async def _servers(self, model: str) -> set[str]:
        """The server processes that hold workers of ``model`` (this one included)."""
        servers = {e.server_id for e in await self.directory.workers() if e.model_name == model and e.server_id}
        if self.fleet.workers_of(model):
            servers.add(self.server_id)
        return servers

    async def _everywhere(
        self, servers: set[str], method: str, model: str, params: dict[str, Any]
    ) -> list[WorkerWeights]:
        """``method`` on every process's workers of ``model``, side by side."""

        async def here() -> list[WorkerWeights]:
            if method == "weights_check":
                return await self.fleet.check_here(model, str(params["path"]))
            return await self.fleet.load_here(model, int(params["version"]), str(params["path"]),
                                              str(params["mode"]))  # fmt: skip

        jobs: list[Awaitable[list[WorkerWeights]]] = [
            here() if sid == self.server_id else self._there(sid, method, model, params) for sid in sorted(servers)
        ]
        return [r for results in await asyncio.gather(*jobs) for r in results]

    async def _there(self, server_id: str, method: str, model: str, params: dict[str, Any]) -> list[WorkerWeights]:
        relay = self._relay()
        if relay is None:
            return [WorkerWeights(f"server {server_id}", 0, code=ErrorCode.no_worker.value, error="no relay")]
        timeout = self.settings.weights_load_timeout_s + 10.0
        try:
            answer = await relay.request(server_id, model, method, params, timeout_s=timeout)
        except (RelayError, RelayTimeout) as exc:
            code = exc.code if isinstance(exc, RelayError) else ErrorCode.no_worker.value
            return [WorkerWeights(f"server {server_id}", 0, code=code, error=str(exc))]
        return [WorkerWeights(**w) for w in answer.get("workers", [])]


def _describe(results: list[WorkerWeights]) -> str:
    first = results[0]
    others = f" (and {len(results) - 1} other workers)" if len(results) > 1 else ""
    return f"worker {first.id} answered {first.code}: {first.error}{others}"
