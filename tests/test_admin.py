"""Operating it: the admin API and CLI (workers, users, keys, revocation) and JSON logs.

A real server (thread), a real websocket peer as the worker, the CLI as subprocesses."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from server.admin import issue_user_key, issue_worker_key
from server.settings import ServerSettings
from tests.stack import ServerThread, fake_hello, wait_for
from tokentrail.launcher import free_port, spawn

MODEL = "admin-model"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerSettings, str]]:
    settings = ServerSettings(
        data_dir=tmp_path_factory.mktemp("admin"), port=free_port(), worker_heartbeat_interval_s=0.5
    )
    server = ServerThread(settings).start()
    yield settings, server.url
    server.stop()


def _cli(settings: ServerSettings, *args: str, tmp: Path) -> Any:
    log = tmp / f"cli-{time.monotonic_ns()}.log"
    proc = spawn(["admin", *args, "--data-dir", str(settings.data_dir)], output=log)
    assert proc.wait(timeout=120) == 0, log.read_text()
    return json.loads(log.read_text())


async def _worker_session(url: str, key: str, received: list[dict[str, Any]]) -> int | None:
    """Say hello, heartbeat until the server closes the connection; return its close code."""
    ws_url = url.replace("http://", "ws://") + "/workers/work"
    async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        try:  # a revoked key is refused before the hello is read: sending it may fail already
            await ws.send(fake_hello(MODEL, capacity=3).model_dump_json())
            while True:
                try:
                    received.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=0.3)))
                except TimeoutError:
                    await ws.send('{"type": "heartbeat"}')
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None


def test_workers_are_listed_and_a_revoked_key_disconnects_them(
    cluster: tuple[ServerSettings, str], tmp_path: Path
) -> None:
    settings, url = cluster
    admin = {"Authorization": f"Bearer {issue_user_key(settings, 'root', admin=True)}"}
    user = {"Authorization": f"Bearer {issue_user_key(settings, 'plain')}"}
    key = issue_worker_key(settings, "gpu-node-7")
    received: list[dict[str, Any]] = []

    outcome: dict[str, int | None] = {}
    session = threading.Thread(target=lambda: outcome.update(code=asyncio.run(_worker_session(url, key, received))))
    session.start()

    def listed() -> list[dict[str, Any]]:
        rows = httpx.get(f"{url}/admin/workers", headers=admin).json()
        return [w for w in rows if w["model_name"] == MODEL]

    wait_for(lambda: bool(listed()), 30, "the worker listed")
    [worker] = listed()
    assert worker["key_name"] == "gpu-node-7" and worker["capacity"] == 3 and worker["inflight"] == 0
    assert abs(time.time() - _epoch(worker["last_seen"])) < 30
    assert httpx.get(f"{url}/admin/workers", headers=user).status_code == 403

    keys = httpx.get(f"{url}/admin/worker_keys", headers=admin).json()
    [mine] = [k for k in keys if k["name"] == "gpu-node-7"]
    assert mine["connected_workers"] == 1 and mine["revoked_at"] is None
    revoked = httpx.post(f"{url}/admin/worker_keys/{mine['id']}/revoke", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    session.join(timeout=30)
    assert outcome.get("code") == 4401, outcome
    assert httpx.post(f"{url}/admin/worker_keys/no-such-key/revoke", headers=admin).status_code == 404
    assert any(f.get("type") == "error" and f.get("code") == "invalid_worker_key" for f in received), received
    again: list[dict[str, Any]] = []
    assert asyncio.run(_worker_session(url, key, again)) == 4401  # refused from now on

    # the CLI sees the same, from the database
    [cli_key] = [k for k in _cli(settings, "list-worker-keys", tmp=tmp_path) if k["name"] == "gpu-node-7"]
    assert cli_key["revoked_at"] is not None


def test_users_are_listed_and_a_revoked_api_key_is_refused(cluster: tuple[ServerSettings, str], tmp_path: Path) -> None:
    settings, url = cluster
    admin = {"Authorization": f"Bearer {issue_user_key(settings, 'root2', admin=True)}"}
    user = {"Authorization": f"Bearer {issue_user_key(settings, 'carol')}"}
    assert httpx.get(f"{url}/auth/check", headers=user).status_code == 200
    users = {u["id"]: u for u in httpx.get(f"{url}/admin/users", headers=admin).json()}
    carol = users["carol"]
    assert not carol["is_admin"] and users["root2"]["is_admin"] and len(carol["api_keys"]) == 1
    key_id = carol["api_keys"][0]["id"]
    assert httpx.post(f"{url}/admin/api_keys/{key_id}/revoke", headers=admin).status_code == 200
    refused = httpx.get(f"{url}/auth/check", headers=user)
    assert refused.status_code == 401 and refused.json()["code"] == "invalid_credentials"

    # the CLI: list, and revoke another key of carol's
    second = {"Authorization": f"Bearer {issue_user_key(settings, 'carol')}"}
    listed = {u["id"]: u for u in _cli(settings, "list-users", tmp=tmp_path)}
    fresh = [k["id"] for k in listed["carol"]["api_keys"] if k["revoked_at"] is None]
    assert len(fresh) == 1
    [row] = _cli(settings, "revoke-api-key", fresh[0], tmp=tmp_path)
    assert row["revoked_at"] is not None
    wait_for(lambda: httpx.get(f"{url}/auth/check", headers=second).status_code == 401, 15, "the key refused")


def test_admin_workers_cli_and_json_logs(tmp_path: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path / "data", port=free_port())
    admin_key = issue_user_key(settings, "ops", admin=True)
    server = spawn(
        ["serve", "--port", str(settings.port), "--data-dir", str(settings.data_dir), "--log-format", "json"],
        output=tmp_path / "server.log",
    )
    try:
        url = f"http://127.0.0.1:{settings.port}"
        wait_for(lambda: _up(url), 60, "server")
        httpx.get(f"{url}/chats", headers={"Authorization": "Bearer nope"})  # an error worth a log line
        out = tmp_path / "workers.log"
        assert spawn(["admin", "workers", "--server-url", url, "--api-key", admin_key], output=out).wait(60) == 0
        assert "no workers connected" in out.read_text()
        bad = tmp_path / "bad.log"
        assert spawn(["admin", "workers", "--server-url", url, "--api-key", "wrong"], output=bad).wait(60) != 0
        assert "401" in bad.read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    lines = [ln for ln in (tmp_path / "server.log").read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is a JSON object
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp).timestamp()
