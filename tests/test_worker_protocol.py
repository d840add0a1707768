"""The worker websocket: keys, protocol versions, API-key users, and recovery of a lost worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from typer.testing import CliRunner

from server.settings import ServerSettings
from shared.protocol import PROTOCOL_VERSION
from tests.stack import MODEL, ServerThread, WorkerThread, free_port, worker_key
from tests.test_e2e_embedded import events, login, turn
from tokentrail.cli import app
from worker.chat_format import ChatFormat
from worker.client import FatalWorkerError, WorkerClient, WorkerOptions, websocket_url
from worker.engines.contract import EngineInfo, GenerationParams, TokenStep
from worker.engines.hf import HFEngine


def hello(version: int = PROTOCOL_VERSION) -> str:
    return json.dumps(
        {
            "type": "hello",
            "protocol_version": version,
            "model_name": "x",
            "engine": "hf",
            "tokenizer_hash": "t",
            "template_hash": "t",
            "compat_hash": "c",
            "capacity": 1,
        }
    )


async def _handshake(url: str, key: str, frame: str) -> tuple[dict[str, Any], int | None]:
    async with websockets.connect(websocket_url(url), additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        await ws.send(frame)
        reply = json.loads(await ws.recv())
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), timeout=5)  # the server closes after its error frame
        return reply, ws.close_code


def test_bad_worker_key_is_refused(embedded_stack: str) -> None:
    reply, close = asyncio.run(_handshake(embedded_stack, "tt_w_wrong", hello()))
    assert reply == {"type": "error", "code": "invalid_worker_key", "message": reply["message"]}
    assert close == 4401


def test_protocol_mismatch_is_refused(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    reply, close = asyncio.run(_handshake(embedded_stack, worker_key(embedded_settings), hello(version=999)))
    assert reply["code"] == "protocol_version_mismatch"
    assert close == 4426


def test_worker_client_stops_on_a_refused_key(embedded_stack: str, tiny_model_dir: Path) -> None:
    fmt = ChatFormat.load(str(tiny_model_dir))
    client = WorkerClient(WorkerOptions(embedded_stack, "tt_w_wrong", MODEL), HFEngine(str(tiny_model_dir)), fmt)
    with pytest.raises(FatalWorkerError, match="invalid_worker_key"):
        asyncio.run(client.run_forever())


def test_api_key_user_from_the_cli(embedded_stack: str, embedded_settings: ServerSettings) -> None:
    result = CliRunner().invoke(app, ["admin", "create-user", "keyuser", "--data-dir", str(embedded_settings.data_dir)])
    assert result.exit_code == 0, result.output
    key = result.output.strip()
    assert key.startswith("tt_u_")
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{embedded_stack}/auth/check", headers=headers).json() == "keyuser"
    chat_id = httpx.post(f"{embedded_stack}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(embedded_stack, headers, chat_id, None, "hello")
    assert events(embedded_stack, f"/chats/{chat_id}/messages/{reply['id']}/events", headers)[-1]["event_type"] == (
        "message"
    )


class SlowEngine:
    """The real hf engine, paced so that a test can lose the worker mid-stream."""

    def __init__(self, inner: HFEngine, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.info: EngineInfo = inner.info

    async def start(self) -> None:
        await self.inner.start()
        self.info = self.inner.info

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncIterator[TokenStep]:
        async for step in self.inner.generate(request_id, prompt_ids, params):
            await asyncio.sleep(self.delay_s)
            yield step

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture()
def private_server(tmp_path: Path) -> Iterator[tuple[ServerThread, str]]:
    settings = ServerSettings(data_dir=tmp_path, port=free_port())
    server = ServerThread(settings).start()
    yield server, worker_key(settings)
    server.stop()


def test_lost_worker_is_resumed_by_another_in_one_stream(
    private_server: tuple[ServerThread, str], tiny_model_dir: Path
) -> None:
    server, key = private_server
    fmt = ChatFormat.load(str(tiny_model_dir))
    first = WorkerThread(server.url, key, MODEL, fmt, lambda: SlowEngine(HFEngine(str(tiny_model_dir)), 0.05)).start()
    headers = login(server.url, "resume")
    chat_id = httpx.post(f"{server.url}/chats", json={}, headers=headers).json()["id"]
    _, reply = turn(server.url, headers, chat_id, None, "go on", max_new_tokens=60, stop_token_ids=[])
    path = f"/chats/{chat_id}/messages/{reply['id']}/events"
    seen: list[dict[str, Any]] = []

    def read() -> None:
        events(server.url, path, headers, sink=seen)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = 200
    while sum(e["event_type"] == "token" for e in seen) < 10 and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    first.stop()  # the worker goes away mid-stream
    streamed_before = sum(e["event_type"] == "token" for e in seen)
    assert 0 < streamed_before < 60
    second = WorkerThread(server.url, key, MODEL, fmt, lambda: HFEngine(str(tiny_model_dir))).start()
    try:
        reader.join(timeout=60)
        assert not reader.is_alive()
        tokens = [e for e in seen if e["event_type"] == "token"]
        assert seen[-1]["event_type"] == "message", seen[-3:]
        assert [e["index"] for e in tokens] == list(range(len(tokens)))  # one continuous stream
        stored = httpx.get(f"{server.url}{path[: -len('/events')]}?include=tokens", headers=headers).json()
        assert stored["state"] == "complete"
        assert stored["completion_token_ids"] == [e["token_id"] for e in tokens]
        assert len(tokens) == 60 and stored["finish_reason"] == "length"
        if not stored["reasoning_content"] and not stored["tool_calls"]:
            assert stored["content"] == "".join(e["text"] for e in tokens).strip()
    finally:
        second.stop()
