"""PostgreSQL going away under a running server (DESIGN D18), with a real PostgreSQL of the test's own
that is SIGKILLed (every process of it) and started again, through crash recovery, on the same port:

- every route answers 503 ``not_ready`` with Retry-After while it is away or shutting down, never 500;
- a worker's session outlives the outage: what it held finishes once the database is back, and the
  same session serves the next turn;
- an OpenAI stream open across the outage goes on from Redis and ends with ``[DONE]``, its text = SQL;
- every 429 carries Retry-After.

The one stand-in is at the engine boundary: ``GatedEngine`` is the real hf engine whose steps wait at
a gate after the first few, so that a message is in the worker's hand while the database is away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from server import migrate
from server.admin import issue_user_key
from server.db import create_engine, ping
from server.outages import is_database_unavailable
from server.settings import ServerSettings
from tests.services import RestartablePostgres, RestartableRedis, ServiceUnavailable
from tests.stack import MODEL, ServerThread, WorkerThread, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tests.test_limits import MODEL as IDLE_MODEL
from tests.test_limits import IdleWorker
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep
from worker.engines.hf import HFEngine

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

SECRET = "database-outage-secret-0123456789abcdef"


class GatedEngine:
    """The real hf engine; after ``open_steps`` steps of a request, each further step waits until
    ``gate`` is set (a stand-in at the engine boundary: a slow generation the test controls)."""

    def __init__(self, inner: HFEngine, gate: threading.Event, open_steps: int = 3) -> None:
        self.inner, self.gate, self.open_steps = inner, gate, open_steps
        self.info: EngineInfo = inner.info

    async def start(self) -> None:
        await self.inner.start()
        self.info = self.inner.info

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        steps = 0
        async for step in self.inner.generate(request_id, prompt_ids, params):
            steps += 1
            if steps > self.open_steps and not self.gate.is_set():
                await asyncio.to_thread(self.gate.wait)  # a threading.Event: the test's thread sets it
            yield step

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()


class Stack:
    def __init__(self, pg: RestartablePostgres, server: ServerThread, key: str) -> None:
        self.pg, self.server, self.key = pg, server, key
        self.url = server.url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        pg = RestartablePostgres().start()
        redis = RestartableRedis().start()
    except ServiceUnavailable as exc:
        pytest.skip(str(exc))
    migrate.upgrade(pg.url)
    settings = ServerSettings(
        data_dir=tmp_path_factory.mktemp("data"),
        port=free_port(),
        database_url=pg.url,
        redis_url=redis.url,
        auth_secret=SECRET,
        allow_debug_auth=True,
        worker_heartbeat_interval_s=0.5,
        pending_event_interval_s=0.2,  # followers check SQL every second: inside the outage
    )
    server = ServerThread(settings).start()
    try:
        yield Stack(pg, server, worker_key(settings))
    finally:
        server.stop()
        redis.stop()
        pg.stop()


def _back(stack: Stack) -> None:
    """Start PostgreSQL again if a test left it down, and wait for the server to be ready."""
    if stack.pg.proc is None or stack.pg.proc.poll() is not None:
        stack.pg.start()
    wait_for(lambda: httpx.get(f"{stack.url}/ready").status_code == 200, 60, "ready")


def _expect_503(resp: httpx.Response, *, openai: bool = False) -> None:
    assert resp.status_code == 503, (resp.request.url, resp.status_code, resp.text)
    assert int(resp.headers["Retry-After"]) >= 1
    code = resp.json()["error"]["code"] if openai else resp.json()["code"]
    assert code == "not_ready", resp.text


def test_routes_answer_503_with_retry_after_while_postgres_is_down_and_recovering(stack: Stack) -> None:
    _back(stack)
    url = stack.url
    headers = login(url, "outage-routes")
    chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    idle = IdleWorker(url, stack.key).start()  # the model is offered: OpenAI requests get as far as SQL
    unused_key = issue_user_key(ServerSettings(database_url=stack.pg.url), "outage-pooled")  # not in any cache
    stack.pg.kill()
    try:
        _expect_503(httpx.get(f"{url}/chats", headers=headers))
        _expect_503(httpx.post(f"{url}/chats", json={}, headers=headers))
        _expect_503(
            httpx.post(
                f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "hi"}, headers=headers
            )
        )
        _expect_503(httpx.get(f"{url}/auth/login/debug", params={"username": "x"}, follow_redirects=True))
        body = {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        _expect_503(httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers), openai=True)
        _expect_503(
            httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers), openai=True
        )
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "Retry-After" in ready.headers
        # A 503 the server closes the connection after says so: a pooling client sends its next request
        # on a new connection, never on the one being closed (that request would fail with a reset).
        with httpx.Client() as pooled:
            fresh = {"Authorization": f"Bearer {unused_key}"}
            for _ in range(20):
                resp = pooled.post(f"{url}/v1/chat/completions", json=body, headers=fresh)
                _expect_503(resp, openai=True)
                assert resp.headers.get("connection") == "close", resp.headers
    finally:
        idle.stop()
        stack.pg.start(wait=False)
    # crash recovery: until it accepts connections, every answer is 503 with Retry-After, never 500
    statuses: set[int] = set()

    def chats() -> bool:
        resp = httpx.get(f"{url}/chats", headers=headers)
        statuses.add(resp.status_code)
        if resp.status_code != 200:
            _expect_503(resp)
        return resp.status_code == 200

    wait_for(chats, 60, "chats again")
    assert statuses <= {200, 503}


def test_shutting_down_postgres_is_unavailable_not_a_bug(stack: Stack, tmp_path: Path) -> None:
    """A smart shutdown (SIGTERM) refuses new connections with SQLSTATE 57P03, as crash recovery does
    ("the database system is starting up"), while a session holds it open: both are 503."""
    _back(stack)
    import asyncpg  # type: ignore[import-untyped]

    async def hold_and_probe() -> tuple[BaseException | None, int]:
        held = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{stack.pg.port}/tokentrail")
        assert stack.pg.proc is not None
        os.kill(stack.pg.proc.pid, signal.SIGTERM)  # smart shutdown: waits for `held` to leave
        await asyncio.sleep(0.5)
        engine = create_engine(stack.pg.url)  # a pool of its own: it must open a new connection
        caught: BaseException | None = None
        try:
            await ping(engine)
        except Exception as exc:
            caught = exc
        finally:
            await engine.dispose()
        # a server that starts now has no pooled connection either
        settings = ServerSettings(
            data_dir=tmp_path, port=free_port(), database_url=stack.pg.url, migrate_on_start=False, auth_secret=SECRET
        )
        with ThreadPoolExecutor(1) as pool:
            status = await asyncio.get_running_loop().run_in_executor(pool, _status_on_fresh_server, settings)
        await held.close()
        return caught, status

    caught, status = asyncio.run(hold_and_probe())
    assert caught is not None and is_database_unavailable(caught), repr(caught)
    assert "57P03" in {getattr(getattr(caught, "orig", None), "sqlstate", None), getattr(caught, "sqlstate", None)}
    assert status == 503
    stack.pg.kill()  # the server's pooled sessions would hold the smart shutdown open
    _back(stack)


def _status_on_fresh_server(settings: ServerSettings) -> int:
    server = ServerThread(settings).start()
    try:
        resp = httpx.get(f"{server.url}/chats", headers={"Authorization": "Bearer tt_u_anything"})
        if resp.status_code != 200:
            _expect_503(resp)
        return resp.status_code
    finally:
        server.stop()


def _read_openai_stream(url: str, headers: dict[str, str], body: dict[str, Any], out: dict[str, Any]) -> None:
    """Read a streamed chat completion to its end: content, error chunk, [DONE], or the break."""
    out.update(content="", done=False, error=None, broken=None, message_ids=None, chunks=0)
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                chunk = orjson.loads(data)
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                out["chunks"] += 1
                info = chunk.get("tokentrail") or {}
                out["message_ids"] = info.get("message_ids") or out["message_ids"]
                out["chat_id"] = info.get("chat_id") or out.get("chat_id")
                for choice in chunk.get("choices", []):
                    out["content"] += choice.get("delta", {}).get("content") or ""
    except httpx.HTTPError as exc:
        out["broken"] = repr(exc)


class _Connects(logging.Handler):
    """Counts the worker's websocket sessions (its "connected as" log lines)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.connects = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("connected as"):
            self.connects += 1


