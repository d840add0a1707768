"""Engine health (issue 23): an engine that dies costs no message. The worker stops taking work, hands
back what it held (requeued and resumed in one stream), restarts its engine and serves again; a message
that keeps killing engines fails with ``engine_poison_message``; /admin/workers, /ready and /metrics show
it. Real server, websockets and hf engines; the engines die by fault injection (``inject_fault``: the
next model step raises on the model thread)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.admin import issue_user_key
from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, WorkerThread, wait_for, worker_key
from tests.test_e2e_embedded import events, login, turn
from tests.test_worker_protocol import SlowEngine
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engine_health import EngineUnrecoverable, HealthState, RestartPolicy, SupervisedEngine
from worker.engines.contract import EngineDead, EngineInfo, GenerationParams, TokenStep
from worker.engines.hf import HFEngine

FAST = RestartPolicy(max_failed_restarts=2, backoff_s=0.05, backoff_max_s=0.2)


def test_a_dead_hf_engine_is_restarted_and_its_requests_named(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        health = SupervisedEngine(lambda: HFEngine(str(tiny_model_dir)), FAST)
        changes: list[tuple[HealthState, frozenset[str]]] = []
        await health.start()
        health.on_change(lambda state, running: changes.append((state, running)))
        params = GenerationParams(max_new_tokens=200, stop_token_ids=())
        stream = health.generate("r1", [1, 2, 3], params)
        await anext(stream)
        health.inject_fault()
        with pytest.raises(EngineDead):
            async for _ in stream:
                pass
        assert changes[0] == ("restarting", frozenset({"r1"}))
        assert health.state == "restarting" and health.deaths == 1
        with pytest.raises(EngineDead):  # nothing is taken while it restarts
            await anext(health.generate("r2", [1, 2, 3], params))
        await asyncio.wait_for(health.wait_ready(), timeout=60)
        assert changes[-1] == ("ready", frozenset()) and health.restarts == 1
        steps = [s async for s in health.generate("r3", [1, 2, 3], GenerationParams(max_new_tokens=4))]
        assert steps[-1].finish_reason == "length"
        await health.close()

    asyncio.run(scenario())


def test_a_restarted_engine_loads_the_weights_its_predecessor_served(tiny_model_dir: Path, tmp_path: Path) -> None:
    """After a push, an engine restarted after a death serves the pushed version, not its model
    directory's weights: the same greedy tokens and logprobs as before the death."""
    from benchmarks.policy_check import perturbed_checkpoint

    checkpoint = perturbed_checkpoint(tiny_model_dir, tmp_path / "v5", seed=5)

    async def scenario() -> None:
        health = SupervisedEngine(lambda: HFEngine(str(tiny_model_dir)), FAST)
        await health.start()
        greedy = GenerationParams(max_new_tokens=8, temperature=0.0)
        base = [s async for s in health.generate("a", [1, 2, 3], greedy)]
        await health.update_weights(str(checkpoint), 5, "drain")
        assert health.policy_version == 5
        before = [s async for s in health.generate("b", [1, 2, 3], greedy)]
        assert [s.logprobs for s in before] != [s.logprobs for s in base]
        health.inject_fault()
        with pytest.raises(EngineDead):
            async for _ in health.generate("c", [1, 2, 3], GenerationParams(max_new_tokens=50)):
                pass
        await asyncio.wait_for(health.wait_ready(), timeout=60)
        assert health.restarts == 1 and health.policy_version == 5
        after = [s async for s in health.generate("d", [1, 2, 3], greedy)]
        assert [(s.token_ids, s.logprobs, s.policy_version) for s in after] == [
            (s.token_ids, s.logprobs, s.policy_version) for s in before
        ]
        await health.close()

    asyncio.run(scenario())


