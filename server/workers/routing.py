"""Cache-aware routing (DESIGN D5): a turn goes to the worker whose engine holds its prefix.

tokentrail knows which worker computed every stored reply, and the next turn's prompt starts with that
reply's prompt and completion (the worker stitches it from those ids), so the worker that served the
path's last reply (the *holder*) has the longest cached prefix of the new prompt. ``Router.prefer``
names it, and the queue keeps the turn in that worker's lane for at most ``route_wait_s`` (or until
the lane overflows the worker's capacity) before any worker of the model takes it
(``server.queue.protocol``): a busy holder delays a turn by a bounded time and never starves it.

Routing pays only where the engine keeps a prefix cache across requests (vLLM); the hf engine does not,
so ``routing=auto`` (the default) leaves its workers unrouted, and ``on`` routes every engine's.

Without a holder (a new conversation, a holder that is gone), a session hint (``X-Session-ID``,
``prompt_cache_key``) picks a worker by rendezvous hashing over the model's live workers, so one
session's first turns land together on every replica alike; without either, any worker takes it.
"""

from __future__ import annotations

import hashlib
import logging
import time

from server.queue.protocol import WorkerDirectory

log = logging.getLogger(__name__)

LIVE_VIEW_S = 1.0  # how stale the view of live workers may be (Redis: one HGETALL per second at most)
PREFIX_CACHING_ENGINES = frozenset({"vllm"})  # engines whose KV cache outlives a request


def _score(session: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{worker_id}".encode(), digest_size=8).digest()


class Router:
    def __init__(self, directory: WorkerDirectory, mode: str = "auto") -> None:
        self.directory = directory
        self.enabled = mode != "off"
        self.engines = None if mode == "on" else PREFIX_CACHING_ENGINES  # None: every engine
        self._live: dict[str, list[str]] = {}  # model -> ids of its workers taking work
        self._read_at = float("-inf")

    async def live(self, model: str) -> list[str]:
        """Workers of ``model`` whose engine takes work, as of at most ``LIVE_VIEW_S`` ago."""
        now = time.monotonic()
        if now - self._read_at > LIVE_VIEW_S:
            live: dict[str, list[str]] = {}
            for entry in await self.directory.workers():
                if entry.engine_state == "ready" and (self.engines is None or entry.engine in self.engines):
                    live.setdefault(entry.model_name, []).append(entry.worker_id)
            self._live, self._read_at = live, now
        return self._live.get(model, [])

    async def prefer(self, model: str, holder: str | None, session: str | None) -> str:
        """The worker to hold the turn for: the holder when it is live, else the session's worker, else
        "" (any worker)."""
        if not self.enabled or (not holder and not session):
            return ""
        try:
            live = await self.live(model)
        except Exception as exc:  # Redis away: the turn goes to any worker (the queue may be away too)
            log.debug("routing without a view of the workers: %s", exc)
            return ""
        if len(live) < 2:
            return ""  # one worker (or none yet): nothing to choose, no lane to keep
        if holder and holder in live:
            return holder
        if session:
            return max(live, key=lambda w: _score(session, w))
        return ""