def test_worker_session_and_open_streams_outlive_a_postgres_restart(stack: Stack, tiny_model_dir: Path) -> None:
    _back(stack)
    url = stack.url
    gate = threading.Event()
    sessions = _Connects()
    logging.getLogger("worker.client").addHandler(sessions)
    logging.getLogger("worker.client").setLevel(logging.INFO)
    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(url, stack.key, MODEL, fmt, lambda: GatedEngine(HFEngine(str(tiny_model_dir)), gate))
    worker.start()
    try:
        headers = login(url, "outage-worker")
        # an OA turn and an OpenAI stream, both held by the worker (the gate is shut)
        chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
        prompt = httpx.post(
            f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "hold"}, headers=headers
        ).json()["id"]
        sampling = {"max_new_tokens": 12, "ignore_eos": True}
        oa = httpx.post(
            f"{url}/chats/{chat}/assistant_message",
            json={"parent_id": prompt, "model_config_name": MODEL, "sampling_parameters": sampling},
            headers=headers,
        ).json()["id"]
        oa_events: list[dict[str, Any]] = []
        oa_reader = threading.Thread(
            target=events, args=(url, f"/chats/{chat}/messages/{oa}/events", headers), kwargs={"sink": oa_events}
        )
        oa_reader.start()
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hold on"}],
            "stream": True,
            "max_tokens": 12,
            "ignore_eos": True,
        }
        stream: dict[str, Any] = {}
        ai_reader = threading.Thread(target=_read_openai_stream, args=(url, headers, body, stream))
        ai_reader.start()
        wait_for(
            lambda: any(e["event_type"] == "token" for e in oa_events) and stream.get("chunks", 0) > 0, 60, "tokens"
        )

        stack.pg.kill()
        # down for several follower checks; then the worker finishes both while the database is away
        threading.Event().wait(2.0)
        gate.set()
        threading.Event().wait(2.0)
        assert ai_reader.is_alive() and oa_reader.is_alive()  # nothing ended them: their ends wait for SQL
        stack.pg.start()

        ai_reader.join(60)
        oa_reader.join(60)
        assert not ai_reader.is_alive() and not oa_reader.is_alive()
        assert stream["broken"] is None and stream["error"] is None and stream["done"], stream
        assert oa_events[-1]["event_type"] == "message", oa_events[-1]
        stored_oa = httpx.get(f"{url}/chats/{chat}/messages/{oa}", headers=headers).json()
        assert stored_oa["state"] == "complete" and stored_oa["attempt"] == 1  # finished, not requeued
        [ai] = stream["message_ids"]
        ai_msg = httpx.get(f"{url}/chats/{stream['chat_id']}/messages/{ai}", headers=headers).json()
        assert ai_msg["state"] == "complete" and ai_msg["attempt"] == 1
        assert ai_msg["content"] == stream["content"]

        # the same worker session serves the next turn
        nxt = httpx.post(
            f"{url}/chats/{chat}/prompter_message", json={"parent_id": oa, "content": "again"}, headers=headers
        ).json()["id"]
        again = httpx.post(
            f"{url}/chats/{chat}/assistant_message",
            json={"parent_id": nxt, "model_config_name": MODEL, "sampling_parameters": sampling},
            headers=headers,
        ).json()["id"]
        final = events(url, f"/chats/{chat}/messages/{again}/events", headers)[-1]
        assert final["event_type"] == "message", final
        assert sessions.connects == 1  # no reconnect: one session throughout
    finally:
        gate.set()
        worker.stop()
        logging.getLogger("worker.client").removeHandler(sessions)
        _back(stack)


