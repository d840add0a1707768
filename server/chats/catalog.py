"""The models offered now: by the workers in the directory, or by one within ``model_grace_s`` (a
restart or deploy: requests wait in the queue for the next worker; the sweep fails them if none comes)."""

from __future__ import annotations

import math
import time

from server.outages import is_unavailable
from server.queue.protocol import WorkerDirectory
from shared.api import ModelConfigRead

_OFFERED_TTL_S = 1.0


class Catalog:
    def __init__(self, directory: WorkerDirectory, model_grace_s: float) -> None:
        self.directory = directory
        self.model_grace_s = model_grace_s
        self._offered: tuple[float, frozenset[str]] = (0.0, frozenset())  # (when, models offered then)
        # model -> time.monotonic() this process last saw it offered: the grace period survives a Redis
        # restart, which empties the shared directory until the workers' next heartbeats
        self._seen: dict[str, float] = {}

    async def offered(self) -> dict[str, ModelConfigRead]:
        """The models connected workers offer, by name."""
        models: dict[str, ModelConfigRead] = {}
        for w in await self.directory.workers():
            if w.model_name in models:
                models[w.model_name].workers += 1
            else:
                models[w.model_name] = ModelConfigRead(
                    name=w.model_name, compat_hash=w.compat_hash, engine=w.engine, max_context=w.max_context
                )
        return models

    async def is_offered(self, model: str) -> bool:
        """Whether a connected worker offers ``model``, or one did within ``model_grace_s``.
        A positive answer is reused for a second (every assistant message asks); a negative one is
        always checked afresh, so a worker that just connected is seen at once."""
        seen_at, names = self._offered
        if model in names and time.monotonic() - seen_at < _OFFERED_TTL_S:
            return True
        try:
            names = frozenset(await self.offered())
        except Exception as exc:  # Redis away: answer from what this process saw within the grace period
            if not is_unavailable(exc):
                raise
            return time.monotonic() - self._seen.get(model, -math.inf) < self.model_grace_s
        now = time.monotonic()
        self._offered = (now, names)
        self._seen.update(dict.fromkeys(names, now))
        if model in names:
            return True
        grace = self.model_grace_s
        if now - self._seen.get(model, -grace) < grace:
            return True
        return model in await self.directory.recent_models(grace)