def test_an_engine_that_cannot_be_restarted_ends_the_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Restarts that fail max_failed_restarts times in a row: state failed, EngineUnrecoverable."""
    paths = iter([str(tiny_model_dir)])

    async def scenario() -> None:
        # the first engine is real; every restart finds no model (its start fails)
        health = SupervisedEngine(lambda: HFEngine(next(paths, str(tiny_model_dir / "gone"))), FAST)
        await health.start()
        died = asyncio.Event()
        health.on_change(lambda state, _running: died.set() if state == "restarting" else None)
        health.inject_fault()
        await asyncio.wait_for(died.wait(), timeout=30)  # noticed between requests (failure() is polled)
        with pytest.raises(EngineUnrecoverable):
            await asyncio.wait_for(health.wait_ready(), timeout=60)
        assert health.state == "failed" and health.restarts == 0 and "restart failed" in (health.error or "")
        await health.close()

    asyncio.run(scenario())


class FaultOnMarkerEngine:
    """Fault injection at the engine boundary: the real hf engine, which kills itself whenever it is
    asked for exactly ``marker`` new tokens (a poison message), and is paced like SlowEngine."""

    def __init__(self, inner: HFEngine, marker: int, delay_s: float = 0.02) -> None:
        self.inner, self.marker = inner, marker
        self.slow = SlowEngine(inner, delay_s)
        self.info: EngineInfo = inner.info

    async def start(self) -> None:
        await self.slow.start()
        self.info = self.inner.info

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        if params.max_new_tokens == self.marker:
            self.inner.inject_fault()
        async for step in self.slow.generate(request_id, prompt_ids, params):
            yield step

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()

    def inject_fault(self) -> None:
        self.inner.inject_fault()

    def failure(self) -> str | None:
        return self.inner.failure()


POISON = 13  # max_new_tokens of a poison message
Stack = tuple[str, dict[str, str], list[SupervisedEngine], WorkerThread]  # url, admin headers, engines, worker


@pytest.fixture()
def health_stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Stack]:
    settings = ServerSettings(
        data_dir=tmp_path, port=free_port(), engine_poison_deaths=2, worker_heartbeat_interval_s=0.5
    )
    server = ServerThread(settings).start()
    admin = {"Authorization": f"Bearer {issue_user_key(settings, 'ops', admin=True)}"}
    engines: list[SupervisedEngine] = []

    def supervised() -> SupervisedEngine:
        engine = SupervisedEngine(lambda: FaultOnMarkerEngine(HFEngine(str(tiny_model_dir)), POISON), FAST)
        engines.append(engine)
        return engine

    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(server.url, worker_key(settings), MODEL, fmt, supervised).start()
    try:
        yield server.url, admin, engines, worker
    finally:
        worker.stop()
        server.stop()
    assert worker.error is None, worker.error


def _admin_worker(url: str, admin: dict[str, str]) -> dict[str, Any]:
    rows = httpx.get(f"{url}/admin/workers", headers=admin).json()
    assert len(rows) == 1, rows
    return dict(rows[0])


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}{{"))


def test_engine_death_mid_stream_requeues_and_resumes_in_one_stream(
    health_stack: Stack,
) -> None:
    url, admin, engines, worker = health_stack
    (engine,) = engines
    headers = login(url, "engine-death")
    chat_id = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(url, headers, chat_id, None, "go on", max_new_tokens=60, stop_token_ids=[], ignore_eos=True)
    path = f"/chats/{chat_id}/messages/{reply['id']}/events"
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: events(url, path, headers, sink=seen))
    reader.start()
    wait_for(lambda: sum(e["event_type"] == "token" for e in seen) >= 10, 60, "ten tokens")
    worker.loop.call_soon_threadsafe(engine.inject_fault)
    reader.join(timeout=120)
    assert not reader.is_alive()
    tokens = [e for e in seen if e["event_type"] == "token"]
    assert seen[-1]["event_type"] == "message", seen[-3:]
    assert [e["index"] for e in tokens] == list(range(60))  # one continuous stream across the death
    stored = httpx.get(f"{url}{path[: -len('/events')]}?include=tokens", headers=headers).json()
    # attempt 2, or 3 when the requeued attempt was claimed for this worker before the server saw it die
    # (the worker hands such work back at once)
    assert stored["state"] == "complete" and stored["attempt"] >= 2
    assert stored["completion_token_ids"] == [e["token_id"] for e in tokens]
    assert engine.deaths == 1 and engine.restarts == 1
    wait_for(lambda: _admin_worker(url, admin)["engine_restarts"] == 1, 30, "the restart in /admin/workers")
    row = _admin_worker(url, admin)
    assert row["engine_state"] == "ready" and row["engine_deaths"] == 1
    assert _metric(url, "tokentrail_engine_deaths_total") == 1
    assert _metric(url, "tokentrail_engine_restarts_total") == 1
    assert httpx.get(f"{url}/ready").json()["worker_engines"] == {"ready": 1}


def test_a_message_that_keeps_killing_engines_fails_with_its_own_code(
    health_stack: Stack,
) -> None:
    url, _admin, engines, _worker = health_stack
    headers = login(url, "poison")
    chat_id = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(url, headers, chat_id, None, "poison", max_new_tokens=POISON)
    evs = events(url, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)
    assert evs[-1]["event_type"] == "error" and evs[-1]["code"] == "engine_poison_message", evs[-1]
    assert engines[0].deaths == 2  # engine_poison_deaths
    # the OpenAI route answers a poison message with 503, never 500, and the worker serves the next one
    body = {"model": MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": POISON}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_poison_message", resp.text
    body["max_tokens"] = 5
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