def test_every_429_carries_retry_after(stack: Stack) -> None:
    _back(stack)
    url = stack.url
    idle = IdleWorker(url, stack.key).start()  # offers the model, takes nothing: open messages pile up
    headers = login(url, "outage-flood")
    chat = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    prompt = httpx.post(
        f"{url}/chats/{chat}/prompter_message", json={"parent_id": None, "content": "flood"}, headers=headers
    ).json()["id"]
    oa = {"parent_id": prompt, "model_config_name": IDLE_MODEL, "sampling_parameters": {"max_new_tokens": 1}}
    ai = {"model": IDLE_MODEL, "messages": [{"role": "user", "content": "flood"}], "n": 2, "stream": True}
    statuses: list[httpx.Response] = []
    try:
        with httpx.Client(base_url=url, headers=headers) as client:
            for k in range(120):
                if k % 2:
                    statuses.append(client.post(f"/chats/{chat}/assistant_message", json=oa))
                else:  # a stream that would wait for the idle worker: its status is all we read
                    resp = client.send(client.build_request("POST", "/v1/chat/completions", json=ai), stream=True)
                    resp.close()
                    statuses.append(resp)
    finally:
        idle.stop()
    refused = [r for r in statuses if r.status_code == 429]
    assert refused, [r.status_code for r in statuses]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert {r.request.url.path.startswith("/v1/") for r in refused} == {True, False}
