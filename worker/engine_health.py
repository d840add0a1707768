"""Engine health: an engine that dies is replaced by a fresh one, with bounded exponential backoff.

``SupervisedEngine`` is itself an ``Engine`` (the worker's pipeline holds it) around the engine that
``factory`` builds. It notices a death two ways: a stream raises ``EngineDead`` (vLLM's EngineDeadError,
an hf step that raised), or the engine's ``failure()`` reports one between requests (polled). Then it
tells its listeners at once (the worker client stops taking work and hands back what it held, naming
the requests that were in the engine), closes the dead engine and builds a new one. Restarts wait
``backoff_s``, doubling per death or failed start since the engine last stayed up ``stable_s``, up to
``backoff_max_s``; after ``max_failed_restarts`` failed starts in a row it gives up (state ``failed``,
``EngineUnrecoverable``), and the worker exits non-zero so that its supervisor starts it afresh. A fresh
engine loads the weights last pushed to the old one (``update_weights``) before it is ready, so that a
restart never brings back an older version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from worker.engines.contract import (
    Engine,
    EngineDead,
    EngineError,
    EngineInfo,
    GenerationParams,
    TokenStep,
    WeightsMode,
)

log = logging.getLogger(__name__)

HealthState = Literal["starting", "ready", "restarting", "failed"]
# (new state, request ids that were generating in the engine when it died: only with "restarting")
Listener = Callable[[HealthState, frozenset[str]], None]

_POLL_S = 1.0  # how often a healthy engine's failure() is asked
_CLOSE_TIMEOUT_S = 30.0  # a dead engine's close may hang on its dead process


@runtime_checkable
class ReportsFailure(Protocol):
    def failure(self) -> str | None:
        """Why the engine is unusable, or None while it is healthy."""
        ...


@runtime_checkable
class FaultInjectable(Protocol):
    def inject_fault(self) -> None:
        """Test-only: make the engine die now (worker.fault_injection)."""
        ...


class EngineUnrecoverable(Exception):
    """The engine could not be restarted: the worker exits non-zero (its supervisor restarts it)."""


@dataclass(frozen=True)
class RestartPolicy:
    max_failed_restarts: int = 5  # failed starts in a row before the worker gives up
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0  # an engine up this long before it died restarts without accumulated backoff


class SupervisedEngine:
    def __init__(self, factory: Callable[[], Engine], policy: RestartPolicy | None = None) -> None:
        self._factory = factory
        self.policy = policy or RestartPolicy()
        self._engine = factory()
        self.info: EngineInfo = self._engine.info  # the current engine's
        self.state: HealthState = "starting"
        self.deaths = 0
        self.restarts = 0
        self.error: str | None = None  # why the engine last died
        self._active: set[str] = set()  # request ids streaming from the current engine
        self._listeners: list[Listener] = []
        self._settled = asyncio.Event()  # ready or failed
        self._up_since = 0.0
        self._streak = 0  # deaths and failed starts since the engine last stayed up stable_s
        self._restarter: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.weights: tuple[str, int] | None = None  # (path, version) last loaded: a fresh engine loads it too

    @property
    def policy_version(self) -> int:
        """The weights version the current engine serves."""
        return int(getattr(self._engine, "policy_version", 0))

    async def update_weights(self, path: str, version: int, mode: WeightsMode) -> None:
        """Load pushed weights into the current engine (``Engine.update_weights``); remembered, so that
        an engine started after a death loads them before it takes work."""
        if self.state != "ready":
            raise EngineError("not_ready", f"the engine is {self.state}")
        await self._engine.update_weights(path, version, mode)
        self.weights = (path, version)

    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        await self._engine.start()
        self.info = self._engine.info
        self._ready()
        self._monitor = asyncio.create_task(self._watch(), name="engine-health-monitor")

    async def wait_ready(self) -> None:
        """Return once the engine is ready; raise EngineUnrecoverable if it never will be."""
        await self._settled.wait()
        if self.state == "failed":
            raise EngineUnrecoverable(f"engine could not be restarted: {self.error}")

    async def close(self) -> None:
        for task in (self._restarter, self._monitor):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._engine.close()

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[TokenStep, None]:
        with self.running(request_id) as engine:
            async for step in engine.generate(request_id, prompt_ids, params):
                yield step

    @contextlib.contextmanager
    def running(self, request_id: str) -> Iterator[Engine]:
        """The current engine, to generate ``request_id`` with inside the block: what ``generate`` does,
        without its generator layer on every step (the worker's pipeline iterates the engine itself). The
        request counts as active meanwhile; an ``EngineDead`` raised in the block starts the restart."""
        engine = self._engine
        if self.state != "ready":
            raise EngineDead(f"the engine is {self.state}")
        self._active.add(request_id)
        try:
            yield engine
        except EngineDead as exc:
            self._died(engine, str(exc))
            raise
        finally:
            self._active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if self.state == "ready":
            await self._engine.abort(request_id)

    def inject_fault(self) -> None:
        """Fault injection: kill the current engine (its own way: a step raises, a process dies)."""
        if isinstance(self._engine, FaultInjectable):
            log.warning("fault injection: killing the engine")
            self._engine.inject_fault()

    # ---- death and restart ---------------------------------------------------------------------
    def _died(self, engine: Engine, reason: str) -> None:
        if engine is not self._engine or self.state != "ready":
            return  # this death is already being handled
        up_for = time.monotonic() - self._up_since
        self._streak = 0 if up_for >= self.policy.stable_s else self._streak + 1
        self.deaths += 1
        self.error = reason
        log.error("engine died after %.0fs up (death %d): %s", up_for, self.deaths, reason)
        self._set("restarting", frozenset(self._active))
        self._restarter = asyncio.get_running_loop().create_task(self._restart(engine), name="engine-restart")

    async def _restart(self, dead: Engine) -> None:
        try:
            await asyncio.wait_for(dead.close(), timeout=_CLOSE_TIMEOUT_S)
        except Exception as exc:  # it is dead: what it left behind goes with the process at worst
            log.warning("closing the dead engine failed: %r", exc)
        failed = 0
        while True:
            delay = min(self.policy.backoff_s * 2 ** (self._streak + failed), self.policy.backoff_max_s)
            log.info("restarting the engine in %.1fs", delay)
            await asyncio.sleep(delay)
            engine: Engine | None = None
            try:
                engine = self._factory()
                await engine.start()
                if self.weights is not None:  # the version it served, not the one it started from
                    await self._reload(engine, *self.weights)
            except Exception as exc:
                failed += 1
                self.error = f"restart failed: {exc!r}"
                log.exception("engine restart %d failed", failed)
                if engine is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(engine.close(), timeout=_CLOSE_TIMEOUT_S)
                if failed >= self.policy.max_failed_restarts:
                    log.error("giving up after %d failed engine restarts", failed)
                    self._set("failed", frozenset())
                    self._settled.set()
                    return
                continue
            self._engine, self.info = engine, engine.info
            self.restarts += 1
            log.warning("engine restarted (restart %d)", self.restarts)
            self._ready()
            return

    async def _reload(self, engine: Engine, path: str, version: int) -> None:
        try:
            await engine.update_weights(path, version, "drain")
        except EngineError as exc:  # it serves what it started from; the server asks for the version again
            log.error("the restarted engine could not load weights version %d from %s: %s", version, path, exc)
            self.weights = None

    def _ready(self) -> None:
        self._up_since = time.monotonic()
        self._set("ready", frozenset())
        self._settled.set()

    def _set(self, state: HealthState, running: frozenset[str]) -> None:
        self.state = state
        if state != "ready":
            self._settled.clear()
        for listener in self._listeners:
            try:
                listener(state, running)
            except Exception:  # a listener's bug must not stop the restart
                log.exception("engine health listener failed")

    async def _watch(self) -> None:
        """Notice an engine that died between requests (vLLM's engine core killed while idle)."""
        while True:
            await asyncio.sleep(_POLL_S)
            engine = self._engine
            if self.state == "ready" and isinstance(engine, ReportsFailure) and (reason := engine.failure()):
                self._died(engine, reason)
