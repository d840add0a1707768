"""The engine fault of benchmarks/chaos.py: a worker's engine killed while the worker process lives on.

Workers run with fault injection on (``TOKENTRAIL_FAULT_INJECTION=engine``, worker/fault_injection.py):
SIGUSR1 makes a worker's engine die (the hf engine's next model step raises on its thread, as a real
failure would; a vLLM worker's engine-core processes are SIGKILLed). The worker must stop taking work,
hand back what it held (requeued and resumed, so the usual checks hold: nothing lost, stuck, duplicated
or missed) and restart its engine. ``EngineWatch`` measures, from /admin/workers, how long until the
cluster's workers have restarted one more engine: "serving again" (the goal: within 60 s of a death).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from worker.fault_injection import ENGINE_FAULT, ENGINE_SIGNAL, ENV

# the workers' environment: fault injection on (never set outside chaos runs and tests)
WORKER_ENV = {ENV: ENGINE_FAULT}
SERVING_AGAIN_GOAL_S = 60.0


def admin_key(run_env: dict[str, str]) -> str:
    """An admin API key (for /admin/workers) in the cluster's database."""
    made = subprocess.run(
        [sys.executable, "-m", "tokentrail", "admin", "create-user", "chaos-admin", "--admin"],
        env=run_env,
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        raise RuntimeError(made.stderr.decode()[-3000:])
    return made.stdout.decode().split()[-1]


def kill_engine(pid: int) -> None:
    """Kill the engine of the worker process ``pid`` (its fault-injection signal)."""
    os.kill(pid, ENGINE_SIGNAL)


@dataclass
class EngineWatch:
    """Engine kills and the time until the workers had restarted one more engine each time."""

    urls: list[str]
    key: str
    kills: int = 0
    recovered_s: list[float] = field(default_factory=list)
    unobserved: int = 0  # kills after which no restart was seen in time (e.g. the worker was killed too)
    _watchers: set[asyncio.Task[None]] = field(default_factory=set)

    async def restarts(self, client: httpx.AsyncClient) -> int | None:
        """Engine restarts summed over the connected workers, from any replica that answers."""
        for url in self.urls:
            try:
                resp = await client.get(
                    f"{url}/admin/workers", headers={"Authorization": f"Bearer {self.key}"}, timeout=5
                )
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                rows: list[dict[str, Any]] = resp.json()
                return sum(int(r.get("engine_restarts", 0)) for r in rows if r.get("engine_state") == "ready")
        return None

    async def kill(self, client: httpx.AsyncClient, pid: int) -> None:
        before = await self.restarts(client)
        at = time.monotonic()
        kill_engine(pid)
        self.kills += 1
        task = asyncio.create_task(self._until_restarted(client, at, before))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _until_restarted(self, client: httpx.AsyncClient, at: float, before: int | None) -> None:
        while before is not None and time.monotonic() - at < 2 * SERVING_AGAIN_GOAL_S:
            await asyncio.sleep(0.25)
            now = await self.restarts(client)
            if now is not None and now > before:
                self.recovered_s.append(time.monotonic() - at)
                return
        self.unobserved += 1

    async def settle(self) -> None:
        if self._watchers:
            await asyncio.wait(list(self._watchers))

    def report(self) -> dict[str, Any]:
        worst = max(self.recovered_s, default=None)
        return {
            "engine_kills": self.kills,
            "engine_serving_again_s": {
                "n": len(self.recovered_s),
                "max": None if worst is None else round(worst, 2),
                "unobserved": self.unobserved,
            },
            "engine_serving_again_within_goal": worst is None or worst <= SERVING_AGAIN_GOAL_S,
        }
