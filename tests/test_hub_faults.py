"""A worker's session in the hub survives Redis faults (real ones: the server's Redis connections are
killed with ``CLIENT KILL`` while the hub blocks on them), and the model stays available."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from server.settings import ServerSettings
from tests.stack import MODEL, ServerThread, WorkerThread, wait_for, worker_key
from tests.test_e2e_embedded import events, login
from tokentrail.launcher import free_port
from worker.chat_format import ChatFormat
from worker.engines.hf import HFEngine

pytestmark = [pytest.mark.redis]


@pytest.fixture
def redis_stack(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, ServerThread]]:
    settings = ServerSettings(
        data_dir=tmp_path,
        port=free_port(),
        redis_url=redis_url,
        auth_secret="fault-test-secret-0123456789abcdef",
        allow_debug_auth=True,
        worker_heartbeat_interval_s=0.5,
    )
    server = ServerThread(settings).start()
    fmt = ChatFormat.load(str(tiny_model_dir))
    worker = WorkerThread(
        server.url, worker_key(settings), MODEL, fmt, lambda: HFEngine(str(tiny_model_dir), max_batch_size=4)
    ).start()
    try:
        yield server.url, server
    finally:
        worker.stop()
        server.stop()


def _turn(url: str, headers: dict[str, str], text: str) -> dict[str, Any]:
    chat_id = httpx.post(f"{url}/chats", json={}, headers=headers).json()["id"]
    prompt = httpx.post(
        f"{url}/chats/{chat_id}/prompter_message", json={"parent_id": None, "content": text}, headers=headers
    ).json()
    reply = httpx.post(
        f"{url}/chats/{chat_id}/assistant_message",
        json={"parent_id": prompt["id"], "model_config_name": MODEL, "sampling_parameters": {"max_new_tokens": 8}},
        headers=headers,
    )
    assert reply.status_code == 200, reply.text
    return events(url, f"/chats/{chat_id}/messages/{reply.json()['id']}/events", headers)[-1]


def test_worker_session_survives_killed_redis_connections(redis_stack: Any, redis_url: str) -> None:
    url, server = redis_stack
    hub = server.server.config.app.state.tt.hub
    headers = login(url, "fault-user")
    assert _turn(url, headers, "before")["event_type"] == "message"
    wait_for(lambda: len(hub.connections) == 1, 30, "worker session")
    [session] = list(hub.connections)
    admin = redis.Redis.from_url(redis_url)
    try:
        # kill every client connection a few times while the hub blocks in XREADGROUP and heartbeats
        for _ in range(5):
            admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            time.sleep(0.3)
    finally:
        admin.close()
    # the same session serves the next turn: nothing reconnected, the model never went away
    assert _turn(url, headers, "after")["event_type"] == "message"
    assert list(hub.connections) == [session]
    models = httpx.get(f"{url}/configs/model_configs").json()
    assert MODEL in [m["name"] for m in models]  # other tests may share this Redis database
