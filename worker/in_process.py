"""The worker inside the server's process (``tokentrail serve --model``): the model loaded as ``tokentrail
worker`` loads it (``worker.runner.load_model``), the same client, connected to the server's hub over an
in-memory link instead of a websocket, so that no frame is encoded, sent or parsed between them.

The server starts it in its lifespan (``create_app(settings, local_worker=...)``) and drains it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from shared.local_link import WorkerEnd
from worker.client import WorkerClient
from worker.runner import LoadedModel, load_model
from worker.spec import ModelSpec

log = logging.getLogger(__name__)

# After a session ended without a crash (the server dropped a worker it found silent; the engine died
# and the server takes no engine frames): dial again.
REDIAL_S = 1.0


class InProcessWorker:
    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.loaded: LoadedModel | None = None
        self.client: WorkerClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, dial: Callable[[], WorkerEnd]) -> None:
        """Load the model, then serve over links that ``dial`` opens; returns once connected."""
        self.loaded = await load_model(self.spec)
        client = self.client = self.loaded.client()
        task = self._task = asyncio.create_task(self._serve(client, dial), name="tokentrail-local-worker")
        connected = asyncio.create_task(client.connected.wait())
        await asyncio.wait({task, connected}, return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        if task.done():
            task.result()  # a refusal: raise it
            raise RuntimeError("the in-process worker ended before it connected")

    async def _serve(self, client: WorkerClient, dial: Callable[[], WorkerEnd]) -> None:
        # A crash (an exception here) ends the session like a dropped connection: the hub recovers the
        # work in hand. It is not dialled again; a session the server ended is.
        while not client.draining:
            try:
                if client.health is not None:
                    await client.health.wait_ready()  # after an engine death; EngineUnrecoverable ends it
                await client.run_local(dial())
            except Exception:
                log.exception("the in-process worker crashed; the server recovers the work it held")
                raise
            if client.draining:
                return
            log.warning("the in-process worker's session ended; connecting again in %.0fs", REDIAL_S)
            await asyncio.sleep(REDIAL_S)

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain: no new work; what is in hand is finished for up to ``drain_timeout_s``, then handed back
        (the hub requeues it and the next worker resumes after the streamed tokens). Then stop the engine."""
        client, task = self.client, self._task
        try:
            if client is not None and task is not None and not task.done():
                await client.drain(drain_timeout_s)
                await asyncio.wait({task}, timeout=10)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        except Exception:
            log.exception("the in-process worker failed")
        finally:
            if self.loaded is not None:
                await self.loaded.engine.close()
